"""Per-token error of the backward scan kernel against float64, for one shape (GPU).

Runs the unfused forward (which keeps [delta_pre | B | C] and the checkpoints), then the backward scan
kernel alone (torch.ops.selscan_fused.scan_bwd) under several L splits, and compares its per-token
outputs (d delta_pre, dB, dC, the scan's part of dx) with float64 autograd of the reference recurrence
on the same projections. Prints, for each split: every output's relative L2 error, the tokens whose
error is largest (with their chunk and segment), bitwise agreement between repeated runs, and dW_B /
dW_delta formed from the kernel's outputs in float64 and by the library product, so that an error can
be placed in the kernel, in its 16-bit outputs or in the product.

    python scripts/diag_bwd_tokens.py --shape 1,4097,2048,16 --dtype bfloat16 --segments 0,1,2,4
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import selscan_fused  # noqa: F401,E402
from selscan_fused.reference import scan_ref  # noqa: E402
from conftest import rel_l2  # noqa: E402
from test_backward import NAMES, make_case  # noqa: E402

CKPT = 64


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="1,4097,2048,16")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--segments", default="0,1,2,4")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--no-ref", action="store_true", help="only the repeat and split comparisons")
    a = ap.parse_args()
    batch, L, Dm, N = map(int, a.shape.split(","))
    torch.manual_seed(a.seed)
    # the inputs of tests/test_backward.py's cases (make_case): b_delta past softplus's threshold on
    # every 7th channel, float16's loss scale
    inp, dy, dhT = make_case(batch, L, Dm, N, "float32-highest" if a.dtype == "float32" else a.dtype, True, True)
    x, A_log, W_delta, b_delta, W_B, W_C, D, h0 = (inp[k] for k in NAMES)
    print(f"device {torch.cuda.get_device_name()} shape {a.shape} {a.dtype} seed {a.seed}", flush=True)

    ops = torch.ops.selscan_fused
    y, hT, proj, ckpt = ops.unfused_fwd_res(x, A_log, W_delta, b_delta, W_B, W_C, D, h0, 0)
    _, _, _, ckpt1 = ops.unfused_fwd_res(x, A_log, W_delta, b_delta, W_B, W_C, D, h0, 1)
    print("forward plan (auto):", ops.scan_plan(x, N, 0), " checkpoints auto vs unsplit: rel",
          f"{rel_l2(ckpt, ckpt1):.2e}", "max abs", f"{(ckpt - ckpt1).abs().max().item():.2e}", flush=True)
    delta_pre, bc = proj[..., :Dm], proj[..., Dm:]

    ref = None
    if not a.no_ref:
        leaves = [t.detach().double().requires_grad_(True) for t in (delta_pre, proj[..., Dm:Dm + N],
                                                                      proj[..., Dm + N:], x)]
        dp64, B64, C64, x64 = leaves
        delta = F.softplus(dp64 + b_delta.double())
        yr, hr = scan_ref(x64, delta, A_log.double(), B64, C64, D.double(), h0.double())
        loss = (yr * dy.double()).sum() + (hr * dhT.double()).sum()
        loss.backward()
        ref = dict(dz=dp64.grad, dB=B64.grad, dC=C64.grad, dx=x64.grad)
        print("reference done", flush=True)

    results = {}
    for seg in [int(s) for s in a.segments.split(",")]:
        runs = [ops.scan_bwd(delta_pre, bc, x, A_log, b_delta, D, h0, dy, dhT, ckpt, seg) for _ in range(a.repeats)]
        torch.cuda.synchronize()
        same = all(torch.equal(r0, r1) for r in runs[1:] for r0, r1 in zip(runs[0], r))
        dP, dx = runs[0][0], runs[0][1]
        got = dict(dz=dP[..., :Dm], dB=dP[..., Dm:Dm + N], dC=dP[..., Dm + N:], dx=dx)
        results[seg] = got
        print(f"\n== l_segments={seg}: {a.repeats} runs bitwise equal: {same}", flush=True)
        if not same:
            for i, r in enumerate(runs[1:], 1):
                for name, r0, r1 in zip(("dP", "dx", "dA_log", "db", "dD", "dh0"), runs[0], r):
                    if not torch.equal(r0, r1):
                        diff = (r0.double() - r1.double()).abs()
                        idx = (diff.reshape(batch * L, -1).amax(1) > 0).nonzero().flatten().tolist() \
                            if r0.dim() == 3 and r0.shape[1] == L else []
                        print(f"   run {i} {name} differs: max {diff.max().item():.3e} rows {idx[:40]}")
        if ref is None:
            continue
        for k in ("dz", "dB", "dC", "dx"):
            g, r = got[k].double(), ref[k]
            e = (g - r).reshape(batch * L, -1)
            rn = r.reshape(batch * L, -1)
            tok_err = e.norm(dim=1)
            scale_t = rn.norm(dim=1).mean().clamp_min(1e-300)
            print(f"  {k}: rel L2 {rel_l2(g, r):.3e}; per-token error / mean token norm: median "
                  f"{(tok_err / scale_t).median().item():.2e} max {(tok_err / scale_t).max().item():.2e}")
            top = torch.topk(tok_err / scale_t, min(a.top, batch * L))
            rows = [(int(i) // L, int(i) % L) for i in top.indices]
            desc = ", ".join(f"t={t}(b{b},chunk {t // CKPT},+{t % CKPT}):{v:.2e}" for (b, t), v in
                             zip(rows, top.values.tolist()))
            print(f"     worst tokens: {desc}")
        x2 = x.reshape(batch * L, Dm)
        for k, name in (("dB", "dW_B"), ("dz", "dW_delta")):
            g2 = got[k].reshape(batch * L, -1)
            r64 = ref[k].reshape(batch * L, -1).T @ x2.double()
            f64 = g2.double().T @ x2.double()
            lib = torch.mm(g2.t(), x2)
            print(f"  {name}: kernel's outputs in float64 {rel_l2(f64, r64):.3e}; library product {rel_l2(lib, r64):.3e};"
                  f" library vs float64 product of the same values {rel_l2(lib, f64):.3e}")
    segs = list(results)
    for s in segs[1:]:
        print(f"\n  split {s} vs {segs[0]}: " + ", ".join(f"{k} {rel_l2(results[s][k], results[segs[0]][k]):.2e}"
                                                      for k in results[s]))


if __name__ == "__main__":
    main()
