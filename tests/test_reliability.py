"""Hostile values, concurrency and state, for both CUDA paths, forward and backward (docs/reliability.md).
GPU only."""
import threading

import pytest
import torch

import selscan_fused
from selscan_fused import ScanConfig
from differential import near_overflow
from conftest import (DTYPES, TOLERANCE, call, float64_eval, fresh_seed, make_inputs, matmul_precision, rel_l2,
                      requires_cuda, requires_extension, requires_hopper)

pytestmark = [requires_cuda, requires_extension]

IMPLS = ["unfused", pytest.param("fused", marks=requires_hopper)]


def _run(inp, impl, config=None, backward=False, seed=0):
    """y, final state and (backward) the gradients of every input, for the path and for float64 autograd
    of the reference on the same values."""
    out = {}
    for which in ("path", "f64"):
        leaves = {k: (v.detach().clone() if which == "path" else v.detach().double()) for k, v in inp.items()
                  if v is not None}
        for v in leaves.values():
            v.requires_grad_(backward)
        a = dict(inp, **leaves)
        if which == "path":
            y, h = call(a, impl, return_final_state=True, config=config)
        else:
            y, h = selscan_fused.reference.selective_scan_ref(a["x"], a["A_log"], a["W_delta"], a["b_delta"],
                                                              a["W_B"], a["W_C"], a["D"], a.get("h0"))
        res = {"y": y.detach(), "h": h.detach()}
        if backward:
            g = torch.Generator(device="cuda").manual_seed(seed)
            # float16: the upstream gradients scaled down as a loss scaler would (the gradient of the
            # projections is stored in float16; docs/math.md, "float16 range")
            s = 2.0 ** -6 if inp["x"].dtype == torch.float16 else 1.0
            dy = torch.randn(y.shape, device="cuda", generator=g, dtype=torch.float64) * s
            dh = torch.randn(h.shape, device="cuda", generator=g, dtype=torch.float64) * s
            loss = (y.double() * dy).sum() + (h.double() * dh).sum()
            names = list(leaves)
            for k, gr in zip(names, torch.autograd.grad(loss, [leaves[k] for k in names], allow_unused=True)):
                res["d" + k] = gr
        out[which] = res
    return out["path"], out["f64"]


def _rel_where_finite(a, b):
    """rel_l2 over the elements where the float64 value, rounded to a's dtype, is finite and not within 2%
    of the dtype's overflow (there either side is right: test_extreme_values_stay_finite; a float16 y of
    65,300 in float64 came out inf from the unfused path, seed 96469712 of huge_delta, 2026-12-03)."""
    fin = torch.isfinite(b.to(a.dtype)) & ~near_overflow(b, a.dtype, 0.02)
    return rel_l2(a[fin], b[fin])


def _same_nonfinite(a, b, name):
    fa, fb = torch.isfinite(a), torch.isfinite(b.to(a.dtype))
    assert torch.equal(fa, fb), (f"{name}: non-finite elements differ from the float64 evaluation's "
                                 f"({int((fa != fb).sum())} of {a.numel()})")


# --- inf and NaN: propagate as in the reference, within their sequence, never back in time ------------

@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("l_segments", [0, 3])
def test_nonfinite_x_stays_in_its_sequence_and_after_it(impl, value, l_segments):
    fresh_seed()
    inp = make_inputs(3, 700, 128, 16, device="cuda")
    t0 = 333
    inp["x"][1, t0, 5] = value
    p, r = _run(inp, impl, ScanConfig(l_segments=l_segments), backward=True)
    _same_nonfinite(p["y"], r["y"], "y")
    _same_nonfinite(p["h"], r["h"], "final state")
    assert torch.isfinite(p["y"][[0, 2]]).all() and torch.isfinite(p["y"][1, :t0]).all()
    assert (~torch.isfinite(p["y"][1, t0:])).any(dim=-1).all()  # every later token is hit
    assert rel_l2(p["y"][1, :t0], r["y"][1, :t0]) < TOLERANCE["float32-highest"]
    # Gradients: the other sequences' input gradients stay finite; what sums over every token (the
    # weights') is non-finite in both.
    _same_nonfinite(p["dx"], r["dx"], "dx")
    assert torch.isfinite(p["dx"][[0, 2]]).all()
    for k in ("dW_delta", "dW_B", "dW_C", "dA_log", "db_delta", "dD"):
        _same_nonfinite(p[k], r[k], k)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name,index", [("W_B", (2, 5)), ("W_delta", (4, 0)), ("W_C", (7, 100)), ("D", (9,)),
                                        ("A_log", (3, 1)), ("b_delta", (11,))])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_parameter_as_in_the_reference(impl, name, index, value):
    fresh_seed()
    inp = make_inputs(2, 300, 128, 16, device="cuda", with_h0=True)
    inp[name][index] = value
    p, r = _run(inp, impl)
    _same_nonfinite(p["y"], r["y"], "y")
    _same_nonfinite(p["h"], r["h"], "final state")
    fin = torch.isfinite(r["y"])
    if fin.any():
        assert rel_l2(p["y"][fin], r["y"][fin]) < TOLERANCE["float32-highest"]


# --- extreme but finite: exactly zero / one decays, huge delta, denormal inputs -------------------------

def _extreme(kind, dtype):
    inp = make_inputs(2, 1500, 128, 16, dtype=dtype, device="cuda", with_h0=True)
    if kind == "decay_zero":        # exp(delta A) == 0: A = -54.6, delta ~ 50
        inp["A_log"].fill_(4.0)
        inp["b_delta"].fill_(50.0)
    elif kind == "decay_one":       # exp(delta A) rounds to 1: A = -3.4e-4, delta ~ 6e-6
        inp["A_log"].fill_(-8.0)
        inp["b_delta"].fill_(-12.0)
    elif kind == "huge_delta":      # delta ~ 1e4 (softplus far past 20)
        inp["b_delta"].fill_(1e4)
    elif kind == "mixed":           # every regime at once, channel by channel
        inp["A_log"].uniform_(-8.0, 4.0)
        inp["b_delta"].uniform_(-30.0, 1e3)
    elif kind == "denormal_x":      # x in the subnormal range of its dtype
        tiny = torch.finfo(dtype).tiny
        inp["x"] = (torch.rand(2, 1500, 128, device="cuda") * tiny).to(dtype)
        inp["h0"].mul_(tiny)
    return inp


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mode", ["float32-highest", "bfloat16", "float16"])
@pytest.mark.parametrize("kind", ["decay_zero", "decay_one", "huge_delta", "mixed", "denormal_x"])
def test_extreme_values_stay_finite(impl, mode, kind):
    fresh_seed()
    with matmul_precision(mode):
        inp = _extreme(kind, DTYPES[mode])
        p, r = _run(inp, impl, backward=True, seed=1)
    for k in r:
        if r[k] is None:
            continue
        # Within 2% of the largest finite value either side of the overflow is right: the unfused path
        # rounds B and C to float16 (2^-11 each), and y = delta x sum_n B_n C_n carries 2^-10 times
        # sum |B_n C_n| / |sum B_n C_n| of relative error, several times 1e-3 for 16 terms (a float64 y
        # of 65300 is finite; the path's 65530 rounds to inf).
        ref_finite = torch.isfinite(r[k].to(p[k].dtype)) & ~near_overflow(r[k], p[k].dtype, 0.02)
        assert torch.isfinite(p[k])[ref_finite].all(), f"{k}: non-finite where the float64 evaluation is finite"
    if kind != "denormal_x":  # subnormal x: only finiteness (the GPU may flush subnormals to zero)
        assert _rel_where_finite(p["y"], r["y"]) < TOLERANCE[mode]
        assert _rel_where_finite(p["h"], r["h"]) < TOLERANCE[mode]


# --- concurrency and state ----------------------------------------------------------------------------

def _workload(impl, seed):
    g = torch.Generator().manual_seed(seed)
    shapes = [(2, 300, 128, 16), (1, 4097, 64, 8), (3, 7, 256, 32), (1, 1, 64, 64), (2, 1000, 192, 16)]
    cases = []
    for i, s in enumerate(shapes):
        torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=g)))
        cases.append(make_inputs(*s, dtype=torch.bfloat16, device="cuda", with_h0=bool(i % 2)))
    return cases


def _forward_backward(inp, impl, make_leaf=lambda name, v: v.detach().clone()):
    leaves = {k: make_leaf(k, v).requires_grad_(True) for k, v in inp.items() if v is not None}
    a = dict(inp, **leaves)
    y, h = call(a, impl, return_final_state=True)
    (y.float().square().mean() + h.square().mean()).backward()
    return [y.detach(), h.detach()] + [leaves[k].grad for k in leaves]


@pytest.mark.parametrize("impl", IMPLS)
def test_two_streams_at_once_equal_one_after_the_other(impl):
    fresh_seed()
    a, b = _workload(impl, 1), _workload(impl, 2)
    seq = [[_forward_backward(inp, impl) for inp in w] for w in (a, b)]
    torch.cuda.synchronize()
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    s1.wait_stream(torch.cuda.current_stream())
    s2.wait_stream(torch.cuda.current_stream())
    par = [[], []]
    for ia, ib in zip(a, b):  # interleaved launches on two streams
        with torch.cuda.stream(s1):
            par[0].append(_forward_backward(ia, impl))
        with torch.cuda.stream(s2):
            par[1].append(_forward_backward(ib, impl))
    torch.cuda.synchronize()
    for sw, pw in zip(seq, par):
        for so, po in zip(sw, pw):
            for x, y in zip(so, po):
                assert torch.equal(x, y)


@pytest.mark.parametrize("impl", IMPLS)
def test_two_threads_at_once_equal_one_after_the_other(impl):
    fresh_seed()
    works = [_workload(impl, 3), _workload(impl, 4)]
    seq = [[_forward_backward(inp, impl) for inp in w] for w in works]
    torch.cuda.synchronize()
    results, errors = [None, None], []

    def worker(i):
        try:
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                out = []
                for _ in range(3):
                    out = [_forward_backward(inp, impl) for inp in works[i]]
                s.synchronize()
            results[i] = out
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for sw, pw in zip(seq, results):
        for so, po in zip(sw, pw):
            for x, y in zip(so, po):
                assert torch.equal(x, y)


def test_ten_thousand_calls_of_mixed_shapes_allocate_nothing_lasting():
    fresh_seed()
    hopper = selscan_fused._extension.fused_extension_available() and torch.cuda.get_device_capability() == (9, 0)
    impls = ["unfused"] + (["fused"] if hopper else [])
    cases = []
    for i, s in enumerate([(1, 1, 64, 16), (2, 37, 128, 8), (1, 700, 64, 32), (3, 5, 256, 64), (1, 130, 128, 16)]):
        for dt in (torch.bfloat16, torch.float32):
            cases.append(make_inputs(*s, dtype=dt, device="cuda", with_h0=bool(i % 2)))

    def one_round(k):
        for j, inp in enumerate(cases):
            impl = impls[(k + j) % len(impls)]
            if (k + j) % 97 == 0:
                _forward_backward(inp, impl)
            else:
                with torch.no_grad():
                    call(inp, impl, return_final_state=bool(j % 2))

    for k in range(20):  # warm-up: the caching allocator settles
        one_round(k)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    reserved = torch.cuda.memory_reserved()
    n = 0
    k = 20
    while n < 10_000:
        one_round(k)
        k += 1
        n += len(cases)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before
    assert torch.cuda.memory_reserved() <= reserved + 64 * 2**20


@pytest.mark.parametrize("impl", IMPLS)
def test_cuda_graph_replay_with_new_inputs_forward_and_backward(impl):
    fresh_seed()
    inp = make_inputs(2, 500, 128, 16, dtype=torch.bfloat16, device="cuda", with_h0=True)
    static = {k: v.clone() for k, v in inp.items()}
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            outs = _forward_backward(static, impl)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = _forward_backward(static, impl)
    for seed in range(3):
        torch.manual_seed(seed)
        new = make_inputs(2, 500, 128, 16, dtype=torch.bfloat16, device="cuda", with_h0=True)
        for k in static:
            static[k].copy_(new[k])
        g.replay()
        torch.cuda.synchronize()
        eager = _forward_backward(new, impl)
        for a, b in zip(outs, eager):
            assert torch.equal(a, b)
        y64, _ = float64_eval(new)
        assert rel_l2(outs[0], y64) < TOLERANCE["bfloat16"]


def _misaligned(t):
    """t's values in a view that starts one element into its storage (2 bytes off for bf16, 4 for float32)."""
    buf = torch.empty(t.numel() + 1, device=t.device, dtype=t.dtype)
    v = buf[1:].view(t.shape)
    v.copy_(t)
    assert v.data_ptr() % 8 != 0
    return v


@pytest.mark.parametrize("impl", IMPLS)
def test_misaligned_and_strided_inputs(impl):
    """Any strides and storage offsets: a view that starts one element into its storage (not 16-byte
    aligned, which TMA and the vector loads need) and a non-contiguous slice give the contiguous answer."""
    fresh_seed()
    inp = make_inputs(2, 300, 128, 16, dtype=torch.bfloat16, device="cuda", with_h0=True)
    ref_y, ref_h = call(inp, impl, return_final_state=True)
    x_mis = _misaligned(inp["x"])
    assert x_mis.data_ptr() % 16 != 0
    wide = torch.zeros(2, 300, 256, device="cuda", dtype=torch.bfloat16)
    wide[..., 64:192] = inp["x"]
    W = torch.zeros(128, 256, device="cuda", dtype=torch.bfloat16)
    W[:, 1:129] = inp["W_delta"]
    y64, h64 = float64_eval(inp)
    for x, Wd in ((x_mis, inp["W_delta"]), (wide[..., 64:192], W[:, 1:129])):
        y, h = call(dict(inp, x=x, W_delta=Wd), impl, return_final_state=True)
        if impl == "fused":  # copied to an aligned contiguous buffer: the same kernel on the same bytes
            assert torch.equal(y, ref_y) and torch.equal(h, ref_h)
        else:  # cuBLAS may pick another algorithm for another alignment
            assert rel_l2(y, y64) < TOLERANCE["bfloat16"] and rel_l2(h, h64) < TOLERANCE["bfloat16"]


@pytest.mark.parametrize("impl", IMPLS)
def test_misaligned_float32_parameters_forward_and_backward(impl):
    """A_log, b_delta, D and h0 as views one float into their storage (the fused kernel reads b_delta two
    floats at a time, so an 8-byte aligned copy is needed): the same values and gradients, bit for bit, as
    aligned tensors, and every gradient lands in the misaligned leaf."""
    fresh_seed()
    inp = make_inputs(2, 300, 128, 16, dtype=torch.bfloat16, device="cuda", with_h0=True)
    ref = _forward_backward(inp, impl)
    names = [k for k in inp if inp[k] is not None]
    got = _forward_backward(inp, impl, lambda k, v: _misaligned(v.detach()) if k in ("A_log", "b_delta", "D", "h0")
                            else v.detach().clone())
    for name, a, b in zip(["y", "h"] + names, got, ref):
        assert torch.equal(a, b), name


@requires_hopper
def test_fused_backward_with_a_misaligned_checkpoint_buffer():
    """The fused backward reads the forward's checkpoints 16 bytes at a time; a caller of the op may pass
    them as any float32 view: the gradients equal those from the aligned buffer."""
    fresh_seed()
    inp = make_inputs(2, 700, 128, 16, dtype=torch.bfloat16, device="cuda", with_h0=True)
    args = (inp["x"], inp["A_log"], inp["W_delta"], inp["b_delta"], inp["W_B"], inp["W_C"], inp["D"], inp["h0"])
    y, hT, ckpt = torch.ops.selscan_fused.fused_fwd_res(*args, 0)
    dy = torch.randn_like(y)
    dhT = torch.randn_like(hT)
    ref = torch.ops.selscan_fused.fused_bwd(*args, dy, dhT, ckpt, 0, 1, 0)
    got = torch.ops.selscan_fused.fused_bwd(*args, dy, dhT, _misaligned(ckpt), 0, 1, 0)
    for i, (a, b) in enumerate(zip(got, ref)):
        assert torch.equal(a, b), i
    assert all(torch.isfinite(g).all() for g in ref)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mode", ["float32-highest", "bfloat16"])
def test_a_log_past_float32_exp_range(impl, mode):
    """A_log = 100 is finite, but exp(A_log) overflows float32: the decay must be exactly 0 (as in
    float64), and the padding past L (299 tokens: not a multiple of any tile) must not turn the final
    state into NaN (-inf * 0); the gradients stay finite as float64's (dA_log = dA * A = 0 * A)."""
    fresh_seed()
    with matmul_precision(mode):
        inp = make_inputs(2, 299, 128, 16, dtype=DTYPES[mode], device="cuda", with_h0=True)
        inp["A_log"][:, :4] = 100.0
        p, r = _run(inp, impl, backward=True, seed=2)
    for k in r:
        assert torch.isfinite(r[k]).all() and torch.isfinite(p[k]).all(), k
    assert rel_l2(p["y"], r["y"]) < TOLERANCE[mode] and rel_l2(p["h"], r["h"]) < TOLERANCE[mode]
    assert rel_l2(p["dA_log"], r["dA_log"]) < TOLERANCE[mode]


@pytest.mark.parametrize("impl", IMPLS)
def test_small_delta_is_accurate(impl):
    """Softplus arguments from -17 to -4 (delta from 4e-8 to 0.018), no h0: the final state is made only
    of such tokens, so delta's relative error shows in it directly. Forming 1 + e^v in float32 cost
    5.5e-5 at -7 and 2e-3 at -13, and the fused kernel's form returned 0 below -16.6; log1p's series
    below -4 (csrc/common/device_math.cuh) keeps delta within float32 rounding."""
    fresh_seed()
    with matmul_precision("float32-highest"):
        inp = make_inputs(2, 1000, 128, 16, device="cuda")
        inp["W_delta"].mul_(0.1)  # arguments spread by about +-0.3 around each channel's bias
        inp["b_delta"] = torch.linspace(-17.0, -4.0, 128, device="cuda")
        p, r = _run(inp, impl, backward=True, seed=3)
    for k in ("h", "y", "db_delta", "dW_delta", "dx"):
        assert rel_l2(p[k], r[k]) < TOLERANCE["float32-highest"], (k, rel_l2(p[k], r[k]))
    # channel by channel too: the smallest deltas (the first channels) must not vanish into the others
    per_channel = (p["h"] - r["h"]).norm(dim=(0, 2)) / r["h"].norm(dim=(0, 2))
    assert per_channel.max() < 1e-4, per_channel.max()
