"""impl='auto''s rule (selscan_fused.api.auto_choice) against the committed measurements: on every shape
and dtype of docs/ablation_table.csv, docs/paper_figure.csv, the plan rows of docs/fwd_plan_check.csv and
the training steps of docs/train_check.csv where both CUDA paths were timed, the path the rule picks is
within 3% of the faster one. Runs on the CPU: the rule is a function of dtype and shape, the timings are
the tables' (measured on the H200 by their commands, docs/results.md). When the tables are measured
again, this checks the rule against the new figures."""
import csv
import os
import sys

import pytest
import torch

from selscan_fused.api import FUSED_FP32_MIN_TOKENS, auto_choice

HERE = os.path.dirname(__file__)
DOCS = os.path.join(HERE, "..", "docs")
sys.path.insert(0, os.path.join(HERE, "..", "benchmarks"))
from shapes import shape_dims  # noqa: E402

TOLERANCE = 1.03  # the bound: never a path more than 3% slower than another supported one
DTYPES = {"bf16": (torch.bfloat16, False), "fp16": (torch.float16, False), "fp32": (torch.float32, False),
          "fp32-high": (torch.float32, True)}


def _times(name, key, keep, field="gpu_ms"):
    """{key(row): {path: ms}} over the rows of docs/<name> that keep(row) accepts."""
    times = {}
    with open(os.path.join(DOCS, name)) as f:
        for r in csv.DictReader(f):
            if keep(r):
                times.setdefault(key(r), {})[r["path"]] = float(r[field])
    return sorted(times.items())


def _by_shape(name, what, training, keep, field="gpu_ms"):
    """(label, dtype name, batch, L, D, training, {path: ms}) of a CSV keyed by named shape and dtype."""
    for (shape, dt), t in _times(name, lambda r: (r["shape"], r["dtype"]), keep, field):
        b, L, D, _ = shape_dims(shape)
        yield f"{shape} {dt} {what}", dt, b, L, D, training, t


def _ablation_rows():
    """The ablation table's forward rows."""
    return _by_shape("ablation_table.csv", "forward", False,
                     lambda r: r["path"] in ("fused", "unfused") and r["status"] == "ok")


def _figure_rows():
    """The same from the paper figure (shape P): forward rows, and forward + backward as training."""
    key = lambda r: (int(r["batch"]), int(r["L"]), int(r["D"]), r["dtype"], r["mode"])  # noqa: E731
    for (b, L, D, dt, mode), t in _times("paper_figure.csv", key,
                                         lambda r: r["path"] in ("fused", "unfused") and r["status"] == "ok"):
        yield f"P {b}x{L}x{D} {dt} {mode}", dt, b, L, D, mode == "fwd+bwd", t


def _plan_check_rows():
    """The same from the sweep of every L split under the plans of 2026-12-03 (docs/fwd_plan_check.csv,
    bf16 forward): the rows where each path ran its own plan (requested_segments 0)."""
    return _by_shape("fwd_plan_check.csv", "forward (plan check)", False, lambda r: r["requested_segments"] == "0")


def _train_rows():
    """The same from the training steps of S1-S5 and shape R (docs/train_check.csv: bench.py --train)."""
    return _by_shape("train_check.csv", "training step", True, lambda r: True, field="step_ms")


ROWS = [r for r in list(_ablation_rows()) + list(_figure_rows()) + list(_plan_check_rows()) + list(_train_rows())
        if len(r[6]) == 2]


def test_the_tables_hold_enough_rows_to_check():
    """A check over no rows would pass by itself: the tables must still hold both paths side by side."""
    assert sum(1 for r in ROWS if not r[5]) >= 40, "forward rows with both paths"
    assert sum(1 for r in ROWS if r[5]) >= 40, "forward + backward rows with both paths"
    # and they include the shapes the rule's exceptions were drawn from
    labels = {r[0] for r in ROWS}
    for needed in ("1x2048x2048x16 bf16 forward", "1x2048x1024x16 bf16 forward", "S3 fp32 forward",
                   "P 1x2048x1024 bf16 fwd+bwd", "P 1x65536x1024 bf16 fwd",
                   "1x8192x2048x16 bf16 forward (plan check)", "S3 fp16 training step",
                   "1x2048x2048x16 bf16 training step", "4x8192x1024x16 fp32-high training step"):
        assert needed in labels, needed


@pytest.mark.parametrize("label,dt,batch,L,D,training,times", ROWS, ids=[r[0] for r in ROWS])
def test_auto_picks_a_path_within_3_percent_of_the_fastest(label, dt, batch, L, D, training, times):
    dtype, tf32 = DTYPES[dt]
    pick = auto_choice(dtype, batch, L, D, tf32=tf32, training=training)
    best = min(times.values())
    assert times[pick] <= TOLERANCE * best, (
        f"{label}: impl='auto' picks {pick} at {times[pick]:.4f} ms, the other path takes "
        f"{times['unfused' if pick == 'fused' else 'fused']:.4f} ms")


def test_the_rule_between_the_measured_rows():
    """What the rule says where no table row sits, as docs/perf/api-and-host.md states it."""
    bf16 = torch.bfloat16
    assert auto_choice(bf16, 4, 4096, 2048, tf32=False, training=False) == "fused"      # 128 channel tiles
    assert auto_choice(bf16, 2, 4096, 2048, tf32=False, training=False) == "unfused"    # 64
    assert auto_choice(bf16, 1, 8192, 2048, tf32=False, training=True) == "unfused"
    assert auto_choice(bf16, 16, 8192, 2048, tf32=False, training=True) == "unfused"     # S3's step, at any batch
    assert auto_choice(bf16, 16, 8192, 2048, tf32=False, training=False) == "fused"
    assert auto_choice(bf16, 1, 3000, 1024, tf32=False, training=False) == "fused"      # 8 segments of 384
    assert auto_choice(bf16, 1, 16384, 1024, tf32=False, training=False) == "unfused"   # 16 unfused segments
    assert auto_choice(bf16, 1, 16384, 512, tf32=False, training=False) == "fused"      # D < 1024: not measured
    assert auto_choice(bf16, 2, 2048, 1024, tf32=False, training=False) == "fused"      # 32 channel tiles
    assert auto_choice(bf16, 2, 65536, 1024, tf32=False, training=False) == "fused"
    assert auto_choice(bf16, 1, 65536, 256, tf32=False, training=True) == "fused"       # S4 trains fused
    assert auto_choice(bf16, 1, 1024, 1024, tf32=False, training=True) == "fused"
    assert auto_choice(bf16, 1, 2048, 1024, tf32=False, training=True) == "unfused"
    assert auto_choice(bf16, 1, 4096, 1024, tf32=False, training=True) == "unfused"
    assert auto_choice(bf16, 1, 8192, 1024, tf32=False, training=True) == "fused"
    assert auto_choice(bf16, 1, 65536, 1024, tf32=False, training=True) == "fused"     # the step, not the forward
    assert auto_choice(bf16, 1, 8192, 1024, tf32=False, training=False) == "fused"
    fp32 = torch.float32
    assert auto_choice(fp32, 1, FUSED_FP32_MIN_TOKENS - 1, 64, tf32=False, training=False) == "unfused"
    assert auto_choice(fp32, 1, FUSED_FP32_MIN_TOKENS, 64, tf32=False, training=False) == "fused"
    assert auto_choice(fp32, 16, 4096, 512, tf32=False, training=False) == "fused"      # 128 channel tiles
    assert auto_choice(fp32, 8, 4096, 512, tf32=False, training=False) == "unfused"
    for D in (512, 1024, 4096):
        assert auto_choice(fp32, 8, 4096, D, tf32=True, training=False) == "unfused"
    assert auto_choice(fp32, 8, 4096, 256, tf32=True, training=False) == "fused"
    assert auto_choice(fp32, 8, 4096, 256, tf32=True, training=True) == "unfused"
