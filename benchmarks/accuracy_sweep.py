"""Relative-error distribution over many fresh seeds, for one shape and precision mode, per path:
how close a path runs to its bound (docs/math.md, "Accuracy") (the tests check one random instance per run).

    python benchmarks/accuracy_sweep.py --shape 1,1,64,16 --mode float32-high --impls fused,unfused --seeds 300
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from conftest import DTYPES, TOLERANCE, call, float64_eval, make_inputs, matmul_precision, rel_l2  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="1,1,64,16", help="batch,L,D,N")
    ap.add_argument("--mode", default="float32-high", choices=list(TOLERANCE))
    ap.add_argument("--impls", default="fused,unfused")
    ap.add_argument("--seeds", type=int, default=300)
    a = ap.parse_args()
    shape = tuple(int(v) for v in a.shape.split(","))
    impls = a.impls.split(",")
    errs = {i: [] for i in impls}
    with matmul_precision(a.mode):
        for seed in range(a.seeds):
            torch.manual_seed(seed)
            inp = make_inputs(*shape, dtype=DTYPES[a.mode], device="cuda", with_h0=bool(seed % 2))
            y64, _ = float64_eval(inp)
            for i in impls:
                errs[i].append(rel_l2(call(inp, i), y64))
    bound = TOLERANCE[a.mode]
    print(f"shape {shape} mode {a.mode} ({a.seeds} seeds, bound {bound:.0e}): rel. L2 error of y")
    for i in impls:
        e = torch.tensor(errs[i], dtype=torch.float64)
        q = torch.quantile(e, torch.tensor([0.5, 0.9, 0.99], dtype=torch.float64)).tolist()
        print(f"  {i:8} median {q[0]:.2e}  p90 {q[1]:.2e}  p99 {q[2]:.2e}  max {e.max():.2e}  "
              f"over the bound: {(e >= bound).sum().item()}/{len(e)}")


if __name__ == "__main__":
    main()
