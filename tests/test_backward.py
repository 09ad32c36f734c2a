"""The backward of both CUDA paths (impl='unfused', impl='fused') against float64 autograd of the
reference on the same inputs, and as torch ops: opcheck with its autograd checks, torch.compile of a
whole training step, CUDA-graph capture of a training step, bitwise determinism, memory. GPU only."""
import pytest
import torch
from torch import nn

import selscan_fused
from selscan_fused import ScanConfig
from selscan_fused.reference import selective_scan_ref
from conftest import (DTYPES, TOLERANCE, fresh_seed, make_inputs, matmul_precision, rel_l2, requires_cuda,
                      requires_extension, short_sum_bound)

pytestmark = [requires_cuda, requires_extension]

HOPPER = (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
          and selscan_fused._extension.fused_extension_available())
IMPLS = ["unfused"] + (["fused"] if HOPPER else [])
NAMES = ("x", "A_log", "W_delta", "b_delta", "W_B", "W_C", "D", "h0")

# (batch, L, D, N, with_h0, with_dhT): L = 1, 7, 1000, 4097; batch 1 and 3; D from 64 to 2048; every N.
SHAPES = [
    (1, 1, 64, 16, True, True),
    (3, 7, 128, 8, False, True),
    (1, 1000, 256, 32, True, False),
    (3, 1000, 1024, 16, False, False),
    (3, 1000, 512, 8, True, True),
    (1, 4097, 2048, 16, True, True),
    (3, 7, 2048, 32, False, True),
    (1, 1000, 512, 64, True, True),
    (2, 130, 192, 64, False, False),
]


def leaf_inputs(inp):
    return {k: (v.detach().clone().requires_grad_(True) if v is not None else None) for k, v in inp.items()}


def run_grads(inp, impl, dy, dhT, config=None):
    """Gradients of <y, dy> + <final state, dhT> (dhT None: the final state unused) through `impl`."""
    leaves = leaf_inputs(inp)
    y, h = selscan_fused.selective_scan(*(leaves[k] for k in NAMES[:7]), h0=leaves["h0"], return_final_state=True,
                                        impl=impl, config=config)
    outs, grads = [y], [dy]
    if dhT is not None:
        outs.append(h)
        grads.append(dhT)
    torch.autograd.backward(outs, grads)
    return {k: leaves[k].grad for k in NAMES if leaves[k] is not None}, y


def float64_grads(inp, dy, dhT):
    """float64 autograd of the reference on the same (already rounded) values."""
    leaves = {k: (v.detach().double().requires_grad_(True) if v is not None else None) for k, v in inp.items()}
    y, h = selective_scan_ref(*(leaves[k] for k in NAMES[:7]), leaves["h0"])
    loss = (y * dy.double()).sum()
    if dhT is not None:
        loss = loss + (h * dhT.double()).sum()
    loss.backward()
    return {k: leaves[k].grad for k in NAMES if leaves[k] is not None}


def check_grads(got, ref, mode, label="", bounds=None):
    """Every gradient within the forward's bound for the dtype (bounds: per-gradient exceptions)."""
    for k, r in ref.items():
        bound = (bounds or {}).get(k, TOLERANCE[mode])
        g = got[k]
        assert g is not None, f"no gradient for {k}"
        assert g.shape == r.shape and torch.isfinite(g).all(), f"{k}: non-finite or misshapen gradient"
        if r.abs().max() == 0:
            err = g.double().abs().max().item()
            print(f"{label} d{k}: max abs {err:.2e} (zero in float64)")
            assert err < bound
        else:
            err = rel_l2(g, r)
            print(f"{label} d{k}: rel err {err:.2e} (bound {bound:.0e})")
            assert err < bound, f"d{k}: rel err {err:.2e} above {bound:.0e}"


def make_case(batch, L, Dm, N, mode, with_h0, with_dhT):
    inp = make_inputs(batch, L, Dm, N, dtype=DTYPES[mode], device="cuda", with_h0=with_h0)
    inp["b_delta"][::7] += 25.0  # softplus arguments past its threshold (20) on some channels
    # float16: a loss scale, as float16 training needs one: dW_B and dW_C sum over every token and
    # channel and pass float16's range (65504) on the largest shapes with an unscaled O(1) gradient.
    scale = 2.0 ** -6 if mode == "float16" else 1.0
    dy = (torch.randn(batch, L, Dm, device="cuda") * scale).to(DTYPES[mode])
    dhT = torch.randn(batch, Dm, N, device="cuda") * scale if with_dhT else None
    return inp, dy, dhT


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:4])) + ("-h0" if s[4] else "")
                         + ("-dhT" if s[5] else ""))
@pytest.mark.parametrize("mode", list(TOLERANCE))
@pytest.mark.parametrize("impl", IMPLS)
def test_gradients_match_float64(shape, mode, impl, poisoned_outputs):
    batch, L, Dm, N, with_h0, with_dhT = shape
    fresh_seed()
    with matmul_precision(mode):
        inp, dy, dhT = make_case(batch, L, Dm, N, mode, with_h0, with_dhT)
        got, _ = run_grads(inp, impl, dy, dhT)
    short = short_sum_bound(TOLERANCE[mode], batch * L)  # gradients summed over few tokens (conftest)
    check_grads(got, float64_grads(inp, dy, dhT), mode, f"{impl} {mode}",
                bounds={k: short for k in ("A_log", "W_delta", "b_delta")})


@pytest.mark.parametrize("l_segments", [1, 2, 5])
@pytest.mark.parametrize("mode", ["float32-highest", "bfloat16"])
@pytest.mark.parametrize("impl", IMPLS)
def test_gradients_split_along_L(l_segments, mode, impl, poisoned_outputs):
    """The backward's own L split (the adjoint crossing segments inside the launch), forced."""
    fresh_seed()
    with matmul_precision(mode):
        inp, dy, dhT = make_case(2, 3001, 256, 16, mode, True, True)
        got, _ = run_grads(inp, impl, dy, dhT, ScanConfig(l_segments=l_segments))
    check_grads(got, float64_grads(inp, dy, dhT), mode, f"{impl} seg={l_segments}")


@pytest.mark.parametrize("impl", IMPLS)
def test_long_sequence_backward(impl, poisoned_outputs):
    """S4-like: one sequence; the automatic plan splits L in the forward and in the backward."""
    fresh_seed()
    inp, dy, dhT = make_case(1, 16385, 256, 16, "bfloat16", True, True)
    got, _ = run_grads(inp, impl, dy, dhT)
    check_grads(got, float64_grads(inp, dy, dhT), "bfloat16", impl)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("l_segments", [0, 6])
def test_gradients_bitwise_deterministic(impl, l_segments):
    fresh_seed()
    inp, dy, dhT = make_case(2, 2500, 512, 16, "bfloat16", True, True)
    runs = [run_grads(inp, impl, dy, dhT, ScanConfig(l_segments=l_segments))[0] for _ in range(5)]
    for r in runs[1:]:
        for k in runs[0]:
            assert torch.equal(runs[0][k], r[k]), f"d{k} differs between runs"


@pytest.mark.parametrize("impl", IMPLS)
def test_backward_allocates_no_state_sized_tensor(impl):
    """Nothing of shape (batch, L, D, N) in the backward: its peak extra memory stays far below one."""
    fresh_seed()
    batch, L, Dm, N = 2, 8192, 512, 16
    inp, dy, dhT = make_case(batch, L, Dm, N, "bfloat16", False, True)
    leaves = leaf_inputs(inp)
    y, h = selscan_fused.selective_scan(*(leaves[k] for k in NAMES[:7]), return_final_state=True, impl=impl)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.autograd.backward([y, h], [dy, dhT])
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    state_bytes = batch * L * Dm * N * 4
    print(f"{impl}: backward peak extra {extra / 2**20:.1f} MiB; one (B,L,D,N) float32 tensor {state_bytes / 2**20:.0f} MiB")
    assert extra < state_bytes / 4


@pytest.mark.parametrize("impl", IMPLS)
def test_upstream_gradient_non_contiguous_and_other_dtype(impl):
    fresh_seed()
    inp, dy, dhT = make_case(2, 300, 128, 16, "float32-highest", True, True)
    ref = float64_grads(inp, dy, dhT)
    dy_t = dy.transpose(0, 1).contiguous().transpose(0, 1)  # a non-contiguous view of the same values
    got, _ = run_grads(inp, impl, dy_t, dhT.transpose(1, 2).contiguous().transpose(1, 2))
    check_grads(got, ref, "float32-highest", "non-contiguous dy")
    # A bfloat16 upstream gradient into a float32 output: autograd casts it; the values are dy's, rounded.
    dy16 = dy.bfloat16()
    got, _ = run_grads(inp, impl, dy16, None)
    check_grads(got, float64_grads(inp, dy16.float(), None), "float32-highest", "bf16 dy")


@pytest.mark.parametrize("impl", IMPLS)
def test_final_state_only_loss(impl):
    """Only the final state feeds the loss: y's gradient is None, the op gets zeros for it."""
    fresh_seed()
    inp, _, dhT = make_case(2, 500, 128, 16, "float32-highest", True, True)
    leaves = leaf_inputs(inp)
    _, h = selscan_fused.selective_scan(*(leaves[k] for k in NAMES[:7]), h0=leaves["h0"], return_final_state=True,
                                        impl=impl)
    (h * dhT).sum().backward()
    got = {k: leaves[k].grad for k in NAMES}
    # dh0 is here a pure product of 500 decays (no loss on y): the bias of the exponential unit
    # (ex2.approx, a fraction of an ulp per decay) adds up along the product; measured 1.09e-5 on the
    # H200, above the 1e-5 of float32 "highest" (docs/math.md, "Accuracy"). The forward's final state
    # carries the same bias in its h0 term.
    check_grads(got, float64_grads(inp, torch.zeros_like(inp["x"]), dhT), "float32-highest", "final state only",
                bounds={"h0": 3e-5})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_opcheck_training_ops(dtype):
    inp = make_inputs(2, 150, 64, 16, dtype=dtype, device="cuda", with_h0=True)
    base = tuple(inp[k] for k in NAMES)
    grad = lambda t: t.detach().clone().requires_grad_(t.is_floating_point())
    targs = tuple(grad(t) for t in base)
    torch.library.opcheck(torch.ops.selscan_fused.unfused_fwd_res.default, targs + (0,))
    torch.library.opcheck(torch.ops.selscan_fused.unfused_fwd.default, targs + (True, 2))
    y, h, proj, ckpt = torch.ops.selscan_fused.unfused_fwd_res(*base, 0)
    dy, dhT = torch.randn_like(y), torch.randn_like(h)
    torch.library.opcheck(torch.ops.selscan_fused.unfused_bwd.default, base + (dy, dhT, proj, ckpt, 0),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
    torch.library.opcheck(torch.ops.selscan_fused.unfused_bwd.default, base + (dy, None, None, ckpt, 3),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
    if HOPPER:
        torch.library.opcheck(torch.ops.selscan_fused.fused_fwd_res.default, targs + (0,))
        torch.library.opcheck(torch.ops.selscan_fused.fused_fwd.default, targs + (True, 0))


def _loss(layer, x, dy, h0):
    y, h = layer(x, h0=h0, return_final_state=True)
    return (y.float() * dy).sum() + h.square().sum()


@pytest.mark.parametrize("impl", IMPLS)
def test_torch_compile_training_step_fullgraph(impl):
    """The forward and the loss compiled as one graph (fullgraph: no graph break); AOTAutograd compiles
    the backward graph from the ops' autograd formulas, which the step then runs."""
    fresh_seed()
    layer = selscan_fused.SelectiveScan(128, 16, impl=impl).cuda()
    x = torch.randn(2, 300, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    h0 = torch.randn(2, 128, 16, device="cuda", requires_grad=True)
    dy = torch.randn(2, 300, 128, device="cuda")
    compiled = torch.compile(_loss, fullgraph=True)
    leaves = [*layer.parameters(), x, h0]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss_c = compiled(layer, x, dy, h0)
    loss_c.backward()
    grads_c = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss_e = _loss(layer, x, dy, h0)
    loss_e.backward()
    grads_e = [t.grad for t in leaves]
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-3)
    for gc, ge in zip(grads_c, grads_e):  # the same kernels; only the compiled casts may round differently
        assert rel_l2(gc, ge) < 1e-2


@pytest.mark.parametrize("impl", IMPLS)
def test_cuda_graph_training_step(impl):
    fresh_seed()
    Dm = 256
    layer = selscan_fused.SelectiveScan(Dm, 16, impl=impl).cuda().to(torch.bfloat16)
    static_x = torch.randn(2, 1500, Dm, device="cuda", dtype=torch.bfloat16)
    static_dy = torch.randn(2, 1500, Dm, device="cuda", dtype=torch.bfloat16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            layer.zero_grad(set_to_none=True)
            layer(static_x).backward(static_dy)
    torch.cuda.current_stream().wait_stream(s)
    layer.zero_grad(set_to_none=True)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        layer(static_x).backward(static_dy)
    captured = {n: p.grad for n, p in layer.named_parameters()}
    for _ in range(2):
        static_x.copy_(torch.randn_like(static_x))
        static_dy.copy_(torch.randn_like(static_dy))
        g.replay()
        ref = selscan_fused.SelectiveScan(Dm, 16, impl=impl).cuda().to(torch.bfloat16)
        ref.load_state_dict({n: p.detach() for n, p in layer.named_parameters()})
        ref(static_x).backward(static_dy)
        for n, p in ref.named_parameters():
            assert torch.equal(captured[n], p.grad), f"{n}: graph replay differs from an eager step"


@pytest.mark.parametrize("impl", IMPLS)
def test_module_trains_with_an_optimizer_under_autocast(impl):
    """float32 parameters under autocast, as with nn.Linear: the gradients are float32 and the loss falls
    below target.pow(2).mean(), the least loss of any model that sees only the current token (the Linear
    alone gets there by shrinking its output): the scan's gradients must carry the previous token."""
    fresh_seed()
    torch.manual_seed(0)
    model = nn.Sequential(selscan_fused.SelectiveScan(128, 16, impl=impl), nn.Linear(128, 128)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x = torch.randn(4, 256, 128, device="cuda")
    target = torch.roll(x, shifts=1, dims=1) * 0.5  # learnable from the recurrence: the previous token
    losses = []
    for _ in range(60):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = (model(x).float() - target).pow(2).mean()
        loss.backward()
        losses.append(loss.item())
        opt.step()
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())
    print(f"{impl}: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    assert losses[-1] < 0.7 * losses[0]
    assert losses[-1] < 0.95 * target.pow(2).mean().item()


def test_backward_op_rejects_bad_gradients():
    inp = make_inputs(2, 70, 64, 16, dtype=torch.bfloat16, device="cuda", with_h0=True)
    base = tuple(inp[k] for k in NAMES)
    y, h, proj, ckpt = torch.ops.selscan_fused.unfused_fwd_res(*base, 0)
    with pytest.raises(RuntimeError, match=r"dy \(the gradient of y\) has shape"):
        torch.ops.selscan_fused.unfused_bwd(*base, y[:, :5], None, proj, ckpt, 0)
    with pytest.raises(RuntimeError, match=r"dhT \(the gradient of the final state\) has shape"):
        torch.ops.selscan_fused.unfused_bwd(*base, y, h[:1], proj, ckpt, 0)
    with pytest.raises(RuntimeError, match=r"ckpt \(the forward's checkpoints\) has shape"):
        torch.ops.selscan_fused.unfused_bwd(*base, y, None, proj, ckpt[:, :1], 0)


def test_scan_kernel_alone_has_no_backward():
    inp = make_inputs(1, 8, 64, 16, dtype=torch.float32, device="cuda")
    proj = (inp["x"] @ torch.cat([inp["W_delta"], inp["W_B"], inp["W_C"]]).T).requires_grad_(True)
    y, _ = torch.ops.selscan_fused.scan_fwd(proj, inp["x"], inp["A_log"], inp["b_delta"], inp["D"], None, False, 0)
    with pytest.raises(NotImplementedError, match="scan_fwd .* has no backward"):
        y.sum().backward()
