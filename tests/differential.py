"""Randomized differential testing of the CUDA paths against the float64 evaluation (docs/reliability.md).

A case is drawn from (seed, index) alone, so that a failure is replayed by its one-line reproducer:

    python scripts/differential.py --seed SEED --only INDEX

Each case: a path ('unfused' or 'fused') and a dtype / float32 matmul precision; batch, L, D, N within
the path's envelope (L from 1 to 4097, log-uniform, batch 1 with long L so that the L split runs);
with or without h0; and parameter scales far from the initialisation: A_log from -8 to 4 (decays from
exactly 1 to exactly 0 in float32), x from 1e-3 to 1e3, the delta projection scaled and biased so that
softplus arguments run past -20 and +20 and delta spans about 1e-4 to 1e2 (float16 cases stay inside its
range: x up to 3, delta up to about 5). A third of the cases run the backward too, against float64 autograd.

Block cases (paths 'block-unfused' and 'block-fused', or 'block-reference' for the harness's own tests):
the Mamba-1 block (selscan_fused.mamba_block) with d_model a multiple of 8 (of 32 for the fused block:
d_inner a multiple of its channel tile), expand 2, N 8-64, d_conv 2-4, dt_rank from 1 to
ceil(d_model / 16) + 8, with or without h0 and conv_state, the same decay and delta-bias ranges, x from
1e-2 to 1e2; judged the same way on out, both final states and every gradient, against
block_reference.mamba_block_ref in float64 and float32 and, for bfloat16/float16, against the float32
evaluation of the unfused block's design (each product's output, the conv's output and y rounded to the
dtype where the path's kernels and library products write theirs).

The bound. Far from the initialisation the problem itself can be ill-conditioned (a softplus argument
that cancels, a decay raised to thousands of tokens), so the float32 evaluation of the same formulas
in plain PyTorch (selscan_fused.reference in float32, the same matmul precision) is run beside the path:
a path passes when its relative L2 error against float64 is within docs/math.md's bound for its mode,
or within 4x the float32 evaluation's own error, or within 3x the error of the float64 values rounded
to the output's dtype (float16 gradients in the subnormal range), whichever is largest. Non-finite
values must be where the float64 evaluation, rounded to the output's dtype, has them, and nowhere else.
"""
from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass

import torch

import selscan_fused
import torch.nn.functional as F

from selscan_fused.block_reference import mamba_block_ref
from selscan_fused.conv import causal_conv1d_ref
from selscan_fused.reference import scan_ref, selective_scan_ref
from selscan_fused.api import FUSED_DIM_MULTIPLE, UNFUSED_DIM_MULTIPLE

TOLERANCE = {"float32-highest": 1e-5, "float32-high": 1e-3, "bfloat16": 1e-2, "float16": 3e-3}
DTYPE = {"float32-highest": torch.float32, "float32-high": torch.float32, "bfloat16": torch.bfloat16,
         "float16": torch.float16}
GRAD_NAMES = ("x", "A_log", "W_delta", "b_delta", "W_B", "W_C", "D", "h0")


@dataclass
class Case:
    seed: int
    index: int
    impl: str
    mode: str
    batch: int
    L: int
    Dm: int
    N: int
    with_h0: bool
    a_log_lo: float
    a_log_hi: float
    x_scale: float
    z_scale: float     # std of the delta projection's product part (softplus argument minus bias)
    b_lo: float        # delta bias range (softplus argument offsets)
    b_hi: float
    backward: bool
    # block cases only (impl 'block-...'): Dm is d_model; d_inner = 2 Dm; with_h0 also gives a conv state
    d_conv: int = 0
    dt_rank: int = 0
    biases: bool = False   # in_proj / out_proj biases (mamba-ssm's bias=True); the conv's bias otherwise
    # packed sequences (cu_seqlens; the unfused paths): the sequences' lengths, batch 1, L their sum; h0
    # (and the block's conv state) one per sequence
    lengths: tuple = ()

    def line(self) -> str:
        return " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in asdict(self).items())


def make_case(seed: int, index: int, impls=("unfused", "fused")) -> Case:
    r = random.Random(f"{seed}:{index}")
    impl = r.choice(impls)
    if impl.startswith("block-"):
        return _make_block_case(r, seed, index, impl)
    mode = r.choice(list(TOLERANCE))
    N = r.choice([8, 16, 32, 64])
    if impl == "fused":
        Dm = 64 * r.choice([1, 1, 2, 3, 4, 8, 16, 32])
    else:
        Dm = 8 * r.choice([1, 2, 5, 8, 16, 33, 64, 128, 256])
    L = max(1, int(round(math.exp(r.uniform(0.0, math.log(4097))))))
    if r.random() < 0.15:
        L = r.choice([1, 7, 1000, 4097])
    batch = r.choice([1, 1, 2, 3]) if L > 1500 else r.choice([1, 2, 3, 5])
    while batch * L * Dm > 3_000_000 and Dm > 64:  # keeps the float64 evaluation quick
        Dm //= 2
    # halving can leave the path's multiple (8 * 33 -> 132): back onto it
    mult = FUSED_DIM_MULTIPLE if impl == "fused" else UNFUSED_DIM_MULTIPLE
    Dm = max(mult, Dm - Dm % mult)
    lo, hi = sorted((r.uniform(-8.0, 4.0), r.uniform(-8.0, 4.0)))
    x_scale = 10 ** r.uniform(-3.0, 3.0)
    z_scale = 10 ** r.uniform(-2.0, 1.5)
    b_lo, b_hi = sorted((r.uniform(-25.0, 25.0), r.uniform(-25.0, 100.0)))
    if mode == "float16":  # y, the products and the gradients mostly inside float16's range
        x_scale = min(x_scale, 3.0)
        b_hi = min(b_hi, 5.0)
        b_lo = min(b_lo, b_hi)
    c = Case(seed, index, impl, mode, batch, L, Dm, N, r.random() < 0.5, lo, hi, x_scale, z_scale, b_lo, b_hi,
             r.random() < 1 / 3)
    return _maybe_packed(r, c)


def _maybe_packed(r: random.Random, c: Case) -> Case:
    """One unfused case in five packs sequences of different lengths (drawn last, so that the other draws
    of a (seed, index) are those of before): 1-8 sequences of 1 to ~2000 tokens (log-uniform), starts on
    and off the kernels' 64-token chunks, batch 1."""
    if c.impl not in ("unfused", "block-unfused") or r.random() >= 0.2:
        return c
    S = r.randint(1, 8)
    lengths = tuple(max(1, int(round(math.exp(r.uniform(0.0, math.log(2000)))))) for _ in range(S))
    while (sum(lengths) > 4097 or sum(lengths) * c.Dm * (2 if c.impl.startswith("block-") else 1) > 3_000_000) \
            and max(lengths) > 1:
        lengths = tuple(max(1, n // 2) for n in lengths)
    c.lengths, c.batch, c.L = lengths, 1, sum(lengths)
    return c


def _make_block_case(r: random.Random, seed: int, index: int, impl: str) -> Case:
    mode = r.choice(list(TOLERANCE))
    N = r.choice([8, 16, 16, 32, 64])
    # d_model: a multiple of 8 (d_inner of UNFUSED_DIM_MULTIPLE), of 32 for the fused block (d_inner of 64)
    mult = FUSED_DIM_MULTIPLE // 2 if impl == "block-fused" else UNFUSED_DIM_MULTIPLE
    Dm = mult * r.choice([1, 2, 3, 6, 12, 24, 48, 96]) // (1 if mult == 8 else 4) or mult
    Dm = max(mult, Dm - Dm % mult)
    L = max(1, int(round(math.exp(r.uniform(0.0, math.log(4097))))))
    if r.random() < 0.15:
        L = r.choice([1, 7, 1000, 4097])
    batch = r.choice([1, 1, 2, 3]) if L > 1500 else r.choice([1, 2, 3, 5])
    while batch * L * 2 * Dm > 3_000_000 and Dm > mult:  # keeps the float64 evaluation quick
        Dm = max(mult, Dm // 2 - (Dm // 2) % mult)
    lo, hi = sorted((r.uniform(-8.0, 4.0), r.uniform(-8.0, 4.0)))
    x_scale = 10 ** r.uniform(-2.0, 2.0)
    z_scale = 10 ** r.uniform(-2.0, 1.0)
    b_lo, b_hi = sorted((r.uniform(-25.0, 25.0), r.uniform(-25.0, 60.0)))
    if mode == "float16":
        x_scale = min(x_scale, 3.0)
        b_hi = min(b_hi, 5.0)
        b_lo = min(b_lo, b_hi)
    c = Case(seed, index, impl, mode, batch, L, Dm, N, r.random() < 0.5, lo, hi, x_scale, z_scale, b_lo, b_hi,
             r.random() < 1 / 3, d_conv=r.choice([2, 3, 4, 4]), dt_rank=r.randint(1, math.ceil(Dm / 16) + 8),
             biases=r.random() < 0.25)
    return _maybe_packed(r, c)


BLOCK_NAMES = ("hidden_states", "in_proj_weight", "in_proj_bias", "conv_weight", "conv_bias", "x_proj_weight",
               "dt_proj_weight", "dt_proj_bias", "A_log", "D", "out_proj_weight", "out_proj_bias", "h0", "conv_state")
_BLOCK_PRODUCTS = ("in_proj_weight", "in_proj_bias", "x_proj_weight", "dt_proj_weight", "out_proj_weight",
                   "out_proj_bias")


def block_case_inputs(c: Case, device="cuda"):
    """mamba_block's arguments by name: the four products' weights (and biases) in the case's dtype, the
    conv's, A_log, the delta bias and D float32, hidden_states and conv_state in the dtype, h0 float32."""
    g = torch.Generator(device="cpu").manual_seed(c.seed * 1_000_003 + c.index)
    dt = DTYPE[c.mode]
    Dm, Di, N, R, W = c.Dm, 2 * c.Dm, c.N, c.dt_rank, c.d_conv

    def rnd(*shape):
        return torch.randn(*shape, generator=g)

    def uni(lo, hi, *shape):
        return lo + (hi - lo) * torch.rand(*shape, generator=g)

    inp = dict(
        hidden_states=(rnd(c.batch, c.L, Dm) * c.x_scale).to(dt),
        in_proj_weight=(rnd(2 * Di, Dm) * Dm ** -0.5).to(dt),
        in_proj_bias=(rnd(2 * Di) * 0.1).to(dt) if c.biases else None,
        conv_weight=rnd(Di, 1, W) * W ** -0.5,
        conv_bias=None if c.biases else rnd(Di) * 0.1,
        x_proj_weight=(rnd(R + 2 * N, Di) * Di ** -0.5).to(dt),
        dt_proj_weight=(rnd(Di, R) * (c.z_scale * R ** -0.5)).to(dt),
        dt_proj_bias=uni(c.b_lo, c.b_hi, Di),
        A_log=uni(c.a_log_lo, c.a_log_hi, Di, N),
        D=rnd(Di),
        out_proj_weight=(rnd(Dm, Di) * Di ** -0.5).to(dt),
        out_proj_bias=(rnd(Dm) * 0.1).to(dt) if c.biases else None,
        h0=rnd(len(c.lengths) or c.batch, Di, N) * c.x_scale if c.with_h0 else None,
        conv_state=(rnd(len(c.lengths) or c.batch, Di, W - 1) * c.x_scale).to(dt) if c.with_h0 else None,
    )
    return {k: (v.to(device) if v is not None else None) for k, v in inp.items()}


def _block_design(a, dt):
    """The float32 evaluation of the unfused block's design: the products in the dtype (their outputs
    rounded to it, as cuBLAS writes them), the conv's output rounded to it, the scan and the gate in
    float32, y rounded to it before out_proj."""
    Di, N = a["A_log"].shape
    R = a["dt_proj_weight"].shape[1]
    W = a["conv_weight"].shape[-1]
    f32 = torch.float32
    xz = F.linear(a["hidden_states"], a["in_proj_weight"], a["in_proj_bias"])
    xi, z = xz.split(Di, dim=-1)
    u, conv_T = causal_conv1d_ref(xi, a["conv_weight"].reshape(Di, W).float(),
                                  None if a["conv_bias"] is None else a["conv_bias"].float(),
                                  None if a["conv_state"] is None else a["conv_state"].float(), activation=True,
                                  compute_dtype=f32)
    xdbl = F.linear(u, a["x_proj_weight"])
    delta = F.softplus(F.linear(xdbl[..., :R], a["dt_proj_weight"]).float() + a["dt_proj_bias"].float())
    y, h = scan_ref(u.float(), delta, a["A_log"].float(), xdbl[..., R:R + N].float(), xdbl[..., R + N:].float(),
                    a["D"].float(), None if a["h0"] is None else a["h0"].float())
    y = y * F.silu(z.float())
    # A gated y within a few ulps of the dtype's largest value rounds to either side of the overflow in
    # a path whose float32 values differ in the last bits (the fused path keeps dt_proj's product in
    # float32): such a token's out is marked non-finite here, so that the judge takes either answer there.
    edge = near_overflow(y.detach(), dt, 4 * torch.finfo(dt).eps).any(-1, keepdim=True)
    out = F.linear(y.to(dt), a["out_proj_weight"], a["out_proj_bias"])
    if edge.any():
        out = out.masked_fill(edge, float("inf"))
    return out, h, conv_T


def _run_block_case(c: Case, device, path) -> list[str]:
    inp = block_case_inputs(c, device)
    dt = DTYPE[c.mode]
    fails = []
    leaves = [k for k, v in inp.items() if v is not None]
    need_grad = c.backward
    design = c.mode in ("bfloat16", "float16")
    evals = ("path", "f32", "f64") + (("design",) if design else ())
    copies = {which: {k: ((v.detach().double() if which == "f64" else v.detach().clone()).requires_grad_(need_grad)
                          if v is not None else None) for k, v in inp.items()} for which in evals}
    a = copies["path"]
    fn = path or selscan_fused.mamba_block
    packed = {"cu_seqlens": _cu(c, device)} if c.lengths else {}
    outs_path = fn(*[a[k] for k in BLOCK_NAMES[:12]], h0=a["h0"], conv_state=a["conv_state"],
                   return_final_state=True, impl=c.impl.removeprefix("block-"), **packed)
    seq = ("h0", "conv_state")
    outs = {"path": outs_path,
            "f32": _per_sequence(c, lambda f: mamba_block_ref(*[f[k] for k in BLOCK_NAMES[:12]], f["h0"],
                                                              f["conv_state"], compute_dtype=torch.float32),
                                 copies["f32"], seq, "hidden_states"),
            "f64": _per_sequence(c, lambda f: mamba_block_ref(*[f[k] for k in BLOCK_NAMES[:12]], f["h0"],
                                                              f["conv_state"]),
                                 copies["f64"], seq, "hidden_states")}
    if design:
        outs["design"] = _per_sequence(c, lambda f: _block_design(f, dt), copies["design"], seq, "hidden_states")
    bound = max(TOLERANCE[c.mode], 3e-3) if c.mode == "float32-high" else TOLERANCE[c.mode]
    for i, name in enumerate(("out", "final state", "conv state")):
        fails += _check(name, outs["path"][i], outs["f32"][i], outs["f64"][i], bound,
                        outs["design"][i] if design else None)
    if need_grad and not fails:
        g = torch.Generator(device="cpu").manual_seed(c.seed * 7 + c.index)
        s = 2.0 ** -6 if c.mode == "float16" else 1.0
        ups = [torch.randn(t.shape, generator=g).to(device) * s for t in outs["path"]]
        grads = {}
        for which in evals:
            loss = sum((o.double() * u.double()).sum() for o, u in zip(outs[which], ups))
            grads[which] = dict(zip(leaves, torch.autograd.grad(loss, [copies[which][k] for k in leaves])))
        for k in leaves:
            fails += _check(f"d{k}", grads["path"][k], grads["f32"][k], grads["f64"][k], bound,
                            grads["design"][k] if design else None)
    return fails


def case_inputs(c: Case, device="cuda"):
    g = torch.Generator(device="cpu").manual_seed(c.seed * 1_000_003 + c.index)
    dt = DTYPE[c.mode]

    def rnd(*shape):
        return torch.randn(*shape, generator=g)

    def uni(lo, hi, *shape):
        return lo + (hi - lo) * torch.rand(*shape, generator=g)

    x = rnd(c.batch, c.L, c.Dm) * c.x_scale
    W_delta = rnd(c.Dm, c.Dm) * (c.z_scale / (c.x_scale * math.sqrt(c.Dm)))
    inp = dict(
        x=x.to(dt),
        A_log=uni(c.a_log_lo, c.a_log_hi, c.Dm, c.N),
        W_delta=W_delta.to(dt),
        b_delta=uni(c.b_lo, c.b_hi, c.Dm),
        W_B=(rnd(c.N, c.Dm) * c.Dm ** -0.5).to(dt),
        W_C=(rnd(c.N, c.Dm) * c.Dm ** -0.5).to(dt),
        D=rnd(c.Dm),
        h0=rnd(len(c.lengths) or c.batch, c.Dm, c.N) * c.x_scale if c.with_h0 else None,
    )
    return {k: (v.to(device) if v is not None else None) for k, v in inp.items()}


def _per_sequence(c: Case, fn, inp: dict, seq_keys: tuple, row_key: str):
    """A reference evaluated one sequence at a time over a packed case (the definition of the packed
    result): inp[row_key] sliced along its tokens, the per-sequence tensors in seq_keys sliced by
    sequence; the outputs' first one concatenated along the tokens, the rest along the sequences."""
    if not c.lengths:
        return fn(inp)
    outs, a = [], 0
    for s, n in enumerate(c.lengths):
        sub = dict(inp)
        sub[row_key] = inp[row_key][:, a:a + n]
        for k in seq_keys:
            if inp[k] is not None:
                sub[k] = inp[k][s:s + 1]
        outs.append(fn(sub))
        a += n
    return (torch.cat([o[0] for o in outs], 1),) + tuple(torch.cat([o[i] for o in outs], 0)
                                                          for i in range(1, len(outs[0])))


def _cu(c: Case, device):
    return None if not c.lengths else torch.tensor([0] + list(torch.tensor(c.lengths).cumsum(0).tolist()),
                                                   dtype=torch.int32, device=device)


def _precision(mode):
    return "high" if mode == "float32-high" else "highest"


def _ref(inp, dtype, projection_dtype=None):
    """selective_scan_ref in `dtype`: float64, the float64 evaluation (float64 leaves, nothing rounded);
    float32, plain PyTorch on the user's tensors (y and the gradients in their dtypes, as the paths');
    with projection_dtype, the float32 evaluation of the unfused design (projections and their gradients
    rounded to it)."""
    f = {k: (v.to(dtype) if v is not None else None) for k, v in inp.items()}
    if dtype == torch.float32:
        f["x"] = inp["x"]  # the reference upcasts bf16/fp16 x itself and returns y in x's dtype
        f["W_delta"], f["W_B"], f["W_C"] = inp["W_delta"], inp["W_B"], inp["W_C"]
    return selective_scan_ref(f["x"], f["A_log"], f["W_delta"], f["b_delta"], f["W_B"], f["W_C"], f["D"], f["h0"],
                              compute_dtype=dtype, projection_dtype=projection_dtype)


def _rel(out, ref):
    out, ref = out.double(), ref.double()
    fin = torch.isfinite(ref)
    d = (out[fin] - ref[fin]).norm()
    n = ref[fin].norm()
    return (d / n).item() if n > 0 else d.item()


def near_overflow(ref, dtype, rel):
    """Where |ref| is within a relative `rel` of dtype's largest finite value, either side (bfloat16 and
    float16; nowhere for other dtypes): there either side of the overflow is a right answer."""
    if dtype not in (torch.float16, torch.bfloat16):
        return torch.zeros_like(ref, dtype=torch.bool)
    top, r = torch.finfo(dtype).max, ref.double().abs()
    return (r > top * (1 - rel)) & (r < top * (1 + rel))


def _finite_mask_error(name, out, ref, design=None):
    """Non-finite elements of out exactly where the float64 value, rounded to out's dtype, is not finite
    (a float16 y past 65504 is inf in any float16 answer), or where the design's evaluation (design: its
    intermediates rounded to the dtype, as every path of that dtype holds them) is not finite either: a
    float16 block whose in_proj output or y passes 65504 overflows in any float16 implementation, even
    where the float64 out would fit."""
    bad = torch.isfinite(out) != torch.isfinite(ref.to(out.dtype))
    if design is not None:
        bad &= ~(~torch.isfinite(out) & ~torch.isfinite(design))
    # Within a few ulps of the largest finite value, either side of the overflow is a right answer
    # (float64 -65521.9 rounds to -inf in float16; a path off by 1e-4 relative gives -65504).
    if out.dtype in (torch.float16, torch.bfloat16):
        bad &= ~near_overflow(ref, out.dtype, 4 * torch.finfo(out.dtype).eps)
    if bad.any():
        i = bad.nonzero()[0].tolist()
        return (f"{name}: {int(bad.sum())} elements finite in one and not the other (first at {i}: "
                f"path {out[tuple(i)].item()}, float64 {ref[tuple(i)].item()})")
    return None


def _judge(out, r32, r64, bound, rdesign=None):
    """(error, tolerance, explanation): the error of out against float64, and the largest of the mode's
    bound, 4x the float32 evaluation's error, 4x the error of the design's evaluation (rdesign: the
    projections and their gradients rounded to x's dtype, where the path does that) and 3x the error of
    float64 rounded to out's dtype (a float16 gradient in the subnormal range cannot be nearer than its
    rounding)."""
    e, e32, er = _rel(out, r64), _rel(r32, r64), _rel(r64.to(out.dtype), r64)
    ed = _rel(rdesign, r64) if rdesign is not None else 0.0
    tol = max(bound, 4 * e32, 4 * ed, 3 * er)
    why = f"bound {bound:g}; float32 evaluation {e32:.3g}; "
    if rdesign is not None:
        why += f"the design's evaluation {ed:.3g}; "
    return e, tol, why + f"float64 rounded to {out.dtype} {er:.3g}"


def _check(name, out, r32, r64, bound, rdesign=None) -> list[str]:
    """[] when out passes the judge against the float64 value r64 (r32: the float32 evaluation's)."""
    m = _finite_mask_error(name, out, r64, rdesign)
    if m:
        return [m]
    if rdesign is not None:  # the errors over the elements the design's evaluation and the path keep finite
        keep = torch.isfinite(out) & torch.isfinite(rdesign)
        if not keep.all():
            out, r32, r64, rdesign = (t[keep] for t in (out, r32, r64, rdesign))
    e, tol, why = _judge(out, r32, r64, bound, rdesign)
    return [] if e <= tol else [f"{name}: rel L2 error {e:.3g} > {tol:.3g} ({why})"]


def run_case(c: Case, device="cuda", path=None) -> list[str]:
    """The failures of one case (empty when it passes). path: what is judged, called as
    selscan_fused.selective_scan is (default: selective_scan with impl=c.impl); tests of this harness
    pass a deliberately wrong one."""
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(_precision(c.mode))
    try:
        if c.impl.startswith("block-"):
            return _run_block_case(c, device, path)
        return _run_case(c, device, path or selscan_fused.selective_scan)
    finally:
        torch.set_float32_matmul_precision(old)


def _run_case(c: Case, device, path) -> list[str]:
    inp = case_inputs(c, device)
    fails = []
    leaves = {k: v for k, v in inp.items() if v is not None}
    need_grad = c.backward
    # bfloat16 / float16: the unfused path rounds the projections to x's dtype, and both paths' backwards
    # round the projections they recompute and the projections' gradients to it (docs/math.md).
    design = c.mode in ("bfloat16", "float16")
    evals = ("path", "f32", "f64") + (("design",) if design else ())
    copies = {}
    for which in evals:  # the float64 evaluation's leaves are float64: exact gradients
        copies[which] = {k: ((v.detach().double() if which == "f64" else v.detach().clone()).requires_grad_(need_grad)
                             if v is not None else None) for k, v in inp.items()}
    a = copies["path"]
    packed = {"cu_seqlens": _cu(c, device)} if c.lengths else {}
    y, h = path(a["x"], a["A_log"], a["W_delta"], a["b_delta"], a["W_B"], a["W_C"], a["D"], h0=a["h0"],
                return_final_state=True, impl=c.impl, **packed)
    y32, h32 = _per_sequence(c, lambda i: _ref(i, torch.float32), copies["f32"], ("h0",), "x")
    y64, h64 = _per_sequence(c, lambda i: _ref(i, torch.float64), copies["f64"], ("h0",), "x")
    yd, hd = _per_sequence(c, lambda i: _ref(i, torch.float32, DTYPE[c.mode]), copies["design"], ("h0",),
                           "x") if design else (None, None)
    fwd_design = design and c.impl == "unfused"  # the fused forward keeps its projections in float32
    bound = TOLERANCE[c.mode]
    for name, out, r32, r64, rd in (("y", y, y32, y64, yd), ("final state", h, h32, h64, hd)):
        fails += _check(name, out, r32, r64, bound, rd if fwd_design else None)
    if need_grad and not fails:
        g = torch.Generator(device="cpu").manual_seed(c.seed * 7 + c.index)
        # float16: upstream gradients scaled down, as a float16 user's loss scale would, so that the
        # float16 gradients of the weights (sums over every token) stay inside float16's range.
        s = 2.0 ** -6 if c.mode == "float16" else 1.0
        dy = torch.randn(c.batch, c.L, c.Dm, generator=g).to(device) * s
        dh = torch.randn(len(c.lengths) or c.batch, c.Dm, c.N, generator=g).to(device) * s
        grads = {}
        outs = {"path": (y, h), "f32": (y32, h32), "f64": (y64, h64), "design": (yd, hd)}
        for which in evals:
            yy, hh = outs[which]
            loss = (yy.double() * dy.double()).sum() + (hh.double() * dh.double()).sum()
            ts = [copies[which][k] for k in leaves]
            grads[which] = dict(zip(leaves, torch.autograd.grad(loss, ts)))
        for k in leaves:
            fails += _check(f"d{k}", grads["path"][k], grads["f32"][k], grads["f64"][k], bound,
                            grads["design"][k] if design else None)
    return fails


def supported_impls(block: bool = True):
    """The CUDA paths the cases draw from: the layer's ('unfused', 'fused') and the block's
    ('block-unfused', 'block-fused'), as far as the extension and the GPU have them."""
    impls = []
    if selscan_fused.extension_available():
        impls.append("unfused")
        if block:
            impls.append("block-unfused")
    if (selscan_fused._extension.fused_extension_available() and torch.cuda.get_device_capability() == (9, 0)):
        impls.append("fused")
        if block:
            impls.append("block-fused")
    return tuple(impls)
