"""Where a training step's GPU time goes: one step of a path on a named shape under torch.profiler,
one line per kernel (total time over --steps steps, after warm-up), the same run for every path asked.

    python benchmarks/profile_train.py --shapes S2 --dtypes bf16 --impls fused,unfused,mamba
    ncu --clock-control none --kernel-name regex:scan_bwd python benchmarks/profile_train.py --shapes S2 --steps 1 --quiet
"""
from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peers  # noqa: E402
from bench import train_step_fn  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="S2")
    ap.add_argument("--dtypes", default="bf16")
    ap.add_argument("--impls", default="fused,unfused,mamba")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--quiet", action="store_true", help="no profiler (for ncu): just run the steps")
    a = ap.parse_args()
    for shape in a.shapes.split(","):
        for dtype in a.dtypes.split(","):
            torch.set_float32_matmul_precision("high" if dtype == "fp32-high" else "highest")
            for impl in a.impls.split(","):
                if impl == "mamba" and not peers.available():
                    continue
                step = train_step_fn(shape, dtype, impl)
                for _ in range(3):
                    step()
                torch.cuda.synchronize()
                if a.quiet:
                    for _ in range(a.steps):
                        step()
                    torch.cuda.synchronize()
                    continue
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    for _ in range(a.steps):
                        step()
                    torch.cuda.synchronize()
                per = defaultdict(float)
                for ev in prof.events():
                    if ev.device_type == torch.autograd.DeviceType.CUDA:
                        per[ev.name] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
                total = sum(per.values()) / a.steps / 1e3
                print(f"== {shape} {dtype} {impl}: {total:.3f} ms of kernels per step")
                for name, us in sorted(per.items(), key=lambda kv: -kv[1])[:14]:
                    print(f"  {us / a.steps / 1e3:8.4f} ms  {name[:110]}")


if __name__ == "__main__":
    main()
