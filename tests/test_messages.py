"""Every rejected input says what is wrong, what was expected and where that expectation comes from.
The first part runs anywhere (the checks of selective_scan, before any path runs); the second calls the
CUDA ops directly (their own checks, in csrc/op_checks.h)."""
import pytest
import torch

import selscan_fused
from conftest import call, make_inputs, requires_cuda, requires_extension, requires_hopper


def _wide(device="cpu"):
    return make_inputs(2, 5, 64, 16, device=device)


# --- selective_scan's checks (any device) ------------------------------------------------------------

def test_x_narrower_than_the_parameters_blames_x():
    inp = _wide()
    inp["x"] = inp["x"][..., :32]
    with pytest.raises(ValueError) as e:
        call(inp, "reference")
    msg = str(e.value)
    assert "x has D = 32 channels (its last dimension; x has shape (2, 5, 32))" in msg
    assert "the parameters are for D = 64" in msg and "A_log (64, 16)" in msg and "W_delta (64, 64)" in msg


def test_a_log_with_another_d_state_than_w_b_and_w_c_blames_a_log():
    inp = _wide()
    inp["A_log"] = torch.randn(64, 8)
    with pytest.raises(ValueError, match=r"A_log has shape \(64, 8\), expected \(64, 16\) \(d_state N = 16 from "
                                         r"W_B \(16, 64\) and W_C \(16, 64\), D = 64 from x's last dimension\)"):
        call(inp, "reference")


@pytest.mark.parametrize("name,shape,why", [
    ("W_B", (7, 64), r"expected \(16, 64\) \(D = 64 from x's last dimension, N = 16 from A_log's second\)"),
    ("W_C", (16, 63), r"expected \(16, 64\) \(D = 64 from x's last dimension, N = 16 from A_log's second\)"),
    ("W_delta", (64, 32), r"expected \(64, 64\) \(D = 64 from x's last dimension\)"),
    ("b_delta", (65,), r"expected \(64,\) \(D = 64 from x's last dimension\)"),
    ("D", (64, 1), r"expected \(64,\) \(D = 64 from x's last dimension\)"),
    ("h0", (3, 64, 16), r"expected \(2, 64, 16\) \(batch = 2 from x, D = 64 from x's last dimension, N = 16"),
])
def test_a_parameter_of_the_wrong_shape_is_named_with_the_expectation(name, shape, why):
    inp = _wide()
    inp[name] = torch.randn(*shape)
    with pytest.raises(ValueError, match=rf"{name} has shape \({', '.join(map(str, shape))},?\), {why}"):
        call(inp, "reference")


@pytest.mark.parametrize("name", ["x", "A_log", "W_delta", "b_delta", "W_B", "W_C", "D", "h0"])
def test_not_a_tensor(name):
    inp = _wide()
    inp[name] = [1.0, 2.0]
    with pytest.raises(TypeError, match=f"selscan_fused: {name} must be a torch.Tensor, got list"):
        call(inp, "reference")


@pytest.mark.parametrize("dtype,match", [
    (torch.int64, "must be a floating-point tensor, got torch.int64"),
    (torch.complex64, "must be a floating-point tensor, got torch.complex64"),
    (torch.float8_e4m3fn, r"has dtype torch.float8_e4m3fn; supported: float32, bfloat16, float16 \(and float64"),
])
def test_unsupported_dtypes(dtype, match):
    inp = _wide()
    inp["W_B"] = torch.randn(16, 64).to(dtype)
    with pytest.raises(TypeError, match=f"W_B {match}"):
        call(inp, "reference")


def test_wrong_rank():
    inp = _wide()
    inp["x"] = inp["x"][0]
    with pytest.raises(ValueError, match=r"x must have shape \(batch, L, D\), got \(5, 64\)"):
        call(inp, "reference")
    inp = _wide()
    inp["A_log"] = torch.randn(64)
    with pytest.raises(ValueError, match=r"A_log must have shape \(D, N\), got \(64,\)"):
        call(inp, "reference")


# --- the CUDA ops' own checks ------------------------------------------------------------------------

def _raw_unfused(inp, **over):
    a = dict(inp, **over)
    return torch.ops.selscan_fused.unfused_fwd(a["x"], a["A_log"], a["W_delta"], a["b_delta"], a["W_B"], a["W_C"],
                                               a["D"], a["h0"], False, 0)


@requires_cuda
@requires_extension
def test_raw_op_blames_x_for_its_width():
    inp = _wide("cuda")
    with pytest.raises(RuntimeError, match=r"x has D = 32 channels \(its last dimension; x has shape \[2, 5, 32\]\) "
                                           r"but the parameters are for D = 64"):
        _raw_unfused(inp, x=inp["x"][..., :32].contiguous())
    with pytest.raises(ValueError, match=r"x has D = 32 channels"):
        call(dict(inp, x=inp["x"][..., :32]), "unfused")


@requires_cuda
@requires_extension
@pytest.mark.parametrize("name,bad,match", [
    ("A_log", lambda t: t.double(), r"A_log has dtype Double, expected Float"),
    ("W_delta", lambda t: t.half(), r"W_delta has dtype Half, expected Float"),
    ("W_B", lambda t: t[:8], r"W_B has shape \[8, 64\], expected \[16, 64\] \(D from x's last dimension, N from "
                             r"A_log's second\)"),
    ("b_delta", lambda t: t[:32], r"b_delta has shape \[32\], expected \[64\] \(D from x's last dimension\)"),
    ("D", lambda t: t.cpu(), r"D is on cpu but x is on cuda:0; all tensors must be on the same device"),
])
def test_raw_op_names_the_argument(name, bad, match):
    inp = _wide("cuda")
    with pytest.raises(RuntimeError, match=match):
        _raw_unfused(inp, **{name: bad(inp[name])})


@requires_cuda
@requires_extension
def test_raw_op_h0_expectation():
    inp = _wide("cuda")
    with pytest.raises(RuntimeError, match=r"h0 has shape \[3, 64, 16\], expected \[2, 64, 16\] \(batch from x"):
        _raw_unfused(inp, h0=torch.randn(3, 64, 16, device="cuda"))


@requires_cuda
@requires_extension
def test_scan_fwd_proj_shape():
    inp = _wide("cuda")
    proj = torch.randn(2, 5, 64 + 16, device="cuda")
    with pytest.raises(RuntimeError, match=r"proj has shape \[2, 5, 80\], expected \[2, 5, 96\]"):
        torch.ops.selscan_fused.scan_fwd(proj, inp["x"], inp["A_log"], inp["b_delta"], inp["D"], None, False, 0)


@requires_cuda
@requires_extension
def test_missing_extension_says_how_to_rebuild(monkeypatch):
    inp = _wide("cuda")
    monkeypatch.setattr(selscan_fused._extension, "_C", None)
    with pytest.raises(RuntimeError, match=r"impl='unfused' needs the CUDA extension selscan_fused._C, which did not "
                                           r"load.*Rebuild it against the installed torch with:\n.*pip install "
                                           r"--no-build-isolation"):
        call(inp, "unfused")


@requires_hopper
def test_raw_fused_op_envelope():
    inp = make_inputs(2, 5, 64, 12, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(RuntimeError, match=r"d_state N = 12 is not supported by impl='fused' \(supported: 8, 16, 32, "
                                           r"64\); use impl='unfused'"):
        torch.ops.selscan_fused.fused_fwd(inp["x"], inp["A_log"], inp["W_delta"], inp["b_delta"], inp["W_B"],
                                          inp["W_C"], inp["D"], None, False, 0)
    inp = make_inputs(2, 5, 64, 16, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(RuntimeError, match=r"x has D = 32 channels"):
        torch.ops.selscan_fused.fused_fwd(inp["x"][..., :32].contiguous(), inp["A_log"], inp["W_delta"],
                                          inp["b_delta"], inp["W_B"], inp["W_C"], inp["D"], None, False, 0)


@requires_hopper
def test_fused_limits_name_the_limit_and_the_path_instead():
    """The fused kernel's limits on D and on batch / L (tensors expanded with stride 0: nothing is
    allocated, the checks come first)."""
    inp = make_inputs(1, 3, 64, 16, dtype=torch.bfloat16, device="cuda")
    big = dict(inp, x=inp["x"][:, :1].expand(1, 2**31, 64))
    with pytest.raises(ValueError, match=r"impl='fused' takes batch and L below 2\^31 \(got batch = 1, L = "
                                         r"2147483648\); use impl='unfused', or split the sequences"):
        call(big, "fused")
    one = torch.zeros(1, device="cuda")
    Dm = 8256
    wide = dict(x=torch.zeros(1, 1, 1, device="cuda", dtype=torch.bfloat16).expand(1, 2, Dm),
                A_log=one.expand(Dm, 16), W_delta=one.bfloat16().expand(Dm, Dm), b_delta=one.expand(Dm),
                W_B=one.bfloat16().expand(16, Dm), W_C=one.bfloat16().expand(16, Dm), D=one.expand(Dm), h0=None)
    with pytest.raises(ValueError, match=r"d_model D = 8256 is not supported by impl='fused' \(a multiple of 64 "
                                         r"from 64 to 8192\); use impl='unfused'"):
        call(wide, "fused")


@requires_extension
def test_plan_ops_need_a_cuda_x():
    """The planning ops (benchmarks and tests ask them for the L split and the channel tile)."""
    x = torch.randn(1, 4, 64)
    with pytest.raises(RuntimeError, match=r"scan_plan needs a CUDA x of shape \(batch, L, D\)"):
        torch.ops.selscan_fused.scan_plan(x, 16, 0)
    if selscan_fused._extension.fused_extension_available():
        with pytest.raises(RuntimeError, match=r"fused_plan needs a CUDA x of shape \(batch, L, D\)"):
            torch.ops.selscan_fused.fused_plan(x, 16, 0, 0)


@requires_cuda
@requires_extension
def test_fused_on_another_gpu_names_the_path_instead(monkeypatch):
    """On a GPU that is not sm_90 (simulated: the capability cache says so), impl='fused' says what it
    needs and what to use instead, and impl='auto' takes the unfused path."""
    inp = make_inputs(1, 5, 64, 16, dtype=torch.bfloat16, device="cuda")
    monkeypatch.setitem(selscan_fused.api._is_sm90, torch.cuda.current_device(), False)
    with pytest.raises(ValueError, match=r"impl='fused' needs an sm_90 GPU \(H100/H200\), cuda:0 is not one; "
                                         r"use impl='unfused'"):
        call(inp, "fused")
    assert selscan_fused.resolve_impl("auto", inp["x"], 16) == "unfused"
