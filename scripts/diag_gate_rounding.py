"""How far float16 storage alone moves the block's gradients, the gate's backward in two forms.

A float64 emulation (CPU) of the unfused float16 block at tests/test_block.py's shape 3 x 7 x 64, N 8,
d_conv 2 (bias): float64 arithmetic with a float16 rounding wherever the CUDA path stores a float16
tensor (in_proj's output, u, x_proj's output, delta_pre, the gated y, out_proj's output, and each of
their gradients), the weights rounded as the test rounds them. The gate's backward either as the
separate gate kernel had it ("old": dy * silu(z) and y before the gate rounded to float16) or as the
backward scan kernel has it since 2026-12-06 ("new": both kept in float32). Prints, over SEEDS random
blocks (the test's initialisation), the distribution of the relative L2 error of dt_proj's weight
gradient (and its bias's) against the unrounded float64 block: what the float16 bound of the test has
to cover, and whether the gate's form moves it. The library products' own arithmetic (cuBLAS's
reduction orders, its reduced-precision float16 reductions) is not emulated.

    python scripts/diag_gate_rounding.py [SEEDS] [FIRST_SEED]
"""
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from selscan_fused import Mamba  # noqa: E402
from selscan_fused.conv import causal_conv1d_ref  # noqa: E402
from selscan_fused.reference import scan_ref  # noqa: E402

F64 = torch.float64


def h16(t):
    return t.half().to(F64)


class Stored16(torch.autograd.Function):
    """A tensor the CUDA path stores in float16: the value and its gradient rounded."""

    @staticmethod
    def forward(ctx, x):
        return h16(x)

    @staticmethod
    def backward(ctx, g):
        return h16(g)


class Gate(torch.autograd.Function):
    """y * silu(z) with the backward's roundings of the old separate kernel or the backward scan's."""

    @staticmethod
    def forward(ctx, yu, z, old):
        ctx.save_for_backward(yu, z)
        ctx.old = old
        return yu * F.silu(z)

    @staticmethod
    def backward(ctx, g):
        yu, z = ctx.saved_tensors
        s = torch.sigmoid(z)
        if ctx.old:
            return h16(g * z * s), h16(g * h16(yu) * s * (1 + z * (1 - s))), None
        return g * z * s, h16(g * yu * s * (1 + z * (1 - s))), None


def block(x, p, mode, N):
    st = Stored16.apply if mode != "exact" else (lambda t: t)
    di, R = p["A_log"].shape[0], p["dt_w"].shape[1]
    xz = st(F.linear(x, p["in_w"], p["in_b"]))
    xi, z = xz[..., :di], xz[..., di:]
    u = st(causal_conv1d_ref(xi, p["cw"], p["cb"], None, activation=True, compute_dtype=F64)[0])
    xdbl = st(F.linear(u, p["x_w"]))
    dt_low, B, C = xdbl[..., :R], xdbl[..., R:R + N], xdbl[..., R + N:]
    delta = F.softplus(st(F.linear(dt_low, p["dt_w"])) + p["dt_b"])
    yu = scan_ref(u, delta, p["A_log"], B, C, p["D"])[0]
    y = yu * F.silu(z) if mode == "exact" else Gate.apply(yu, z, mode == "old")
    return st(F.linear(st(y), p["out_w"], p["out_b"]))


def case(seed, batch=3, L=7, d_model=64, N=8, W=2):
    from test_block import randomize
    torch.manual_seed(seed)
    m = randomize(Mamba(d_model, d_state=N, d_conv=W, bias=True, conv_bias=False, impl="reference"))
    g = lambda t: t.detach().to(F64)
    di = m.d_inner
    p = dict(in_w=h16(g(m.in_proj.weight)), in_b=h16(g(m.in_proj.bias)), cw=g(m.conv1d.weight).reshape(di, -1),
             cb=None, x_w=h16(g(m.x_proj.weight)), dt_w=h16(g(m.dt_proj.weight)), dt_b=g(m.dt_proj.bias),
             A_log=g(m.A_log), D=g(m.D), out_w=h16(g(m.out_proj.weight)), out_b=h16(g(m.out_proj.bias)))
    x, dy = h16(torch.randn(batch, L, d_model, dtype=F64)), h16(torch.randn(batch, L, d_model, dtype=F64))
    grads = {}
    for mode in ("exact", "old", "new"):
        q = {k: None if v is None else v.clone().requires_grad_(True) for k, v in p.items()}
        (block(x, q, mode, N) * dy).sum().backward()
        grads[mode] = (q["dt_w"].grad, q["dt_b"].grad)
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()
    return {mode: [rel(a, b) for a, b in zip(grads[mode], grads["exact"])] for mode in ("old", "new")}


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    first = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    rows = [case(first + i) for i in range(n)]
    for mode in ("old", "new"):
        for j, name in enumerate(("dt_proj.weight", "dt_proj.bias")):
            e = torch.tensor([r[mode][j] for r in rows])
            print(f"{mode}: {name:15s} rel err median {e.median():.2e}, p90 {e.quantile(0.9):.2e}, max {e.max():.2e}, "
                  f"above 3e-3 in {(e > 3e-3).sum().item()} of {n}")


if __name__ == "__main__":
    main()
