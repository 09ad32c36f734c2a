"""A Mamba language model on this package's block: `MambaLMConfig` and `MambaLM`, with mamba-ssm's
`MambaLMHeadModel` structure and parameter names, loading and saving both mamba-ssm's and Hugging Face's
checkpoint layouts.

    model = MambaLM.from_pretrained("path/to/dir", device="cuda", dtype=torch.bfloat16)
    logits = model(input_ids)                                  # (batch, L, vocab)
    logits, states = model(input_ids, return_states=True)      # states: per layer (ssm_state, conv_state)
    logits = model(more_ids, states=states)                    # continues the sequences (chunked prefill)

    cache = model.allocate_cache(batch)                        # static per-layer states, zeros
    last = model.prefill(input_ids, cache)                     # (batch, vocab): the last position's logits
    last = model.step(next_ids, cache)                         # one token per sequence, states in place

Structure (mamba-ssm's names; Hugging Face's differ only in `backbone.embeddings`):

    backbone.embedding     nn.Embedding(padded vocabulary, d_model); normal(0, 0.02) for a fresh model
    backbone.layers.{i}    .norm: RMSNorm (weight only), .mixer: selscan_fused.Mamba (layer_idx=i)
    backbone.norm_f        RMSNorm
    lm_head                nn.Linear(d_model, padded vocabulary, bias=False), tied to the embedding

The residual stream is mamba-ssm's Block's: residual = hidden (+ residual), in float32 when
residual_in_fp32 (for bfloat16/float16 models; a float64 model keeps float64), hidden =
mixer(norm(residual)), and at the end logits = lm_head(norm_f(residual + hidden)).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn

from ._linear import linear
from .api import IMPLS, is_int
from .block import Mamba, mamba_block
from .decode import mamba_block_step, norm_op_available, resolve_step_impl

__all__ = ["MambaLMConfig", "MambaLM", "MambaCache", "RMSNorm"]

logger = logging.getLogger("selscan_fused")

# The block's keyword arguments that a config's ssm_cfg may set (mamba-ssm's Mamba's names).
SSM_CFG_KEYS = ("d_state", "d_conv", "expand", "dt_rank", "dt_min", "dt_max", "dt_init", "dt_scale",
                "dt_init_floor", "conv_bias", "bias")
_SSM_CFG_IGNORED = ("use_fast_path",)  # mamba-ssm's switch between its own kernels: no meaning here
# ssm_cfg key -> Hugging Face MambaConfig key, and the default both use.
_HF_SSM = {"d_state": ("state_size", 16), "d_conv": ("conv_kernel", 4), "expand": ("expand", 2),
           "dt_rank": ("time_step_rank", "auto"), "dt_min": ("time_step_min", 0.001),
           "dt_max": ("time_step_max", 0.1), "dt_init": ("time_step_init_scheme", "random"),
           "dt_scale": ("time_step_scale", 1.0), "dt_init_floor": ("time_step_floor", 1e-4),
           "conv_bias": ("use_conv_bias", True), "bias": ("use_bias", False)}
_MAMBA_SSM_CONFIG_KEYS = ("d_model", "n_layer", "vocab_size", "ssm_cfg", "rms_norm", "residual_in_fp32",
                          "fused_add_norm", "pad_vocab_size_multiple", "tie_embeddings")

EMBEDDING_KEY = "backbone.embedding.weight"
HF_EMBEDDING_KEY = "backbone.embeddings.weight"
LM_HEAD_KEY = "lm_head.weight"


def _check_ids(input_ids, dims: int, rows: int) -> None:
    """input_ids: an integer tensor of `dims` dimensions ((batch, L) for a sequence, (batch,) for a decode
    step); on the CPU, outside torch.compile, its values are checked against the embedding's rows too (on
    CUDA that would be a host synchronisation, under torch.compile a graph break)."""
    shape = "(batch, L)" if dims == 2 else "(batch,) (one token per sequence)"
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != dims:
        got = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"selscan_fused: input_ids must be a {shape} tensor of token ids, got {got}")
    if input_ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"selscan_fused: input_ids must be an int64 or int32 tensor of token ids, got "
                        f"{input_ids.dtype}")
    if input_ids.device.type == "cpu" and input_ids.numel() > 0 and not torch.compiler.is_compiling():
        lo, hi = int(input_ids.min()), int(input_ids.max())
        if lo < 0 or hi >= rows:
            raise ValueError(f"selscan_fused: input_ids holds token ids outside the vocabulary [0, {rows}): "
                             f"{lo if lo < 0 else hi}")


@dataclass
class MambaLMConfig:
    """The model's sizes and switches, with mamba-ssm's `MambaConfig` names.

    d_model, n_layer      width and depth
    vocab_size            the vocabulary; the embedding and lm_head have `padded_vocab_size` rows (vocab_size
                          rounded up to a multiple of pad_vocab_size_multiple: 50277 -> 50280 with 8)
    ssm_cfg               the block's keyword arguments (selscan_fused.Mamba / mamba-ssm's Mamba): d_state,
                          d_conv, expand, dt_rank, dt_min, dt_max, dt_init, dt_scale, dt_init_floor,
                          conv_bias, bias; mamba-ssm's `layer: "Mamba1"` and `use_fast_path` are accepted
    rms_norm              RMSNorm (True) or nn.LayerNorm (False, with a bias) for the norms
    residual_in_fp32      the residual stream in float32 for bfloat16/float16 models
    fused_add_norm        accepted and ignored: mamba-ssm's switch to its fused add+norm kernel; here the add and
                          the RMSNorm are one kernel (csrc/decode/norm_launch.cu) wherever nothing is
                          differentiated on CUDA (the decode step, the prefill), PyTorch operations with the
                          same math otherwise
    pad_vocab_size_multiple, tie_embeddings (lm_head shares the embedding's weight), norm_epsilon
    bos/eos/pad_token_id  carried for generation (from a Hugging Face config); not used by the model
    """

    d_model: int = 768
    n_layer: int = 24
    vocab_size: int = 50277
    ssm_cfg: dict = field(default_factory=dict)
    rms_norm: bool = True
    residual_in_fp32: bool = True
    fused_add_norm: bool = True
    pad_vocab_size_multiple: int = 8
    tie_embeddings: bool = True
    norm_epsilon: float = 1e-5
    bos_token_id: int | None = None
    eos_token_id: int | list | None = None
    pad_token_id: int | None = None

    @property
    def padded_vocab_size(self) -> int:
        m = max(1, int(self.pad_vocab_size_multiple))
        return -(-int(self.vocab_size) // m) * m

    def block_kwargs(self) -> dict:
        """ssm_cfg as selscan_fused.Mamba's keyword arguments (checked)."""
        cfg = dict(self.ssm_cfg or {})
        layer = cfg.pop("layer", "Mamba1")
        if layer != "Mamba1":
            raise ValueError(f"selscan_fused: ssm_cfg asks for layer {layer!r}; MambaLM builds Mamba-1 blocks only "
                             "(Mamba-2's block is not implemented here)")
        for k in _SSM_CFG_IGNORED:
            cfg.pop(k, None)
        unknown = sorted(set(cfg) - set(SSM_CFG_KEYS))
        if unknown:
            raise ValueError(f"selscan_fused: unknown ssm_cfg keys {unknown}; the block takes {list(SSM_CFG_KEYS)}")
        return cfg

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class RMSNorm(nn.Module):
    """mamba-ssm's RMSNorm (weight only): x / sqrt(mean(x^2) + eps) * weight, computed in float32 (float64
    for float64 input) and returned in the input's dtype."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cd = torch.float64 if x.dtype == torch.float64 else torch.float32
        xf = x.to(cd)
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.to(cd)
        return out.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def _fused_add_norm_applies(norm, hidden: torch.Tensor, residual: torch.Tensor | None) -> bool:
    return (isinstance(norm, RMSNorm) and hidden.is_cuda and hidden.numel() > 0 and norm_op_available()
            and hidden.dtype in (torch.float32, torch.bfloat16, torch.float16) and norm.weight.dtype == hidden.dtype
            and (residual is None or (residual.dtype in (torch.float32, hidden.dtype)
                                      and residual.shape == hidden.shape and residual.is_contiguous())))


def add_norm(norm, hidden: torch.Tensor, residual: torch.Tensor | None, residual_in_fp32: bool, fused: bool = False):
    """mamba-ssm's Block's add + norm: residual = hidden (+ residual); (norm(residual in the norm's dtype),
    residual, in float32 when residual_in_fp32 and it is bfloat16 / float16). fused=True: one kernel
    (torch.ops.selscan_fused.add_rmsnorm) for an RMSNorm on CUDA whose weight has hidden's dtype, the same
    math in the same float32 (its sum of squares in another order); elsewhere the PyTorch operations."""
    if fused and _fused_add_norm_applies(norm, hidden, residual):
        d = hidden.shape[-1]
        normed, res = torch.ops.selscan_fused.add_rmsnorm(
            hidden.reshape(-1, d), None if residual is None else residual.reshape(-1, d), norm.weight, norm.eps,
            residual_in_fp32)
        return normed.view(hidden.shape), res.view(hidden.shape)
    residual = hidden if residual is None else hidden + residual
    normed = norm(residual.to(norm.weight.dtype))
    if residual_in_fp32 and residual.dtype in (torch.bfloat16, torch.float16):
        residual = residual.to(torch.float32)
    return normed, residual


class Block(nn.Module):
    """mamba-ssm's Block: (hidden, residual) -> (mixer(norm(residual)), residual); the add + norm fused into
    one kernel where nothing is differentiated (CUDA, RMSNorm), the PyTorch operations otherwise."""

    def __init__(self, config: MambaLMConfig, layer_idx: int, impl: str, device=None, dtype=None):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.residual_in_fp32 = config.residual_in_fp32
        if config.rms_norm:
            self.norm = RMSNorm(config.d_model, eps=config.norm_epsilon, **factory)
        else:
            self.norm = nn.LayerNorm(config.d_model, eps=config.norm_epsilon, **factory)
        self.mixer = Mamba(config.d_model, impl=impl, layer_idx=layer_idx, **config.block_kwargs(), **factory)

    def add_norm(self, hidden: torch.Tensor, residual: torch.Tensor | None, fused: bool = False):
        """(norm(hidden + residual), hidden + residual) with the residual kept in float32 when the config
        says so; fused=True runs it as one kernel (the decode step's, csrc/decode/) where that applies."""
        return add_norm(self.norm, hidden, residual, self.residual_in_fp32, fused)

    def forward(self, hidden, residual=None, h0=None, conv_state=None, return_final_state=False, impl=None,
                cu_seqlens=None, validate=True):
        # Nothing to differentiate (inference, the prefill): the add + RMSNorm as one kernel where it applies,
        # as mamba-ssm fuses it (the PyTorch operations make ~8 passes over (batch, L, d_model) in float32).
        # The kernel has no backward, so a forward that autograd records keeps the PyTorch operations.
        fused = not (torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (hidden, residual, self.norm.weight)))
        normed, residual = self.add_norm(hidden, residual, fused=fused)
        m = self.mixer
        res = mamba_block(normed, *m.weights(), h0=h0, conv_state=conv_state, return_final_state=return_final_state,
                          impl=impl or m.impl, config=m.config, cu_seqlens=cu_seqlens, validate=validate)
        if return_final_state:
            return res[0], residual, (res[1], res[2])
        return res, residual, None


class Backbone(nn.Module):
    def __init__(self, config: MambaLMConfig, impl: str, device=None, dtype=None):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.embedding = nn.Embedding(config.padded_vocab_size, config.d_model, **factory)
        self.layers = nn.ModuleList([Block(config, i, impl, **factory) for i in range(config.n_layer)])
        if config.rms_norm:
            self.norm_f = RMSNorm(config.d_model, eps=config.norm_epsilon, **factory)
        else:
            self.norm_f = nn.LayerNorm(config.d_model, eps=config.norm_epsilon, **factory)


def _init_weights(module, n_layer, initializer_range=0.02, rescale_prenorm_residual=True, n_residuals_per_layer=1):
    """mamba-ssm's _init_weights (mixer_seq_simple.py): Linear biases zeroed (except dt_proj's, marked
    _no_reinit), the embedding normal(0, initializer_range), out_proj re-drawn (kaiming uniform) and divided
    by sqrt(n_layer)."""
    if isinstance(module, nn.Linear):
        if module.bias is not None and not getattr(module.bias, "_no_reinit", False):
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, std=initializer_range)
    if rescale_prenorm_residual:
        for name, p in module.named_parameters():
            if name in ("out_proj.weight", "fc2.weight"):
                nn.init.kaiming_uniform_(p, a=math.sqrt(5))
                with torch.no_grad():
                    p /= math.sqrt(n_residuals_per_layer * n_layer)


class MambaCache:
    """Static per-layer decode states, allocated once (MambaLM.allocate_cache) and updated in place by
    MambaLM.prefill and MambaLM.step: ssm_states[i] (batch, d_inner, N) float32 (float64 for a float64
    model) and conv_states[i] (batch, d_inner, d_conv - 1) in the model's dtype. Zeros stand for "no
    sequence yet" (the block's result with zero states equals its result without any); reset() zeroes
    them for new sequences. cache[i] is (ssm_state, conv_state), the format of MambaLM.forward's states."""

    def __init__(self, ssm_states: list, conv_states: list):
        self.ssm_states, self.conv_states = ssm_states, conv_states
        self.batch_size = ssm_states[0].shape[0] if ssm_states else 0
        self.dtype = conv_states[0].dtype if conv_states else None
        self.device = ssm_states[0].device if ssm_states else None

    def __len__(self):
        return len(self.ssm_states)

    def __getitem__(self, i):
        return self.ssm_states[i], self.conv_states[i]

    def states(self) -> list:
        return [(s, c) for s, c in zip(self.ssm_states, self.conv_states)]

    def tensors(self) -> list:
        return list(self.ssm_states) + list(self.conv_states)

    @torch.no_grad()
    def reset(self):
        for t in self.tensors():
            t.zero_()
        return self

    @torch.no_grad()
    def copy_(self, states):
        """Writes per-layer (ssm_state, conv_state) pairs into the static tensors."""
        for (s, c), (ns, nc) in zip(self.states(), states):
            s.copy_(ns)
            c.copy_(nc)
        return self


class MambaLM(nn.Module):
    """A Mamba-1 language model (mamba-ssm's MambaLMHeadModel: module docstring).

    MambaLM(config, impl="auto", device=None, dtype=None): a fresh model with mamba-ssm's initialisation.
    impl: the blocks' path ('auto' | 'unfused' | 'reference'; see selscan_fused.mamba_block), for forward
    and prefill; forward(..., impl=...) overrides it for one call. The decode step (step) is
    selscan_fused.decode.mamba_block_step on every layer, on the path decode_impl names ('auto' |
    'kernel' | 'torch'; an attribute, step(..., decode_impl=...) overrides it for one call; 'auto' takes
    the decode kernels wherever they run the step, with the fused residual add + RMSNorm).
    """

    def __init__(self, config: MambaLMConfig, impl: str = "auto", device=None, dtype=None):
        super().__init__()
        if impl not in IMPLS:
            raise ValueError(f"selscan_fused: impl must be one of {IMPLS}, got {impl!r}")
        self.config = config
        factory = {"device": device, "dtype": dtype}
        self.backbone = Backbone(config, impl, **factory)
        self.lm_head = nn.Linear(config.d_model, config.padded_vocab_size, bias=False, **factory)
        if self.backbone.embedding.weight.device.type != "meta":
            self.apply(lambda m: _init_weights(m, n_layer=config.n_layer))
        self.tie_weights()
        self.register_load_state_dict_pre_hook(MambaLM._load_hook)
        self.checkpoint_info: dict | None = None
        self.decode_impl = "auto"

    # ---- structure ----

    def tie_weights(self):
        if self.config.tie_embeddings:
            self.lm_head.weight = self.backbone.embedding.weight

    @property
    def impl(self) -> str:
        return self.backbone.layers[0].mixer.impl if len(self.backbone.layers) else "auto"

    def set_impl(self, impl: str):
        if impl not in IMPLS:
            raise ValueError(f"selscan_fused: impl must be one of {IMPLS}, got {impl!r}")
        for layer in self.backbone.layers:
            layer.mixer.impl = impl
        return self

    @staticmethod
    def _load_hook(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        """Hugging Face's key names to mamba-ssm's (as transformers' MambaModel.load_hook does the other
        way), and the tied lm_head filled from the embedding when a checkpoint leaves it out."""
        hf, ours, head = prefix + HF_EMBEDDING_KEY, prefix + EMBEDDING_KEY, prefix + LM_HEAD_KEY
        if hf in state_dict:
            if ours in state_dict:
                raise ValueError(f"selscan_fused: the state_dict holds both {HF_EMBEDDING_KEY!r} (Hugging Face's name) "
                                 f"and {EMBEDDING_KEY!r} (mamba-ssm's); give one")
            state_dict[ours] = state_dict.pop(hf)
        if module.config.tie_embeddings and ours in state_dict:
            if head in state_dict and state_dict[head] is not state_dict[ours]:
                a, b = state_dict[head], state_dict[ours]
                if a.shape != b.shape or not torch.equal(a.to(b.device, b.dtype), b):
                    warnings.warn("selscan_fused: the checkpoint's lm_head.weight differs from its embedding although "
                                  "the config ties them (tie_embeddings / tie_word_embeddings); the embedding is used")
            state_dict[head] = state_dict[ours]

    # ---- forward ----

    def forward(self, input_ids: torch.Tensor, states: list | None = None, return_states: bool = False,
                impl: str | None = None, num_last_tokens: int = 0, cu_seqlens: torch.Tensor | None = None,
                validate: bool = True, logits_rows: torch.Tensor | None = None):
        """input_ids (batch, L) -> logits (batch, L, padded vocab) in the model's dtype, or with
        return_states=True (logits, states): per layer (ssm_state (batch, d_inner, N) float32, conv_state
        (batch, d_inner, d_conv - 1)) after the last token; passing them back as states= continues the
        sequences (a sequence fed in pieces gives the logits of one call). num_last_tokens > 0 computes the
        logits of the last that many positions only. impl overrides the blocks' path for this call.

        Packed sequences: with cu_seqlens (int32, (num_seqs + 1,); selscan_fused.varlen), input_ids is
        (1, total_tokens) holding num_seqs sequences one after another, and the states (given and
        returned) are per sequence, (num_seqs, ...): each sequence's logits and states are those of
        running it alone (the blocks' packed paths: selscan_fused.mamba_block). num_last_tokens does not
        apply (the sequences end at different rows): logits_rows=cu_seqlens[1:] - 1 computes the logits of
        each sequence's last token only, (1, num_seqs, padded vocab). logits_rows (a LongTensor of
        positions) selects the positions of any call the same way."""
        if cu_seqlens is not None and num_last_tokens:
            raise ValueError("selscan_fused: num_last_tokens does not apply to packed sequences (cu_seqlens); take "
                             "the rows cu_seqlens[1:] - 1 of the logits")
        if impl is not None and impl not in IMPLS:
            raise ValueError(f"selscan_fused: impl must be one of {IMPLS}, got {impl!r}")
        _check_ids(input_ids, 2, self.backbone.embedding.num_embeddings)
        if not is_int(num_last_tokens) or num_last_tokens < 0:
            raise ValueError(f"selscan_fused: num_last_tokens must be an int >= 0 (0: every position), got "
                             f"{num_last_tokens!r}")
        layers = self.backbone.layers
        if states is not None and (len(states) != len(layers) or
                                   not all(isinstance(st, (tuple, list)) and len(st) == 2 for st in states)):
            raise ValueError(f"selscan_fused: states must hold one (ssm_state, conv_state) pair per layer "
                             f"({len(layers)} layers), got {len(states)} entries of types "
                             f"{sorted({type(st).__name__ for st in states})}")
        hidden = self.backbone.embedding(input_ids)
        residual = None
        new_states = []
        for i, layer in enumerate(layers):
            h0, c0 = states[i] if states is not None else (None, None)
            # cu_seqlens' values are checked (validate) by the first layer only: one host read per call
            hidden, residual, st = layer(hidden, residual, h0=h0, conv_state=c0, return_final_state=return_states,
                                         impl=impl, cu_seqlens=cu_seqlens, validate=validate and i == 0)
            new_states.append(st)
        residual = hidden if residual is None else hidden + residual
        if num_last_tokens > 0:
            residual = residual[:, -num_last_tokens:]
        if logits_rows is not None:
            residual = residual[:, logits_rows]
        hidden = self.backbone.norm_f(residual.to(self.backbone.norm_f.weight.dtype))
        logits = linear(hidden, self.lm_head.weight, self.lm_head.bias)  # weight gradient: _linear.weight_grad
        return (logits, new_states) if return_states else logits

    # ---- decoding ----

    def allocate_cache(self, batch_size: int, dtype: torch.dtype | None = None, device=None) -> MambaCache:
        """Static per-layer states for `batch_size` sequences (zeros), in `dtype` (default: the model's)
        on `device` (default: the model's)."""
        w = self.backbone.embedding.weight
        dtype = dtype or w.dtype
        if not dtype.is_floating_point:
            raise TypeError(f"selscan_fused: the cache's dtype must be a floating-point dtype (the conv states'), got "
                            f"{dtype}")
        device = torch.device(device) if device is not None else w.device
        sdt = torch.float64 if dtype == torch.float64 else torch.float32
        ssm, conv = [], []
        for layer in self.backbone.layers:
            m = layer.mixer
            ssm.append(torch.zeros(batch_size, m.d_inner, m.d_state, dtype=sdt, device=device))
            conv.append(torch.zeros(batch_size, m.d_inner, m.d_conv - 1, dtype=dtype, device=device))
        return MambaCache(ssm, conv)

    def _check_cache(self, cache: MambaCache, batch: int):
        if not isinstance(cache, MambaCache):
            raise TypeError(f"selscan_fused: cache must be a MambaCache (MambaLM.allocate_cache), got "
                            f"{type(cache).__name__}")
        if len(cache) != len(self.backbone.layers):
            raise ValueError(f"selscan_fused: the cache has {len(cache)} layers, the model {len(self.backbone.layers)}")
        if cache.batch_size != batch:
            raise ValueError(f"selscan_fused: the cache was allocated for batch {cache.batch_size}, the input has "
                             f"batch {batch}")

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, cache: MambaCache, impl: str | None = None) -> torch.Tensor:
        """Runs input_ids (batch, L) through the blocks' sequence path (impl) starting from the cache's
        states (zeros after allocate_cache / reset: a fresh start), writes the final states into the cache
        in place and returns the last position's logits (batch, padded vocab). Called again, it continues
        the sequences (chunked prefill)."""
        if input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise ValueError(f"selscan_fused: prefill takes input_ids of shape (batch, L) with L >= 1, got "
                             f"{tuple(input_ids.shape)}")
        self._check_cache(cache, input_ids.shape[0])
        logits, states = self(input_ids, states=cache.states(), return_states=True, impl=impl, num_last_tokens=1)
        cache.copy_(states)
        return logits[:, -1]

    @torch.no_grad()
    def step(self, input_ids: torch.Tensor, cache: MambaCache, decode_impl: str | None = None) -> torch.Tensor:
        """One token per sequence: input_ids (batch,) -> logits (batch, padded vocab); every layer's states
        in the cache advance by one token in place (selscan_fused.decode.mamba_block_step, on the path
        decode_impl names, default self.decode_impl). No host synchronisation: capturable in a CUDA graph
        (selscan_fused.generation.CUDAGraphStep)."""
        _check_ids(input_ids, 1, self.backbone.embedding.num_embeddings)
        self._check_cache(cache, input_ids.shape[0])
        hidden = self.backbone.embedding(input_ids)
        impl = self.decode_impl if decode_impl is None else decode_impl
        if len(self.backbone.layers) == 0:
            impl = resolve_step_impl(impl)
        else:  # 'auto': the kernel where it runs every layer's step (the layers share their shapes)
            mixer = self.backbone.layers[0].mixer
            impl = resolve_step_impl(impl, hidden, mixer.d_state, mixer.dt_rank, mixer.d_conv,
                                     (*cache.conv_states, *cache.ssm_states))
        fused = impl == "kernel"  # the kernel path also fuses each residual add + RMSNorm
        residual = None
        for i, layer in enumerate(self.backbone.layers):
            normed, residual = layer.add_norm(hidden, residual, fused=fused)
            hidden = mamba_block_step(normed, cache.conv_states[i], cache.ssm_states[i], *layer.mixer.weights(),
                                      impl=impl)
        normed, _ = add_norm(self.backbone.norm_f, hidden, residual, False, fused=fused)
        return self.lm_head(normed)

    # ---- checkpoints ----

    @classmethod
    def from_pretrained(cls, path, device=None, dtype: torch.dtype | None = None, impl: str = "auto") -> "MambaLM":
        """Loads a local checkpoint directory in either layout:

        mamba-ssm's       config.json with d_model, n_layer, vocab_size, ssm_cfg, ... and pytorch_model.bin
                          (keys backbone.embedding.weight, backbone.layers.{i}.mixer.*, ...norm.weight,
                          backbone.norm_f.weight, lm_head.weight)
        Hugging Face's    transformers' MambaConfig config.json (hidden_size, num_hidden_layers, state_size,
                          ...) and model.safetensors (or sharded with model.safetensors.index.json, or
                          pytorch_model.bin); keys backbone.embeddings.weight, ...; lm_head.weight may be
                          absent when tied

        The layout found is logged (logger "selscan_fused") and kept in model.checkpoint_info. The embedding
        decides the vocabulary's rows: a checkpoint with more rows than the config's (padded) vocabulary is
        followed. dtype: default the checkpoint's (its embedding's); device: default CPU. .bin files are
        read with weights_only=True.
        """
        from . import checkpoint as ck

        path = os.fspath(path)
        config, layout, raw = ck.read_config(path)
        state_dict, files = ck.read_weights(path, layout)
        emb = state_dict.get(EMBEDDING_KEY, state_dict.get(HF_EMBEDDING_KEY))
        where = f"{path} ({ck.LAYOUT_NAMES[layout]}: config.json + {', '.join(files)})"
        if emb is None:
            raise ValueError(f"selscan_fused: the checkpoint {where} has no embedding: neither {EMBEDDING_KEY!r} "
                             f"(mamba-ssm) nor {HF_EMBEDDING_KEY!r} (Hugging Face) is among its "
                             f"{len(state_dict)} tensors (first keys: {sorted(state_dict)[:5]})")
        config = ck.fit_vocab(config, emb.shape[0], where)
        if emb.shape[1] != config.d_model:
            raise ValueError(f"selscan_fused: the checkpoint {where} has an embedding of width {emb.shape[1]}, but "
                             f"its config.json says d_model = {config.d_model}")
        dtype = dtype or emb.dtype
        with torch.device("meta"):
            model = cls(config, impl=impl)
        try:
            model.load_state_dict(state_dict, strict=True, assign=True)
        except RuntimeError as e:
            raise ValueError(f"selscan_fused: the checkpoint {where} does not match the model its config.json "
                             f"describes ({config.n_layer} layers, d_model {config.d_model}, ssm_cfg "
                             f"{config.ssm_cfg}):\n{e}") from None
        model.tie_weights()
        model.to(device=device or "cpu", dtype=dtype)
        model.tie_weights()
        model.checkpoint_info = {"path": path, "layout": layout, "layout_name": ck.LAYOUT_NAMES[layout],
                                 "files": ["config.json"] + files}
        logger.info("selscan_fused: loaded %s", where)
        return model

    def save_pretrained(self, path, layout: str = "mamba_ssm"):
        """Writes the model to the directory `path` in mamba-ssm's layout (config.json + pytorch_model.bin,
        what mamba-ssm's MambaLMHeadModel.from_pretrained reads) or Hugging Face's (layout="hf":
        config.json of transformers' MambaConfig + model.safetensors, what
        transformers.MambaForCausalLM.from_pretrained reads). Returns the paths written."""
        from . import checkpoint as ck

        return ck.save(self, os.fspath(path), layout)

    def extra_repr(self) -> str:
        c = self.config
        return f"n_layer={c.n_layer}, d_model={c.d_model}, vocab={c.padded_vocab_size}, tied={c.tie_embeddings}"
