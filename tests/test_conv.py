"""The depthwise causal conv1d with fused SiLU (selscan_fused/conv.py, csrc/conv/).

CPU (run everywhere, CI included): the plain-PyTorch reference against F.conv1d and against the
definition element by element in float64, its final state, chunking and gradients (autograd against
the backward's formulas written out).
GPU: the CUDA op against the float64 reference for the output, the final state and every gradient
(dx, dweight, dbias, dinitial_state, with and without dfinal_state) over float32/bfloat16/float16,
W = 2, 3, 4, L from 1 to 4097, x as a strided view of in_proj's (batch, L, 2C) output; every element
written (NaN-poisoned outputs), bitwise determinism, chunked calls, layouts, opcheck, empty inputs,
bad input, and more than 2^31 elements."""
import pytest
import torch
import torch.nn.functional as F

from conftest import fresh_seed, rel_l2, requires_cuda, requires_extension, requires_gpu_memory
from selscan_fused.conv import causal_conv1d, causal_conv1d_ref


def gpu(f):
    return requires_cuda(requires_extension(f))


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Relative L2 error bounds against the float64 evaluation, as the rest of the project's (conftest.TOLERANCE).
TOL = {"float32": 1e-5, "bfloat16": 1e-2, "float16": 3e-3}


def make_conv_inputs(batch, L, C, W, dtype=torch.float32, device="cpu", bias=True, init=True, second_half=False):
    """Fresh random inputs: x as a strided view of a (batch, L, 2C) tensor (in_proj's output: x is its
    first C columns, or the last C with second_half), weight/bias with nn.Conv1d's default init scale."""
    base = torch.randn(batch, L, 2 * C, device=device).to(dtype)
    bound = W ** -0.5  # nn.Conv1d(C, C, W, groups=C): fan_in = W
    return dict(
        base=base,
        x=base[..., C:] if second_half else base[..., :C],
        weight=(torch.rand(C, W, device=device) * 2 - 1) * bound,
        bias=(torch.rand(C, device=device) * 2 - 1) * bound if bias else None,
        initial_state=torch.randn(batch, C, W - 1, device=device) if init else None,
    )


def conv1d_math(x, weight, bias, initial_state, activation):
    """The same math through F.conv1d (channels first, the initial state as the left padding)."""
    batch, L, C = x.shape
    W = weight.shape[-1]
    head = initial_state if initial_state is not None else x.new_zeros(batch, C, W - 1)
    xx = torch.cat([head.to(x.dtype), x.transpose(1, 2)], dim=2)  # (batch, C, W-1+L)
    pre = F.conv1d(xx, weight.reshape(C, 1, W), bias, groups=C)
    out = F.silu(pre) if activation else pre
    return out.transpose(1, 2), xx[:, :, L:]


# ---------------------------------------------------------------------------------------------------
# CPU: the reference.

@pytest.mark.parametrize("W", [2, 3, 4])
@pytest.mark.parametrize("L", [1, 2, 3, 7, 100])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("bias,init", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("activation", [True, False])
def test_reference_matches_conv1d(W, L, batch, bias, init, activation):
    fresh_seed()
    inp = make_conv_inputs(batch, L, 24, W, dtype=torch.float64, bias=bias, init=init)
    inp = {k: (v.double() if v is not None else None) for k, v in inp.items()}
    out, fs = causal_conv1d_ref(inp["x"], inp["weight"], inp["bias"], inp["initial_state"], activation)
    out2, fs2 = conv1d_math(inp["x"], inp["weight"], inp["bias"], inp["initial_state"], activation)
    assert out.dtype == torch.float64 and out.shape == (batch, L, 24) and fs.shape == (batch, 24, W - 1)
    torch.testing.assert_close(out, out2, rtol=1e-12, atol=1e-12)
    assert torch.equal(fs, fs2)


def test_reference_matches_nn_conv1d_as_mamba_uses_it():
    """Mamba-1's conv: nn.Conv1d(C, C, W, groups=C, padding=W-1) on (batch, C, L), the first L outputs."""
    fresh_seed()
    C, W, L = 16, 4, 50
    conv = torch.nn.Conv1d(C, C, W, groups=C, padding=W - 1).double()
    x = torch.randn(2, L, C, dtype=torch.float64)
    want = F.silu(conv(x.transpose(1, 2))[..., :L]).transpose(1, 2)
    got, _ = causal_conv1d_ref(x, conv.weight, conv.bias)  # weight as nn.Conv1d stores it, (C, 1, W)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("W", [2, 3, 4])
@pytest.mark.parametrize("L", [1, 2, 3, 5])
def test_reference_definition_elementwise(W, L):
    """pre[b,t,c] = bias[c] + sum_k weight[c,k] * xx[b, t-W+1+k, c]; final_state[b,c,j] = xx[b, L-(W-1)+j, c],
    reaching into the initial state when L < W - 1."""
    fresh_seed()
    batch, C = 2, 3
    inp = make_conv_inputs(batch, L, C, W, dtype=torch.float64)
    inp = {k: v.double() for k, v in inp.items()}
    x, w, b, h = inp["x"], inp["weight"], inp["bias"], inp["initial_state"]
    out, fs = causal_conv1d_ref(x, w, b, h, activation=False)

    def xx(bi, s, c):
        return x[bi, s, c] if s >= 0 else h[bi, c, W - 1 + s]

    for bi in range(batch):
        for c in range(C):
            for t in range(L):
                pre = b[c] + sum(w[c, k] * xx(bi, t - W + 1 + k, c) for k in range(W))
                torch.testing.assert_close(out[bi, t, c], pre, rtol=1e-12, atol=1e-12)
            for j in range(W - 1):
                assert fs[bi, c, j] == xx(bi, L - (W - 1) + j, c)


@pytest.mark.parametrize("W", [2, 4])
@pytest.mark.parametrize("split", [1, 2, 3, 10])
def test_reference_chunked(W, split):
    fresh_seed()
    inp = make_conv_inputs(2, 12, 8, W, dtype=torch.float64)
    inp = {k: v.double() for k, v in inp.items()}
    x, w, b, h = inp["x"], inp["weight"], inp["bias"], inp["initial_state"]
    out, fs = causal_conv1d_ref(x, w, b, h)
    o1, f1 = causal_conv1d_ref(x[:, :split], w, b, h)
    o2, f2 = causal_conv1d_ref(x[:, split:], w, b, f1)
    torch.testing.assert_close(torch.cat([o1, o2], 1), out, rtol=1e-12, atol=1e-12)
    assert torch.equal(f2, fs)


def backward_formulas(x, w, b, h, dout, dfs, activation):
    """The backward the CUDA kernel implements, written out (float64): dpre = dout * silu'(pre),
    dx[t] = sum_k w[k] dpre[t+W-1-k] (t+W-1-k < L) + dfinal_state's part, dinitial_state likewise at s < 0,
    dweight[c,k] = sum dpre[t] xx[t-W+1+k], dbias = sum dpre."""
    batch, L, C = x.shape
    W = w.shape[1]
    head = h.transpose(1, 2) if h is not None else x.new_zeros(batch, W - 1, C)
    xx = torch.cat([head, x], 1)  # xx[:, W-1+s]
    pre = sum(xx[:, k:k + L] * w[:, k] for k in range(W)) + (b if b is not None else 0)
    if activation:
        s = torch.sigmoid(pre)
        dpre = dout * s * (1 + pre * (1 - s))
    else:
        dpre = dout
    dxx = x.new_zeros(batch, W - 1 + L, C)  # gradient of xx
    for k in range(W):
        dxx[:, k:k + L] += dpre * w[:, k]
    if dfs is not None:
        dxx[:, L:L + W - 1] += dfs.transpose(1, 2)
    dweight = torch.stack([(dpre * xx[:, k:k + L]).sum((0, 1)) for k in range(W)], 1)
    return dxx[:, W - 1:], dweight, dpre.sum((0, 1)), dxx[:, :W - 1].transpose(1, 2)


@pytest.mark.parametrize("W", [2, 3, 4])
@pytest.mark.parametrize("L", [1, 2, 3, 7, 40])
@pytest.mark.parametrize("activation", [True, False])
def test_reference_gradients_match_the_formulas(W, L, activation):
    fresh_seed()
    inp = make_conv_inputs(3, L, 5, W, dtype=torch.float64)
    leaves = [inp[k].double().requires_grad_() for k in ("x", "weight", "bias", "initial_state")]
    out, fs = causal_conv1d_ref(*leaves, activation=activation)
    dout, dfs = torch.randn_like(out), torch.randn_like(fs)
    got = torch.autograd.grad([out, fs], leaves, [dout, dfs])
    want = backward_formulas(*[t.detach() for t in leaves], dout, dfs, activation)
    for g, w_, name in zip(got, want, ("dx", "dweight", "dbias", "dinitial_state")):
        torch.testing.assert_close(g, w_, rtol=1e-10, atol=1e-10, msg=name)


def test_reference_gradcheck():
    fresh_seed()
    inp = make_conv_inputs(2, 5, 3, 4, dtype=torch.float64)
    leaves = [inp[k].double().requires_grad_() for k in ("x", "weight", "bias", "initial_state")]
    assert torch.autograd.gradcheck(lambda *a: causal_conv1d_ref(*a), leaves)


def test_reference_low_precision():
    """bfloat16 x: float32 arithmetic by default, out and final_state in bfloat16."""
    fresh_seed()
    inp = make_conv_inputs(2, 30, 8, 4, dtype=torch.bfloat16)
    out, fs = causal_conv1d_ref(inp["x"], inp["weight"], inp["bias"], inp["initial_state"])
    assert out.dtype == fs.dtype == torch.bfloat16
    ref, _ = causal_conv1d_ref(inp["x"].double(), inp["weight"].double(), inp["bias"].double(),
                               inp["initial_state"].double())
    assert rel_l2(out, ref) < TOL["bfloat16"]
    # the arithmetic is float32's (bfloat16 arithmetic is ~3x further from float64 here, within the bound too)
    f32, _ = causal_conv1d_ref(*(inp[k].float() for k in ("x", "weight", "bias", "initial_state")))
    assert torch.equal(out, f32.bfloat16())


def test_reference_bad_shapes():
    x = torch.randn(2, 5, 8)
    with pytest.raises(ValueError, match="weight must have shape"):
        causal_conv1d_ref(x, torch.randn(7, 4))
    with pytest.raises(ValueError, match="not depthwise"):
        causal_conv1d_ref(x, torch.randn(8, 2, 4))
    with pytest.raises(ValueError, match="initial_state must have shape"):
        causal_conv1d_ref(x, torch.randn(8, 4), initial_state=torch.randn(2, 8, 4))


# ---------------------------------------------------------------------------------------------------
# The extension without a GPU: the ops are registered, and CPU tensors get a clear error.

@requires_extension
def test_ops_registered_and_cpu_tensors_rejected():
    from selscan_fused.conv import conv_op_available
    assert conv_op_available(), "selscan_fused._C has no causal_conv1d ops: a stale build, rebuild it"
    x, w = torch.randn(2, 5, 8), torch.randn(8, 4)
    with pytest.raises(RuntimeError, match="x is on cpu; the op needs CUDA tensors"):
        torch.ops.selscan_fused.causal_conv1d_fwd(x, w, None, None, True, False)
    with pytest.raises(RuntimeError, match="x is on cpu; the op needs CUDA tensors"):
        torch.ops.selscan_fused.causal_conv1d_bwd(x, w, None, None, x, None, True)
    with pytest.raises(RuntimeError, match="x is on cpu; the op needs CUDA tensors"):
        causal_conv1d(x, w)


# ---------------------------------------------------------------------------------------------------
# GPU: the CUDA op.

@pytest.fixture
def conv_poisoned():
    """The conv ops fill their outputs (and the backward's partial sums) with NaN before launching."""
    torch.ops.selscan_fused.conv_set_poison_outputs(True)
    yield
    torch.ops.selscan_fused.conv_set_poison_outputs(False)


def run_op(inp, activation, dout, dfs, C):
    """The op through autograd on leaves (base, weight, bias, initial_state): (out, final_state, grads)."""
    base = inp["base"].detach().clone().requires_grad_()
    second_half = inp["x"].data_ptr() != inp["base"].data_ptr()
    x = base[..., C:] if second_half else base[..., :C]
    others = {k: (inp[k].detach().clone().requires_grad_() if inp[k] is not None else None)
              for k in ("weight", "bias", "initial_state")}
    out, fs = causal_conv1d(x, others["weight"], others["bias"], others["initial_state"], activation,
                            return_final_state=True)
    leaves = [base] + [v for v in others.values() if v is not None]
    outs, gos = [out], [dout]
    if dfs is not None:
        outs.append(fs)
        gos.append(dfs)
    grads = torch.autograd.grad(outs, leaves, gos)
    names = ["x"] + [k for k, v in others.items() if v is not None]
    g = dict(zip(names, grads))
    g["base"] = g.pop("x")
    g["x"] = g["base"][..., C:] if second_half else g["base"][..., :C]
    g["rest"] = g["base"][..., :C] if second_half else g["base"][..., C:]
    return out, fs, g


def run_ref(inp, activation, dout, dfs):
    """The float64 evaluation on the same (already rounded) values, with its autograd gradients."""
    d = {k: (inp[k].detach().double().requires_grad_() if inp[k] is not None else None)
         for k in ("x", "weight", "bias", "initial_state")}
    out, fs = causal_conv1d_ref(d["x"], d["weight"], d["bias"], d["initial_state"], activation)
    outs, gos = [out], [dout.double()]
    if dfs is not None:
        outs.append(fs)
        gos.append(dfs.double())
    names = [k for k, v in d.items() if v is not None]
    grads = torch.autograd.grad(outs, [d[k] for k in names], gos)
    return out, fs, dict(zip(names, grads))


# (batch, bias, initial_state, dfinal_state, activation): each shape runs all four.
COMBOS = [
    (1, False, False, False, True),
    (3, True, True, True, True),
    (3, True, False, True, False),
    (1, False, True, False, True),
]


def check_case(batch, L, C, W, mode, bias, init, with_dfs, activation, second_half=False):
    dtype, tol = DTYPES[mode], TOL[mode]
    inp = make_conv_inputs(batch, L, C, W, dtype=dtype, device="cuda", bias=bias, init=init,
                           second_half=second_half)
    dout = torch.randn(batch, L, C, device="cuda").to(dtype)
    dfs = torch.randn(batch, C, W - 1, device="cuda").to(dtype) if with_dfs else None
    out, fs, g = run_op(inp, activation, dout, dfs, C)
    out64, fs64, g64 = run_ref(inp, activation, dout, dfs)
    what = f"batch={batch} L={L} C={C} W={W} {mode} bias={bias} init={init} dfs={with_dfs} silu={activation}"
    assert out.dtype == dtype and out.shape == (batch, L, C) and out.is_contiguous(), what
    assert fs.dtype == dtype and fs.shape == (batch, C, W - 1) and fs.is_contiguous(), what
    for name, t in [("out", out), ("final_state", fs)] + [(k, v) for k, v in g.items()]:
        assert bool(torch.isfinite(t).all()), f"{what}: unwritten (NaN-poisoned) or non-finite elements in {name}"
    # The final state is a copy of inputs: exact.
    assert torch.equal(fs, fs64.to(dtype)), what
    assert not g["rest"].any(), f"{what}: gradient in the columns of in_proj's output that x does not cover"
    errs = {"out": rel_l2(out, out64), "dx": rel_l2(g["x"], g64["x"]), "dweight": rel_l2(g["weight"], g64["weight"])}
    if bias:
        errs["dbias"] = rel_l2(g["bias"], g64["bias"])
    if init:
        errs["dinitial_state"] = rel_l2(g["initial_state"], g64["initial_state"])
    print(what, " ".join(f"{k}={v:.1e}" for k, v in errs.items()), f"(bound {tol:.0e})")
    bad = {k: v for k, v in errs.items() if not v < tol}
    assert not bad, f"{what}: relative L2 errors above {tol}: {bad}"


@gpu
@pytest.mark.parametrize("mode", list(DTYPES))
@pytest.mark.parametrize("W", [2, 3, 4])
@pytest.mark.parametrize("L", [1, 2, 3, 7, 1000, 4097])
@pytest.mark.parametrize("C", [8, 24, 1536])
def test_op_matches_float64(mode, W, L, C, conv_poisoned):
    fresh_seed()
    for i, combo in enumerate(COMBOS):
        check_case(combo[0], L, C, W, mode, *combo[1:], second_half=(i == 3))


@gpu
@pytest.mark.parametrize("mode", list(DTYPES))
@pytest.mark.parametrize("C", [13, 102, 4104])
def test_op_channel_counts_without_vector_alignment(mode, C, conv_poisoned):
    """C not a multiple of the vector widths (13, 102: the scalar forward and backward kernels in every
    dtype), and 4104 (= 8 * 513: several channel tiles)."""
    fresh_seed()
    check_case(3, 300, C, 4, mode, True, True, True, True)


def layouts(x):
    """The same values of x (batch, L, C) in other layouts: contiguous, a view of a (batch, L, 2C) tensor
    (both halves), misaligned by one element, and with a channel stride other than 1."""
    batch, L, C = x.shape
    out = {"contiguous": x.contiguous()}
    wide = torch.randn(batch, L, 2 * C, device=x.device).to(x.dtype)
    wide[..., :C] = x
    out["first half"] = wide[..., :C]
    wide2 = torch.randn(batch, L, 2 * C, device=x.device).to(x.dtype)
    wide2[..., C:] = x
    out["second half"] = wide2[..., C:]
    flat = torch.empty(x.numel() + 1, device=x.device, dtype=x.dtype)
    out["misaligned"] = flat[1:].view(batch, L, C)
    out["misaligned"].copy_(x)
    out["channel stride 2"] = torch.repeat_interleave(x, 2, dim=2)[..., ::2]
    return out


@gpu
@pytest.mark.parametrize("mode", list(DTYPES))
def test_layouts_give_bitwise_equal_results(mode, conv_poisoned):
    """Every layout of x and dout (vector and scalar kernels alike) gives the same bits: the kernels do the
    same arithmetic per element, and the backward's token partition does not depend on the alignment."""
    fresh_seed()
    dtype = DTYPES[mode]
    batch, L, C, W = 3, 777, 96, 4
    inp = make_conv_inputs(batch, L, C, W, dtype=dtype, device="cuda")
    dout = torch.randn(batch, L, C, device="cuda").to(dtype)
    dfs = torch.randn(batch, C, W - 1, device="cuda")
    ref = None
    for name, x in layouts(inp["x"]).items():
        for dname, d in layouts(dout).items():
            if name != "contiguous" and dname != "contiguous":
                continue  # every x layout with a contiguous dout, every dout layout with a contiguous x
            out, fs = torch.ops.selscan_fused.causal_conv1d_fwd(x, inp["weight"], inp["bias"], inp["initial_state"],
                                                                True, True)
            grads = torch.ops.selscan_fused.causal_conv1d_bwd(x, inp["weight"], inp["bias"], inp["initial_state"],
                                                              d, dfs, True)
            got = [out, fs] + list(grads)
            if ref is None:
                ref = got
                continue
            for a, b, what in zip(got, ref, ("out", "final_state", "dx", "dweight", "dbias", "dinitial_state")):
                assert torch.equal(a, b), f"x {name}, dout {dname}: {what} differs from the contiguous layout's"


@gpu
@pytest.mark.parametrize("mode", list(DTYPES))
def test_backward_is_deterministic(mode):
    fresh_seed()
    dtype = DTYPES[mode]
    inp = make_conv_inputs(3, 4097, 1536, 4, dtype=dtype, device="cuda")
    args = (inp["x"], inp["weight"], inp["bias"], inp["initial_state"])
    dout = torch.randn(3, 4097, 1536, device="cuda").to(dtype)
    dfs = torch.randn(3, 1536, 3, device="cuda")
    first = torch.ops.selscan_fused.causal_conv1d_bwd(*args, dout, dfs, True)
    for _ in range(3):
        again = torch.ops.selscan_fused.causal_conv1d_bwd(*args, dout, dfs, True)
        for a, b in zip(first, again):
            assert torch.equal(a, b), "two backward runs differ"
    o1 = torch.ops.selscan_fused.causal_conv1d_fwd(*args, True, True)
    o2 = torch.ops.selscan_fused.causal_conv1d_fwd(*args, True, True)
    assert torch.equal(o1[0], o2[0]) and torch.equal(o1[1], o2[1])


@gpu
@pytest.mark.parametrize("mode", list(DTYPES))
@pytest.mark.parametrize("W", [2, 3, 4])
@pytest.mark.parametrize("split", [1, 2, 3, 500])
def test_chunked_calls_equal_one_call(mode, W, split, conv_poisoned):
    """Two calls, the second given the first's final state as its initial state, give one call's bits. The
    final state is in x's dtype (it holds inputs): the initial state is too here, since with split < W - 1
    the first call's final state passes part of it on."""
    fresh_seed()
    dtype = DTYPES[mode]
    inp = make_conv_inputs(3, 1000, 24, W, dtype=dtype, device="cuda")
    x, w, b, h = inp["x"], inp["weight"], inp["bias"], inp["initial_state"].to(dtype).float()
    out, fs = causal_conv1d(x, w, b, h, return_final_state=True)
    o1, f1 = causal_conv1d(x[:, :split], w, b, h, return_final_state=True)
    o2, f2 = causal_conv1d(x[:, split:], w, b, f1.float(), return_final_state=True)
    assert torch.equal(torch.cat([o1, o2], 1), out)
    assert torch.equal(f2, fs)


@gpu
def test_weight_as_nn_conv1d_stores_it_and_no_final_state():
    fresh_seed()
    C, W = 64, 4
    conv = torch.nn.Conv1d(C, C, W, groups=C, padding=W - 1).cuda()
    x = torch.randn(2, 50, C, device="cuda")
    out = causal_conv1d(x, conv.weight, conv.bias)
    assert isinstance(out, torch.Tensor)
    want, _ = causal_conv1d_ref(x.double(), conv.weight.double(), conv.bias.double())
    assert rel_l2(out, want) < TOL["float32"]
    out, fs = torch.ops.selscan_fused.causal_conv1d_fwd(x, conv.weight.detach().reshape(C, W), None, None, False, False)
    assert fs.shape == (0,)


@gpu
def test_gradient_of_the_final_state_only():
    """dout absent (only final_state feeds the loss): the backward takes zeros for dout."""
    fresh_seed()
    inp = make_conv_inputs(2, 2, 16, 4, device="cuda")  # L < W - 1: the final state reaches into initial_state
    leaves = {k: inp[k].clone().requires_grad_() for k in ("x", "weight", "bias", "initial_state")}
    _, fs = causal_conv1d(leaves["x"], leaves["weight"], leaves["bias"], leaves["initial_state"], return_final_state=True)
    fs.sum().backward()
    assert torch.equal(leaves["x"].grad, torch.ones_like(inp["x"]))
    want = torch.zeros_like(inp["initial_state"])
    want[:, :, 2:] = 1  # final_state = [h[:, :, 2], x[:, 0], x[:, 1]]
    assert torch.equal(leaves["initial_state"].grad, want)
    assert not leaves["weight"].grad.any() and not leaves["bias"].grad.any()


@gpu
@pytest.mark.parametrize("mode", ["float32", "bfloat16"])
def test_opcheck(mode):
    fresh_seed()
    dtype = DTYPES[mode]
    inp = make_conv_inputs(2, 70, 32, 4, dtype=dtype, device="cuda")
    grad = lambda t: t.detach().clone().requires_grad_()
    args = (grad(inp["x"]), grad(inp["weight"]), grad(inp["bias"]), grad(inp["initial_state"]))
    torch.library.opcheck(torch.ops.selscan_fused.causal_conv1d_fwd.default, args + (True, True))
    torch.library.opcheck(torch.ops.selscan_fused.causal_conv1d_fwd.default, args[:2] + (None, None, False, False))
    plain = tuple(a.detach() for a in args)
    dout = torch.randn(2, 70, 32, device="cuda").to(dtype)
    dfs = torch.randn(2, 32, 3, device="cuda").to(dtype)
    utils = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.selscan_fused.causal_conv1d_bwd.default, plain + (dout, dfs, True), test_utils=utils)
    torch.library.opcheck(torch.ops.selscan_fused.causal_conv1d_bwd.default, plain[:2] + (None, None, dout, None, False),
                          test_utils=utils)


@gpu
def test_torch_compile_training_step():
    fresh_seed()
    inp = make_conv_inputs(2, 300, 64, 4, dtype=torch.bfloat16, device="cuda")
    dout = torch.randn(2, 300, 64, device="cuda")

    def loss(x, w, b, h):
        out, fs = causal_conv1d(x, w, b, h, return_final_state=True)
        return (out.float() * dout).sum() + fs.float().square().sum()

    def grads(fn):
        leaves = [inp[k].detach().clone().requires_grad_() for k in ("x", "weight", "bias", "initial_state")]
        fn(*leaves).backward()
        return [t.grad for t in leaves]

    eager = grads(loss)
    compiled = grads(torch.compile(loss, fullgraph=True))
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(b, a)  # the loss's own casts may be fused differently


@gpu
def test_empty_inputs():
    W = 4
    inp = make_conv_inputs(2, 0, 16, W, device="cuda")
    x, w, b, h = inp["x"], inp["weight"], inp["bias"], inp["initial_state"]
    out, fs = torch.ops.selscan_fused.causal_conv1d_fwd(x, w, b, h, True, True)
    assert out.shape == (2, 0, 16) and torch.equal(fs, h)  # L = 0: the final state is the initial state
    dfs = torch.randn(2, 16, W - 1, device="cuda")
    dx, dw, db, dh = torch.ops.selscan_fused.causal_conv1d_bwd(x, w, b, h, torch.empty_like(x), dfs, True)
    assert dx.shape == (2, 0, 16) and torch.equal(dh, dfs) and not dw.any() and not db.any()
    inp = make_conv_inputs(0, 5, 16, W, device="cuda")
    out, fs = torch.ops.selscan_fused.causal_conv1d_fwd(inp["x"], w, b, inp["initial_state"], True, True)
    assert out.shape == (0, 5, 16) and fs.shape == (0, 16, W - 1)


@gpu
def test_bad_input():
    inp = make_conv_inputs(2, 5, 16, 4, device="cuda")
    x, w, b, h = inp["x"], inp["weight"], inp["bias"], inp["initial_state"]
    op = torch.ops.selscan_fused.causal_conv1d_fwd
    with pytest.raises(RuntimeError, match=r"weight \(causal_conv1d\) has shape"):
        op(x, w[:8], b, h, True, False)
    with pytest.raises(RuntimeError, match="W = 5"):
        op(x, torch.randn(16, 5, device="cuda"), b, None, True, False)
    with pytest.raises(RuntimeError, match=r"bias \(causal_conv1d\) has dtype"):
        op(x, w, b.half(), h, True, False)
    with pytest.raises(RuntimeError, match=r"initial_state \(causal_conv1d\) has shape"):
        op(x, w, b, h[:, :, :2], True, False)
    with pytest.raises(RuntimeError, match="x has dtype Double"):
        op(x.double(), w, b, h, True, False)
    with pytest.raises(RuntimeError, match="x must have shape"):
        op(x[0], w, b, h, True, False)
    with pytest.raises(RuntimeError, match=r"weight \(causal_conv1d\) is on cpu"):
        op(x, w.cpu(), b, h, True, False)
    with pytest.raises(RuntimeError, match="x is on cpu"):
        op(x.cpu(), w.cpu(), b.cpu(), h.cpu(), True, False)
    bwd = torch.ops.selscan_fused.causal_conv1d_bwd
    with pytest.raises(RuntimeError, match="dout"):
        bwd(x, w, b, h, x[:, :3], None, True)
    with pytest.raises(RuntimeError, match="dfinal_state"):
        bwd(x, w, b, h, torch.randn_like(x), torch.randn(2, 16, 2, device="cuda"), True)
    with pytest.raises(RuntimeError, match="x is on cpu"):
        bwd(x.cpu(), w.cpu(), b.cpu(), h.cpu(), x.cpu(), None, True)


# More than 2^31 elements in x, out, dout and dx: every offset 64-bit. ~40 GB of inputs and outputs plus
# one sequence's float64 reference at a time.
BIG = (5, 262147, 2048)  # 2,684,385,280 elements in x, out, dout and dx (2^31 = 2,147,483,648)


@gpu
@requires_gpu_memory(80)
def test_more_than_2_31_elements(conv_poisoned):
    fresh_seed()
    batch, L, C = BIG
    W = 4
    assert batch * L * C > 2**31
    inp = make_conv_inputs(batch, L, C, W, dtype=torch.bfloat16, device="cuda")
    del inp["base"]
    x, w, b, h = inp["x"], inp["weight"], inp["bias"], inp["initial_state"]
    dout = torch.randn(batch, L, C, device="cuda", dtype=torch.bfloat16)
    dfs = torch.randn(batch, C, W - 1, device="cuda")
    out, fs = torch.ops.selscan_fused.causal_conv1d_fwd(x, w, b, h, True, True)
    dx, dw, db, dh = torch.ops.selscan_fused.causal_conv1d_bwd(x, w, b, h, dout, dfs, True)
    for name, t in (("out", out), ("dx", dx)):
        assert bool(torch.isfinite(t.view(-1)[2**31 - 4096:]).all()), f"{name}: elements past 2^31 unwritten"
        assert bool(torch.isfinite(t).all()), name
    dw_ref = torch.zeros(C, W, dtype=torch.float64, device="cuda")
    db_ref = torch.zeros(C, dtype=torch.float64, device="cuda")
    for s in range(batch):  # one sequence at a time in float64; the last ones lie wholly past 2^31 elements
        sub = {k: (v[s:s + 1] if k in ("x", "initial_state") else v) for k, v in inp.items()}
        o64, f64, g64 = run_ref(sub, True, dout[s:s + 1], dfs[s:s + 1])
        if s in (0, batch - 1):
            assert rel_l2(out[s:s + 1], o64) < TOL["bfloat16"]
            assert torch.equal(fs[s:s + 1], f64.to(torch.bfloat16))
            assert rel_l2(dx[s:s + 1], g64["x"]) < TOL["bfloat16"]
            assert rel_l2(dh[s:s + 1], g64["initial_state"]) < 1e-5
        dw_ref += g64["weight"]
        db_ref += g64["bias"]
        del o64, f64, g64
    assert rel_l2(dw, dw_ref) < 1e-5 and rel_l2(db, db_ref) < 1e-5
    del out, dx, dout, inp, x
    torch.cuda.empty_cache()
