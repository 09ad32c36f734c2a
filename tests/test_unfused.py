"""The unfused path (cuBLAS projections + this project's scan kernel) against the float64 evaluation,
and as a torch op: opcheck, torch.compile, CUDA graphs, the current stream, bad input. GPU only."""
import pytest
import torch
from torch import nn

import selscan_fused
from selscan_fused import ScanConfig
from conftest import (DTYPES, TOLERANCE, call, check_against_float64, float64_eval, fresh_seed, make_inputs,
                      matmul_precision, rel_l2, requires_cuda, requires_extension)

pytestmark = [requires_cuda, requires_extension]

# (batch, L, D, N): L = 1, 7, 1000, 4097; batch 1 and 3; D from 64 to 2048; N = 8, 16, 32, 64.
SHAPES = [
    (1, 1, 64, 16),
    (3, 7, 128, 8),
    (1, 1000, 256, 32),
    (3, 1000, 1024, 8),
    (3, 4097, 64, 16),
    (1, 4097, 2048, 16),
    (3, 7, 2048, 32),
    (1, 1000, 520, 64),  # D not a multiple of any channel tile
    (3, 1, 96, 16),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("mode", list(TOLERANCE))
@pytest.mark.parametrize("with_h0", [False, True], ids=["h0=0", "h0"])
def test_unfused_matches_float64(shape, mode, with_h0, poisoned_outputs):
    fresh_seed()
    with matmul_precision(mode):
        inp = make_inputs(*shape, dtype=DTYPES[mode], device="cuda", with_h0=with_h0)
        y, h = call(inp, "unfused", return_final_state=True)
    check_against_float64(inp, y, h, mode)


@pytest.mark.parametrize("l_segments", [1, 2, 5, 64])
@pytest.mark.parametrize("mode", ["float32-highest", "bfloat16"])
def test_unfused_split_along_L(l_segments, mode, poisoned_outputs):
    fresh_seed()
    with matmul_precision(mode):
        inp = make_inputs(2, 3001, 256, 16, dtype=DTYPES[mode], device="cuda", with_h0=True)
        n_seg, seg_len = torch.ops.selscan_fused.scan_plan(inp["x"], 16, l_segments)
        # at most l_segments: the segment length is rounded up to whole chunks of tokens
        assert (n_seg == 1) == (l_segments == 1) and n_seg <= l_segments and n_seg * seg_len >= 3001
        y, h = call(inp, "unfused", return_final_state=True, config=ScanConfig(l_segments=l_segments))
    check_against_float64(inp, y, h, mode)


def test_long_sequence_fills_the_gpu(poisoned_outputs):
    """S4-like: one sequence of 65,537 tokens; the automatic plan splits L across CTAs."""
    fresh_seed()
    inp = make_inputs(1, 65537, 256, 16, dtype=torch.bfloat16, device="cuda", with_h0=True)
    n_seg, seg_len = torch.ops.selscan_fused.scan_plan(inp["x"], 16, 0)
    assert n_seg >= 16, (n_seg, seg_len)
    y, h = call(inp, "unfused", return_final_state=True)
    check_against_float64(inp, y, h, "bfloat16")


def test_split_plan_for_few_sequences():
    """The unfused forward's automatic L split (csrc/scan/scan_launch.cu, plan_split): where the
    (sequence, 32-channel) items leave SMs idle, the largest power of two of segments whose CTAs are
    all resident at once, in segments of one chunk (32 tokens) or more, and no split into fewer than
    4 segments (where L / 32 bounds it below 4, one segment measured faster); the splits measured fastest
    on the H200 (docs/fwd_split_sweep.csv, docs/perf/batch1.md "The batch-1 regime")."""
    plan = torch.ops.selscan_fused.scan_plan
    x = lambda b, L, D: torch.empty(1, 1, D, dtype=torch.bfloat16, device="cuda").expand(b, L, D)
    assert plan(x(4, 2048, 2048), 16, 0)[0] == 1        # 256 items: every SM has a CTA already
    assert plan(x(1, 32, 1024), 16, 0)[0] == 1          # one chunk
    assert plan(x(1, 64, 1024), 16, 0)[0] == 1          # 2 chunks: no split into fewer than 4 (S5-64)
    assert plan(x(1, 96, 1024), 16, 0)[0] == 1
    assert plan(x(1, 128, 1024), 16, 0) == [4, 32]
    assert plan(x(1, 256, 1024), 16, 0) == [8, 32]      # the floor of one chunk bounds it
    if torch.cuda.get_device_properties(0).multi_processor_count == 132:  # H200 / H100 SXM
        assert plan(x(1, 2048, 1024), 16, 0) == [16, 128]   # 32 items
        assert plan(x(1, 65536, 1024), 16, 0)[0] == 16
        assert plan(x(2, 8192, 1024), 16, 0)[0] == 8        # 64 items
        assert plan(x(4, 8192, 1024), 16, 0)[0] == 4        # 128 items
        assert plan(x(1, 65536, 256), 16, 0)[0] == 64       # S4: 8 items


def test_scan_kernel_alone(poisoned_outputs):
    fresh_seed()
    inp = make_inputs(2, 777, 256, 16, dtype=torch.bfloat16, device="cuda", with_h0=True)
    W = torch.cat([inp["W_delta"], inp["W_B"], inp["W_C"]])
    proj = inp["x"] @ W.T
    y, h = torch.ops.selscan_fused.scan_fwd(proj, inp["x"], inp["A_log"], inp["b_delta"], inp["D"], inp["h0"],
                                            True, 0)
    check_against_float64(inp, y, h, "bfloat16")


@pytest.mark.parametrize("l_segments", [1, 8])
def test_deterministic(l_segments):
    fresh_seed()
    inp = make_inputs(2, 2500, 512, 16, dtype=torch.bfloat16, device="cuda", with_h0=True)
    cfg = ScanConfig(l_segments=l_segments)
    y1, h1 = call(inp, "unfused", return_final_state=True, config=cfg)
    y2, h2 = call(inp, "unfused", return_final_state=True, config=cfg)
    assert torch.equal(y1, y2) and torch.equal(h1, h2)


def test_final_state_not_requested_returns_y_only():
    inp = make_inputs(2, 10, 64, 16, dtype=torch.bfloat16, device="cuda")
    y = call(inp, "unfused")
    assert isinstance(y, torch.Tensor) and y.shape == (2, 10, 64)


def test_non_contiguous_and_misaligned_x(poisoned_outputs):
    fresh_seed()
    inp = make_inputs(3, 100, 128, 16, dtype=torch.bfloat16, device="cuda")
    base = torch.randn(3, 128, 100, device="cuda").to(torch.bfloat16)
    inp["x"] = base.transpose(1, 2)  # non-contiguous view
    y, h = call(inp, "unfused", return_final_state=True)
    check_against_float64(inp, y, h, "bfloat16")
    flat = torch.randn(3 * 100 * 128 + 1, device="cuda").to(torch.bfloat16)
    inp["x"] = flat[1:].view(3, 100, 128)  # contiguous but 2 bytes off 16-byte alignment
    y, h = call(inp, "unfused", return_final_state=True)
    check_against_float64(inp, y, h, "bfloat16")


def test_empty_inputs():
    inp = make_inputs(0, 5, 64, 16, dtype=torch.bfloat16, device="cuda", with_h0=True)
    y, h = call(inp, "unfused", return_final_state=True)
    assert y.shape == (0, 5, 64) and h.shape == (0, 64, 16)
    inp = make_inputs(2, 0, 64, 16, dtype=torch.bfloat16, device="cuda", with_h0=True)
    y, h = call(inp, "unfused", return_final_state=True)
    assert y.shape == (2, 0, 64)
    torch.testing.assert_close(h, inp["h0"])


def test_nan_and_inf_propagate_as_in_reference():
    fresh_seed()
    inp = make_inputs(2, 50, 64, 16, dtype=torch.float32, device="cuda")
    inp["x"][1, 20, 5] = float("nan")
    inp["D"][3] = float("inf")
    y = call(inp, "unfused")
    y_ref = call(inp, "reference")
    assert torch.equal(torch.isnan(y), torch.isnan(y_ref))
    assert torch.equal(torch.isinf(y), torch.isinf(y_ref))


def test_bad_input_on_cuda():
    inp = make_inputs(2, 5, 64, 16, device="cuda")
    bad = dict(inp, W_delta=inp["W_delta"].cpu())
    with pytest.raises(ValueError, match="W_delta is on cpu but x is on cuda"):
        call(bad, "unfused")
    bad = {k: (v.double() if v is not None else None) for k, v in inp.items()}
    with pytest.raises(ValueError, match="x has dtype torch.float64; impl='unfused' takes"):
        call(bad, "unfused")
    assert call(bad, "auto").dtype == torch.float64  # auto: only the reference takes float64
    odd_n = make_inputs(2, 5, 64, 12, device="cuda")
    with pytest.raises(ValueError, match="d_state N = 12 is not supported by impl='unfused'"):
        call(odd_n, "unfused")
    odd_d = make_inputs(2, 5, 100, 16, device="cuda")
    with pytest.raises(ValueError, match="d_model D = 100 is not supported by impl='unfused'"):
        call(odd_d, "unfused")
    with pytest.warns(UserWarning, match="runs the slow reference"):
        call(odd_d, "auto")
    # The raw op checks too (it can be called directly through torch.ops).
    with pytest.raises(RuntimeError, match="W_B has shape"):
        torch.ops.selscan_fused.unfused_fwd(inp["x"], inp["A_log"], inp["W_delta"], inp["b_delta"],
                                           inp["W_B"][:3], inp["W_C"], inp["D"], None, False, 0)
    with pytest.raises(RuntimeError, match="x has dtype Double"):
        torch.ops.selscan_fused.unfused_fwd(bad["x"], inp["A_log"], bad["W_delta"], inp["b_delta"],
                                           bad["W_B"], bad["W_C"], inp["D"], None, False, 0)


def test_auto_picks_the_fastest_supported_path():
    """The measured policy (selscan_fused.api.auto_choice; tests/test_auto_rule.py checks it against the
    committed tables) as resolve_impl applies it to CUDA tensors."""
    hopper = torch.cuda.get_device_capability() == (9, 0) and selscan_fused._extension.fused_extension_available()
    fused_if_hopper = "fused" if hopper else "unfused"
    for dt in (torch.bfloat16, torch.float16):
        x = torch.randn(1, 4, 64, device="cuda", dtype=dt)
        assert selscan_fused.resolve_impl("auto", x, 16) == fused_if_hopper
        assert selscan_fused.resolve_impl("auto", x, 12) == "reference"  # N outside both CUDA paths
    x = torch.randn(1, 4, 72, device="cuda", dtype=torch.bfloat16)  # D not a multiple of 64
    assert selscan_fused.resolve_impl("auto", x, 16) == "unfused"
    big = torch.empty(2, selscan_fused.api.FUSED_FP32_MIN_TOKENS // 2, 64, device="cuda")
    small = torch.empty(1, 64, 64, device="cuda")
    with matmul_precision("float32-highest"):
        assert selscan_fused.resolve_impl("auto", big, 16) == fused_if_hopper
        assert selscan_fused.resolve_impl("auto", small, 16) == "unfused"
    wide = torch.empty(2, selscan_fused.api.FUSED_FP32_MIN_TOKENS // 2, 512, device="cuda")
    with matmul_precision("float32-highest"):
        assert selscan_fused.resolve_impl("auto", wide, 16) == "unfused"  # 16 channel tiles: an L split
    with matmul_precision("float32-high"):
        assert selscan_fused.resolve_impl("auto", big, 16) == fused_if_hopper  # D <= 256, the forward
        assert selscan_fused.resolve_impl("auto", big, 16, training=True) == "unfused"
        assert selscan_fused.resolve_impl("auto", wide, 16) == "unfused"
    wide_bf16 = torch.empty(1, 2048, 2048, device="cuda", dtype=torch.bfloat16)  # cuBLAS leads
    assert selscan_fused.resolve_impl("auto", wide_bf16, 16) == "unfused"
    many_wide = torch.empty(4, 16, 2048, device="cuda", dtype=torch.bfloat16)  # S3's batch and D
    assert selscan_fused.resolve_impl("auto", many_wide, 16) == fused_if_hopper
    assert selscan_fused.resolve_impl("auto", many_wide, 16, training=True) == "unfused"  # the step: unfused
    one = torch.empty(1, 2048, 1024, device="cuda", dtype=torch.bfloat16)  # shape P
    assert selscan_fused.resolve_impl("auto", one, 16) == fused_if_hopper
    assert selscan_fused.resolve_impl("auto", one, 16, training=True) == "unfused"
    assert selscan_fused.resolve_impl("auto", one[:, :512], 16, training=True) == fused_if_hopper
    long = torch.empty(1, 16384, 1024, device="cuda", dtype=torch.bfloat16)
    assert selscan_fused.resolve_impl("auto", long, 16) == "unfused"  # the unfused plan's 16 segments
    assert selscan_fused.resolve_impl("auto", long, 16, training=True) == fused_if_hopper


def _op_args(dtype=torch.bfloat16):
    inp = make_inputs(2, 33, 64, 16, dtype=dtype, device="cuda", with_h0=True)
    return inp, (inp["x"], inp["A_log"], inp["W_delta"], inp["b_delta"], inp["W_B"], inp["W_C"], inp["D"],
                 inp["h0"], True, 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_opcheck(dtype):
    inp, args = _op_args(dtype)
    torch.library.opcheck(torch.ops.selscan_fused.unfused_fwd.default, args)
    proj = inp["x"] @ torch.cat([inp["W_delta"], inp["W_B"], inp["W_C"]]).T
    torch.library.opcheck(torch.ops.selscan_fused.scan_fwd.default,
                          (proj, inp["x"], inp["A_log"], inp["b_delta"], inp["D"], inp["h0"], False, 2))


def test_torch_compile_fullgraph():
    fresh_seed()
    layer = selscan_fused.SelectiveScan(128, 16, impl="unfused").cuda()
    x = torch.randn(2, 300, 128, device="cuda", dtype=torch.bfloat16)
    h0 = torch.randn(2, 128, 16, device="cuda")
    compiled = torch.compile(layer, fullgraph=True)
    with torch.no_grad():
        y_c, h_c = compiled(x, h0=h0, return_final_state=True)
        y_e, h_e = layer(x, h0=h0, return_final_state=True)
    torch.testing.assert_close(y_c, y_e, rtol=0, atol=0)
    torch.testing.assert_close(h_c, h_e, rtol=0, atol=0)


@pytest.mark.parametrize("l_segments", [1, 6])
def test_cuda_graph_capture_and_replay(l_segments, poisoned_outputs):
    fresh_seed()
    Dm, N = 256, 16
    layer = selscan_fused.SelectiveScan(Dm, N, impl="unfused", config=ScanConfig(l_segments=l_segments))
    layer = layer.cuda().to(torch.bfloat16)
    static_x = torch.randn(2, 1500, Dm, device="cuda", dtype=torch.bfloat16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(s):
        for _ in range(2):
            layer(static_x)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(g):
        static_y, static_h = layer(static_x, return_final_state=True)
    for _ in range(2):
        static_x.copy_(torch.randn_like(static_x))
        g.replay()
        inp = dict(x=static_x, A_log=layer.A_log, W_delta=layer.proj_delta.weight, b_delta=layer.proj_delta.bias,
                   W_B=layer.proj_B.weight, W_C=layer.proj_C.weight, D=layer.D, h0=None)
        inp = {k: (v.detach().float() if (v is not None and k not in ("x", "W_delta", "W_B", "W_C")) else v)
               for k, v in inp.items()}
        check_against_float64(inp, static_y, static_h, "bfloat16")


def test_runs_on_the_current_stream():
    fresh_seed()
    Dm = 256
    lin = nn.Linear(Dm, Dm, device="cuda")
    layer = selscan_fused.SelectiveScan(Dm, 16, impl="unfused").cuda()
    inp = torch.randn(4, 2048, Dm, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)  # keeps `side` busy: a launch on another stream would race the Linear
        x = lin(inp)
        y = layer(x)
    side.synchronize()
    with torch.no_grad():
        y_ref = layer(lin(inp))
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)


def test_autocast_bf16():
    fresh_seed()
    layer = selscan_fused.SelectiveScan(128, 16, impl="unfused").cuda()
    x = torch.randn(2, 200, 128, device="cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    inp = dict(x=x.bfloat16(), A_log=layer.A_log.detach(), W_delta=layer.proj_delta.weight.detach().bfloat16(),
               b_delta=layer.proj_delta.bias.detach(), W_B=layer.proj_B.weight.detach().bfloat16(),
               W_C=layer.proj_C.weight.detach().bfloat16(), D=layer.D.detach(), h0=None)
    y64, _ = float64_eval(inp)
    assert rel_l2(y, y64) < TOLERANCE["bfloat16"]
