"""Packed variable-length sequences (cu_seqlens) for the layer and the Mamba block: the packed result
against an independent float64 evaluation that walks the packed tokens once and restarts the state (and
the conv window) at every sequence start, values and gradients; the argument checks and their messages;
validate=False reading nothing on the host."""
import pytest
import torch
import torch.nn.functional as F

import selscan_fused
from selscan_fused import Mamba, mamba_block, selective_scan
from selscan_fused.varlen import CUDA_VARLEN_MESSAGE, check_cu_seqlens
from conftest import TOLERANCE, fresh_seed, make_inputs, rel_l2, requires_cuda, requires_extension, requires_hopper

LAYER_ARGS = ("A_log", "W_delta", "b_delta", "W_B", "W_C", "D")


def cu_of(lengths, device="cpu"):
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32, device=device)


def starts_and_ids(cu, T):
    starts = torch.zeros(T, dtype=torch.bool)
    starts[cu[:-1].long()] = True
    return starts.tolist(), (torch.cumsum(starts.long(), 0) - 1).tolist()


def packed_layer_walk(x, A_log, W_delta, b_delta, W_B, W_C, D, cu, h0=None):
    """One walk over the packed tokens in x's dtype, the state reset (to h0[s] or zeros) where a sequence
    starts, each sequence's final state taken at its last token. Independent of the library's code."""
    T = x.shape[1]
    xt = x[0]
    delta = F.softplus(xt @ W_delta.T + b_delta)
    Bt, Ct = xt @ W_B.T, xt @ W_C.T
    A = -torch.exp(A_log)
    starts, ids = starts_and_ids(cu, T)
    S = cu.shape[0] - 1
    h = None
    ys, finals = [], [None] * S
    for t in range(T):
        if starts[t]:
            h = h0[ids[t]] if h0 is not None else torch.zeros_like(A)
        h = torch.exp(delta[t][:, None] * A) * h + (delta[t] * xt[t])[:, None] * Bt[t][None, :]
        ys.append(h @ Ct[t] + D * xt[t])
        finals[ids[t]] = h
    return torch.stack(ys)[None], torch.stack(finals)


def packed_block_walk(x, w, cu, h0=None, conv_state=None):
    """The block over packed tokens in one walk (w: mamba_block's weights by name), the conv window and
    the scan state restarting at every sequence start."""
    T = x.shape[1]
    d_inner, N = w["A_log"].shape
    R = w["dt_proj_weight"].shape[1]
    cw = w["conv_weight"].reshape(d_inner, -1)
    Wc = cw.shape[1]
    xz = F.linear(x[0], w["in_proj_weight"], w["in_proj_bias"])
    xi, z = xz[:, :d_inner], xz[:, d_inner:]
    starts, ids = starts_and_ids(cu, T)
    S = cu.shape[0] - 1
    A = -torch.exp(w["A_log"])
    h, window = None, None
    ys, finals, conv_finals = [], [None] * S, [None] * S
    for t in range(T):
        s = ids[t]
        if starts[t]:
            h = h0[s] if h0 is not None else torch.zeros_like(A)
            window = (conv_state[s] if conv_state is not None else xi.new_zeros(d_inner, Wc - 1))
        window = torch.cat([window, xi[t][:, None]], 1)[:, -Wc:]       # the last Wc inputs, oldest first
        pre = (window * cw).sum(1) + (w["conv_bias"] if w["conv_bias"] is not None else 0)
        u = F.silu(pre)
        window = window[:, 1:]                                          # keep Wc - 1
        xdbl = u @ w["x_proj_weight"].T
        delta = F.softplus(xdbl[:R] @ w["dt_proj_weight"].T + w["dt_proj_bias"])
        Bt, Ct = xdbl[R:R + N], xdbl[R + N:]
        h = torch.exp(delta[:, None] * A) * h + (delta * u)[:, None] * Bt[None, :]
        ys.append((h @ Ct + w["D"] * u) * F.silu(z[t]))
        finals[s], conv_finals[s] = h, window
    out = F.linear(torch.stack(ys), w["out_proj_weight"], w["out_proj_bias"])
    return out[None], torch.stack(finals), torch.stack(conv_finals)


# Lengths: single tokens, sequences shorter than the conv window, odd lengths, one long one, and many short.
MIXES = {
    "mixed": [7, 1, 130, 3, 1000, 2],
    "long": [4097, 5],
    "many-short": [1, 2, 3, 1, 5] * 40,
    "one": [64],
}


@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("with_h0", [False, True])
def test_layer_packed_equals_walk_float64(mix, with_h0):
    fresh_seed()
    lengths = MIXES[mix]
    S, T = len(lengths), sum(lengths)
    inp = make_inputs(1, T, 8, 4, dtype=torch.float64)
    p = {k: inp[k].double() for k in LAYER_ARGS}
    h0 = torch.randn(S, 8, 4, dtype=torch.float64) if with_h0 else None
    cu = cu_of(lengths)
    y, hT = selective_scan(inp["x"], *p.values(), h0=h0, return_final_state=True, impl="reference", cu_seqlens=cu)
    y_w, hT_w = packed_layer_walk(inp["x"], *p.values(), cu, h0)
    assert y.shape == (1, T, 8) and hT.shape == (S, 8, 4)
    torch.testing.assert_close(y, y_w, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(hT, hT_w, rtol=1e-12, atol=1e-12)


def test_layer_packed_gradients_float64():
    fresh_seed()
    lengths = [5, 1, 17, 2]
    S, T = len(lengths), sum(lengths)
    inp = make_inputs(1, T, 8, 4, dtype=torch.float64)
    leaves = {k: inp[k].double().clone().requires_grad_() for k in ("x",) + LAYER_ARGS}
    h0 = torch.randn(S, 8, 4, dtype=torch.float64, requires_grad=True)
    cu = cu_of(lengths)
    gy, gh = torch.randn(1, T, 8, dtype=torch.float64), torch.randn(S, 8, 4, dtype=torch.float64)

    def grads(fn):
        y, hT = fn()
        return torch.autograd.grad((y * gy).sum() + (hT * gh).sum(), list(leaves.values()) + [h0])

    args = [leaves[k] for k in ("x",) + LAYER_ARGS]
    got = grads(lambda: selective_scan(*args, h0=h0, return_final_state=True, impl="reference", cu_seqlens=cu))
    want = grads(lambda: packed_layer_walk(*args, cu, h0))
    for name, a, b in zip(list(leaves) + ["h0"], got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=lambda m: f"d{name}: {m}")


def test_layer_packed_float32_within_bound():
    fresh_seed()
    lengths = [300, 1, 41]
    T = sum(lengths)
    inp = make_inputs(1, T, 16, 8)
    cu = cu_of(lengths)
    layer = selscan_fused.SelectiveScan(16, 8, impl="reference")
    with torch.no_grad():
        for name, t in zip(("A_log", "proj_delta.weight", "proj_delta.bias", "proj_B.weight", "proj_C.weight", "D"),
                           (inp[k] for k in LAYER_ARGS)):
            layer.get_parameter(name).copy_(t)
        y, hT = layer(inp["x"], return_final_state=True, cu_seqlens=cu)
    y_w, hT_w = packed_layer_walk(inp["x"].double(), *(inp[k].double() for k in LAYER_ARGS), cu)
    assert y.dtype == torch.float32
    # docs/math.md's bound for float32 (relative L2 against the float64 evaluation)
    assert rel_l2(y, y_w) <= TOLERANCE["float32-highest"] and rel_l2(hT, hT_w) <= TOLERANCE["float32-highest"]


def make_block(d_model=8, d_state=4, d_conv=4, dtype=torch.float64, conv_bias=True, bias=False):
    block = Mamba(d_model, d_state=d_state, d_conv=d_conv, dt_rank=3, impl="reference", conv_bias=conv_bias,
                  bias=bias, dtype=dtype)
    with torch.no_grad():  # off the initialisation's symmetric values
        block.A_log.add_(torch.randn_like(block.A_log) * 0.5)
        block.D.add_(torch.randn_like(block.D) * 0.5)
        if block.conv1d.bias is not None:
            block.conv1d.bias.add_(torch.randn_like(block.conv1d.bias) * 0.1)
        if block.in_proj.bias is not None:
            block.in_proj.bias.add_(torch.randn_like(block.in_proj.bias) * 0.1)
    return block


BLOCK_NAMES = ("in_proj_weight", "in_proj_bias", "conv_weight", "conv_bias", "x_proj_weight", "dt_proj_weight",
               "dt_proj_bias", "A_log", "D", "out_proj_weight", "out_proj_bias")


@pytest.mark.parametrize("mix", ["mixed", "many-short", "one"])
@pytest.mark.parametrize("states", [False, True])
@pytest.mark.parametrize("d_conv,bias", [(4, False), (2, True)])
def test_block_packed_equals_walk_float64(mix, states, d_conv, bias):
    fresh_seed()
    lengths = MIXES[mix]
    S, T = len(lengths), sum(lengths)
    block = make_block(d_conv=d_conv, bias=bias, conv_bias=not bias)
    x = torch.randn(1, T, 8, dtype=torch.float64)
    h0 = torch.randn(S, 16, 4, dtype=torch.float64) if states else None
    cs = torch.randn(S, 16, d_conv - 1, dtype=torch.float64) if states else None
    cu = cu_of(lengths)
    out, hT, cT = block(x, h0, cs, return_final_state=True, cu_seqlens=cu)
    w = dict(zip(BLOCK_NAMES, block.weights()))
    out_w, hT_w, cT_w = packed_block_walk(x, w, cu, h0, cs)
    assert out.shape == (1, T, 8) and hT.shape == (S, 16, 4) and cT.shape == (S, 16, d_conv - 1)
    torch.testing.assert_close(out, out_w, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(hT, hT_w, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(cT, cT_w, rtol=1e-12, atol=1e-12)


def test_block_packed_gradients_float64():
    fresh_seed()
    lengths = [6, 1, 2, 11]
    S, T = len(lengths), sum(lengths)
    block = make_block(bias=True)
    x = torch.randn(1, T, 8, dtype=torch.float64, requires_grad=True)
    h0 = torch.randn(S, 16, 4, dtype=torch.float64, requires_grad=True)
    cs = torch.randn(S, 16, 3, dtype=torch.float64, requires_grad=True)
    cu = cu_of(lengths)
    go, gh, gc = torch.randn(1, T, 8, dtype=torch.float64), torch.randn(S, 16, 4, dtype=torch.float64), \
        torch.randn(S, 16, 3, dtype=torch.float64)
    params = [p for p in block.weights() if p is not None]

    def grads(fn):
        out, hT, cT = fn()
        return torch.autograd.grad((out * go).sum() + (hT * gh).sum() + (cT * gc).sum(), [x, h0, cs] + params)

    w = dict(zip(BLOCK_NAMES, block.weights()))
    got = grads(lambda: block(x, h0, cs, return_final_state=True, cu_seqlens=cu))
    want = grads(lambda: packed_block_walk(x, w, cu, h0, cs))
    for i, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=lambda m: f"gradient {i}: {m}")


def test_block_functional_packed_matches_module():
    fresh_seed()
    block = make_block(dtype=torch.float32)
    cu = cu_of([3, 9, 1])
    x = torch.randn(1, 13, 8)
    a = block(x, cu_seqlens=cu)
    b = mamba_block(x, *block.weights(), impl="reference", cu_seqlens=cu, validate=False)
    assert torch.equal(a, b)
    # and the result of each sequence alone, exactly (the reference runs them one by one)
    alone = torch.cat([block(x[:, s:e]) for s, e in ((0, 3), (3, 12), (12, 13))], 1)
    assert torch.equal(a, alone)


# ---- the checks and their messages ----

def layer_call(x, cu, h0=None, impl="reference", validate=True):
    inp = make_inputs(1, 4, 8, 4)
    return selective_scan(x, *(inp[k] for k in LAYER_ARGS), h0=h0, impl=impl, cu_seqlens=cu, validate=validate)


@pytest.mark.parametrize("cu,exc,words", [
    (torch.tensor([0, 3, 5], dtype=torch.int64), TypeError, ["cu_seqlens", "int64", "int32"]),
    ([0, 3, 5], TypeError, ["cu_seqlens", "torch.Tensor", "list"]),
    (torch.tensor([[0, 3, 5]], dtype=torch.int32), ValueError, ["cu_seqlens", "(1, 3)", "(num_seqs + 1,)"]),
    (torch.tensor([0], dtype=torch.int32), ValueError, ["cu_seqlens", "(1,)", "num_seqs >= 1"]),
    (torch.tensor([1, 3, 5], dtype=torch.int32), ValueError, ["cu_seqlens[0] = 1", "must be 0"]),
    (torch.tensor([0, 3, 3, 5], dtype=torch.int32), ValueError, ["strictly increasing", "cu_seqlens[2] = 3"]),
    (torch.tensor([0, 4, 2, 5], dtype=torch.int32), ValueError, ["strictly increasing", "cu_seqlens[2] = 2"]),
    (torch.tensor([0, 3, 6], dtype=torch.int32), ValueError, ["cu_seqlens[-1] = 6", "5 packed tokens"]),
    (torch.tensor([0, 3, 4], dtype=torch.int32), ValueError, ["cu_seqlens[-1] = 4", "5 packed tokens"]),
])
def test_bad_cu_seqlens_named(cu, exc, words):
    x = torch.randn(1, 5, 8)
    with pytest.raises(exc) as e:
        layer_call(x, cu)
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    block = make_block(dtype=torch.float32)
    with pytest.raises(exc) as e:
        block(x, cu_seqlens=cu)
    for w in words:
        assert w in str(e.value).replace("hidden_states holds", "x holds"), (w, str(e.value))


def test_packed_shapes_named():
    cu = cu_of([2, 3])
    with pytest.raises(ValueError, match=r"with cu_seqlens, x holds the packed tokens .*\(batch 2\)"):
        layer_call(torch.randn(2, 5, 8), cu)
    with pytest.raises(ValueError, match=r"h0 has shape \(1, 8, 4\), expected \(2, 8, 4\) \(num_seqs = 2 from cu_seqlens"):
        layer_call(torch.randn(1, 5, 8), cu, h0=torch.randn(1, 8, 4))
    block = make_block(dtype=torch.float32)
    with pytest.raises(ValueError, match=r"with cu_seqlens, hidden_states holds .*\(batch 2\)"):
        block(torch.randn(2, 5, 8), cu_seqlens=cu)
    with pytest.raises(ValueError, match=r"h0 has shape \(1, 16, 4\), expected \(2, 16, 4\) \(num_seqs = 2"):
        block(torch.randn(1, 5, 8), torch.randn(1, 16, 4), cu_seqlens=cu)
    with pytest.raises(ValueError, match=r"conv_state has shape \(2, 16, 4\), expected \(2, 16, 3\) .*d_conv = 4"):
        block(torch.randn(1, 5, 8), None, torch.randn(2, 16, 4), cu_seqlens=cu)
    with pytest.raises(ValueError, match="cu_seqlens is on meta but x is on cpu"):
        layer_call(torch.randn(1, 5, 8), cu.to("meta"))
    with pytest.raises(TypeError, match="validate must be a bool"):
        layer_call(torch.randn(1, 5, 8), cu, validate=1)


def test_cuda_paths_name_the_argument():
    """On CPU tensors: where the fused kernel takes packed sequences, impl='fused' says that it needs CUDA
    tensors, as impl='unfused' does; elsewhere (no fused extension, or a build without packed sequences) it
    refuses them naming the paths that take them."""
    cu = cu_of([2, 3])
    fused_takes_them = selscan_fused._extension.fused_packed_available()
    with pytest.raises(ValueError) as e:
        layer_call(torch.randn(1, 5, 8), cu, impl="fused")
    assert ("needs CUDA tensors" if fused_takes_them else CUDA_VARLEN_MESSAGE) in str(e.value)
    with pytest.raises(ValueError, match="impl='unfused' needs CUDA tensors"):
        layer_call(torch.randn(1, 5, 8), cu, impl="unfused")
    block = make_block(dtype=torch.float32)
    with pytest.raises(ValueError) as e:
        mamba_block(torch.randn(1, 5, 8), *block.weights(), impl="fused", cu_seqlens=cu)
    assert ("needs CUDA tensors" if fused_takes_them else CUDA_VARLEN_MESSAGE) in str(e.value)
    with pytest.raises(ValueError, match="impl='unfused' needs CUDA tensors"):
        mamba_block(torch.randn(1, 5, 8), *block.weights(), impl="unfused", cu_seqlens=cu)


def test_validate_false_reads_nothing_on_the_host(monkeypatch):
    """validate=False checks the metadata only: no value of cu_seqlens is read (a meta tensor has none)."""
    cu = torch.empty(7, dtype=torch.int32, device="meta")
    assert check_cu_seqlens(cu, 100, torch.device("meta"), validate=False) == 6
    with pytest.raises(NotImplementedError):  # validate=True reads the values: impossible on meta
        check_cu_seqlens(cu, 100, torch.device("meta"), validate=True)
    calls = []
    real = torch.Tensor.tolist
    cu = cu_of([2, 3])
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: calls.append(1) or real(self))
    check_cu_seqlens(cu, 5, torch.device("cpu"), validate=True)
    assert len(calls) == 1  # one read (one synchronisation on a GPU)
    check_cu_seqlens(cu, 5, torch.device("cpu"), validate=False)
    assert len(calls) == 1


@requires_cuda
@requires_extension
def test_cuda_auto_takes_the_unfused_packed_kernels():
    """impl='auto' with cu_seqlens runs the unfused path's packed kernels (no warning): bitwise
    impl='unfused', for the layer and the block, and the layer within the dtype's bound of the float64
    walk (the block's: test_unfused_packed_layer_and_block_against_float64)."""
    import warnings
    fresh_seed()
    lengths = [5, 1, 9]
    cu = cu_of(lengths, "cuda")
    inp = make_inputs(1, 15, 16, 8, device="cuda")
    args = [inp[k] for k in ("x",) + LAYER_ARGS]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = selective_scan(*args, cu_seqlens=cu)
    assert not [w for w in caught if "selscan_fused" in str(w.message)], [str(w.message) for w in caught]
    assert torch.equal(y, selective_scan(*args, cu_seqlens=cu, impl="unfused"))
    y_w, _ = packed_layer_walk(*(a.double().cpu() for a in args), cu.cpu())
    assert rel_l2(y.cpu(), y_w) <= TOLERANCE["float32-highest"]
    block = make_block(d_model=16, d_state=8, dtype=torch.float32).cuda()
    xb = torch.randn(1, sum(lengths), 16, device="cuda")
    block.impl = "auto"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = block(xb, cu_seqlens=cu)
    assert not [w for w in caught if "selscan_fused" in str(w.message)], [str(w.message) for w in caught]
    block.impl = "unfused"
    assert torch.equal(out, block(xb, cu_seqlens=cu))


def test_per_sequence_message_is_made_only_for_an_error():
    """check_per_sequence formats its explanation only when it raises: a formatted num_seqs would make
    torch.compile specialise a packed graph on the number of sequences."""
    from selscan_fused.varlen import check_per_sequence

    def never():
        raise AssertionError("the message was formatted for a valid state")

    check_per_sequence("h0", torch.randn(3, 4, 2), (3, 4, 2), never, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"h0 has shape \(2, 4, 2\), expected \(3, 4, 2\) \(because\)"):
        check_per_sequence("h0", torch.randn(2, 4, 2), (3, 4, 2), lambda: "because", torch.device("cpu"))


# ---- the unfused path's packed kernels (GPU) ----

# Starts on and inside the 64-token chunks; empty sequences (the API refuses them under validate=True,
# the kernels pass their states through: validate=False must not break them)
PACKED_MIX = [1, 7, 0, 1000, 64, 65, 3, 0, 130, 4097, 2]


def _slices(lengths):
    out, a = [], 0
    for n in lengths:
        out.append((a, a + n))
        a += n
    return out


@requires_cuda
@requires_extension
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gate", [False, True])
def test_packed_scan_kernels_bitwise_equal_each_sequence_alone(dtype, gate, poisoned_outputs):
    """scan_fwd_packed and scan_bwd_packed against gated_scan_fwd (scan_fwd for the layer) / scan_bwd on
    each sequence alone: y, the final state, dP (the gradients of delta_pre, B, C), dx, dh0 and the gate's
    gradient bitwise, every
    element written (the outputs were NaN-poisoned); an empty sequence passes its state and its
    gradient through."""
    fresh_seed()
    lengths = PACKED_MIX
    S, T, Dm, N = len(lengths), sum(lengths), 72, 16
    f = dict(device="cuda", dtype=dtype)
    delta = torch.randn(1, T, Dm, **f) - 1
    xdbl = torch.randn(1, T, 4 + 2 * N, **f)
    bc = xdbl[..., 4:]
    u = torch.randn(1, T, Dm, **f)
    z = torch.randn(1, T, Dm, **f) if gate else None
    A_log = torch.randn(Dm, N, device="cuda")
    b = torch.randn(Dm, device="cuda") * 0.5
    D = torch.randn(Dm, device="cuda")
    h0 = torch.randn(S, Dm, N, device="cuda")
    cu = cu_of(lengths, "cuda")
    ops = torch.ops.selscan_fused
    y, hT, ckpt = ops.scan_fwd_packed(delta, bc, u, z, A_log, b, D, h0, cu, True, True)
    dy = torch.randn(1, T, Dm, **f)
    dhT = torch.randn(S, Dm, N, device="cuda")
    dP, dx, dA, db, dD, dh0, dz = ops.scan_bwd_packed(delta, bc, u, A_log, b, D, h0, dy, dhT, ckpt, cu, gate_z=z)
    assert dz.shape == ((1, T, Dm) if gate else (0, T, Dm))
    for t in (y, hT, dP, dx, dh0, dz):
        assert torch.isfinite(t).all()
    sums = [torch.zeros_like(t) for t in (dA, db, dD)]
    for s, (a, e) in enumerate(_slices(lengths)):
        if a == e:  # empty: the state and its gradient pass through
            assert torch.equal(hT[s], h0[s]) and torch.equal(dh0[s], dhT[s])
            continue
        zz = z[:, a:e] if gate else torch.zeros(1, e - a, Dm, **f)  # the layer: its checkpoints only
        ys, hs, ck = ops.gated_scan_fwd(delta[:, a:e], bc[:, a:e], u[:, a:e], zz, A_log, b, D, h0[s:s + 1],
                                        True, True, 1)
        if not gate:  # the layer's batch kernel
            ys, hs = ops.scan_fwd(torch.cat([delta[:, a:e], bc[:, a:e]], -1), u[:, a:e], A_log, b, D, h0[s:s + 1],
                                  True, 1)
        assert torch.equal(hs[0], hT[s]), s
        assert torch.equal(ys, y[:, a:e]), s
        g = ops.scan_bwd(delta[:, a:e], bc[:, a:e], u[:, a:e], A_log, b, D, h0[s:s + 1], dy[:, a:e], dhT[s:s + 1],
                         ck, 1, gate_z=z[:, a:e] if gate else None)
        assert torch.equal(g[0], dP[:, a:e]), s
        assert torch.equal(g[1], dx[:, a:e]), s
        assert torch.equal(g[5][0], dh0[s]), s
        if gate:
            assert torch.equal(g[6], dz[:, a:e]), s
        for acc, part in zip(sums, g[2:5]):
            acc += part
    # dA_log, db_delta, dD: sums over the sequences (the packed kernel's partials in another order)
    for got, want in zip((dA, db, dD), sums):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    # without h0, dhT, the final state or the gate's training outputs: zeros in, nothing asked back
    y2, hT2, ck2 = ops.scan_fwd_packed(delta, bc, u, z, A_log, b, D, None, cu, False, False)
    assert hT2.numel() == 0 and ck2.shape[0] == 0 and torch.isfinite(y2).all()
    y3, _, ck3 = ops.scan_fwd_packed(delta, bc, u, z, A_log, b, D, None, cu, True, True)
    assert torch.equal(y2, y3)
    g2 = ops.scan_bwd_packed(delta, bc, u, A_log, b, D, None, dy, None, ck3, cu, gate_z=z)
    assert all(torch.isfinite(t).all() for t in g2)


@requires_cuda
@requires_extension
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [2, 4])
def test_packed_conv_kernels_bitwise_equal_each_sequence_alone(dtype, width, poisoned_outputs):
    from selscan_fused.conv import causal_conv1d, causal_conv1d_packed
    fresh_seed()
    lengths = PACKED_MIX + [2, 1]  # sequences shorter than the window
    S, T, C = len(lengths), sum(lengths), 96
    xz = torch.randn(1, T, 2 * C, device="cuda").to(dtype).requires_grad_(True)
    x = xz[..., :C]  # strided, as the block passes in_proj's output
    w = torch.randn(C, width, device="cuda").mul_(0.5).requires_grad_(True)
    bias = torch.randn(C, device="cuda").mul_(0.1).requires_grad_(True)
    init = torch.randn(S, C, width - 1, device="cuda").to(dtype).float().requires_grad_(True)
    cu = cu_of(lengths, "cuda")
    torch.ops.selscan_fused.conv_set_poison_outputs(True)  # every output element must be written
    try:
        out, fs = causal_conv1d_packed(x, w, bias, init, cu, activation=True, return_final_state=True)
        g_out = torch.randn_like(out)
        g_fs = torch.randn_like(fs)
        # one backward of the whole loss, as on each sequence alone below (dfinal_state is added to dx in
        # float32 before its one rounding)
        ((out.float() * g_out.float()).sum() + (fs.float() * g_fs.float()).sum()).backward()
    finally:
        torch.ops.selscan_fused.conv_set_poison_outputs(False)
    assert torch.isfinite(out).all() and torch.isfinite(fs).all() and torch.isfinite(xz.grad).all()
    dw_sum, db_sum = torch.zeros_like(w), torch.zeros_like(bias)
    for s, (a, e) in enumerate(_slices(lengths)):
        ls = [t.detach().clone().requires_grad_(True) for t in (x[:, a:e], w, bias, init[s:s + 1])]
        if a == e:
            assert torch.equal(fs[s], init[s].to(dtype)) and torch.equal(init.grad[s], g_fs[s].float())
            continue
        o, f_ = causal_conv1d(*ls, activation=True, return_final_state=True)
        assert torch.equal(o, out[:, a:e]) and torch.equal(f_[0], fs[s]), s
        ((o.float() * g_out[:, a:e].float()).sum() + (f_.float() * g_fs[s:s + 1].float()).sum()).backward()
        assert torch.equal(ls[0].grad, xz.grad[:, a:e, :C]), s
        assert torch.equal(ls[3].grad[0], init.grad[s]), s
        dw_sum += ls[1].grad
        db_sum += ls[2].grad
    assert not xz.grad[..., C:].any()  # nothing reaches z's half
    # the weight's and the bias's gradients: sums over every sequence (in another order than the packed
    # kernel's partials: close, not bitwise)
    torch.testing.assert_close(w.grad, dw_sum, rtol=1e-4, atol=1e-4 * dw_sum.abs().max().item())
    torch.testing.assert_close(bias.grad, db_sum, rtol=1e-4, atol=1e-4 * db_sum.abs().max().item())


def check_packed_layer_against_float64(impl, dtype, lengths):
    """selective_scan(impl=impl, cu_seqlens=) against the independent float64 walk: y, the final states and
    every gradient (h0's included) within the dtype's bound."""
    from conftest import matmul_precision
    S, T = len(lengths), sum(lengths)
    cu = cu_of(lengths, "cuda")
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    inp = make_inputs(1, T, 64, 16, device="cuda")
    inp["x"] = inp["x"].to(dtype)
    h0 = torch.randn(S, 64, 16, device="cuda")
    leaves = {k: inp[k].detach().clone().requires_grad_(True) for k in ("x",) + LAYER_ARGS}
    hh = h0.clone().requires_grad_(True)
    with matmul_precision("float32-highest"):
        y, hT = selective_scan(*(leaves[k] for k in ("x",) + LAYER_ARGS), h0=hh, impl=impl, cu_seqlens=cu,
                               return_final_state=True)
        (y.float().square().sum() + hT.square().sum()).backward()
    l64 = {k: inp[k].detach().double().cpu().requires_grad_(True) for k in ("x",) + LAYER_ARGS}
    h64 = h0.double().cpu().requires_grad_(True)
    y64, hT64 = packed_layer_walk(*(l64[k] for k in ("x",) + LAYER_ARGS), cu.cpu(), h64)
    (y64.square().sum() + hT64.square().sum()).backward()
    assert rel_l2(y.cpu(), y64) < tol and rel_l2(hT.cpu(), hT64) < tol
    for k in ("x",) + LAYER_ARGS:
        assert rel_l2(leaves[k].grad.cpu(), l64[k].grad) < tol * 3, k
    assert rel_l2(hh.grad.cpu(), h64.grad) < tol * 3


def check_packed_block_against_float64(impl, dtype, lengths):
    """mamba_block(impl=impl, cu_seqlens=) against the independent float64 walk: the output, both final
    states and every gradient (the weights', x's, h0's and the conv state's) within the dtype's bound.
    Returns the output and the call's inputs (cu_seqlens, x, the weights, h0, the conv state)."""
    from conftest import matmul_precision
    S, T = len(lengths), sum(lengths)
    cu = cu_of(lengths, "cuda")
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    block = make_block(d_model=32, d_state=16, dtype=torch.float32).cuda()
    xb = torch.randn(1, T, 32, device="cuda").to(dtype).requires_grad_(True)
    cs = torch.randn(S, 64, 3, device="cuda").to(dtype).requires_grad_(True)
    hb = torch.randn(S, 64, 16, device="cuda").requires_grad_(True)
    low = {0, 1, 4, 5, 9, 10}
    wd = [None if t is None else (t.detach().to(dtype) if i in low else t.detach()).requires_grad_(True)
          for i, t in enumerate(block.weights())]
    with matmul_precision("float32-highest"):
        out, hT, cT = mamba_block(xb, *wd, h0=hb, conv_state=cs, return_final_state=True, impl=impl,
                                  cu_seqlens=cu)
        (out.float().square().sum() + hT.square().sum() + cT.float().square().sum()).backward()
    assert torch.isfinite(out).all() and torch.isfinite(hT).all()
    w64 = [None if t is None else t.detach().double().cpu().requires_grad_(True) for t in wd]
    x64 = xb.detach().double().cpu().requires_grad_(True)
    cs64 = cs.detach().double().cpu().requires_grad_(True)
    hb64 = hb.detach().double().cpu().requires_grad_(True)
    o64, hT64, cT64 = packed_block_walk(x64, dict(zip(BLOCK_NAMES, w64)), cu.cpu(), hb64, cs64)
    (o64.square().sum() + hT64.square().sum() + cT64.square().sum()).backward()
    assert rel_l2(out.cpu(), o64) < tol and rel_l2(hT.cpu(), hT64) < tol and rel_l2(cT.cpu(), cT64) < tol
    for i, (a, b64) in enumerate(zip(wd, w64)):
        if a is not None:
            assert rel_l2(a.grad.cpu(), b64.grad) < tol * 3, BLOCK_NAMES[i]
    for a, b64 in ((xb, x64), (cs, cs64), (hb, hb64)):
        assert rel_l2(a.grad.cpu(), b64.grad) < tol * 3
    return out, (cu, xb, wd, hb, cs)


@requires_cuda
@requires_extension
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unfused_packed_layer_and_block_against_float64(dtype):
    """The whole packed paths (impl='unfused') against the independent float64 walk: values and every
    gradient within the dtype's bound."""
    fresh_seed()
    check_packed_layer_against_float64("unfused", dtype, [300, 1, 77, 700, 5])
    check_packed_block_against_float64("unfused", dtype, [300, 1, 77, 700, 5])


requires_fused_packed = pytest.mark.skipif(
    not selscan_fused._extension.fused_packed_available(),
    reason="the fused kernel's extension is not loaded or was built with "
           "SELSCAN_FUSED_NVCC_FLAGS=-DSELSCAN_FUSED_NO_PACKED")


@requires_cuda
@requires_hopper
def test_fused_packed_op_says_how_it_is_built():
    """impl='fused' takes cu_seqlens; in a build with -DSELSCAN_FUSED_NO_PACKED the fused packed ops refuse,
    naming the switch and the path to use."""
    cu = cu_of([3, 5], "cuda")
    inp = make_inputs(1, 8, 64, 16, device="cuda")
    args = [inp["x"]] + [inp[k] for k in LAYER_ARGS]
    flags = selscan_fused._extension.build_info().get("FUSED_NVCC_EXTRA_FLAGS", "")
    # the default build takes them: a build that silently lost them would skip every fused packed test
    assert selscan_fused._extension.fused_packed_available() == ("-DSELSCAN_FUSED_NO_PACKED" not in flags.split())
    if selscan_fused._extension.fused_packed_available():
        y = selective_scan(*args, impl="fused", cu_seqlens=cu)
        assert y.shape == (1, 8, 64) and torch.isfinite(y).all()
    else:
        with pytest.raises(RuntimeError, match="SELSCAN_FUSED_NO_PACKED; use impl='unfused'"):
            torch.ops.selscan_fused.fused_fwd_packed(*args, None, cu, True, False)
        u, z = torch.randn(1, 8, 64, device="cuda"), torch.randn(1, 8, 64, device="cuda")
        with pytest.raises(RuntimeError, match="SELSCAN_FUSED_NO_PACKED; use impl='unfused'"):
            torch.ops.selscan_fused.fused_block_scan_packed(u, torch.randn(1, 8, 36, device="cuda"), z,
                                                           torch.randn(64, 4, device="cuda"), inp["A_log"],
                                                           inp["b_delta"], inp["D"], None, cu, True, False)
        with pytest.raises(ValueError, match="SELSCAN_FUSED_NO_PACKED"):
            selective_scan(*args, impl="fused", cu_seqlens=cu)
        block = make_block(d_model=32, d_state=16, dtype=torch.float32).cuda()
        with pytest.raises(ValueError, match="SELSCAN_FUSED_NO_PACKED"):
            mamba_block(torch.randn(1, 8, 32, device="cuda"), *block.weights(), impl="fused", cu_seqlens=cu)


@requires_cuda
@requires_hopper
@requires_fused_packed
@pytest.mark.parametrize("dtype,N", [(torch.bfloat16, 16), (torch.float16, 32), (torch.float32, 32),
                                     (torch.bfloat16, 64)])
def test_fused_packed_layer_bitwise_equals_each_sequence_alone(dtype, N, poisoned_outputs):
    """fused_fwd_packed against the fused kernel on each sequence alone (batch 1, no L split): y, the
    final state and the checkpoints (in the packed slot layout) bitwise, every element written (NaN-
    poisoned outputs); sequence starts inside and on the 64- and 128-token tiles, empty sequences (their
    state passes through), L = 1. At N = 16 a sequence alone of at most 1024 tokens takes the
    two-warpgroup scan layout, which the packed call (5,369 tokens) does not: those are held to float32
    rounding."""
    from conftest import matmul_precision
    fresh_seed()
    lengths = PACKED_MIX
    S, T, Dm = len(lengths), sum(lengths), 128
    inp = make_inputs(1, T, Dm, N, device="cuda")
    x = inp["x"].to(dtype)
    w = [inp[k].to(dtype) if k in ("W_delta", "W_B", "W_C") else inp[k] for k in LAYER_ARGS]
    h0 = torch.randn(S, Dm, N, device="cuda")
    cu = cu_of(lengths, "cuda")
    ops = torch.ops.selscan_fused
    with matmul_precision("float32-highest"):
        y, hT, ckpt = ops.fused_fwd_packed(x, *w, h0, cu, True, True)
        assert ckpt.shape == (1, T // 64 + S, Dm, N)
        for t in (y, hT):
            assert torch.isfinite(t).all()
        for s, (a, e) in enumerate(_slices(lengths)):
            if a == e:
                assert torch.equal(hT[s], h0[s]), s
                continue
            ys, hs, ck = ops.fused_fwd_res(x[:, a:e], *w, h0[s:s + 1], 1, False, 0, 64, 0)
            slot0 = a // 64 + s
            got_ck = ckpt[0, slot0:slot0 + ck.shape[1]]
            if N != 16 or e - a > 1024:
                assert torch.equal(ys, y[:, a:e]), s
                assert torch.equal(hs[0], hT[s]), s
                assert torch.equal(ck[0], got_ck), s
            else:
                torch.testing.assert_close(y[:, a:e], ys, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-5)
                torch.testing.assert_close(hT[s], hs[0], rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(got_ck, ck[0], rtol=1e-5, atol=1e-5)
        # without h0 or the final state
        y2, hT2, ck2 = ops.fused_fwd_packed(x, *w, None, cu, False, False)
        assert hT2.numel() == 0 and ck2.shape[0] == 0 and torch.isfinite(y2).all()


@requires_cuda
@requires_hopper
@requires_fused_packed
@pytest.mark.parametrize("lengths", [[100, 50, 300, 7, 200], [100, 50, 300, 7, 700]])  # T <= 1024 and above
@pytest.mark.parametrize("block", [False, True])
def test_fused_packed_keeps_non_finite_inputs_in_their_sequence(lengths, block, poisoned_outputs):
    """Sequences 1 and 3 given inf and NaN inputs (x; for the block u, x_proj's output and the gate z):
    every other sequence's y, final state and checkpoints bitwise those of the clean call. The tile that
    ends a sequence holds the next one's rows (here starts at 100 and 150, inside the 128-token tiles),
    which the kernel must take as zeros (dt, B, C, x, the gate), not multiply by zero."""
    fresh_seed()
    S, T, Dm, N, R = len(lengths), sum(lengths), 128, 16, 8
    cu = cu_of(lengths, "cuda")
    h0 = torch.randn(S, Dm, N, device="cuda")
    inp = make_inputs(1, T, Dm, N, device="cuda")
    ops, dtype = torch.ops.selscan_fused, torch.bfloat16
    if block:
        clean = [torch.randn(1, T, Dm, device="cuda").to(dtype),  # u, x_proj's output, z
                 (0.5 * torch.randn(1, T, R + 2 * N, device="cuda")).to(dtype),
                 torch.randn(1, T, Dm, device="cuda").to(dtype)]
        dt_w = (torch.randn(Dm, R, device="cuda") / R ** 0.5).to(dtype)

        def run(u, xdbl, z):
            return ops.fused_block_scan_packed(u, xdbl, z, dt_w, inp["A_log"], inp["b_delta"], inp["D"], h0, cu,
                                               True, True)
    else:
        clean = [inp["x"].to(dtype)]
        w = [inp[k].to(dtype) if k in ("W_delta", "W_B", "W_C") else inp[k] for k in LAYER_ARGS]

        def run(x):
            return ops.fused_fwd_packed(x, *w, h0, cu, True, True)
    y, hT, ckpt = run(*clean)
    dirty = [t.clone() for t in clean]
    bad = (1, 3)
    for s in bad:
        a, e = _slices(lengths)[s]
        for t in dirty:
            t[:, a:e:2] = float("inf")
            t[:, a + 1:e:2] = float("nan")
    y2, hT2, ckpt2 = run(*dirty)
    for s, (a, e) in enumerate(_slices(lengths)):
        if s in bad:
            continue
        assert torch.isfinite(y[:, a:e]).all() and torch.isfinite(hT[s]).all(), s
        assert torch.equal(y2[:, a:e], y[:, a:e]), s
        assert torch.equal(hT2[s], hT[s]), s
        slots = slice(a // 64 + s, a // 64 + s + (e - a + 63) // 64)  # its checkpoints (the packed slot layout)
        torch.testing.assert_close(ckpt2[0, slots], ckpt[0, slots], rtol=0, atol=0, equal_nan=True,
                                   msg=f"checkpoints of sequence {s}")


@requires_cuda
@requires_hopper
@requires_fused_packed
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_packed_layer_against_float64(dtype):
    """impl='fused' with cu_seqlens, forward and backward (the fused forward's checkpoints into the
    unfused path's packed backward), against the independent float64 walk."""
    fresh_seed()
    check_packed_layer_against_float64("fused", dtype, [300, 1, 77, 700, 5])  # validate=True: none empty


@requires_cuda
@requires_hopper
@requires_fused_packed
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_packed_block_against_float64(dtype, poisoned_outputs):
    """mamba_block(impl='fused', cu_seqlens=) (the packed conv and x_proj, then the fused kernel's packed
    streams with dt_proj, the scan and the gate) against the independent float64 walk: values, final
    states and every gradient; and against impl='unfused' on the same weights."""
    from conftest import matmul_precision
    fresh_seed()
    out, (cu, xb, wd, hb, cs) = check_packed_block_against_float64("fused", dtype, [300, 1, 77, 700, 5, 130])
    with matmul_precision("float32-highest"):
        out_u = mamba_block(xb.detach(), *(None if t is None else t.detach() for t in wd), h0=hb.detach(),
                            conv_state=cs.detach(), impl="unfused", cu_seqlens=cu)
    assert rel_l2(out, out_u) < (1e-5 if dtype == torch.float32 else 2e-2)


PACKED_CUDA_IMPLS = ["unfused", pytest.param("fused", marks=[requires_hopper, requires_fused_packed])]


@requires_cuda
@requires_extension
@pytest.mark.parametrize("impl", PACKED_CUDA_IMPLS)
def test_packed_block_training_step_is_deterministic(impl):
    """A packed training step (bf16 autocast, sequence starts inside the 128-token tiles, h0 and conv
    states per sequence) run twice: the output, the final states and every gradient bitwise equal."""
    fresh_seed()
    block = make_block(d_model=64, d_state=16, dtype=torch.float32).cuda()
    block.impl = impl
    lengths = [100, 1, 250, 1000, 149]
    S, T = len(lengths), sum(lengths)
    cu = cu_of(lengths, "cuda")
    x = torch.randn(1, T, 64, device="cuda")
    h0 = torch.randn(S, 128, 16, device="cuda")
    cs = torch.randn(S, 128, 3, device="cuda")
    g = torch.randn(1, T, 64, device="cuda")

    def step():
        block.zero_grad(set_to_none=True)
        xx, hh, cc = (t.clone().requires_grad_() for t in (x, h0, cs))
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out, h, c = block(xx, h0=hh, conv_state=cc, cu_seqlens=cu, return_final_state=True)
        (out.float() * g).sum().backward()
        return [out, h, c, xx.grad, hh.grad, cc.grad] + [p.grad for p in block.parameters()]

    first, second = step(), step()
    for i, (a, b) in enumerate(zip(first, second)):
        assert torch.isfinite(a.float()).all(), i
        assert torch.equal(a, b), i


@requires_cuda
@requires_extension
@pytest.mark.parametrize("impl", PACKED_CUDA_IMPLS)
def test_packed_block_compiles_and_replays_with_new_cu_seqlens(impl):
    """torch.compile(fullgraph=True) of a packed training step (validate=False: no host read) equals eager,
    and a CUDA graph captured once replays with new cu_seqlens values (same number of sequences)."""
    fresh_seed()
    block = make_block(d_model=32, d_state=16, dtype=torch.float32).cuda()
    block.impl = impl
    T = 500
    x = torch.randn(1, T, 32, device="cuda")
    cu = cu_of([100, 1, 250, 149], "cuda")

    def loss_fn(xx, cc):
        return block(xx, cu_seqlens=cc, validate=False).square().mean()

    eager = loss_fn(x, cu)
    eager.backward()
    g_eager = [p.grad.clone() for p in block.parameters()]
    block.zero_grad(set_to_none=True)
    compiled = torch.compile(loss_fn, fullgraph=True)(x, cu)
    compiled.backward()
    assert rel_l2(compiled, eager) < 1e-5
    for p, g in zip(block.parameters(), g_eager):
        assert rel_l2(p.grad, g) < 1e-4
    static_cu = cu.clone()
    with torch.no_grad():
        loss_fn(x, static_cu)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            loss_fn(x, static_cu)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = block(x, cu_seqlens=static_cu, validate=False)
        new = cu_of([3, 300, 97, 100], "cuda")
        static_cu.copy_(new)
        g.replay()
        assert torch.equal(out, block(x, cu_seqlens=new))


def test_language_model_packed_equals_each_sequence_alone():
    """MambaLM.forward with cu_seqlens (the reference path, float64): the logits and every layer's states
    of each sequence equal running it alone; states passed in per sequence continue each sequence."""
    from selscan_fused.model import MambaLM, MambaLMConfig
    fresh_seed()
    cfg = MambaLMConfig(d_model=16, n_layer=2, vocab_size=40, ssm_cfg={"d_state": 4, "d_conv": 3})
    m = MambaLM(cfg, impl="reference").double().eval()
    lengths = [5, 1, 12, 2]
    cu = cu_of(lengths)
    ids = torch.randint(0, 40, (1, sum(lengths)))
    with torch.no_grad():
        logits, states = m(ids, return_states=True, cu_seqlens=cu)
        a = 0
        for s, n in enumerate(lengths):
            lg, st = m(ids[:, a:a + n], return_states=True)
            torch.testing.assert_close(logits[:, a:a + n], lg, rtol=1e-12, atol=1e-12)
            for (h, c), (h1, c1) in zip(states, st):
                torch.testing.assert_close(h[s], h1[0], rtol=1e-12, atol=1e-12)
                torch.testing.assert_close(c[s], c1[0], rtol=1e-12, atol=1e-12)
            a += n
        # continuing: a second packed call from the first's states equals one call on the joined sequences
        more = [3, 2, 4, 6]
        ids2 = torch.randint(0, 40, (1, sum(more)))
        logits2, _ = m(ids2, states=states, return_states=True, cu_seqlens=cu_of(more))
        a, b = 0, 0
        for s, (n, k) in enumerate(zip(lengths, more)):
            joined = torch.cat([ids[:, a:a + n], ids2[:, b:b + k]], 1)
            torch.testing.assert_close(logits2[:, b:b + k], m(joined)[:, n:], rtol=1e-10, atol=1e-10)
            a, b = a + n, b + k
    with pytest.raises(ValueError, match="num_last_tokens"):
        m(ids, cu_seqlens=cu, num_last_tokens=1)
    # each sequence's last logits only
    with torch.no_grad():
        last = m(ids, cu_seqlens=cu, logits_rows=cu[1:].long() - 1)
    assert last.shape == (1, len(lengths), logits.shape[-1])
    torch.testing.assert_close(last[0], logits[0, cu[1:].long() - 1], rtol=1e-12, atol=1e-12)


def test_cached_path_queries_do_not_retrace_a_compiled_caller(monkeypatch):
    """The front ends' cached questions (is the GPU an sm_90, does the fused kernel take packed sequences)
    fill their cache on the first call; a compiled caller whose first call fills it must not guard on
    the cache and retrace at the second (the fused packed block's compile-once test caught this in a
    fresh process). Runs on the CPU: the GPU's answer is faked."""
    from torch._dynamo.testing import CompileCounter
    import selscan_fused._extension as ext
    from selscan_fused import api
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda idx=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # the CPU tensor's device has no index
    # as the front ends ask: of the compiled function's input's device
    for query, reset in ((lambda t: api._sm90(t.device), lambda: monkeypatch.setattr(api, "_is_sm90", {})),
                         (lambda t: ext.fused_packed_available(),
                          lambda: monkeypatch.setattr(ext, "_fused_packed", None))):
        reset()
        torch._dynamo.reset()
        cnt = CompileCounter()
        f = torch.compile(lambda t: t + 1 if query(t) else t - 1, backend=cnt, fullgraph=True, dynamic=True)
        for n in (5, 6, 7):
            f(torch.randn(n))
        assert cnt.frame_count == 1, cnt.frame_count
    torch._dynamo.reset()


@requires_cuda
@requires_extension
@pytest.mark.parametrize("impl", PACKED_CUDA_IMPLS)
def test_packed_block_compiled_once_for_any_number_of_sequences(impl):
    """torch.compile(dynamic=True) of a packed forward traces once: a call with another number of
    sequences (cu_seqlens of another length) and another packed length reuses the graph."""
    from torch._dynamo.testing import CompileCounterWithBackend
    fresh_seed()
    block = make_block(d_model=32, d_state=16, dtype=torch.float32).cuda()
    block.impl = impl
    cnt = CompileCounterWithBackend("inductor")

    @torch.compile(backend=cnt, dynamic=True, fullgraph=True)
    def fwd(xx, cc):
        return block(xx, cu_seqlens=cc, validate=False)

    torch._dynamo.reset()
    for lengths in ([100, 1, 250, 149], [7, 300, 5, 90, 60], [33, 2]):
        x = torch.randn(1, sum(lengths), 32, device="cuda")
        cu = cu_of(lengths, "cuda")
        with torch.no_grad():
            out = fwd(x, cu)
            assert rel_l2(out, block(x, cu_seqlens=cu)) < 1e-6
    assert cnt.frame_count == 1, cnt.frame_count
