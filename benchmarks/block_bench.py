"""The Mamba-1 block, forward and training step, against mamba-ssm's block as its users run it.

    python benchmarks/block_bench.py [--sizes 130M,370M,1.4B,2.8B] [--shapes 8x2048,1x16384] [--reps 20]
                                     [--csv docs/block_bench.csv] [--profile]

--profile: also where the GPU time goes, one line per kernel (torch.profiler) for a forward and a step.

Rows: this project's block (`selscan_fused.Mamba`, each available path) and mamba-ssm's fast path
(`mamba_inner_fn`: cuBLAS in_proj into its (batch, 2 d_inner, L) layout, causal-conv1d's kernel, x_proj
and dt_proj products, its scan kernel with the gate and the delta softplus inside, out_proj; its
backward recomputes the conv output and delta), when its kernels are importable: `selective_scan_cuda`
and `causal_conv1d_cuda` built by the peers' scripts, and mamba-ssm's and causal-conv1d's Python files
on PYTHONPATH (scripts/build_peers.sh prepares them in the git-ignored .peer/ folder, never in this
repository). Without them the mamba-ssm rows say so.

bfloat16 parameters and input (the block built with mamba-ssm's initialisation, then cast), GPU time of
one call by CUDA events, median of --reps after warm-up; a training step is `out = block(x);
out.backward(g)`; peak memory is the allocator's peak above what the inputs and weights hold.
"""
from __future__ import annotations

import argparse
import csv
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import selscan_fused  # noqa: E402
from bench import median_ms  # noqa: E402
from selscan_fused.block import block_unsupported_reason  # noqa: E402

SIZES = {"130M": 768, "370M": 1024, "790M": 1536, "1.4B": 2048, "2.8B": 2560}


def mamba_ssm_inner():
    """mamba-ssm's mamba_inner_fn, or the reason it is not importable."""
    try:
        from mamba_ssm.ops.selective_scan_interface import mamba_inner_fn  # type: ignore
        import causal_conv1d_cuda  # type: ignore  # noqa: F401
        import selective_scan_cuda  # type: ignore  # noqa: F401
        return mamba_inner_fn, None
    except Exception as e:  # noqa: BLE001  (any import failure: the rows say why)
        return None, f"{type(e).__name__}: {e}"


def mamba_ssm_forward(inner, block: selscan_fused.Mamba):
    """The block's forward as mamba-ssm's Mamba.forward computes it (its fast path), on our parameters."""
    def f(x):
        batch, L, _ = x.shape
        xz = (block.in_proj.weight @ x.reshape(batch * L, -1).T).view(-1, batch, L).permute(1, 0, 2)
        A = -torch.exp(block.A_log.float())
        return inner(xz, block.conv1d.weight, block.conv1d.bias, block.x_proj.weight, block.dt_proj.weight,
                     block.out_proj.weight, block.out_proj.bias, A, None, None, block.D.float(),
                     delta_bias=block.dt_proj.bias.float(), delta_softplus=True)
    return f


def time_ms(fn, reps: int) -> float:
    """Three warm-up calls, then bench.py's median of CUDA-event times (no L2 flush: the block's
    inputs and activations are several times the L2)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    return median_ms(fn, reps, flush=False)


def measure(forward, x, g, reps):
    with torch.no_grad():
        fwd = time_ms(lambda: forward(x), reps)
    xx = x.detach().clone().requires_grad_(True)

    def step():
        forward(xx).backward(g)

    stp = time_ms(step, reps)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    return fwd, stp, peak


def profile(forward, x, g, label, steps=3):
    """Per-kernel GPU time of a no-grad forward and of a training step (torch.profiler)."""
    from collections import defaultdict
    xx = x.detach().clone().requires_grad_(True)
    for what, fn in (("forward", lambda: forward(x)), ("step", lambda: forward(xx).backward(g))):
        grad = what == "step"
        with torch.set_grad_enabled(grad):
            fn()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(steps):
                    fn()
                torch.cuda.synchronize()
        per = defaultdict(float)
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                per[ev.name] += getattr(ev, "device_time_total", 0.0)
        print(f"== {label} {what}: {sum(per.values()) / steps / 1e3:.3f} ms of kernels")
        for name, us in sorted(per.items(), key=lambda kv: -kv[1])[:12]:
            print(f"  {us / steps / 1e3:8.4f} ms  {name[:100]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="130M,370M,1.4B,2.8B")
    ap.add_argument("--shapes", default="8x2048,1x16384")
    ap.add_argument("--impls", default="unfused,fused,mamba-ssm")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--csv", default=None)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    inner, why = mamba_ssm_inner()
    if inner is None:
        print(f"mamba-ssm's block is not importable ({why}): its rows are left out")
    rows = []
    print(f"{'size':>5} {'shape':>8} {'path':>10} {'fwd ms':>8} {'step ms':>8} {'peak MiB':>9} {'fwd x':>6} {'step x':>6}")
    for size in args.sizes.split(","):
        d_model = SIZES[size]
        for shape in args.shapes.split(","):
            batch, L = map(int, shape.split("x"))
            torch.manual_seed(0)
            block = selscan_fused.Mamba(d_model, impl="unfused", device="cuda").to(torch.bfloat16)
            x = torch.randn(batch, L, d_model, device="cuda", dtype=torch.bfloat16)
            g = torch.randn_like(x)
            results = {}
            for impl in args.impls.split(","):
                if impl == "mamba-ssm":
                    if inner is None:
                        continue
                    fwd = mamba_ssm_forward(inner, block)
                else:
                    reason = block_unsupported_reason(impl, x, block.d_inner, block.d_state, block.d_conv)
                    if reason is not None:
                        print(f"{size} {shape} {impl}: left out ({reason})")
                        continue
                    block.impl = impl
                    fwd = block
                results[impl] = measure(fwd, x, g, args.reps)
                if args.profile:
                    profile(fwd, x, g, f"{size} {shape} {impl}")
                block.zero_grad(set_to_none=True)
            base = results.get("mamba-ssm")
            for impl, (f, s, m) in results.items():
                fx = f"{base[0] / f:.2f}" if base else "-"
                sx = f"{base[1] / s:.2f}" if base else "-"
                print(f"{size:>5} {shape:>8} {impl:>10} {f:8.3f} {s:8.3f} {m:9.0f} {fx:>6} {sx:>6}", flush=True)
                rows.append(dict(size=size, d_model=d_model, batch=batch, L=L, path=impl, fwd_ms=round(f, 4),
                                 step_ms=round(s, 4), peak_step_mib=round(m, 1)))
    if args.csv:
        with open(args.csv, "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
        print(f"wrote {args.csv}")


if __name__ == "__main__":
    main()
