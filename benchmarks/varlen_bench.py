"""Packed variable-length sequences (cu_seqlens) against their alternatives, side by side in one run: the
Mamba block (selscan_fused.Mamba) on a mix of sequence lengths, for each of --impls (default unfused;
fused: its packed row runs where the fused kernel takes packed sequences (every build but one with
-DSELSCAN_FUSED_NO_PACKED) and says why not elsewhere)

    packed    the sequences packed in one row with cu_seqlens (the state restarts at every start)
    one       one sequence of the same total length (the floor a packed batch is held to: within 5%)
    padded    a batch of the sequences padded to the longest (what users do without cu_seqlens)

forward and training step (out.backward(g)), bf16, GPU time by CUDA events, median of --reps after
warm-up. The mix: --lengths, or --num-seqs lengths drawn from a log-normal with median 1024 clipped to
[16, 16384] (seeded), the project's realistic mix.

    python benchmarks/varlen_bench.py [--d-model 768] [--num-seqs 16] [--lengths 100,2000,...]
                                      [--impls unfused,fused] [--reps 20] [--seed 0] [--csv docs/varlen_bench.csv]
"""
from __future__ import annotations

import argparse
import csv
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import selscan_fused  # noqa: E402
from selscan_fused.block import block_unsupported_reason  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import median_ms  # noqa: E402

FIELDS = ["impl", "layout", "tokens", "num_seqs", "longest", "fwd_ms", "step_ms", "fwd_vs_one", "step_vs_one", "status"]


def draw_lengths(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, generator=g)
    return [int(min(16384, max(16, round(math.exp(math.log(1024) + 1.0 * v))))) for v in z.tolist()]


def time_ms(fn, reps: int) -> float:
    for _ in range(3):  # warm-up (plans, allocator)
        fn()
    return median_ms(fn, reps, flush=False)  # inputs far larger than the L2


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--num-seqs", type=int, default=16)
    ap.add_argument("--lengths", default="")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--csv", default=None)
    ap.add_argument("--impls", default="unfused", help="the block's paths, comma-separated: unfused, fused")
    args = ap.parse_args(argv)
    impls = args.impls.split(",")
    if set(impls) - {"unfused", "fused"}:
        ap.error(f"--impls: unknown {sorted(set(impls) - {'unfused', 'fused'})}; the paths are unfused, fused")
    lengths = [int(v) for v in args.lengths.split(",")] if args.lengths else draw_lengths(args.num_seqs, args.seed)
    T, S, longest = sum(lengths), len(lengths), max(lengths)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(args.seed)
    block = selscan_fused.Mamba(args.d_model, device=device, dtype=dtype)
    probe = torch.empty(1, 1, args.d_model, device=device, dtype=dtype)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=device)
    layouts = {
        "packed": (torch.randn(1, T, args.d_model, device=device, dtype=dtype), dict(cu_seqlens=cu, validate=False)),
        "one": (torch.randn(1, T, args.d_model, device=device, dtype=dtype), {}),
        "padded": (torch.randn(S, longest, args.d_model, device=device, dtype=dtype), {}),
    }
    rows = []
    print(f"{S} sequences, {T} tokens, longest {longest}: {lengths}")
    for impl in impls:
        block.impl = impl
        reason = block_unsupported_reason(impl, probe, block.d_inner, block.d_state, block.d_conv)
        results = {}
        for name, (x, kw) in layouts.items():
            row = dict(impl=impl, layout=name, tokens=x.shape[0] * x.shape[1], num_seqs=S if name != "one" else 1,
                       longest=longest if name != "one" else T, fwd_ms="", step_ms="", fwd_vs_one="",
                       step_vs_one="")
            why = reason
            if why is None and impl == "fused" and name == "packed" and \
                    not selscan_fused._extension.fused_packed_available():
                why = "the fused kernel was built with -DSELSCAN_FUSED_NO_PACKED (no packed sequences)"
            if why is not None:
                row["status"] = f"unavailable: {why}"
            else:
                g = torch.randn_like(x)
                xr = x.clone().requires_grad_(True)

                def fwd():
                    with torch.no_grad():
                        block(x, **kw)

                def step():
                    block(xr, **kw).backward(g)

                results[name] = (time_ms(fwd, args.reps), time_ms(step, args.reps))
                row.update(fwd_ms=f"{results[name][0]:.4f}", step_ms=f"{results[name][1]:.4f}", status="ok")
            rows.append(row)
        if "one" in results:  # each path against its own one sequence
            for row in rows:
                if row["impl"] == impl and row["layout"] in results:
                    f, s_ = results[row["layout"]]
                    row.update(fwd_vs_one=f"{f / results['one'][0]:.3f}", step_vs_one=f"{s_ / results['one'][1]:.3f}")
    for row in rows:
        print(f"{row['impl']:>7} {row['layout']:>7}: forward {row['fwd_ms'] or '-':>9} ms ({row['fwd_vs_one'] or '-'} "
              f"x one), step {row['step_ms'] or '-':>9} ms ({row['step_vs_one'] or '-'} x one)  {row['status']}")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=FIELDS)
            w.writeheader()
            w.writerows(rows)
    return rows


if __name__ == "__main__":
    main()
