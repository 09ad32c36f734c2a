"""Bad input to the block's constructor, the language model, its checkpoints, generation and the
`python -m selscan_fused.generate` command: a clear error naming the argument, raised before anything
runs, never a crash inside torch or a silently wrong answer (CPU)."""
import json
import os

import numpy as np
import pytest
import torch

import selscan_fused
from selscan_fused.decode import mamba_block_step
from selscan_fused.generation import generate, prompt_batch, stream_generate
from selscan_fused.model import MambaLM, MambaLMConfig
from conftest import fresh_seed, run_generate_cli

VOCAB = 50  # padded to 56 (pad_vocab_size_multiple 8)


def tiny_lm():
    fresh_seed()
    cfg = MambaLMConfig(d_model=16, n_layer=2, vocab_size=VOCAB, ssm_cfg={"d_state": 4})
    return MambaLM(cfg, impl="reference").eval()


@pytest.mark.parametrize("kw,match", [
    ({"dt_rank": 0}, r"dt_rank must be an int >= 1 or 'auto', got 0"),
    ({"dt_rank": 2.7}, r"dt_rank must be an int >= 1 or 'auto', got 2.7"),
    ({"dt_rank": "Auto"}, r"dt_rank must be an int >= 1 or 'auto', got 'Auto'"),
    ({"dt_rank": None}, r"dt_rank must be an int >= 1 or 'auto', got None"),
    ({"d_conv": 0}, r"d_conv must be an int >= 1, got 0"),
    ({"d_conv": 2.5}, r"d_conv must be an int >= 1, got 2.5"),
    ({"d_state": -1}, r"d_state must be an int >= 1, got -1"),
    ({"d_state": None}, r"d_state must be an int >= 1, got None"),
    ({"expand": 0}, r"expand must be a number with int\(expand \* d_model\) >= 1"),
    ({"dt_min": 0.0}, r"0 < dt_min <= dt_max, got dt_min = 0.0"),
    ({"dt_min": 0.2, "dt_max": 0.1}, r"0 < dt_min <= dt_max"),
])
def test_block_constructor_checks_its_sizes(kw, match):
    with pytest.raises(ValueError, match=match):
        selscan_fused.Mamba(16, **kw)
    with pytest.raises(ValueError, match=r"d_model must be an int >= 1, got 0"):
        selscan_fused.Mamba(0)


def test_config_must_be_a_scan_config():
    with pytest.raises(TypeError, match=r"config must be a selscan_fused.ScanConfig or None, got str"):
        selscan_fused.Mamba(16, config="x")
    m = selscan_fused.Mamba(16, d_state=4)
    x = torch.randn(1, 5, 16)
    with pytest.raises(TypeError, match=r"config must be a selscan_fused.ScanConfig or None, got dict"):
        selscan_fused.mamba_block(x, *m.weights(), config={"l_segments": 2}, impl="reference")
    D, N = 8, 4
    with pytest.raises(TypeError, match=r"config must be a selscan_fused.ScanConfig or None, got str"):
        selscan_fused.selective_scan(torch.randn(1, 5, D), torch.randn(D, N), torch.randn(D, D), torch.randn(D),
                                     torch.randn(N, D), torch.randn(N, D), torch.randn(D), config="x",
                                     impl="reference")


def test_forward_checks_token_ids_and_its_arguments():
    m = tiny_lm()
    ids = torch.randint(0, VOCAB, (2, 5))
    with pytest.raises(TypeError, match=r"input_ids must be an int64 or int32 tensor of token ids, got torch.float32"):
        m(ids.float())
    with pytest.raises(TypeError, match=r"got torch.uint8"):
        m(ids.to(torch.uint8))
    rows = m.backbone.embedding.num_embeddings
    with pytest.raises(ValueError, match=rf"outside the vocabulary \[0, {rows}\): {rows}"):
        m(torch.full((2, 5), rows))
    with pytest.raises(ValueError, match=rf"outside the vocabulary \[0, {rows}\): -1"):
        m(torch.full((2, 5), -1))
    assert m(ids.int()).shape == (2, 5, rows)  # int32 ids are token ids too
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match=r"num_last_tokens must be an int >= 0"):
            m(ids, num_last_tokens=bad)
    _, states = m(ids, return_states=True)
    with pytest.raises(ValueError, match=r"states must hold one \(ssm_state, conv_state\) pair per layer"):
        m(ids, states=[s for s, _ in states])  # tensors instead of pairs


def test_step_checks_its_cache_and_token_ids():
    m = tiny_lm()
    cache = m.allocate_cache(2)
    tok = torch.tensor([1, 2])
    with pytest.raises(TypeError, match=r"cache must be a MambaCache"):
        m.step(tok, None)
    with pytest.raises(ValueError, match=r"input_ids must be a \(batch,\) \(one token per sequence\) tensor"):
        m.step(tok[None], cache)
    with pytest.raises(TypeError, match=r"got torch.float32"):
        m.step(tok.float(), cache)
    with pytest.raises(ValueError, match=r"the cache was allocated for batch 2, the input has batch 3"):
        m.step(torch.tensor([1, 2, 3]), cache)
    other = MambaLM(MambaLMConfig(d_model=16, n_layer=1, vocab_size=VOCAB, ssm_cfg={"d_state": 4}))
    with pytest.raises(ValueError, match=r"the cache has 1 layers, the model 2"):
        m.step(tok, other.allocate_cache(2))
    with pytest.raises(ValueError, match=r"outside the vocabulary"):
        m.step(torch.tensor([1, 99]), cache)


def test_integer_conv_state_is_refused_not_truncated():
    m = tiny_lm()
    with pytest.raises(TypeError, match=r"the cache's dtype must be a floating-point dtype"):
        m.allocate_cache(2, dtype=torch.int64)
    mixer = m.backbone.layers[0].mixer
    x = torch.randn(2, 16)
    ssm = torch.zeros(2, mixer.d_inner, mixer.d_state)
    conv = torch.zeros(2, mixer.d_inner, mixer.d_conv - 1, dtype=torch.int32)
    with pytest.raises(TypeError, match=r"conv_state must be a floating-point tensor"):
        mamba_block_step(x, conv, ssm, *mixer.weights())


def test_generate_refuses_what_it_would_have_truncated():
    m = tiny_lm()
    with pytest.raises(TypeError, match=r"input_ids must hold integer token ids, got 1.7"):
        generate(m, [[1.7, 2.2]], 3)
    with pytest.raises(TypeError, match=r"got True"):
        generate(m, [[True, 2]], 3)
    with pytest.raises(TypeError, match=r"a list of prompts .* got str"):
        generate(m, "hello", 2)
    with pytest.raises(TypeError, match=r"a list of prompts"):
        generate(m, [torch.ones(1, 2, dtype=torch.long)], 2)  # a 2-D tensor is not one prompt
    with pytest.raises(TypeError, match=r"got torch.float32"):
        prompt_batch([torch.tensor([1.0, 2.0])], "cpu")
    # equal-length prompts given as 1-D tensors, as lists, as numpy integers: the same batch
    a = prompt_batch([torch.tensor([1, 2]), torch.tensor([3, 4])], "cpu")
    b = prompt_batch([[1, 2], [np.int64(3), 4]], "cpu")
    assert torch.equal(a, b) and a.dtype == torch.long


@pytest.mark.parametrize("kw,exc,match", [
    ({"do_sample": "no"}, TypeError, r"do_sample must be True or False"),
    ({"do_sample": True, "temperature": "1"}, ValueError, r"temperature must be > 0 for sampling \(a number\)"),
    ({"do_sample": True, "temperature": None}, ValueError, r"temperature must be > 0 for sampling \(a number\)"),
    ({"do_sample": True, "top_k": True}, ValueError, r"top_k must be an int >= 0"),
    ({"do_sample": True, "top_p": None}, ValueError, r"top_p must be in \(0, 1\] \(a number"),
    ({"max_new_tokens": True}, ValueError, r"max_new_tokens must be an int >= 0"),
    ({"eos_token_id": 2.0}, TypeError, r"eos_token_id must be an int or a list of ints"),
    ({"eos_token_id": "2"}, TypeError, r"eos_token_id must be an int or a list of ints"),
    ({"eos_token_id": [1, 2.5]}, TypeError, r"eos_token_id must hold integer token ids"),
    ({"eos_token_id": torch.tensor([[1]])}, TypeError, r"at most one dimension"),
    ({"eos_token_id": 1000, "pad_token_id": 0}, ValueError, r"eos_token_id 1000 is not in the vocabulary"),
    ({"eos_token_id": 1, "pad_token_id": 0.5}, TypeError, r"pad_token_id must be an int"),
])
def test_generation_arguments_are_checked_before_the_first_token(kw, exc, match):
    m = tiny_lm()
    args = {"max_new_tokens": 3, **kw}
    with pytest.raises(exc, match=match):
        stream_generate(m, [[1, 2]], **args)


def test_eos_token_id_of_every_integer_kind_stops_a_row():
    m = tiny_lm()
    assert generate(m, [[1, 2]], 4).shape == (1, 6)
    first = int(generate(m, [[1, 2]], 1)[0, -1])  # the greedy first token
    for eos in (first, np.int64(first), torch.tensor(first), torch.tensor([first]), [first], (first,)):
        out = generate(m, [[1, 2]], 4, eos_token_id=eos)
        assert out.tolist() == [[1, 2, first]], eos  # every row finished: generation ends there


def _write_dir(path, cfg):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return str(path)


@pytest.mark.parametrize("cfg,match", [
    ([1, 2], r"must hold a JSON object .* got a list"),
    ({"d_model": 16, "n_layer": 1, "vocab_size": 50, "ssm_cfg": [1]}, r"has ssm_cfg = \[1\]; it must be a JSON"),
    ({"d_model": 16, "n_layer": "2", "vocab_size": 50}, r"has n_layer = '2'; it must be an integer >= 0"),
    ({"d_model": "16", "n_layer": 1, "vocab_size": 50}, r"has d_model = '16'; it must be an integer >= 1"),
    ({"d_model": 16, "n_layer": 1, "vocab_size": None}, r"has vocab_size = None; it must be an integer >= 1"),
    ({"model_type": "mamba", "hidden_size": 16, "num_hidden_layers": 1, "vocab_size": 50, "state_size": None},
     r"d_state must be an int >= 1, got None"),
    ({"model_type": "mamba", "hidden_size": 16.0, "num_hidden_layers": 1, "vocab_size": 50, "state_size": 4},
     r"has hidden_size = 16.0; it must be an integer >= 1"),
])
def test_config_json_of_the_wrong_types_is_a_clear_error(tmp_path, cfg, match):
    with pytest.raises(ValueError, match=match):
        MambaLM.from_pretrained(_write_dir(tmp_path / "m", cfg))


def test_command_line_errors_come_before_any_output(tmp_path):
    m = tiny_lm()
    m.save_pretrained(tmp_path / "m", layout="hf")
    d = str(tmp_path / "m")
    base = ("--device", "cpu", "--impl", "reference")
    cases = [
        (("--model", str(tmp_path / "none"), "--prompt", "hi"), "is not a directory"),
        (("--model", str(tmp_path / "none"), "--ids", "1,2"), "is not a directory"),
        (("--model", d, "--ids", "1,2", "--max-new-tokens", "-1"), "--max-new-tokens must be >= 0"),
        (("--model", d, "--ids", "1,2", "--temperature", "-1"), "--temperature must be >= 0"),
        (("--model", d, "--ids", "1,2", "--temperature", "0.5", "--top-p", "1.5"), "--top-p in (0, 1]"),
        (("--model", d, "--ids", "1,2", "--temperature", "0.5", "--top-k", "-3"), "--top-k must be >= 0"),
        (("--model", d, "--ids", "1,2,99"), "outside the vocabulary"),
        (("--model", d, "--ids", "1,2", "--eos", "99999"), "eos_token_id 99999 is not in the vocabulary"),
    ]
    for args, msg in cases:
        r = run_generate_cli(*args, *base)
        assert r.returncode == 2, (args, r.returncode, r.stderr)
        assert msg in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
        assert r.stdout == "", (args, r.stdout)
    os.remove(os.path.join(d, "config.json"))
    r = run_generate_cli("--model", d, "--ids", "1,2", *base)
    assert r.returncode == 1 and "error: could not load" in r.stderr and "config.json" in r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""


def test_packed_h0_of_an_unsupported_float_dtype_is_refused():
    D, N = 8, 4
    x = torch.randn(1, 9, D)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    h0 = torch.zeros(2, D, N).to(torch.float8_e4m3fn)
    with pytest.raises(TypeError, match=r"h0 has dtype torch.float8_e4m3fn; supported"):
        selscan_fused.selective_scan(x, torch.randn(D, N), torch.randn(D, D), torch.randn(D), torch.randn(N, D),
                                     torch.randn(N, D), torch.randn(D), h0=h0, cu_seqlens=cu, impl="reference")
