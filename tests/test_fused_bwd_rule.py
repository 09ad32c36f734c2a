"""fused_bwd's automatic mode against the committed sweep (docs/fused_bwd_sweep.csv, written by
`python benchmarks/bwd_variants.py --shapes ... --segments 0,2,4,8,16,32 --layouts 4 --csv ...`; the
command is in docs/perf/batch1.md, "The batch-1 regime: the plans' L splits measured"): on every recorded shape the
op's own choice (the fused backward kernel with its plan, or the recomputation) must be within 3% of
the faster of the two as recorded. The rule is the op's (csrc/fused/fused_api.h), asked through
fused_bwd_plan, so this needs the sm_90 GPU the plan is made for; timing stays in the benchmark.
"""
import csv
import os
from collections import defaultdict

import pytest
import torch

from conftest import requires_hopper

SWEEP = os.path.join(os.path.dirname(__file__), "..", "docs", "fused_bwd_sweep.csv")
TOL = 1.03


def _recorded():
    with open(SWEEP, newline="") as fh:
        rows = list(csv.DictReader(fh))
    by = defaultdict(lambda: {"kernel": {}, "recomputation": None})
    for r in rows:
        key = (int(r["batch"]), int(r["L"]), int(r["D"]), int(r["N"]), r["dtype"])
        if r["variant"] == "recomputation":
            by[key]["recomputation"] = float(r["gpu_ms"])
        elif r["variant"].startswith("kernel, 4 "):
            by[key]["kernel"][(int(r["segments"]), int(r["seg_len"]))] = float(r["gpu_ms"])
    return by


def test_the_sweep_is_committed_and_covers_the_regime():
    by = _recorded()
    assert len(by) >= 50
    assert all(v["recomputation"] is not None for v in by.values())
    # batch 1 to 8, D 256 to 2048, L 512 to 64K, the named shapes S1 and S4 among them
    assert {k[0] for k in by} >= {1, 2, 4, 8} and {k[2] for k in by} >= {256, 512, 1024, 2048}
    assert (8, 2048, 256, 16, "bf16") in by and (1, 65536, 256, 16, "bf16") in by


@requires_hopper
def test_automatic_mode_is_within_3_percent_of_the_faster_variant():
    by = _recorded()
    checked, wrong = 0, []
    for (b, L, D, N, dtype), v in sorted(by.items()):
        # The plan reads the sizes only: an expanded view, not an allocation of (b, L, D).
        x = torch.empty(1, 1, D, device="cuda", dtype=torch.bfloat16).expand(b, L, D)
        takes_kernel = torch.ops.selscan_fused.fused_bwd_plan(x, N, 0, 0)[0] == 1
        plan = torch.ops.selscan_fused.fused_bwd_plan(x, N, 0, 1)
        kernel_ms = v["kernel"].get((plan[1], plan[2]))
        rec_ms = v["recomputation"]
        if kernel_ms is None:
            # The kernel's own plan was not recorded: only a choice of the recomputation can be right.
            assert not takes_kernel, f"{b}x{L}x{D}: the kernel's plan {plan[1]}x{plan[2]} is not in the sweep"
            continue
        checked += 1
        chosen = kernel_ms if takes_kernel else rec_ms
        if chosen > TOL * min(kernel_ms, rec_ms):
            wrong.append(f"{b}x{L}x{D}x{N}: took {'kernel' if takes_kernel else 'recomputation'} "
                         f"{chosen:.4f} ms, kernel {plan[1]}x{plan[2]} {kernel_ms:.4f}, recomputation {rec_ms:.4f}")
    assert checked >= 50, checked
    assert not wrong, "\n".join(wrong)


@requires_hopper
def test_the_sweep_was_recorded_with_this_plan():
    """Every shape's automatic plan (requested_segments = 0) in the CSV is the plan the op makes now:
    a change of the plan needs a new sweep."""
    with open(SWEEP, newline="") as fh:
        rows = [r for r in csv.DictReader(fh) if r["variant"].startswith("kernel, 4 ") and r["requested_segments"] == "0"]
    assert rows
    for r in rows:
        b, L, D, N = (int(r[k]) for k in ("batch", "L", "D", "N"))
        x = torch.empty(1, 1, D, device="cuda", dtype=torch.bfloat16).expand(b, L, D)
        plan = torch.ops.selscan_fused.fused_bwd_plan(x, N, 0, 1)
        assert (plan[1], plan[2]) == (int(r["segments"]), int(r["seg_len"])), (b, L, D, plan)
