"""Reading and writing MambaLM checkpoint directories in mamba-ssm's and Hugging Face's layouts (used by
MambaLM.from_pretrained / save_pretrained; selscan_fused/model.py describes both layouts)."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import warnings

import torch

from .api import is_int
from .block import Mamba
from .model import EMBEDDING_KEY, HF_EMBEDDING_KEY, LM_HEAD_KEY, MambaLMConfig, _HF_SSM

LAYOUT_NAMES = {"mamba_ssm": "mamba-ssm layout", "hf": "Hugging Face layout"}
LAYOUTS = tuple(LAYOUT_NAMES)

def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"selscan_fused: {path} is not valid JSON: {e}") from None


def read_config(path: str):
    """(MambaLMConfig, layout, the raw dict) from path/config.json."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"selscan_fused: {path!r} is not a directory; from_pretrained reads a local checkpoint "
                                "directory (config.json and the weights)")
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"selscan_fused: {path} has no config.json (a checkpoint directory holds config.json "
                                f"and pytorch_model.bin or model.safetensors; found: {sorted(os.listdir(path))})")
    raw = _read_json(cfg_path)
    if not isinstance(raw, dict):
        raise ValueError(f"selscan_fused: {cfg_path} must hold a JSON object (the model's settings), got a "
                         f"{type(raw).__name__}")
    model_type = raw.get("model_type")
    if "d_model" in raw and "n_layer" in raw:
        return _check_block(_from_mamba_ssm(raw, cfg_path), cfg_path), "mamba_ssm", raw
    if model_type == "mamba" or ("hidden_size" in raw and "state_size" in raw):
        return _check_block(_from_hf(raw, cfg_path), cfg_path), "hf", raw
    if model_type is not None:
        raise ValueError(f"selscan_fused: {cfg_path} describes a {model_type!r} model; MambaLM loads Mamba-1 language "
                         "models (transformers' model_type 'mamba', or mamba-ssm's config with d_model and n_layer)")
    raise ValueError(f"selscan_fused: {cfg_path} is neither mamba-ssm's config (needs d_model, n_layer, vocab_size) "
                     "nor Hugging Face's MambaConfig (needs hidden_size, num_hidden_layers, vocab_size, state_size); "
                     f"its keys: {sorted(raw)}")


def _check_block(cfg: MambaLMConfig, cfg_path: str) -> MambaLMConfig:
    """The block's settings checked by building one block on the meta device (no memory, no weights read),
    its errors naming the file."""
    try:
        Mamba(cfg.d_model, **cfg.block_kwargs(), device="meta")
    except (ValueError, TypeError) as e:
        raise ValueError(f"selscan_fused: {cfg_path}: {str(e).removeprefix('selscan_fused: ')}") from None
    return cfg


def _need(raw: dict, keys, cfg_path: str, what: str):
    missing = [k for k in keys if k not in raw]
    if missing:
        raise ValueError(f"selscan_fused: {cfg_path} ({what}) lacks {missing}")


def _from_mamba_ssm(raw: dict, cfg_path: str) -> MambaLMConfig:
    what = LAYOUT_NAMES["mamba_ssm"]
    _need(raw, ("d_model", "n_layer", "vocab_size"), cfg_path, what)
    _check_sizes(raw, ("d_model", "n_layer", "vocab_size"), cfg_path)
    if raw.get("d_intermediate", 0):
        raise ValueError(f"selscan_fused: {cfg_path} has d_intermediate = {raw['d_intermediate']} (an MLP after "
                         "every mixer); MambaLM builds mixer-only blocks (d_intermediate = 0)")
    if raw.get("attn_layer_idx"):
        raise ValueError(f"selscan_fused: {cfg_path} has attention layers (attn_layer_idx = {raw['attn_layer_idx']}); "
                         "MambaLM builds Mamba blocks only")
    fields = {f.name for f in dataclasses.fields(MambaLMConfig)}
    known = fields | {"d_intermediate", "attn_layer_idx", "attn_cfg"}
    unknown = sorted(set(raw) - known)
    if unknown:
        warnings.warn(f"selscan_fused: {cfg_path}: ignoring keys MambaLM does not know: {unknown}")
    if not isinstance(raw.get("ssm_cfg") or {}, dict):
        raise ValueError(f"selscan_fused: {cfg_path} has ssm_cfg = {raw['ssm_cfg']!r}; it must be a JSON object of the "
                         "block's settings (d_state, d_conv, expand, ...)")
    cfg = MambaLMConfig(**{k: v for k, v in raw.items() if k in fields})
    cfg.ssm_cfg = dict(cfg.ssm_cfg or {})
    return cfg  # its ssm_cfg is checked by read_config's _check_block, naming the file


def _check_sizes(raw: dict, keys, cfg_path: str):
    """The model's sizes in the file are integers: the depth >= 0, the others >= 1."""
    for k in keys:
        v, least = raw[k], 0 if k in ("n_layer", "num_hidden_layers") else 1
        if not is_int(v) or v < least:
            raise ValueError(f"selscan_fused: {cfg_path} has {k} = {v!r}; it must be an integer >= {least}")


def _from_hf(raw: dict, cfg_path: str) -> MambaLMConfig:
    what = LAYOUT_NAMES["hf"] + ", transformers' MambaConfig"
    _need(raw, ("hidden_size", "num_hidden_layers", "vocab_size"), cfg_path, what)
    _check_sizes(raw, ("hidden_size", "num_hidden_layers", "vocab_size"), cfg_path)
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"selscan_fused: {cfg_path} has hidden_act = {act!r}; the block's activation is SiLU")
    ssm_cfg = {}
    for ours, (theirs, default) in _HF_SSM.items():
        v = raw.get(theirs, default)
        if v != default:
            ssm_cfg[ours] = v
    expand = raw.get("expand", 2)
    if "intermediate_size" in raw and raw["intermediate_size"] != int(expand * raw["hidden_size"]):
        raise ValueError(f"selscan_fused: {cfg_path} has intermediate_size = {raw['intermediate_size']}, but expand * "
                         f"hidden_size = {int(expand * raw['hidden_size'])} (transformers derives it from them)")
    return MambaLMConfig(
        d_model=raw["hidden_size"], n_layer=raw["num_hidden_layers"], vocab_size=raw["vocab_size"], ssm_cfg=ssm_cfg,
        rms_norm=True, residual_in_fp32=raw.get("residual_in_fp32", True), fused_add_norm=False,
        pad_vocab_size_multiple=1,  # Hugging Face's vocab_size is the embedding's rows (already padded)
        tie_embeddings=raw.get("tie_word_embeddings", True), norm_epsilon=raw.get("layer_norm_epsilon", 1e-5),
        bos_token_id=raw.get("bos_token_id"), eos_token_id=raw.get("eos_token_id"),
        pad_token_id=raw.get("pad_token_id"))


def fit_vocab(cfg: MambaLMConfig, rows: int, where: str) -> MambaLMConfig:
    """The config whose padded vocabulary equals the checkpoint's embedding rows: unchanged when it does;
    a checkpoint with more rows than the config's vocab_size is followed (vocab_size = rows, no padding)."""
    if rows == cfg.padded_vocab_size:
        return cfg
    if rows < cfg.vocab_size:
        raise ValueError(f"selscan_fused: the checkpoint {where} has an embedding of {rows} rows, fewer than its "
                         f"config's vocab_size = {cfg.vocab_size}")
    return dataclasses.replace(cfg, vocab_size=rows, pad_vocab_size_multiple=1)


def _load_bin(fp: str) -> dict:
    try:
        return torch.load(fp, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as e:
        if "mmap" not in str(e):  # an old (non-zip) torch.save file cannot be memory-mapped
            raise
        return torch.load(fp, map_location="cpu", weights_only=True)


def _load_safetensors(fp: str) -> dict:
    try:
        from safetensors.torch import load_file
    except ImportError:
        raise ImportError(f"selscan_fused: reading {fp} needs the safetensors package "
                          "(pip install safetensors)") from None
    return load_file(fp, device="cpu")


def read_weights(path: str, layout: str):
    """(state_dict on the CPU, the files read) from the directory: model.safetensors (or its sharded
    index), else pytorch_model.bin (or its sharded index)."""
    order = [("model.safetensors.index.json", _load_safetensors), ("model.safetensors", _load_safetensors),
             ("pytorch_model.bin.index.json", _load_bin), ("pytorch_model.bin", _load_bin)]
    if layout == "mamba_ssm":  # mamba-ssm writes pytorch_model.bin; look there first
        order = order[2:] + order[:2]
    for name, loader in order:
        fp = os.path.join(path, name)
        if not os.path.isfile(fp):
            continue
        if not name.endswith(".index.json"):
            return loader(fp), [name]
        index = _read_json(fp)
        shards = sorted(set(index.get("weight_map", {}).values()))
        if not shards:
            raise ValueError(f"selscan_fused: {fp} has no weight_map")
        missing = [s for s in shards if not os.path.isfile(os.path.join(path, s))]
        if missing:
            raise FileNotFoundError(f"selscan_fused: {fp} names shards that are not in {path}: {missing}")
        sd = {}
        for s in shards:
            sd.update(loader(os.path.join(path, s)))
        return sd, [name] + shards
    raise FileNotFoundError(f"selscan_fused: {path} ({LAYOUT_NAMES[layout]} by its config.json) has no weights: "
                            "expected model.safetensors, model.safetensors.index.json with its shards, or "
                            f"pytorch_model.bin; found {sorted(os.listdir(path))}")


def _hf_config(model) -> dict:
    c = model.config
    if not c.rms_norm:
        raise ValueError("selscan_fused: Hugging Face's MambaForCausalLM has RMSNorm only; this model uses LayerNorm "
                         "(rms_norm=False): save it with layout='mamba_ssm'")
    kw = c.block_kwargs()
    m = model.backbone.layers[0].mixer if c.n_layer else None
    out = {"architectures": ["MambaForCausalLM"], "model_type": "mamba",
           "vocab_size": c.padded_vocab_size, "hidden_size": c.d_model, "num_hidden_layers": c.n_layer}
    for ours, (theirs, default) in _HF_SSM.items():
        out[theirs] = kw.get(ours, default)
    if out["time_step_rank"] == "auto":
        out["time_step_rank"] = math.ceil(c.d_model / 16)
    if m is not None:
        out["intermediate_size"] = m.d_inner
    out.update({"hidden_act": "silu", "layer_norm_epsilon": c.norm_epsilon, "residual_in_fp32": c.residual_in_fp32,
                "tie_word_embeddings": c.tie_embeddings, "use_cache": True,
                "dtype": str(model.backbone.embedding.weight.dtype).removeprefix("torch.")})
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):  # null, not transformers' default of 0
        out[k] = getattr(c, k)
    return out


def _mamba_ssm_config(model) -> dict:
    c = model.config
    out = {k: getattr(c, k) for k in ("d_model", "n_layer", "vocab_size", "ssm_cfg", "rms_norm", "residual_in_fp32",
                                      "fused_add_norm", "pad_vocab_size_multiple", "tie_embeddings")}
    out["ssm_cfg"] = dict(c.ssm_cfg or {})
    if c.norm_epsilon != 1e-5:
        warnings.warn(f"selscan_fused: norm_epsilon = {c.norm_epsilon} is written to config.json, but mamba-ssm's "
                      "MambaConfig has no such key (mamba-ssm would refuse the file and builds its norms with 1e-5)")
        out["norm_epsilon"] = c.norm_epsilon
    return out


def save(model, path: str, layout: str):
    if layout not in LAYOUTS:
        raise ValueError(f"selscan_fused: layout must be one of {LAYOUTS}, got {layout!r}")
    os.makedirs(path, exist_ok=True)
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    tied = model.config.tie_embeddings
    if layout == "hf":
        try:
            from safetensors.torch import save_file
        except ImportError:
            raise ImportError("selscan_fused: save_pretrained(layout='hf') writes model.safetensors and needs the "
                              "safetensors package (pip install safetensors)") from None
        cfg = _hf_config(model)
        sd[HF_EMBEDDING_KEY] = sd.pop(EMBEDDING_KEY)
        if tied:
            sd.pop(LM_HEAD_KEY)  # transformers leaves tied weights out (and safetensors refuses shared tensors)
        weights = os.path.join(path, "model.safetensors")
        save_file({k: v.contiguous().cpu() for k, v in sd.items()}, weights, metadata={"format": "pt"})
    else:
        cfg = _mamba_ssm_config(model)
        weights = os.path.join(path, "pytorch_model.bin")
        torch.save(sd, weights)  # mamba-ssm's save_pretrained: the state_dict, lm_head.weight included
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    return [cfg_path, weights]


__all__ = ["LAYOUTS", "LAYOUT_NAMES", "read_config", "read_weights", "fit_vocab", "save"]
