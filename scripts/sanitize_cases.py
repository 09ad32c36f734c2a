#!/usr/bin/env python3
"""The workload scripts/sanitize.sh runs under compute-sanitizer: both CUDA paths, forward and backward,
over a grid that has L = 1, odd L, batch 1, the L split (automatic and forced), the fused kernel's
narrow (16) and wide (64) channel tiles, every N and every dtype / float32 precision; then the Mamba
block on both paths (BLOCK_GRID: its conv, gate and scan kernels, forward and backward) with three
decode steps each (the decode kernels, the fused add + RMSNorm), and packed sequences on the unfused
path (PACKED_LENGTHS: the scan and conv kernels' packed policies; the layer's fused path too where the
fused kernel takes them: every build but one with -DSELSCAN_FUSED_NO_PACKED). Small sizes: the
tools slow every launch down by orders of magnitude. Checks each result against the float64 evaluation
too (a tool can change timing, never results).

    python scripts/sanitize_cases.py [--quick]      # --quick: a third of the grid (racecheck)
    python scripts/sanitize_cases.py --quick --shard 2/6   # the third of the six parts of that (a slow tool
                                                           # run in parts: K/M runs the runs with index % M == K)
    python scripts/sanitize_cases.py --rest                 # the two thirds --quick leaves out
    python scripts/sanitize_cases.py --initcheck            # what initcheck runs (below)
    python scripts/sanitize_cases.py --with fused_backward  # only the grid entries whose config sets a key

--initcheck: compute-sanitizer's initcheck does not see the writes of cuBLAS's kernels (a clone of an
F.linear output is reported as a read of uninitialized memory), so every read of the projections
that the ops compute with cuBLAS would be reported. This mode drives the kernels through the ops that
take their inputs from the caller: the projections formed by elementwise products and a sum (no
cuBLAS), the scan kernel on them (`scan_fwd`), the fused kernel (`fused_fwd_res`: it reads only the
caller's tensors) for the checkpoints and its own forward, and the backward kernel (`unfused_bwd`) on
those projections and checkpoints (and, in the grid's fused-backward cases, the fused backward kernel
through `fused_bwd`). sanitize.sh instruments every kernel under initcheck (a kernel
left out of the instrumentation is not seen writing either). What is left to cuBLAS: the backward op's
own dx and dW products, whose values this mode does not read (its finiteness check covers the
gradients formed from the kernels' partials: dA_log, db_delta, dD, dh0; dW_B and dW_C are separate
products since 2026-12-02, no copy of a cuBLAS output); a report in one of this project's kernels is a
read of memory nothing wrote. The block's kernels the same way (`_block_ops_without_cublas`: in_proj's
output drawn at random, x_proj's and dt_proj's products as elementwise products and sums): the conv
kernel, the gated scan and its backward, the conv's backward, the fused block's two kernels, the decode
step's kernels and the packed conv and scan kernels. Needs the fused kernel (sm_90).
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import torch  # noqa: E402

import selscan_fused  # noqa: E402
from selscan_fused import ScanConfig  # noqa: E402
from conftest import TOLERANCE, float64_eval, make_inputs, rel_l2  # noqa: E402

MODES = {"bfloat16": (torch.bfloat16, "highest"), "float16": (torch.float16, "highest"),
         "float32-highest": (torch.float32, "highest"), "float32-high": (torch.float32, "high")}
# (batch, L, D, N, config)
GRID = [
    (1, 1, 64, 16, {}),
    (3, 7, 128, 8, {}),
    (2, 130, 192, 64, {}),
    (1, 1000, 256, 32, {}),
    (1, 2049, 64, 16, {}),                        # one sequence: the automatic L split
    (2, 600, 128, 16, {"l_segments": 3}),         # a forced L split
    (1, 300, 64, 16, {"channel_tile": 16}),       # fused: the narrow layout (bf16/fp16, N = 16)
    (1, 300, 64, 16, {"channel_tile": 64}),       # fused: the wide layout
    (1, 2049, 64, 16, {"fused_backward": "kernel"}),                   # fused backward kernel, its L split
    (2, 600, 128, 16, {"l_segments": 3, "fused_backward": "kernel"}),  # ... forced split
    (3, 130, 64, 16, {"fused_backward": "kernel"}),                    # ... no split
]

# The Mamba-1 block (both CUDA paths, forward + backward) and its decode step (the decode kernels and the
# fused add + RMSNorm), checked against the float64 reference: (batch, L, d_model, N, d_conv). d_model 32
# and 96 give d_inner 64 and 192 (the fused block's channel tile); 40 (d_inner 80) is the unfused path's
# alone.
BLOCK_GRID = [
    (1, 1, 32, 16, 4),
    (3, 7, 96, 8, 2),
    (2, 130, 32, 64, 3),
    (1, 1000, 40, 16, 4),
    (1, 2049, 32, 16, 4),   # one sequence: the L split
]


def _block_runs(args, impls):
    k, m = (int(v) for v in args.shard.split("/"))
    index = -1
    for gi, (batch, L, Dm, N, W) in enumerate(BLOCK_GRID):
        for mi, (mode, (dt, prec)) in enumerate(MODES.items()):
            if args.quick and (gi + mi) % 3:
                continue
            if args.rest and not (gi + mi) % 3:
                continue
            for impl in impls:
                if impl == "fused" and (2 * Dm) % 64:
                    continue
                index += 1
                if index % m == k:
                    yield impl, mode, dt, prec, batch, L, Dm, N, W, 1000 * gi + 10 * mi + 7


def _block_case(impl, dt, batch, L, Dm, N, W, seed):
    """The block forward + backward on `impl`, then three decode steps on the decode kernels; (rel err of
    out against float64, ok)."""
    from selscan_fused.block_reference import mamba_block_ref, mamba_step_ref
    from selscan_fused.decode import mamba_block_step
    torch.manual_seed(seed)
    block = selscan_fused.Mamba(Dm, d_state=N, d_conv=W, impl=impl, device="cuda")
    with torch.no_grad():
        for p in block.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    w = [None if t is None else t.detach() for t in block.weights()]
    low = {0, 1, 4, 5, 9, 10}  # the products' weights and biases: in the dtype, as the CUDA paths use them
    w = [None if t is None else (t.to(dt) if i in low else t) for i, t in enumerate(w)]
    x = torch.randn(batch, L, Dm, device="cuda").to(dt)
    h0 = torch.randn(batch, block.d_inner, N, device="cuda") * 0.5
    c0 = torch.randn(batch, block.d_inner, W - 1, device="cuda").to(dt)
    leaves = [x.clone().requires_grad_(True)] + [None if t is None else t.clone().requires_grad_(True) for t in w]
    out, hT, cT = selscan_fused.mamba_block(*leaves, h0=h0, conv_state=c0, return_final_state=True, impl=impl)
    scale = 2.0 ** -6 if dt == torch.float16 else 1.0
    (out.float().sum() * scale + hT.sum() * scale).backward()
    ok = all(bool(torch.isfinite(t.grad).all()) for t in leaves if t is not None)
    w64 = [None if t is None else t.double() for t in w]
    out64, _, _ = mamba_block_ref(x.double(), *w64, h0.double(), c0.double())
    err = rel_l2(out.detach(), out64)
    # decode: three steps from the final states, the kernel path (with the fused norm's op beside it)
    cs, ss = cT.detach().clone(), hT.detach().clone()
    cs64, ss64 = cs.double(), ss.double()
    for _ in range(3):
        xt = torch.randn(batch, Dm, device="cuda").to(dt)
        o = mamba_block_step(xt, cs, ss, *w, impl="kernel")
        o64, cs64, ss64 = mamba_step_ref(xt.double(), cs64, ss64, *w64)
        err = max(err, rel_l2(o, o64))
    from selscan_fused.model import RMSNorm, add_norm
    norm = RMSNorm(Dm, device="cuda", dtype=dt)
    n1, _ = add_norm(norm, x[:, 0], None, True, fused=True)
    n2, _ = add_norm(norm, x[:, 0], None, True, fused=False)
    ok = ok and bool(torch.isfinite(n1).all()) and rel_l2(n1, n2) < 1e-2
    return err, ok


BLOCK_TOLERANCE = dict(TOLERANCE, **{"float32-high": 3e-3})  # tests/test_block.py's bounds

# Packed sequences on the unfused path (the scan and conv kernels' packed policies), forward + backward:
# sequences shorter than the conv window, starts on and inside the 64-token chunks.
PACKED_LENGTHS = [1, 70, 2, 64, 300, 5]


def _packed_case(dt, seed):
    """The packed layer and block (impl='unfused') against their references, sequence by sequence; (worst rel
    err against float64, ok: every gradient finite)."""
    from selscan_fused.block_reference import mamba_block_ref
    torch.manual_seed(seed)
    cu = torch.tensor([0] + torch.tensor(PACKED_LENGTHS).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    T, S = sum(PACKED_LENGTHS), len(PACKED_LENGTHS)
    inp = make_inputs(1, T, 64, 16, dtype=dt, device="cuda")
    h0 = torch.randn(S, 64, 16, device="cuda")
    leaves = {k: v.clone().requires_grad_(True) for k, v in inp.items() if v is not None}
    y, h = selscan_fused.selective_scan(leaves["x"], leaves["A_log"], leaves["W_delta"], leaves["b_delta"],
                                        leaves["W_B"], leaves["W_C"], leaves["D"], h0=h0, cu_seqlens=cu,
                                        impl="unfused", return_final_state=True)
    (y.float().sum() + h.sum()).backward()
    ok = all(bool(torch.isfinite(t.grad).all()) for t in leaves.values())
    ref = selscan_fused.selective_scan(*(inp[k].double() for k in ("x", "A_log", "W_delta", "b_delta", "W_B", "W_C",
                                                                   "D")), h0=h0.double(), cu_seqlens=cu,
                                       impl="reference")
    err = rel_l2(y.detach(), ref)
    if selscan_fused._extension.fused_packed_available():  # the fused kernel's packed streams
        for t in leaves.values():
            t.grad = None
        yf, hf = selscan_fused.selective_scan(leaves["x"], leaves["A_log"], leaves["W_delta"], leaves["b_delta"],
                                              leaves["W_B"], leaves["W_C"], leaves["D"], h0=h0, cu_seqlens=cu,
                                              impl="fused", return_final_state=True)
        (yf.float().sum() + hf.sum()).backward()
        ok = ok and all(bool(torch.isfinite(t.grad).all()) for t in leaves.values())
        err = max(err, rel_l2(yf.detach(), ref))
    block = selscan_fused.Mamba(32, d_state=16, impl="unfused", device="cuda")
    w = [None if t is None else t.detach() for t in block.weights()]
    low = {0, 1, 4, 5, 9, 10}
    w = [None if t is None else (t.to(dt) if i in low else t).requires_grad_(True) for i, t in enumerate(w)]
    xb = torch.randn(1, T, 32, device="cuda").to(dt).requires_grad_(True)
    out = selscan_fused.mamba_block(xb, *w, cu_seqlens=cu, impl="unfused")
    out.float().sum().backward()
    ok = ok and bool(torch.isfinite(xb.grad).all()) and all(bool(torch.isfinite(t.grad).all()) for t in w
                                                              if t is not None)
    w64 = [None if t is None else t.detach().double() for t in w]
    pieces, a = [], 0
    for n in PACKED_LENGTHS:
        if n:
            pieces.append(mamba_block_ref(xb.detach()[:, a:a + n].double(), *w64)[0])
        a += n
    err = max(err, rel_l2(out.detach(), torch.cat(pieces, 1)))
    return err, ok


def _block_ops_without_cublas(dt, batch, L, Dm, N, W, seed, fused, ops=None, device="cuda"):
    """--initcheck: the block's kernels through its ops, on tensors no cuBLAS product wrote: in_proj's
    output drawn at random, x_proj's and dt_proj's products formed by elementwise products and sums. The
    conv kernel, the gated scan kernel, the backward scan kernel with the gate's derivative and the conv's
    backward kernel (the unfused block); the fused block's kernels (block_xproj and the fused kernel, when
    `fused`) and the backward scan kernel on their checkpoints; the decode step's kernels (decode_mid,
    add_rmsnorm); the packed conv and scan kernels, forward and backward. Returns (worst rel err of a
    gated y against float64, ok: every output finite and each decode / norm output within its bound).
    `ops` and `device` stand in for torch.ops.selscan_fused and the GPU in tests/test_sanitize_cases.py."""
    from selscan_fused.block_reference import mamba_block_ref, mamba_step_ref
    from selscan_fused.model import RMSNorm
    ops = torch.ops.selscan_fused if ops is None else ops
    g = torch.Generator(device=device).manual_seed(seed)
    d_inner, R = 2 * Dm, max(1, -(-Dm // 16))

    def rnd(*shape, scale=1.0, dtype=torch.float32):
        return (torch.randn(*shape, device=device, generator=g) * scale).to(dtype)

    def mm(a, w):  # a @ w.T without cuBLAS: an elementwise product and a sum, rounded to a's dtype
        return (a.float().unsqueeze(-2) * w.float()).sum(-1).to(a.dtype)

    xz = rnd(batch, L, 2 * d_inner, dtype=dt)
    cw, cb = rnd(d_inner, W, scale=0.5), rnd(d_inner, scale=0.1)
    cs = rnd(batch, d_inner, W - 1, dtype=dt)
    wx = rnd(R + 2 * N, d_inner, scale=d_inner ** -0.5, dtype=dt)
    dt_w = rnd(d_inner, R, scale=R ** -0.5, dtype=dt)
    A_log = torch.log(torch.arange(1, N + 1, device=device, dtype=torch.float32)).repeat(d_inner, 1)
    dt_bias, D = rnd(d_inner, scale=0.5) - 3.0, rnd(d_inner)
    h0 = rnd(batch, d_inner, N, scale=0.5)
    xi, z = xz[..., :d_inner], xz[..., d_inner:]
    ok = True

    def c64(t):
        return t.detach().double().cpu()

    def finite(*ts):
        return all(bool(torch.isfinite(t).all()) for t in ts if t is not None and t.numel())

    # The float64 references of what lies between in_proj and out_proj: the block's, with both products the
    # identity (exact in float64), on the CPU (no launch for the tool to slow down).
    eye_in, eye_out = torch.eye(2 * d_inner, dtype=torch.float64), torch.eye(d_inner, dtype=torch.float64)
    small64 = [c64(t) for t in (cw, cb, wx, dt_w, dt_bias, A_log, D)]

    with torch.no_grad():
        y64, _, _ = mamba_block_ref(c64(xz), eye_in, None, *small64, eye_out, None, c64(h0), c64(cs))
        # the unfused block: the conv kernel, the gated scan, its backward, the conv's backward
        u, conv_T = ops.causal_conv1d_fwd(xi, cw, cb, cs.float(), True, True)
        xdbl = mm(u, wx)
        delta, bc = mm(xdbl[..., :R], dt_w), xdbl[..., R:]
        y, h, ckpt = ops.gated_scan_fwd(delta, bc, u, z, A_log, dt_bias, D, h0, True, True, 0)
        dy, dhT = rnd(*y.shape, dtype=dt), rnd(*h.shape)
        grads = ops.scan_bwd(delta, bc, u, A_log, dt_bias, D, h0, dy, dhT, ckpt, 0, gate_z=z)
        cgrads = ops.causal_conv1d_bwd(xi, cw, cb, cs.float(), grads[1], None, True)
        ok = ok and finite(y, h, conv_T, *grads, *cgrads)
        err = rel_l2(y.cpu(), y64)
        if fused:  # block_xproj and the fused kernel, then the backward scan on the fused forward's checkpoints
            yf, hf, ckf, xdf = ops.fused_block_fwd(xz, cw, cb, cs.float(), wx, None, dt_w, A_log, dt_bias, D, h0,
                                                    True, True, 0)
            gf = ops.scan_bwd(mm(xdf[..., :R], dt_w), xdf[..., R:], u, A_log, dt_bias, D, h0, dy, dhT, ckf, 0,
                              gate_z=z)
            ok = ok and finite(yf, hf, xdf, *gf)
            err = max(err, rel_l2(yf.cpu(), y64))
        # the decode step's kernels on one token from the final states, against float64
        cst, sst = conv_T.to(dt).contiguous(), h.clone()
        cst2, sst2 = cst.clone(), sst.clone()
        xz1 = rnd(batch, 2 * d_inner, dtype=dt)
        y1_64, _, _ = mamba_step_ref(c64(xz1), c64(cst), c64(sst), eye_in, None, *small64, eye_out, None)
        y1 = ops.decode_mid(xz1, cst, sst, cw, cb, wx, dt_w, dt_bias, A_log, D)
        ok = ok and finite(y1, cst, sst) and rel_l2(y1.cpu(), y1_64) < BLOCK_TOLERANCE["bfloat16"]
        # the same step in two kernels (the one-launch form's ablation): bitwise the same
        y2 = ops.decode_mid(xz1, cst2, sst2, cw, cb, wx, dt_w, dt_bias, A_log, D, launches=2)
        ok = ok and torch.equal(y1, y2) and torch.equal(cst, cst2) and torch.equal(sst, sst2)
        hid, nw = rnd(batch, Dm, dtype=dt), rnd(Dm, dtype=dt)
        n1, r1 = ops.add_rmsnorm(hid, None, nw, 1e-5, True)
        norm64 = RMSNorm(Dm, eps=1e-5, dtype=torch.float64)
        norm64.weight.copy_(c64(nw))
        n64 = norm64(c64(hid))
        ok = ok and finite(n1, r1) and rel_l2(n1.cpu(), n64) < 1e-2
        # packed: the conv and the gated scan over sequences that restart inside and on the chunks
        cu = torch.tensor([0] + torch.tensor(PACKED_LENGTHS).cumsum(0).tolist(), dtype=torch.int32, device=device)
        T, S = sum(PACKED_LENGTHS), len(PACKED_LENGTHS)
        pxi, pz = rnd(1, T, d_inner, dtype=dt), rnd(1, T, d_inner, dtype=dt)
        pcs, ph0 = rnd(S, d_inner, W - 1), rnd(S, d_inner, N, scale=0.5)
        pu, pcT = ops.causal_conv1d_packed_fwd(pxi, cw, cb, pcs, cu, True, True)
        pxd = mm(pu, wx)
        pdl, pbc = mm(pxd[..., :R], dt_w), pxd[..., R:]
        py, ph, pck = ops.scan_fwd_packed(pdl, pbc, pu, pz, A_log, dt_bias, D, ph0, cu, True, True)
        pdy, pdhT = rnd(1, T, d_inner, dtype=dt), rnd(S, d_inner, N)
        pg = ops.scan_bwd_packed(pdl, pbc, pu, A_log, dt_bias, D, ph0, pdy, pdhT, pck, cu, gate_z=pz)
        pcg = ops.causal_conv1d_packed_bwd(pxi, cw, cb, pcs, pg[1], None, cu, True)
        ok = ok and finite(pu, pcT, py, ph, *pg, *pcg)
    return err, ok


def _runs(args, impls):
    """(impl, mode, dtype, precision, batch, L, D, N, config, grid index) of every run the arguments select."""
    k, m = (int(v) for v in args.shard.split("/"))
    index = -1
    for gi, (batch, L, Dm, N, cfg) in enumerate(GRID):
        if args.with_key and args.with_key not in cfg:
            continue
        for mi, (mode, (dt, prec)) in enumerate(MODES.items()):
            if args.quick and (gi + mi) % 3:
                continue
            if args.rest and not (gi + mi) % 3:
                continue
            for impl in impls:
                if impl == "unfused" and "channel_tile" in cfg:
                    continue
                if cfg.get("channel_tile") == 16 and dt == torch.float32:
                    continue
                if "fused_backward" in cfg and (impl == "unfused" or dt == torch.float32):
                    continue  # the fused backward kernel: impl='fused', bfloat16/float16 (N = 16)
                index += 1
                if index % m == k:
                    yield impl, mode, dt, prec, batch, L, Dm, N, cfg, 1000 * gi + 10 * mi, bool(gi % 2)


def _through_the_api(inp, impl, cfg, dt):
    """([y], ok): forward + backward through selective_scan; ok when the no-grad call gives the same y and
    every gradient is finite."""
    leaves = {name: v.clone().requires_grad_(True) for name, v in inp.items() if v is not None}
    a = dict(inp, **leaves)
    y, h = selscan_fused.selective_scan(a["x"], a["A_log"], a["W_delta"], a["b_delta"], a["W_B"], a["W_C"], a["D"],
                                        h0=a["h0"], return_final_state=True, impl=impl, config=ScanConfig(**cfg))
    scale = 2.0 ** -6 if dt == torch.float16 else 1.0
    (y.float().sum() * scale + h.sum() * scale).backward()
    with torch.no_grad():
        y2 = selscan_fused.selective_scan(inp["x"], inp["A_log"], inp["W_delta"], inp["b_delta"], inp["W_B"],
                                          inp["W_C"], inp["D"], h0=inp["h0"], impl=impl, config=ScanConfig(**cfg))
    same = torch.equal(y.detach(), y2)
    return [y2], same and all(bool(torch.isfinite(t.grad).all()) for t in leaves.values())


def _ops_without_cublas(inp, cfg):
    """--initcheck: the scan kernel, the fused kernel and the backward kernel, none reading a cuBLAS output;
    (their two y, whether every gradient is finite)."""
    ops = torch.ops.selscan_fused
    x, h0 = inp["x"], inp["h0"]
    W = torch.cat([inp["W_delta"], inp["W_B"], inp["W_C"]])
    with torch.no_grad():
        proj = (x.float().unsqueeze(-2) * W.float()).sum(-1).to(x.dtype)  # (batch, L, D + 2N), reductions only
        seg, tile = cfg.get("l_segments", 0), cfg.get("channel_tile", 0)
        y_scan, h = ops.scan_fwd(proj, x, inp["A_log"], inp["b_delta"], inp["D"], h0, True, seg)
        y_fused, _, ckpt = ops.fused_fwd_res(x, inp["A_log"], inp["W_delta"], inp["b_delta"], inp["W_B"],
                                             inp["W_C"], inp["D"], h0, seg, False, 0, tile)
        dy, dhT = torch.randn_like(y_scan), torch.randn_like(h)
        grads = ops.unfused_bwd(x, inp["A_log"], inp["W_delta"], inp["b_delta"], inp["W_B"], inp["W_C"], inp["D"],
                                h0, dy, dhT, proj, ckpt, seg)
        if cfg.get("fused_backward") == "kernel":  # the fused backward kernel (it reads the caller's tensors)
            grads = grads + ops.fused_bwd(x, inp["A_log"], inp["W_delta"], inp["b_delta"], inp["W_B"], inp["W_C"],
                                          inp["D"], h0, dy, dhT, ckpt, seg, 1)
    # Finiteness of the gradients the kernels' own partials give (dA_log, db_delta, dD, dh0 of each op:
    # torch sums of kernel outputs); dx and the dW are cuBLAS products, whose writes initcheck does not see.
    return [y_scan, y_fused], all(bool(torch.isfinite(g).all()) for i, g in enumerate(grads) if i % 8 in (1, 3, 6, 7))


def main():
    ap = argparse.ArgumentParser()
    third = ap.add_mutually_exclusive_group()
    third.add_argument("--quick", action="store_true")
    third.add_argument("--rest", action="store_true", help="the two thirds of the grid that --quick leaves out")
    ap.add_argument("--shard", default="0/1", help="K/M: only the runs whose index modulo M is K")
    ap.add_argument("--initcheck", action="store_true", help="the kernels through the ops without cuBLAS inputs")
    ap.add_argument("--only-block", action="store_true", help="the block's and the packed runs alone")
    ap.add_argument("--with", dest="with_key", default="",
                    help="only the grid entries whose config sets this key (e.g. fused_backward)")
    args = ap.parse_args()
    hopper = selscan_fused._extension.fused_extension_available() and torch.cuda.get_device_capability() == (9, 0)
    if args.initcheck and not hopper:
        sys.exit("--initcheck needs the fused kernel (an sm_90 GPU and the fused extension) for its checkpoints")
    impls = ["ops"] if args.initcheck else ["unfused"] + (["fused"] if hopper else [])
    runs, worst = 0, 0.0
    for impl, mode, dt, prec, batch, L, Dm, N, cfg, seed, with_h0 in ([] if args.only_block else _runs(args, impls)):
        torch.manual_seed(seed)
        torch.set_float32_matmul_precision(prec)
        inp = make_inputs(batch, L, Dm, N, dtype=dt, device="cuda", with_h0=with_h0)
        ys, ok = _ops_without_cublas(inp, cfg) if impl == "ops" else _through_the_api(inp, impl, cfg, dt)
        torch.cuda.synchronize()
        y64, _ = float64_eval(inp)
        err = max(rel_l2(y, y64) for y in ys)
        ok = ok and err < TOLERANCE[mode]
        print(f"{impl:8s} {mode:16s} {batch}x{L}x{Dm}x{N} {cfg}: rel err {err:.2e} {'ok' if ok else 'WRONG'}",
              flush=True)
        if not ok:
            sys.exit(f"wrong result: {impl} {mode} {batch}x{L}x{Dm}x{N} {cfg}")
        runs += 1
        worst = max(worst, err / TOLERANCE[mode])
    if not args.with_key:  # the block: through its API, or under initcheck through its ops (no cuBLAS product read)
        for impl, mode, dt, prec, batch, L, Dm, N, W, seed in _block_runs(args, impls):
            torch.set_float32_matmul_precision(prec)
            if impl == "ops":
                err, ok = _block_ops_without_cublas(dt, batch, L, Dm, N, W, seed, fused=(2 * Dm) % 64 == 0)
            else:
                err, ok = _block_case(impl, dt, batch, L, Dm, N, W, seed)
            torch.cuda.synchronize()
            ok = ok and err < BLOCK_TOLERANCE[mode]
            print(f"block {impl:8s} {mode:16s} {batch}x{L}x{Dm}x{N} d_conv {W}: rel err {err:.2e} "
                  f"{'ok' if ok else 'WRONG'}", flush=True)
            if not ok:
                sys.exit(f"wrong result: block {impl} {mode} {batch}x{L}x{Dm}x{N} d_conv {W}")
            runs += 1
            worst = max(worst, err / BLOCK_TOLERANCE[mode])
    if not args.initcheck and not args.with_key:  # packed sequences through the API (initcheck: in the ops above)
        for mi, (mode, (dt, prec)) in enumerate(MODES.items()):  # packed sequences, the unfused path
            if (args.quick and mi % 3) or (args.rest and not mi % 3) or int(args.shard.split("/")[0]) != 0:
                continue
            torch.set_float32_matmul_precision(prec)
            err, ok = _packed_case(dt, 5000 + mi)
            torch.cuda.synchronize()
            ok = ok and err < BLOCK_TOLERANCE[mode]
            print(f"packed unfused  {mode:16s} lengths {PACKED_LENGTHS}: rel err {err:.2e} {'ok' if ok else 'WRONG'}",
                  flush=True)
            if not ok:
                sys.exit(f"wrong result: packed unfused {mode}")
            runs += 1
            worst = max(worst, err / BLOCK_TOLERANCE[mode])
    torch.set_float32_matmul_precision("highest")
    print(f"{runs} forward+backward runs, all within bounds (worst {worst:.2f} of the bound)")


if __name__ == "__main__":
    main()
