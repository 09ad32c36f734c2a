"""The fused backward kernel (csrc/fused/fused_bwd_kernel.cuh) through its op, forced on
(fused_bwd(mode=1), both scan layouts): every gradient against float64 autograd of the reference, its L split, bitwise
determinism, and the plan that decides between it and the recomputation. The autograd path
(impl='fused') takes it automatically; tests/test_backward.py covers that path. sm_90 GPUs only."""
import pytest
import torch

import selscan_fused
from conftest import fresh_seed, requires_cuda, requires_extension, requires_hopper
from test_backward import NAMES, check_grads, float64_grads, make_case

# The needs marks (tests/conftest.py) skip with one line per cause for the whole suite; the fused
# backward kernel is in the fused extension, for sm_90 GPUs.
pytestmark = [requires_cuda, requires_extension, requires_hopper]

MODES = ["bfloat16", "float16"]
LAYOUTS = [4, 8]  # scan threads per channel (fused_bwd's threads_per_channel)


def kernel_grads(inp, dy, dhT, l_segments=0, mode=1, threads_per_channel=0):
    """The fused forward with residuals, then fused_bwd; gradients keyed as float64_grads'."""
    args = tuple(inp[k] for k in NAMES)
    _, _, ckpt = torch.ops.selscan_fused.fused_fwd_res(*args, l_segments)
    g = torch.ops.selscan_fused.fused_bwd(*args, dy, dhT, ckpt, l_segments, mode, threads_per_channel)
    out = dict(zip(NAMES, g))
    if inp["h0"] is None:
        del out["h0"]
    return out


# (batch, L, D, with_h0, with_dhT, l_segments): L = 1, 7, 1000, 4097, odd and whole tiles; batch 1 and
# 3; D from 64 to 2048; the L split automatic (0: few streams split) and forced.
CASES = [
    (1, 1, 64, True, True, 0),
    (3, 7, 128, False, True, 0),
    (2, 64, 192, True, False, 1),
    (3, 1000, 1024, False, False, 0),
    (1, 4097, 512, True, True, 0),
    (2, 3001, 256, True, True, 1),
    (2, 3001, 256, True, True, 2),
    (2, 3001, 256, False, True, 7),
    (1, 1000, 2048, True, True, 0),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c[:3])) + ("-h0" if c[3] else "")
                         + ("-dhT" if c[4] else "") + f"-seg{c[5]}")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("tpc", LAYOUTS)
def test_kernel_gradients_match_float64(case, mode, tpc, poisoned_outputs):
    batch, L, Dm, with_h0, with_dhT, l_segments = case
    fresh_seed()
    inp, dy, dhT = make_case(batch, L, Dm, 16, mode, with_h0, with_dhT)
    plan = torch.ops.selscan_fused.fused_bwd_plan(inp["x"], 16, l_segments, 1, tpc)
    assert plan[0] == 1 and plan[3] == tpc
    if l_segments > 0:  # split_lengths: segments of whole 64-token tiles, at most l_segments of them
        seg_len = -(-(-(-L // l_segments)) // 64) * 64
        assert plan[1:3] == [-(-L // seg_len), seg_len]
    got = kernel_grads(inp, dy, dhT, l_segments, threads_per_channel=tpc)
    check_grads(got, float64_grads(inp, dy, dhT), mode, f"fused bwd kernel {mode} plan={plan}")


@pytest.mark.parametrize("tpc", LAYOUTS)
def test_kernel_long_sequence_split(tpc, poisoned_outputs):
    """S4-like: one sequence of 16385 tokens, 4 streams: the automatic plan splits L (phase 1, grid
    barrier, phase 2 inside the launch)."""
    fresh_seed()
    inp, dy, dhT = make_case(1, 16385, 256, 16, "bfloat16", True, True)
    plan = torch.ops.selscan_fused.fused_bwd_plan(inp["x"], 16, 0, 1, tpc)
    assert plan[0] == 1 and plan[1] > 8, plan
    got = kernel_grads(inp, dy, dhT, threads_per_channel=tpc)
    check_grads(got, float64_grads(inp, dy, dhT), "bfloat16", f"fused bwd kernel plan={plan}")


@pytest.mark.parametrize("l_segments", [0, 5])
@pytest.mark.parametrize("tpc", LAYOUTS)
def test_kernel_bitwise_deterministic(l_segments, tpc):
    fresh_seed()
    inp, dy, dhT = make_case(2, 2500, 512, 16, "bfloat16", True, True)
    runs = [kernel_grads(inp, dy, dhT, l_segments, threads_per_channel=tpc) for _ in range(5)]
    for r in runs[1:]:
        for k in runs[0]:
            assert torch.equal(runs[0][k], r[k]), f"d{k} differs between runs"


def test_kernel_and_recomputation_agree():
    """The kernel and the recomputation (one library product, the standalone backward kernel) on the
    same inputs: both near float64, and near each other."""
    fresh_seed()
    inp, dy, dhT = make_case(2, 777, 256, 16, "bfloat16", True, True)
    a = kernel_grads(inp, dy, dhT, mode=1)
    b = kernel_grads(inp, dy, dhT, mode=2)
    ref = float64_grads(inp, dy, dhT)
    check_grads(a, ref, "bfloat16", "kernel")
    check_grads(b, ref, "bfloat16", "recomputation")
    check_grads(a, {k: v.double() for k, v in b.items()}, "bfloat16", "kernel vs recomputation")


def test_plan_takes_the_kernel_where_it_exists():
    x16 = torch.empty(2, 100, 128, device="cuda", dtype=torch.bfloat16)
    assert torch.ops.selscan_fused.fused_bwd_plan(x16, 16, 0, 1)[0] == 1
    assert torch.ops.selscan_fused.fused_bwd_plan(x16.half(), 16, 0, 1)[0] == 1
    assert torch.ops.selscan_fused.fused_bwd_plan(x16, 16, 0, 2)[0] == 0      # forced recomputation
    assert torch.ops.selscan_fused.fused_bwd_plan(x16, 8, 0, 0)[0] == 0       # no kernel for N = 8 yet
    assert torch.ops.selscan_fused.fused_bwd_plan(x16.float(), 16, 0, 0)[0] == 0  # nor for float32
    with pytest.raises(RuntimeError, match="fused backward kernel takes bfloat16/float16 with N = 16"):
        torch.ops.selscan_fused.fused_bwd_plan(x16.float(), 16, 0, 1)
    with pytest.raises(RuntimeError, match="mode = 3 must be 0"):
        torch.ops.selscan_fused.fused_bwd_plan(x16, 16, 0, 3)
    with pytest.raises(RuntimeError, match="threads_per_channel = 5 must be 0"):
        torch.ops.selscan_fused.fused_bwd_plan(x16, 16, 0, 1, 5)
    # Few streams split L; many do not.
    one = torch.empty(1, 65536, 256, device="cuda", dtype=torch.bfloat16)
    n_seg = torch.ops.selscan_fused.fused_bwd_plan(one, 16, 0, 1)[1]
    assert 16 <= n_seg <= 33, n_seg
    many = torch.empty(8, 4096, 1024, device="cuda", dtype=torch.bfloat16)
    assert torch.ops.selscan_fused.fused_bwd_plan(many, 16, 0, 1)[1] == 1
    # Automatic: the kernel where its plan splits L into 2 .. 8 segments (S1), the recomputation at S2
    # (no split), S4 (32 segments) and where nothing is split (x16).
    s1 = torch.empty(8, 2048, 256, device="cuda", dtype=torch.bfloat16)
    assert torch.ops.selscan_fused.fused_bwd_plan(s1, 16, 0, 0)[:2] == [1, 4]
    for x in (many, one, x16):
        assert torch.ops.selscan_fused.fused_bwd_plan(x, 16, 0, 0)[0] == 0


def test_opcheck_fused_bwd():
    from conftest import make_inputs
    inp = make_inputs(2, 150, 64, 16, dtype=torch.bfloat16, device="cuda", with_h0=True)
    base = tuple(inp[k] for k in NAMES)
    _, h, ckpt = torch.ops.selscan_fused.fused_fwd_res(*base, 0)
    dy, dhT = torch.randn_like(inp["x"]), torch.randn_like(h)
    for mode, tpc in ((0, 0), (2, 0), (1, 8)):
        torch.library.opcheck(torch.ops.selscan_fused.fused_bwd.default, base + (dy, dhT, ckpt, 0, mode, tpc),
                              test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
    torch.library.opcheck(torch.ops.selscan_fused.fused_bwd.default, base + (dy, None, ckpt, 3, 1, 4),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


@pytest.mark.parametrize("setting,shape", [("auto", (8, 2048, 256)), ("kernel", (2, 300, 128))])
def test_autograd_path_uses_the_kernel(setting, shape):
    """impl='fused' training in bf16 with N = 16 reaches fused_bwd: automatically on an S1 shape (the
    plan splits L in 4), or forced by ScanConfig(fused_backward='kernel'): the gradients equal the
    forced kernel's bit for bit."""
    fresh_seed()
    inp, dy, dhT = make_case(*shape, 16, "bfloat16", True, True)
    leaves = {k: (v.detach().clone().requires_grad_(True) if v is not None else None) for k, v in inp.items()}
    y, h = selscan_fused.selective_scan(*(leaves[k] for k in NAMES[:7]), h0=leaves["h0"], return_final_state=True,
                                        impl="fused", config=selscan_fused.ScanConfig(fused_backward=setting))
    torch.autograd.backward([y, h], [dy, dhT])
    forced = kernel_grads(inp, dy, dhT, mode=1)
    for k in NAMES:
        assert torch.equal(leaves[k].grad, forced[k]), f"d{k}"


def test_fused_backward_setting_recompute_and_errors():
    """ScanConfig(fused_backward='recompute') gives the recomputation's gradients bit for bit; 'kernel'
    where the kernel does not exist is an error that says so; the setting is for impl='fused' only."""
    fresh_seed()
    inp, dy, dhT = make_case(2, 300, 128, 16, "bfloat16", True, True)
    leaves = {k: (v.detach().clone().requires_grad_(True) if v is not None else None) for k, v in inp.items()}
    cfg = selscan_fused.ScanConfig(fused_backward="recompute")
    y, h = selscan_fused.selective_scan(*(leaves[k] for k in NAMES[:7]), h0=leaves["h0"], return_final_state=True,
                                        impl="fused", config=cfg)
    torch.autograd.backward([y, h], [dy, dhT])
    forced = kernel_grads(inp, dy, dhT, mode=2)
    for k in NAMES:
        assert torch.equal(leaves[k].grad, forced[k]), f"d{k}"
    x8 = make_case(2, 100, 128, 8, "bfloat16", False, False)[0]
    leaves = {k: (v.detach().clone().requires_grad_(True) if v is not None else None) for k, v in x8.items()}
    y = selscan_fused.selective_scan(*(leaves[k] for k in NAMES[:7]), impl="fused",
                                     config=selscan_fused.ScanConfig(fused_backward="kernel"))
    with pytest.raises(RuntimeError, match="fused backward kernel takes bfloat16/float16 with N = 16"):
        y.float().sum().backward()
    with pytest.raises(ValueError, match="fused_backward='kernel'.* applies to impl='fused' only"):
        selscan_fused.selective_scan(*(inp[k] for k in NAMES[:7]), impl="unfused",
                                     config=selscan_fused.ScanConfig(fused_backward="kernel"))
