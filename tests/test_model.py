"""The Mamba language model (selscan_fused.model.MambaLM), its decode step (selscan_fused.decode) and
generation (selscan_fused.generation, the `python -m selscan_fused.generate` command): checkpoints of both
layouts against transformers' MambaForCausalLM, the step against the full forward, chunked prefill,
greedy and sampled generation against transformers', eos, errors; on the GPU the unfused path and the
CUDA-graph step."""
import json
import math
import os

import pytest
import torch

from selscan_fused.block_reference import mamba_step_ref
from selscan_fused.decode import mamba_block_step
from selscan_fused.generation import CUDAGraphStep, generate, sample_next, stream_generate, warp_logits
from selscan_fused.model import MambaLM, MambaLMConfig
from conftest import fresh_seed, matmul_precision, rel_l2, requires_cuda, requires_extension, run_generate_cli

transformers = pytest.importorskip("transformers", reason="transformers (a test dependency) is not installed")
pytest.importorskip("safetensors", reason="safetensors (a transformers dependency) is not installed")


# The variants the checkpoint tests run on: (vocab, d_conv, use_bias, use_conv_bias, tie).
VARIANTS = [(100, 4, False, True, True), (97, 3, True, True, True), (97, 2, False, False, False)]


def randomize_lm(model, scale=1.0):
    """Every parameter of a MambaLM or a transformers MambaForCausalLM (same names) moved off its init:
    projections N(0, scale^2 / fan_in), A_log / D / norms / conv / delta bias perturbed, embedding N(0, 0.3^2),
    so that the logits are far from uniform and greedy decoding does not fall into one repeated token
    (with untied embeddings)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.add_(torch.randn_like(p) * 0.5)
            elif name.endswith(".D") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
            elif "embedding" in name:
                p.normal_(0, 0.3)
            elif "conv1d" in name:
                p.add_(torch.randn_like(p) * 0.2)
            elif name.endswith("dt_proj.bias"):
                p.add_(torch.randn_like(p) * 0.3)
            elif name.endswith(".bias"):
                p.normal_(0, 0.1)
            elif p.dim() == 2:
                p.normal_(0, scale / math.sqrt(p.shape[-1]))
    return model


def make_hf(vocab=100, d_conv=4, use_bias=False, use_conv_bias=True, tie=True, hidden=64, layers=2, state=16):
    cfg = transformers.MambaConfig(hidden_size=hidden, num_hidden_layers=layers, vocab_size=vocab, state_size=state,
                                   conv_kernel=d_conv, expand=2, use_bias=use_bias, use_conv_bias=use_conv_bias,
                                   tie_word_embeddings=tie, eos_token_id=None, pad_token_id=None, bos_token_id=None)
    return randomize_lm(transformers.MambaForCausalLM(cfg).eval())


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(ids).logits


def write_mamba_ssm_dir(hf, path, vocab_size, pad_multiple, ssm_extra=None):
    """A mamba-ssm layout directory written by hand from a transformers model: config.json with mamba-ssm's
    keys and pytorch_model.bin with mamba-ssm's names (backbone.embedding, lm_head.weight present)."""
    c = hf.config
    sd = {k.replace("backbone.embeddings.", "backbone.embedding."): v.clone() for k, v in hf.state_dict().items()}
    if "lm_head.weight" not in sd:
        sd["lm_head.weight"] = sd["backbone.embedding.weight"]
    ssm_cfg = {"d_state": c.state_size, "d_conv": c.conv_kernel, "expand": c.expand, "dt_rank": c.time_step_rank,
               "bias": c.use_bias, "conv_bias": c.use_conv_bias, **(ssm_extra or {})}
    cfg = {"d_model": c.hidden_size, "n_layer": c.num_hidden_layers, "vocab_size": vocab_size, "ssm_cfg": ssm_cfg,
           "rms_norm": True, "residual_in_fp32": True, "fused_add_norm": True,
           "pad_vocab_size_multiple": pad_multiple, "tie_embeddings": c.tie_word_embeddings}
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    torch.save(sd, os.path.join(path, "pytorch_model.bin"))
    return path


def small_lm(dtype=torch.float32, d_conv=4, bias=False, tie=False, vocab=97, layers=2, d_model=64, state=16,
             impl="reference", device=None):
    cfg = MambaLMConfig(d_model=d_model, n_layer=layers, vocab_size=vocab, tie_embeddings=tie,
                        ssm_cfg={"d_state": state, "d_conv": d_conv, "bias": bias})
    return randomize_lm(MambaLM(cfg, impl=impl)).to(device=device, dtype=dtype).eval()


# ---- structure and initialisation (CPU) ----

def test_structure_names_and_initialisation_follow_mamba_ssm():
    fresh_seed()
    cfg = MambaLMConfig(d_model=64, n_layer=3, vocab_size=50277, ssm_cfg={"d_state": 8})
    assert cfg.padded_vocab_size == 50280
    m = MambaLM(cfg, impl="reference")
    assert m.backbone.embedding.weight.shape == (50280, 64)
    assert m.lm_head.weight is m.backbone.embedding.weight
    keys = set(m.state_dict())
    for i in range(3):
        assert m.backbone.layers[i].mixer.layer_idx == i
        assert {f"backbone.layers.{i}.norm.weight", f"backbone.layers.{i}.mixer.A_log",
                f"backbone.layers.{i}.mixer.out_proj.weight"} <= keys
        assert f"backbone.layers.{i}.norm.bias" not in keys  # RMSNorm: weight only
    assert {"backbone.embedding.weight", "backbone.norm_f.weight", "lm_head.weight"} <= keys
    assert m.backbone.layers[0].norm.eps == 1e-5
    # mamba-ssm's _init_weights: embedding N(0, 0.02), out_proj kaiming-uniform / sqrt(n_layer), dt bias kept
    assert m.backbone.embedding.weight.std().item() == pytest.approx(0.02, rel=0.02)
    w = m.backbone.layers[1].mixer.out_proj.weight
    bound = 1 / math.sqrt(128) / math.sqrt(3)
    assert w.abs().max() <= bound and w.abs().max() > 0.95 * bound
    dt = torch.nn.functional.softplus(m.backbone.layers[0].mixer.dt_proj.bias)
    assert dt.min() >= 0.999e-3 and dt.max() <= 0.1001
    # fused_add_norm is accepted (and ignored)
    MambaLM(MambaLMConfig(d_model=32, n_layer=1, vocab_size=10, fused_add_norm=False))
    with pytest.raises(ValueError, match="unknown ssm_cfg keys"):
        MambaLM(MambaLMConfig(d_model=32, n_layer=1, vocab_size=10, ssm_cfg={"d_sate": 8}))
    with pytest.raises(ValueError, match="Mamba-1 blocks only"):
        MambaLM(MambaLMConfig(d_model=32, n_layer=1, vocab_size=10, ssm_cfg={"layer": "Mamba2"}))


def test_state_dict_of_transformers_loads_through_the_hook():
    fresh_seed()
    hf = make_hf(vocab=104)
    cfg = MambaLMConfig(d_model=64, n_layer=2, vocab_size=100, ssm_cfg={"d_state": 16})
    m = MambaLM(cfg, impl="reference")
    sd = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}  # tied: may be left out
    assert "backbone.embeddings.weight" in sd
    m.load_state_dict(sd, strict=True)
    assert torch.equal(m.backbone.embedding.weight, hf.backbone.embeddings.weight)
    assert m.lm_head.weight is m.backbone.embedding.weight
    ids = torch.randint(0, 100, (2, 9))
    e = rel_l2(m(ids).detach(), hf_logits(hf, ids))
    print(f"rel err {e:.2e}")
    assert e < 1e-5


# ---- checkpoints of both layouts against transformers (CPU, float32) ----

@pytest.mark.parametrize("vocab,d_conv,use_bias,use_conv_bias,tie", VARIANTS)
def test_hugging_face_checkpoint_gives_transformers_logits(tmp_path, vocab, d_conv, use_bias, use_conv_bias, tie):
    fresh_seed()
    hf = make_hf(vocab, d_conv, use_bias, use_conv_bias, tie)
    hf.save_pretrained(tmp_path / "hf")
    m = MambaLM.from_pretrained(tmp_path / "hf", impl="reference")
    assert m.checkpoint_info["layout"] == "hf"
    assert m.backbone.embedding.weight.shape == (vocab, 64)  # Hugging Face's vocabulary is not padded again
    assert (m.lm_head.weight is m.backbone.embedding.weight) == tie
    ids = torch.randint(0, vocab, (3, 17))
    ref = hf_logits(hf, ids)
    out = m(ids)
    assert out.shape == ref.shape
    e = rel_l2(out.detach(), ref)
    print(f"rel err {e:.2e}")
    assert e < 1e-5


@pytest.mark.parametrize("vocab,d_conv,use_bias,use_conv_bias,tie", VARIANTS)
def test_mamba_ssm_checkpoint_gives_transformers_logits(tmp_path, vocab, d_conv, use_bias, use_conv_bias, tie):
    """A mamba-ssm layout directory (config.json + pytorch_model.bin written here) with mamba-ssm's padded
    vocabulary: config vocab_size 97 -> 104 rows with pad_vocab_size_multiple 8."""
    fresh_seed()
    rows = -(-vocab // 8) * 8
    hf = make_hf(rows, d_conv, use_bias, use_conv_bias, tie)
    d = write_mamba_ssm_dir(hf, tmp_path / "ms", vocab_size=vocab, pad_multiple=8, ssm_extra={"layer": "Mamba1"})
    m = MambaLM.from_pretrained(d, impl="reference")
    assert m.checkpoint_info["layout"] == "mamba_ssm"
    assert m.checkpoint_info["files"] == ["config.json", "pytorch_model.bin"]
    assert m.config.vocab_size == vocab and m.config.padded_vocab_size == rows
    ids = torch.randint(0, vocab, (2, 13))
    e = rel_l2(m(ids).detach(), hf_logits(hf, ids))
    print(f"rel err {e:.2e}")
    assert e < 1e-5


def test_embedding_with_more_rows_than_the_config_is_followed(tmp_path):
    fresh_seed()
    hf = make_hf(vocab=104)
    d = write_mamba_ssm_dir(hf, tmp_path / "ms", vocab_size=97, pad_multiple=1)  # config: 97 rows, checkpoint: 104
    m = MambaLM.from_pretrained(d, impl="reference")
    assert m.backbone.embedding.weight.shape[0] == 104 and m.config.padded_vocab_size == 104
    ids = torch.randint(0, 104, (1, 6))
    assert rel_l2(m(ids).detach(), hf_logits(hf, ids)) < 1e-5
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    cfg["vocab_size"] = 120
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="104 rows, fewer than its config's vocab_size = 120"):
        MambaLM.from_pretrained(d)


def test_sharded_safetensors_checkpoint(tmp_path):
    fresh_seed()
    hf = make_hf(vocab=100)
    hf.save_pretrained(tmp_path / "hf", max_shard_size="100KB")
    files = os.listdir(tmp_path / "hf")
    assert "model.safetensors.index.json" in files, files
    m = MambaLM.from_pretrained(tmp_path / "hf", impl="reference")
    assert m.checkpoint_info["files"][1] == "model.safetensors.index.json" and len(m.checkpoint_info["files"]) > 3
    ids = torch.randint(0, 100, (2, 5))
    assert rel_l2(m(ids).detach(), hf_logits(hf, ids)) < 1e-5


@pytest.mark.parametrize("tie", [True, False])
def test_save_pretrained_round_trips_in_both_layouts(tmp_path, tie):
    fresh_seed()
    m = small_lm(tie=tie, bias=True, d_conv=3)
    ids = torch.randint(0, 97, (2, 11))
    ref = m(ids).detach()
    for layout in ("mamba_ssm", "hf"):
        d = tmp_path / layout
        m.save_pretrained(d, layout=layout)
        names = sorted(os.listdir(d))
        assert names == (["config.json", "pytorch_model.bin"] if layout == "mamba_ssm"
                         else ["config.json", "model.safetensors"])
        m2 = MambaLM.from_pretrained(d, impl="reference")
        assert m2.checkpoint_info["layout"] == layout
        assert (m2.lm_head.weight is m2.backbone.embedding.weight) == tie
        sd, sd2 = m.state_dict(), m2.state_dict()
        assert sd.keys() == sd2.keys()
        assert all(torch.equal(sd[k], sd2[k]) for k in sd)
        assert torch.equal(m2(ids).detach(), ref)
    with open(tmp_path / "mamba_ssm" / "config.json") as f:
        assert set(json.load(f)) == {"d_model", "n_layer", "vocab_size", "ssm_cfg", "rms_norm", "residual_in_fp32",
                                     "fused_add_norm", "pad_vocab_size_multiple", "tie_embeddings"}
    sd = torch.load(tmp_path / "mamba_ssm" / "pytorch_model.bin", weights_only=True)
    assert "backbone.embedding.weight" in sd and "lm_head.weight" in sd
    # transformers reads the "hf" layout, with no key missing or left over
    hf, info = transformers.MambaForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert hf.config.vocab_size == 104 and hf.config.conv_kernel == 3 and hf.config.use_bias
    assert hf.config.eos_token_id is None  # written as null, not left to transformers' default of 0
    e = rel_l2(hf_logits(hf.eval(), ids), ref)
    print(f"transformers on our 'hf' layout: rel err {e:.2e}")
    assert e < 1e-5


def test_checkpoint_errors_name_what_is_missing(tmp_path):
    fresh_seed()
    with pytest.raises(FileNotFoundError, match="not a directory"):
        MambaLM.from_pretrained(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        MambaLM.from_pretrained(tmp_path / "empty")
    m = small_lm()
    m.save_pretrained(tmp_path / "a", layout="hf")
    os.remove(tmp_path / "a" / "model.safetensors")
    with pytest.raises(FileNotFoundError, match=r"Hugging Face layout.*has no weights: expected model.safetensors"):
        MambaLM.from_pretrained(tmp_path / "a")
    m.save_pretrained(tmp_path / "b", layout="mamba_ssm")
    sd = torch.load(tmp_path / "b" / "pytorch_model.bin", weights_only=True)
    del sd["backbone.layers.1.mixer.A_log"]
    torch.save(sd, tmp_path / "b" / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"(?s)mamba-ssm layout.*does not match.*backbone\.layers\.1\.mixer\.A_log"):
        MambaLM.from_pretrained(tmp_path / "b")
    with open(tmp_path / "b" / "config.json", "w") as f:
        json.dump({"d_model": 64, "n_layer": 2}, f)
    with pytest.raises(ValueError, match=r"mamba-ssm layout\) lacks \['vocab_size'\]"):
        MambaLM.from_pretrained(tmp_path / "b")
    with open(tmp_path / "b" / "config.json", "w") as f:
        json.dump({"model_type": "mamba2", "hidden_size": 64}, f)
    with pytest.raises(ValueError, match="describes a 'mamba2' model"):
        MambaLM.from_pretrained(tmp_path / "b")
    with pytest.raises(ValueError, match="layout must be one of"):
        m.save_pretrained(tmp_path / "c", layout="gguf")


# ---- the decode step (CPU) ----

@pytest.mark.parametrize("d_conv,bias", [(4, False), (3, True), (2, False)])
def test_block_step_equals_the_reference_step_in_place(d_conv, bias):
    fresh_seed()
    lm = small_lm(dtype=torch.float64, d_conv=d_conv, bias=bias, layers=1)
    w = lm.backbone.layers[0].mixer.weights()
    x = torch.randn(3, 64, dtype=torch.float64)
    conv = torch.randn(3, 128, d_conv - 1, dtype=torch.float64)
    ssm = torch.randn(3, 128, 16, dtype=torch.float64)
    ref_out, ref_conv, ref_ssm = mamba_step_ref(x, conv.clone(), ssm.clone(), *w)
    conv_p, ssm_p = conv.data_ptr(), ssm.data_ptr()
    buf = torch.empty(3, 64, dtype=torch.float64)
    out = mamba_block_step(x, conv, ssm, *w, out=buf)
    assert out is buf and conv.data_ptr() == conv_p and ssm.data_ptr() == ssm_p
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(conv, ref_conv, rtol=0, atol=0)
    torch.testing.assert_close(ssm, ref_ssm, rtol=1e-12, atol=1e-12)
    with pytest.raises(TypeError, match="ssm_state must be torch.float64"):
        mamba_block_step(x, conv, ssm.float(), *w)
    with pytest.raises(ValueError, match=r"conv_state has shape"):
        mamba_block_step(x, conv[..., :1] if d_conv > 2 else torch.randn(3, 128, 2, dtype=torch.float64), ssm, *w)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("d_conv", [4, 2])
def test_step_logits_equal_the_forward_at_every_position(dtype, tol, d_conv):
    fresh_seed()
    m = small_lm(dtype=dtype, d_conv=d_conv, bias=True, layers=3)
    ids = torch.randint(0, 97, (3, 14))
    full = m(ids).detach()
    cache = m.allocate_cache(3)
    assert cache.ssm_states[0].dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert cache.conv_states[0].dtype == dtype and cache.conv_states[0].shape == (3, 128, d_conv - 1)
    steps = [m.prefill(ids[:, :1], cache)]
    for t in range(1, ids.shape[1]):
        steps.append(m.step(ids[:, t], cache).clone())
    steps = torch.stack(steps, 1)
    e = rel_l2(steps, full)
    print(f"{dtype}: step vs forward rel err {e:.2e}")
    assert e < tol
    # per position too
    for t in range(ids.shape[1]):
        assert rel_l2(steps[:, t], full[:, t]) < tol * 10, t
    # the cache after the steps holds the forward's final states
    _, states = m(ids, return_states=True)
    for (s, c), (s2, c2) in zip(states, cache.states()):
        assert rel_l2(s2, s) < tol * 10 and rel_l2(c2, c) < tol * 10


def test_chunked_prefill_equals_one_prefill():
    """States carried over three chunks (2, 1 and 9 tokens; the first two shorter than d_conv = 4) give the
    logits and final states of one call, through forward(states=) and through prefill on a cache."""
    fresh_seed()
    m = small_lm(dtype=torch.float64, d_conv=4, layers=2)
    ids = torch.randint(0, 97, (2, 12))
    full, states = m(ids, return_states=True)
    pieces, st = [], None
    for a, b in ((0, 2), (2, 3), (3, 12)):
        lg, st = m(ids[:, a:b], states=st, return_states=True)
        pieces.append(lg)
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=1e-12, atol=1e-12)
    for (s, c), (s2, c2) in zip(states, st):
        torch.testing.assert_close(s2, s, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(c2, c, rtol=1e-12, atol=1e-12)
    one = m.allocate_cache(2)
    last_one = m.prefill(ids, one)
    chunked = m.allocate_cache(2)
    for a, b in ((0, 1), (1, 3), (3, 12)):
        last = m.prefill(ids[:, a:b], chunked)
    torch.testing.assert_close(last, last_one, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(last, full[:, -1], rtol=1e-12, atol=1e-12)
    for x, y in zip(chunked.tensors(), one.tensors()):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)
    # reset() starts new sequences
    chunked.reset()
    torch.testing.assert_close(m.prefill(ids, chunked), last_one, rtol=0, atol=0)


# ---- generation (CPU) ----

@pytest.mark.parametrize("tie", [False, True])
def test_greedy_generate_equals_transformers(tmp_path, tie):
    fresh_seed()
    hf = make_hf(vocab=97, tie=tie)
    hf.save_pretrained(tmp_path)
    m = MambaLM.from_pretrained(tmp_path, impl="reference")
    generated = set()
    for shape in ((3, 7), (1, 1), (2, 16)):
        ids = torch.randint(0, 97, shape)
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False)
        out = generate(m, ids, 20)
        assert out.shape == (shape[0], shape[1] + 20)
        assert torch.equal(out, ref), (out, ref)
        generated |= set(out[:, shape[1]:].flatten().tolist())
    if not tie:
        # The comparison means something only if the model does not emit one token throughout. One row of
        # an untied random model can settle on a repeated token (3 of 61 seeds had a row with 1-2
        # distinct tokens), but the 120 generated tokens together held 44-66 distinct ones in all 61.
        assert len(generated) > 20, sorted(generated)


def test_sampling_follows_transformers_warpers_and_is_reproducible():
    fresh_seed()
    from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)
    logits = torch.randn(4, 97) * 3
    for t, k, p in ((1.0, 0, 1.0), (0.7, 10, 1.0), (1.3, 0, 0.8), (0.5, 5, 0.6), (1.0, 1, 1.0), (2.0, 200, 0.01)):
        ref = logits.clone()
        if t != 1.0:
            ref = TemperatureLogitsWarper(t)(None, ref)
        if k:
            ref = TopKLogitsWarper(k)(None, ref)
        if p < 1.0:
            ref = TopPLogitsWarper(p)(None, ref)
        torch.testing.assert_close(warp_logits(logits, t, k, p), ref, rtol=0, atol=0)
    m = small_lm()
    ids = torch.randint(0, 97, (3, 5))
    kw = dict(do_sample=True, temperature=0.9, top_k=20, top_p=0.95)
    a = generate(m, ids, 15, generator=torch.Generator().manual_seed(7), **kw)
    b = generate(m, ids, 15, generator=torch.Generator().manual_seed(7), **kw)
    c = generate(m, ids, 15, generator=torch.Generator().manual_seed(8), **kw)
    assert torch.equal(a, b) and not torch.equal(a, c)
    greedy = generate(m, ids, 15)
    assert torch.equal(generate(m, ids, 15, do_sample=True, top_k=1, generator=torch.Generator().manual_seed(1)),
                       greedy)
    assert torch.equal(sample_next(torch.tensor([[0.0, 2.0, 1.0]])), torch.tensor([1]))
    with pytest.raises(ValueError, match="temperature must be > 0"):
        generate(m, ids, 3, do_sample=True, temperature=0.0)
    with pytest.raises(ValueError, match="top_p must be in"):
        generate(m, ids, 3, do_sample=True, top_p=0.0)


def test_eos_stops_rows_and_finished_rows_emit_pad():
    fresh_seed()
    m = small_lm()
    ids = torch.randint(0, 97, (3, 6))
    free = generate(m, ids, 20)
    new = free[:, 6:]
    eos = int(new[0, 4])

    out = generate(m, ids, 20, eos_token_id=eos, pad_token_id=96)
    assert torch.equal(out[:, :6], ids)
    rows = new.tolist()
    ends = [r.index(eos) + 1 if eos in r else None for r in rows]
    n = max(ends) if all(e is not None for e in ends) else 20
    assert out.shape[1] == 6 + n
    for i, (r, end) in enumerate(zip(rows, ends)):
        exp = r if end is None else r[:end] + [96] * (20 - end)
        assert out[i, 6:].tolist() == exp[:n], i
    assert out[0, 6:].tolist() == (rows[0][:ends[0]] + [96] * 20)[:n] and ends[0] <= 5
    # every row finishes: generation stops early, shorter than max_new_tokens
    eos_all = [int(new[r, 2]) for r in range(3)]
    out = generate(m, ids, 20, eos_token_id=eos_all)
    assert out.shape[1] <= 6 + 3
    for r in range(3):
        row = out[r, 6:].tolist()
        first = next(i for i, t in enumerate(row) if t in eos_all)
        assert row[:first + 1] == new[r, :first + 1].tolist()
        assert all(t == eos_all[0] for t in row[first + 1:])  # pad defaults to the first eos id
    toks = list(stream_generate(m, ids, 4))
    assert len(toks) == 4 and all(t.shape == (3,) for t in toks)
    assert torch.equal(torch.stack(toks, 1), free[:, 6:10])
    with pytest.raises(ValueError, match="not in the vocabulary"):
        generate(m, ids, 3, eos_token_id=1, pad_token_id=500)


def test_prompts_of_unequal_length_each_as_alone():
    """A list of prompts of different lengths: each prefilled alone into its cache row, then decoded
    together; every sequence's tokens are those of generating it alone (greedy, and with an eos)."""
    fresh_seed()
    # float64: the batch-of-3 and batch-of-1 decode steps' products round alike to far below any logit gap
    m = small_lm(vocab=97, dtype=torch.float64)
    prompts = [[5, 9, 13, 2, 40, 7, 7], [3], [60, 61, 62, 1]]
    out = generate(m, prompts, 9)
    assert isinstance(out, list) and [len(o) for o in out] == [16, 10, 13]
    for p, o in zip(prompts, out):
        alone = generate(m, torch.tensor([p]), 9)[0]
        assert torch.equal(o, alone), (p, o, alone)
    toks = list(stream_generate(m, prompts, 4))
    assert len(toks) == 4 and all(t.shape == (3,) for t in toks)
    assert torch.equal(torch.stack(toks, 1), torch.stack([o[len(p):len(p) + 4] for p, o in zip(prompts, out)]))
    eos = int(out[1][3])  # the third new token of the second prompt: it finishes there, the others go on
    with_eos = generate(m, prompts, 9, eos_token_id=eos, pad_token_id=0)
    for p, o in zip(prompts, with_eos):
        alone = generate(m, torch.tensor([p]), 9, eos_token_id=eos, pad_token_id=0)[0]
        assert torch.equal(o[:len(alone)], alone) and (o[len(alone):] == 0).all()
    assert all(torch.equal(o, torch.tensor(p)) for o, p in zip(generate(m, prompts, 0), prompts))


def test_prompts_of_unequal_length_are_a_clear_error():
    m = small_lm()
    from selscan_fused.generation import prompt_batch
    with pytest.raises(ValueError, match=r"unequal lengths \[3, 2\].*Padding is not supported"):
        prompt_batch([[1, 2, 3], [4, 5]], "cpu")
    with pytest.raises(ValueError, match="prompts of at least one token"):
        generate(m, [[1, 2, 3], []], 5)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        stream_generate(m, [[1, 2, 3], [4, 500]], 5)  # checked when called, before any token
    assert torch.equal(generate(m, [[1, 2, 3], [4, 5, 6]], 2), generate(m, torch.tensor([[1, 2, 3], [4, 5, 6]]), 2))
    with pytest.raises(ValueError, match=r"use input_ids\[None\] for one prompt"):
        generate(m, torch.tensor([1, 2, 3]), 2)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        generate(m, torch.tensor([[1, 200]]), 2)
    with pytest.raises(ValueError, match="at least one token"):
        generate(m, torch.zeros(2, 0, dtype=torch.long), 2)


def test_command_line_with_ids_and_with_a_tokenizer(tmp_path):
    fresh_seed()
    m = small_lm()
    m.save_pretrained(tmp_path, layout="hf")
    r = run_generate_cli("--model", str(tmp_path), "--ids", "5,6,7", "--max-new-tokens", "8", "--device", "cpu",
                         "--impl", "reference")
    assert r.returncode == 0, r.stderr
    assert "Hugging Face layout" in r.stderr
    expect = generate(m, torch.tensor([[5, 6, 7]]), 8)[0].tolist()
    assert [int(t) for t in r.stdout.split()] == expect
    r = run_generate_cli("--model", str(tmp_path), "--prompt", "hello", "--device", "cpu")
    assert r.returncode == 2 and "give the prompt's token ids with --ids" in r.stderr
    # the decode step's path is named on the command line (the kernel needs CUDA: a clear error here)
    r = run_generate_cli("--model", str(tmp_path), "--ids", "5,6,7", "--max-new-tokens", "2", "--device", "cpu",
                         "--decode-impl", "torch")
    assert r.returncode == 0 and "decode torch" in r.stderr, r.stderr
    assert [int(t) for t in r.stdout.split()] == expect[:5]
    r = run_generate_cli("--model", str(tmp_path), "--ids", "5,6,7", "--max-new-tokens", "2", "--device", "cpu",
                         "--decode-impl", "kernel")
    assert r.returncode == 2 and "--decode-impl kernel cannot run here" in r.stderr and "CUDA" in r.stderr
    # sampled, seeded: the same twice
    args = ("--model", str(tmp_path), "--ids", "1,2", "--max-new-tokens", "6", "--device", "cpu", "--temperature",
            "0.8", "--top-k", "10", "--seed", "3")
    r1, r2 = run_generate_cli(*args), run_generate_cli(*args)
    assert r1.returncode == 0 and r1.stdout == r2.stdout and len(r1.stdout.split()) == 8
    # a tokenizer.json in the directory: --prompt works and text is printed
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {f"w{i}": i for i in range(104)}  # the padded vocabulary: a random model may pick any row
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.decoder = tokenizers.decoders.WordPiece()  # joins words with spaces
    tok.save(str(tmp_path / "tokenizer.json"))
    r = run_generate_cli("--model", str(tmp_path), "--prompt", "w5 w6 w7", "--max-new-tokens", "8", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [f"w{t}" for t in expect]


def test_generate_name_stays_the_function_after_importing_the_command_module():
    import selscan_fused
    import selscan_fused.generate as cmd  # noqa: F401  (rebinds the package attribute to the module)

    m = small_lm()
    ids = torch.randint(0, 97, (2, 4))
    assert torch.equal(selscan_fused.generate(m, ids, 3), generate(m, ids, 3))


def record_add_norm(monkeypatch) -> list:
    """The `fused` argument of every add_norm call the model makes from now on, in call order."""
    import selscan_fused.model as model_mod
    seen, real = [], model_mod.add_norm

    def spy(norm, hidden, residual, residual_in_fp32, fused=False):
        seen.append(fused)
        return real(norm, hidden, residual, residual_in_fp32, fused)
    monkeypatch.setattr(model_mod, "add_norm", spy)
    return seen


def test_add_norm_fused_only_where_nothing_is_differentiated(monkeypatch):
    """Block.forward asks for the fused add + RMSNorm under no_grad and for the PyTorch operations while
    autograd records (the kernel has no backward); off CUDA the fused request falls back to the same
    math, so both logits agree exactly here."""
    fresh_seed()
    m = small_lm(layers=3)
    ids = torch.randint(0, 97, (2, 11))
    seen = record_add_norm(monkeypatch)
    with torch.no_grad():
        a = m(ids)
    assert seen == [True] * 3
    seen.clear()
    b = m(ids)
    assert seen == [False] * 3 and b.requires_grad
    assert torch.equal(a, b.detach())


# ---- the CUDA paths (GPU) ----

def _gpu_pair(dtype, tie=False):
    """A randomized float32 model on the CPU (reference) and its copy on the GPU in `dtype` (unfused)."""
    cpu = small_lm(tie=tie, d_model=128, layers=3, vocab=203)
    gpu = MambaLM(cpu.config, impl="unfused", device="cuda", dtype=dtype)
    gpu.load_state_dict(cpu.state_dict())
    return cpu, gpu.eval()


@requires_cuda
@requires_extension
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_unfused_logits_on_the_gpu(tmp_path, dtype, tol):
    """The model on the unfused path against the float64 evaluation of the same (rounded) weights, and in
    float32 against transformers' logits from the Hugging Face checkpoint."""
    fresh_seed()
    hf = make_hf(vocab=200, hidden=128, layers=3)
    hf.save_pretrained(tmp_path)
    m = MambaLM.from_pretrained(tmp_path, device="cuda", dtype=dtype, impl="unfused")
    ref64 = MambaLM.from_pretrained(tmp_path, dtype=torch.float64, impl="reference")
    ref64.load_state_dict({k: v.double().cpu() for k, v in m.state_dict().items()})
    ids = torch.randint(0, 200, (2, 300))
    full64 = ref64(ids).detach()
    with matmul_precision("float32-highest"):
        out = m(ids.cuda())
        e64 = rel_l2(out.float().cpu(), full64)
        print(f"{dtype}: against float64 rel err {e64:.2e}")
        assert e64 < tol
        if dtype == torch.float32:
            e = rel_l2(out.cpu(), hf_logits(hf, ids))
            print(f"against transformers rel err {e:.2e}")
            assert e < tol
        # the decode step on the GPU (after a prefill of 40 tokens), against the float64 evaluation
        cache = m.allocate_cache(2)
        steps = [m.prefill(ids[:, :40].cuda(), cache)]
        for t in range(40, 80):
            steps.append(m.step(ids[:, t].cuda(), cache).clone())
        e = rel_l2(torch.stack(steps, 1).float().cpu(), full64[:, 39:80])
        print(f"{dtype}: prefill + steps against float64 rel err {e:.2e}")
        assert e < tol


@requires_cuda
@requires_extension
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_inference_forward_fuses_the_add_and_norm(monkeypatch, dtype, tol):
    """Under no_grad (the prefill's case) every layer's residual add + RMSNorm runs as the one kernel;
    with autograd recording, as PyTorch operations. Both against the float64 evaluation, and the two
    against each other within float32 summation order (float32) or the dtype's rounding (bfloat16)."""
    fresh_seed()
    cpu, gpu = _gpu_pair(dtype)
    ids = torch.randint(0, 203, (2, 257))
    ref64 = MambaLM(cpu.config, impl="reference", dtype=torch.float64)
    ref64.load_state_dict({k: v.double().cpu() for k, v in gpu.state_dict().items()})
    full64 = ref64(ids).detach()
    seen = record_add_norm(monkeypatch)
    with matmul_precision("float32-highest"):
        with torch.no_grad():
            fused_out = gpu(ids.cuda())
        assert seen == [True] * len(gpu.backbone.layers), seen
        seen.clear()
        plain_out = gpu(ids.cuda())
        assert seen == [False] * len(gpu.backbone.layers), seen
    for out in (fused_out, plain_out):
        assert rel_l2(out.float().cpu(), full64) < tol
    # float32: the two differ by the norm's summation order only
    assert rel_l2(fused_out.float(), plain_out.detach().float()) < (1e-5 if dtype == torch.float32 else tol)


@requires_cuda
@requires_extension
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_generate_equals_eager_and_the_cpu_reference(dtype):
    fresh_seed()
    cpu, gpu = _gpu_pair(dtype)
    ids = torch.randint(0, 203, (3, 37))
    with matmul_precision("float32-highest"):
        eager = generate(gpu, ids, 64, cuda_graph=False)
        graphed = generate(gpu, ids, 64, cuda_graph=True)
        assert torch.equal(graphed, eager)
        if dtype == torch.float32:
            assert torch.equal(graphed.cpu(), generate(cpu, ids, 64))
        g = torch.Generator("cuda")
        kw = dict(do_sample=True, temperature=0.9, top_p=0.9)
        a = generate(gpu, ids, 32, generator=g.manual_seed(5), cuda_graph=True, **kw)
        b = generate(gpu, ids, 32, generator=g.manual_seed(5), cuda_graph=False, **kw)
        assert torch.equal(a, b)


@requires_cuda
@requires_extension
def test_cuda_graph_step_replayed_many_times_equals_the_eager_step():
    fresh_seed()
    _, gpu = _gpu_pair(torch.float32)
    ids = torch.randint(0, 203, (4, 20), device="cuda")
    with matmul_precision("float32-highest"):
        c1, c2 = gpu.allocate_cache(4), gpu.allocate_cache(4)
        gpu.prefill(ids, c1)
        gpu.prefill(ids, c2)
        before = [t.clone() for t in c2.tensors()]
        stepper = CUDAGraphStep(gpu, c2)
        for x, y in zip(c2.tensors(), before):  # construction keeps the cache's contents
            assert torch.equal(x, y)
        toks = torch.randint(0, 203, (200, 4), device="cuda")
        for i in range(200):
            eager = gpu.step(toks[i], c1)
            replay = stepper(toks[i])
            assert rel_l2(replay, eager) < 1e-6, i
        for x, y in zip(c2.tensors(), c1.tensors()):
            assert rel_l2(x, y) < 1e-6


@requires_cuda
@requires_extension
def test_cuda_prompts_of_unequal_length():
    """On the GPU (the unfused prefill, the CUDA-graph step): every prompt kept, max_new_tokens new
    tokens each, and the first of them that of the prompt alone (its prefill is the same batch-1 call)."""
    fresh_seed()
    _, gpu = _gpu_pair(torch.float32)
    prompts = [[5, 9, 13, 2, 40, 7, 7], [3], list(range(1, 130))]
    with matmul_precision("float32-highest"):
        out = generate(gpu, prompts, 6)
        for p, o in zip(prompts, out):
            assert o.shape == (len(p) + 6,) and o[:len(p)].tolist() == p
            alone = generate(gpu, torch.tensor([p], device="cuda"), 1)[0]
            assert int(o[len(p)]) == int(alone[-1])

