"""Runs one path once on a named shape, for a profiler (ncu) to attach to:

    ncu --clock-control none --kernel-name regex:scan_fwd python benchmarks/profile_one.py S1 bf16 scan 0
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import make, paths  # noqa: E402

shape, dtype, impl, seg = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
# As bench.py: "fp32-high" is float32 under matmul precision "high" (TF32 products).
torch.set_float32_matmul_precision("high" if dtype == "fp32-high" else "highest")
inp = make(shape, dtype)
(name, fn), = [p for p in paths(inp, {impl}, [seg])]
fn()
torch.cuda.synchronize()
print("ran", name)
