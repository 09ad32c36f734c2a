"""The fused path's backward, variant by variant, on the named shapes: the fused backward kernel in
each scan layout (4 or 8 threads per channel) against the recomputation (one library product for the
projections, then the standalone backward scan kernel), each the whole `fused_bwd` op (kernel, the
partials' sums and the library products dx, dW) captured in a CUDA graph and replayed, L2 flushed,
median of --reps; and the peak memory each allocates above its inputs.

    python benchmarks/bwd_variants.py --shapes S1,S2,S3,S4 --dtypes bf16
"""
from __future__ import annotations

import argparse
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
    a = ap.parse_args()
    print(f"fused_bwd variants: device {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(f"{'shape':6} {'dtype':6} {'variant':28} {'plan':>16} {'gpu ms':>8} {'vs recomp':>9} {'peak MiB':>9}")
    for shape in a.shapes.split(","):
        b, L, D, N = shape_dims(shape)
        for dtype in a.dtypes.split(","):
            inp = make_inputs(b, L, D, N, TORCH_DTYPE[dtype], "cuda")
            args = tuple(inp[k] for k in NAMES) + (None,)
            _, _, ckpt = torch.ops.selscan_fused.fused_fwd_res(*args, 0)
            dy = torch.randn_like(inp["x"])
            res = []
            for name, mode, tpc in VARIANTS:
                plan = torch.ops.selscan_fused.fused_bwd_plan(inp["x"], N, 0, mode, tpc)
                if mode == 1 and plan[0] != 1:
                    continue
                def fn(mode=mode, tpc=tpc):
                    return torch.ops.selscan_fused.fused_bwd(*args, dy, None, ckpt, 0, mode, tpc)
                ms = time_ms(fn, a.reps, graph=True)
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                out = fn()
                torch.cuda.synchronize()
                peak = (torch.cuda.max_memory_allocated() - base) / 2**20
                del out
                res.append((name, plan, ms, peak))
            rec = [r for r in res if r[0] == "recomputation"][0][2]
            for name, plan, ms, peak in res:
                p = f"{plan[1]}x{plan[2]}" if plan[0] else "-"
                print(f"{shape:6} {dtype:6} {name:28} {p:>16} {ms:8.3f} {rec / ms:9.2f} {peak:9.1f}")
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
