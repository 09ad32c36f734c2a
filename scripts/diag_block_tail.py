"""The distribution of the block's errors against float64 over many seeds, for one case of
tests/test_block.py's test_cuda_values_and_gradients_against_float64: whether a bound sits in the tail
of a quantity's error (a failure at one seed among many) or below its bulk (a defect). Needs a GPU and
the built extension.

    python scripts/diag_block_tail.py --impl unfused --mode float16 --shape 3,7,64,8,2,1,0,2 --seeds 300

Prints any seeds given by --replay, one by one; then, per quantity, the median, 90th and 99th
percentiles, the largest error and its seed, and how many seeds exceed the test's bound
(tests/test_block.py's block_bound).
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from test_block import BLOCK_TOLERANCE, block_bound, block_errors_against_float64  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--impl", default="unfused", choices=["unfused", "fused"])
    ap.add_argument("--mode", default="float16")
    ap.add_argument("--shape", default="3,7,64,8,2,1,0,2",
                    help="batch,L,d_model,N,d_conv,bias,with_states,expand (tests/test_block.py's SHAPES)")
    ap.add_argument("--seeds", type=int, default=300)
    ap.add_argument("--first", type=int, default=1, help="the first seed; seeds first .. first+seeds-1")
    ap.add_argument("--replay", type=int, nargs="*", default=[], help="seeds to print one by one")
    a = ap.parse_args()
    v = [int(t) for t in a.shape.split(",")]
    shape = tuple(v[:5]) + (bool(v[5]), bool(v[6]), v[7])
    tol = BLOCK_TOLERANCE[a.mode]
    for s in a.replay:
        e = block_errors_against_float64(a.impl, a.mode, shape, seed=s)
        print(f"seed {s}:", " ".join(f"{k}={x:.2e}" for k, x in e.items()))
    runs = {}
    for s in range(a.first, a.first + a.seeds):
        e = block_errors_against_float64(a.impl, a.mode, shape, seed=s)
        if e is None:
            sys.exit(f"{a.shape} is outside impl={a.impl!r}'s envelope")
        runs[s] = e
    if not runs:
        return
    print(f"{a.impl} {a.mode} shape {a.shape}: {len(runs)} seeds from {a.first}; bound {tol:.0e} "
          f"(the test's: twice that for the gradients summed over few tokens)")
    print(f"{'quantity':<22}{'median':>10}{'p90':>10}{'p99':>10}{'max':>10}  {'at seed':>8}  over bound")
    for k in next(iter(runs.values())):
        xs = torch.tensor([r[k] for r in runs.values()], dtype=torch.float64)
        worst = max(runs, key=lambda s: runs[s][k])
        q = torch.quantile(xs, torch.tensor([0.5, 0.9, 0.99], dtype=torch.float64)).tolist()
        over = int((xs >= block_bound(k, a.mode, shape)).sum())
        print(f"{k:<22}{q[0]:>10.2e}{q[1]:>10.2e}{q[2]:>10.2e}{xs.max().item():>10.2e}  {worst:>8}  {over}")


if __name__ == "__main__":
    main()
