"""The fused path's backward, variant by variant, on the named shapes: the fused backward kernel in
each scan layout (4 or 8 threads per channel) against the recomputation (one library product for the
projections, then the standalone backward scan kernel), each the whole `fused_bwd` op (kernel, the
partials' sums and the library products dx, dW) captured in a CUDA graph and replayed, L2 flushed,
median of --reps; and the peak memory each allocates above its inputs. --segments times the kernel at
each L split given (0 = its plan's own), to place the automatic mode's boundary (docs/perf/batch1.md).

    python benchmarks/bwd_variants.py --shapes S1,S2,S3,S4 --dtypes bf16
    python benchmarks/bwd_variants.py --shapes 1x4096x1024x16,8x2048x256x16 --segments 0,1,2,4,8 --layouts 4
"""
from __future__ import annotations

import argparse
import csv
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import TORCH_DTYPE, time_ms  # noqa: E402
from shapes import shape_dims  # noqa: E402

from selscan_fused.demo import make_inputs  # noqa: E402

NAMES = ("x", "A_log", "W_delta", "b_delta", "W_B", "W_C", "D")
VARIANTS = [("kernel, 4 threads/channel", 1, 4), ("kernel, 8 threads/channel", 1, 8), ("recomputation", 2, 0)]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="S1,S2,S3,S4")
    ap.add_argument("--dtypes", default="bf16")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--segments", default="0", help="L splits of the kernel to time (0 = its plan's)")
    ap.add_argument("--layouts", default="4,8", help="threads per channel of the kernel variants")
    ap.add_argument("--csv", help="also write the rows here")
    a = ap.parse_args()
    segments = [int(v) for v in a.segments.split(",")]
    layouts = {int(v) for v in a.layouts.split(",")}
    variants = [v for v in VARIANTS if v[1] == 2 or v[2] in layouts]
    print(f"fused_bwd variants: device {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(f"{'shape':16} {'dtype':6} {'variant':28} {'plan':>16} {'gpu ms':>8} {'vs recomp':>9} {'peak MiB':>9}")
    rows = []
    for shape in a.shapes.split(","):
        b, L, D, N = shape_dims(shape)
        for dtype in a.dtypes.split(","):
            inp = make_inputs(b, L, D, N, TORCH_DTYPE[dtype], "cuda")
            args = tuple(inp[k] for k in NAMES) + (None,)
            _, _, ckpt = torch.ops.selscan_fused.fused_fwd_res(*args, 0)
            dy = torch.randn_like(inp["x"])
            res = []
            runs = [(name, mode, tpc, seg) for name, mode, tpc in variants for seg in (segments if mode == 1 else [0])]
            seen = set()
            for name, mode, tpc, seg in runs:
                plan = torch.ops.selscan_fused.fused_bwd_plan(inp["x"], N, seg, mode, tpc)
                if mode == 1 and plan[0] != 1:
                    continue
                if mode == 1 and (tpc, plan[1]) in seen:
                    continue  # a split asked for that the plan clamps to one already timed
                seen.add((tpc, plan[1]))
                def fn(mode=mode, tpc=tpc, seg=seg):
                    return torch.ops.selscan_fused.fused_bwd(*args, dy, None, ckpt, seg, mode, tpc)
                ms = time_ms(fn, a.reps, graph=True)
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                out = fn()
                torch.cuda.synchronize()
                peak = (torch.cuda.max_memory_allocated() - base) / 2**20
                del out
                res.append((name, plan, ms, peak, seg))
            rec = [r for r in res if r[0] == "recomputation"][0][2]
            for name, plan, ms, peak, seg in res:
                p = f"{plan[1]}x{plan[2]}" if plan[0] else "-"
                print(f"{shape:16} {dtype:6} {name:28} {p:>16} {ms:8.3f} {rec / ms:9.2f} {peak:9.1f}", flush=True)
                rows.append(dict(batch=b, L=L, D=D, N=N, dtype=dtype, variant=name, requested_segments=seg,
                                 segments=plan[1], seg_len=plan[2], gpu_ms=round(ms, 5),
                                 vs_recomputation=round(rec / ms, 4), peak_mib=round(peak, 1)))
            torch.cuda.empty_cache()
            if a.csv:
                with open(a.csv, "w", newline="") as f:
                    w = csv.DictWriter(f, fieldnames=list(rows[0]))
                    w.writeheader()
                    w.writerows(rows)


if __name__ == "__main__":
    main()
