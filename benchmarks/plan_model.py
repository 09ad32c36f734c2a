"""The fused forward's L-split plan, modelled offline against the committed sweep
(docs/fwd_split_sweep.csv, written from `benchmarks/bench.py --impls fused,unfused --segments
0,1,2,4,8,16,32`; docs/perf/batch1.md, "The batch-1 regime: the plans' L splits measured").

Two plans of csrc/fused/fused_api.cu (`fused_plan`) are restated here. The plan before 2026-12-03
("before"): per channel tile (64 wide or 16 narrow), the split n = min(SMs / streams, L / 512), and the
cost (phase-1 + phase-2 waves) x segment length x max(scan cost, operand-load cost) per token. The
library's plan since ("library", `plan_library`, which tests/test_fused_plan.py holds the op to): the
same cost plus a fixed cost per grid phase (--phase-cost, in the model's units: 1 unit is about 1 ns
on the H200 at shape P), a 128-token floor (--floor), every power-of-two split up to n (and 1) tried,
and among candidates within --tie of the cheapest the one with the most segments. For every swept
shape it prints the split each plan takes, its measured time against the fastest measured split, and
the mean of those ratios.

    python benchmarks/plan_model.py                          # the plan before against the library's
    python benchmarks/plan_model.py --phase-cost 5000 --floor 256   # another candidate on the same rows

This models only the fused forward; it predicts which split to take, it does not time anything: a new
rule is measured on the GPU before it lands.
"""
from __future__ import annotations

import argparse
import csv
import os
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from shapes import shape_dims  # noqa: E402

# The planner's constants (csrc/fused/fused_api.h) and the H200's SM count.
SMS = 132
TOKEN_TILE = 128          # kFusedTokenTile: segments are whole token tiles
SHORT_STREAM = 1024       # kFusedShortStream: the short-stream layout's extra cost per exponential
NARROW_COST = 2.0         # kFusedNarrowCost
LOAD_BYTES_PER_UNIT = 75.0  # kFusedLoadBytesPerUnit
BEFORE_FLOOR = 512        # the segment floor (tokens) of the plan before 2026-12-03
# The library's (kFusedMinSegment, kFusedPhaseCost, kFusedPlanTie)
FLOOR, PHASE_COST, TIE = 128, 7500.0, 0.03


def split_lengths(L, n, tile=TOKEN_TILE):
    """(segments, segment length) as csrc/common/l_split.h cuts L into n parts of whole tiles."""
    seg = ((L + n - 1) // n + tile - 1) // tile * tile
    return (L + seg - 1) // seg, seg


def cost(b, L, D, N, tile, n, phase_cost, elem=2.0):
    streams = b * (D // tile)
    ns, seg = split_lengths(L, n)
    waves = (streams * ns + SMS - 1) // SMS + (streams * (ns - 1) + SMS - 1) // SMS
    per_exp = NARROW_COST if tile == 16 else (1.14 if seg <= SHORT_STREAM else 1.0)
    load = D * elem * (1.0 + (tile + 2 * N) / TOKEN_TILE) / LOAD_BYTES_PER_UNIT
    return waves * seg * max(tile * per_exp, load) + (1 if ns == 1 else 2) * phase_cost, ns, seg


def max_split(b, L, D, tile, floor, requested=0):
    """The split the plan asks split_lengths for: requested, or one stream per SM at most and segments
    of at least floor tokens; at most one segment per token tile either way."""
    streams = b * (D // tile)
    n = requested
    if n <= 0:
        n = min(max(1, SMS // streams), max(1, L // floor)) if streams < SMS else 1
    return max(1, min(n, (L + TOKEN_TILE - 1) // TOKEN_TILE))


def plan_before(b, L, D, N, requested=0):
    """(tile, segments, segment length) of the plan before 2026-12-03; requested > 0 forces the split
    (the sweep's forced rows ran that: bf16, N = 16, the narrow layout allowed)."""
    best = None
    for tile in (64, 16):  # the narrow layout exists for bf16/fp16 at N = 16, the rows swept
        c, ns, seg = cost(b, L, D, N, tile, max_split(b, L, D, tile, BEFORE_FLOOR, requested), 0.0)
        if best is None or c < best[0]:  # the wide layout unless the narrow one costs less
            best = (c, tile, ns, seg)
    return best[1:]


def plan_library(b, L, D, N, phase_cost=PHASE_COST, floor=FLOOR, tie=TIE, narrow=True, elem=2.0):
    """(tile, segments, segment length) of the library's plan (automatic split and channel tile);
    narrow: whether the narrow layout exists (bf16/fp16 with N = 16); elem: operand bytes."""
    cands = []
    for tile in ((64, 16) if narrow else (64,)):
        top = max_split(b, L, D, tile, floor)
        for n in sorted({1, top} | {v for v in (2, 4, 8, 16, 32, 64) if v <= top}):
            c, ns, seg = cost(b, L, D, N, tile, n, phase_cost, elem)
            cands.append((c, ns, tile, seg))
    cheapest = min(c[0] for c in cands)
    c, ns, tile, seg = max((c for c in cands if c[0] <= cheapest * (1 + tie)), key=lambda c: (c[1], -c[0]))  # most segments, then cheapest
    return tile, ns, seg


def read_sweep(path):
    """{shape: {requested segments: gpu ms}} of the fused rows of a sweep CSV (docs/fwd_split_sweep.csv)."""
    measured = defaultdict(dict)
    with open(path, newline="") as fh:
        for r in csv.DictReader(fh):
            if r["path"] == "fused":
                measured[r["shape"]][int(r["requested_segments"])] = float(r["gpu_ms"])
    return measured


def times_by_plan(shape, times):
    """(b, L, D, N) and {(tile, segments, segment length): fastest gpu ms} of one swept shape: which plan
    each forced split ran (the plan before chose the tile)."""
    b, L, D, N = shape_dims(shape)
    by_plan = {}
    for req, ms in times.items():
        key = plan_before(b, L, D, N, req)
        by_plan[key] = min(ms, by_plan.get(key, float("inf")))
    return (b, L, D, N), by_plan


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--csv", default=os.path.join(os.path.dirname(__file__), "..", "docs", "fwd_split_sweep.csv"))
    ap.add_argument("--phase-cost", type=float, default=PHASE_COST)
    ap.add_argument("--floor", type=int, default=FLOOR)
    ap.add_argument("--tie", type=float, default=TIE)
    a = ap.parse_args(argv)
    measured = read_sweep(a.csv)
    print(f"{'shape':16} {'fastest':>8} | {'before: tile x segments':>23} {'x fastest':>9} | "
          f"{'library':>10} {'x fastest':>9}")
    ratios_before, ratios_new, unmeasured = [], [], 0
    for shape, times in measured.items():
        (b, L, D, N), by_plan = times_by_plan(shape, times)
        fastest = min(by_plan.values())
        before = times[0]
        new = plan_library(b, L, D, N, a.phase_cost, a.floor, a.tie)
        got = by_plan.get(new)
        ratios_before.append(before / fastest)
        t = plan_before(b, L, D, N)
        if got is None:
            unmeasured += 1
            g = "not swept"
        else:
            ratios_new.append(got / fastest)
            g = f"{got / fastest:9.3f}"
        print(f"{shape:16} {fastest:8.4f} | {t[0]:>14} x {t[1]:<6} {before / fastest:9.3f} | "
              f"{new[0]:>4} x {new[1]:<3} {g}")
    print(f"mean x fastest: before {sum(ratios_before) / len(ratios_before):.3f}; library "
          f"{sum(ratios_new) / max(1, len(ratios_new)):.3f} over {len(ratios_new)} shapes"
          + (f" ({unmeasured} library plans not in the sweep)" if unmeasured else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
