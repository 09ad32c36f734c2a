"""Bad input: a clear error naming the argument, raised before anything runs (CPU part; the CUDA part
is in test_unfused.py)."""
import pytest
import torch

import selscan_fused
from conftest import call, make_inputs, requires_extension


def _inp():
    return make_inputs(2, 5, 16, 8)


@pytest.mark.parametrize("name,bad,match", [
    ("x", torch.randn(5, 16), r"x must have shape \(batch, L, D\)"),
    ("A_log", torch.randn(16, 8, 1), r"A_log must have shape \(D, N\)"),
    ("A_log", torch.randn(15, 8), r"A_log has shape \(15, 8\), expected \(16, 8\)"),
    ("W_delta", torch.randn(16, 15), r"W_delta has shape \(16, 15\), expected \(16, 16\)"),
    ("b_delta", torch.randn(15), r"b_delta has shape \(15,\), expected \(16,\)"),
    ("W_B", torch.randn(7, 16), r"W_B has shape \(7, 16\), expected \(8, 16\)"),
    ("W_C", torch.randn(8, 17), r"W_C has shape \(8, 17\), expected \(8, 16\)"),
    ("D", torch.randn(16, 1), r"D has shape \(16, 1\), expected \(16,\)"),
    ("h0", torch.randn(2, 16, 7), r"h0 has shape \(2, 16, 7\), expected \(2, 16, 8\)"),
])
def test_shape_errors_name_the_argument(name, bad, match):
    inp = _inp()
    inp[name] = bad
    with pytest.raises(ValueError, match=match):
        call(inp, "reference")


def test_bad_impl():
    with pytest.raises(ValueError, match="impl must be one of"):
        call(_inp(), "fast")


def test_integer_dtype_rejected():
    inp = _inp()
    inp["x"] = torch.ones(2, 5, 16, dtype=torch.int32)
    with pytest.raises(TypeError, match="x must be a floating-point tensor"):
        call(inp, "reference")


def test_cpu_tensors_to_cuda_paths():
    for impl in ("unfused", "fused"):
        with pytest.raises(ValueError, match=f"impl='{impl}' needs CUDA tensors"):
            call(_inp(), impl)


@requires_extension
def test_raw_op_rejects_cpu_tensors_clearly():
    inp = _inp()
    with pytest.raises(RuntimeError, match="x is on cpu; the CUDA paths need CUDA tensors"):
        torch.ops.selscan_fused.unfused_fwd(inp["x"], inp["A_log"], inp["W_delta"], inp["b_delta"], inp["W_B"],
                                           inp["W_C"], inp["D"], None, False, 0)


def test_auto_on_cpu_is_reference():
    assert selscan_fused.resolve_impl("auto", torch.randn(1, 2, 16), 8) == "reference"


@pytest.mark.parametrize("kw,match", [
    (dict(ring_stages=-1), r"ring_stages=-1\) must be an int >= 0"),
    (dict(ring_stages=1), r"ring_stages=1\): the ring needs at least 2 stages"),
    (dict(ring_stages=2.0), r"ring_stages=2.0\) must be an int >= 0"),
    (dict(l_segments=True), r"l_segments=True\) must be an int >= 0"),
    (dict(exp_poly=1), r"exp_poly=1\) must be a bool"),
    (dict(channel_tile=32), r"channel_tile=32\) must be 0 \(automatic\), 16 or 64"),
    (dict(channel_tile=-16), r"channel_tile=-16\) must be an int >= 0"),
])
def test_scan_config_rejects_bad_switches(kw, match):
    with pytest.raises(ValueError, match=match):
        selscan_fused.ScanConfig(**kw)


@pytest.mark.parametrize("cfg", [dict(exp_poly=True), dict(ring_stages=3), dict(channel_tile=16),
                                 dict(fused_backward="kernel")])
@pytest.mark.parametrize("impl", ["reference", "auto"])
def test_fused_only_switches_refused_where_the_fused_kernel_does_not_run(cfg, impl):
    """A switch of the layer's fused kernel on a path that does not run it is an error (as on the unfused
    path), not silently ignored: here the reference, chosen or picked by 'auto' on the CPU."""
    config = selscan_fused.ScanConfig(**cfg)
    with pytest.raises(ValueError, match=r"applies to impl='fused' only; this call runs impl='reference'"):
        call(_inp(), impl, config=config)
    blk = selscan_fused.Mamba(16, d_state=4, impl=impl, config=config)
    with pytest.raises(ValueError, match=r"the Mamba block takes l_segments only"):
        blk(torch.randn(2, 5, 16))
    # l_segments applies to every CUDA path and changes no result: the reference takes it
    call(_inp(), impl, config=selscan_fused.ScanConfig(l_segments=2))
    selscan_fused.Mamba(16, d_state=4, impl=impl, config=selscan_fused.ScanConfig(l_segments=2))(torch.randn(2, 5, 16))
