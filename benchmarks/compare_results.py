"""A second run of a results table against the committed one, row by row: whether the committed
figures reproduce (docs/results.md, "5. Reproducing").

    python benchmarks/compare_results.py docs/paper_figure.csv NEW.csv       # the paper figure's rows
    python benchmarks/compare_results.py docs/ablation_table.csv NEW.csv     # the ablation table's rows

Rows are matched on the table's key columns (the paper figure: path, mode, L, batch, D, N, dtype; the
ablation table: shape, dtype, path). For each row measured in both ("ok" status), the ratio of the new
GPU time to the committed one; a row is within noise when that ratio is within --tol (default 10%, the
run-to-run spread of a shared machine, docs/perf/README.md). Also listed: rows whose status changed
(one run measured, the other ran out of memory or had no peer) and rows in only one of the two.
Exit status 0 when every row measured in both is within noise and no status changed, 1 otherwise.

Host-timed rows are compared and listed but not held to the noise bound: the ablation table's
reference path is a Python loop over tokens timed as called (no CUDA graph), so its time is the host's
single-thread speed, which differs between machines of the same GPU model by far more than 10%.
"""
from __future__ import annotations

import argparse
import csv
import statistics
import sys

KEYS = {"paper_figure": ["path", "mode", "L", "batch", "D", "N", "dtype"], "ablation_table": ["shape", "dtype", "path"]}
# Paths timed as called, on the host (see above): listed, not held to the GPU noise bound. The ablation
# table times these without a CUDA graph (benchmarks/ablation_table.py reads this set).
HOST_TIMED_PATHS = {"reference"}


def table_kind(fields):
    for kind, keys in KEYS.items():
        if all(k in fields for k in keys):
            return kind
    raise SystemExit(f"not a results table this script knows (columns {fields}); expected the columns of "
                     f"benchmarks/paper_figure.py or benchmarks/ablation_table.py")


def read(path):
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        rows = list(reader)
        return reader.fieldnames or [], rows


def _ok(row):
    return row["status"].startswith("ok")


def compare(old_rows, new_rows, keys, tol):
    """{'within', 'outside', 'status', 'only_old', 'only_new'} lists and the ratios (new / old)."""
    key = lambda r: tuple(r[k] for k in keys)  # noqa: E731
    old = {key(r): r for r in old_rows}
    new = {key(r): r for r in new_rows}
    out = {"within": [], "outside": [], "host": [], "status": [], "only_old": [], "ratios": [],
           "only_new": [k for k in new if k not in old]}
    for k, o in old.items():
        n = new.get(k)
        if n is None:
            out["only_old"].append(k)
        elif _ok(o) and _ok(n):
            ratio = float(n["gpu_ms"]) / float(o["gpu_ms"])
            if o.get("path") in HOST_TIMED_PATHS:
                out["host"].append((k, float(o["gpu_ms"]), float(n["gpu_ms"]), ratio))
                continue
            out["ratios"].append(ratio)
            out["within" if abs(ratio - 1.0) <= tol else "outside"].append((k, float(o["gpu_ms"]), float(n["gpu_ms"]),
                                                                            ratio))
        elif _ok(o) != _ok(n):
            out["status"].append((k, o["status"], n["status"]))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("committed")
    ap.add_argument("new")
    ap.add_argument("--tol", type=float, default=0.10, help="relative difference counted as noise (0.10 = 10%%)")
    a = ap.parse_args(argv)
    f_old, old_rows = read(a.committed)
    f_new, new_rows = read(a.new)
    kind = table_kind(f_old)
    if table_kind(f_new) != kind:
        raise SystemExit(f"{a.committed} is a {kind} table, {a.new} is not")
    res = compare(old_rows, new_rows, KEYS[kind], a.tol)
    name = lambda k: " ".join(f"{c}={v}" for c, v in zip(KEYS[kind], k))  # noqa: E731
    both = len(res["within"]) + len(res["outside"])
    print(f"{kind}: {both} rows measured in both runs, {len(res['within'])} within {a.tol:.0%}, "
          f"{len(res['outside'])} outside; {len(res['status'])} changed status; {len(res['host'])} host-timed; "
          f"{len(res['only_old'])} only in {a.committed}, {len(res['only_new'])} only in {a.new}")
    if res["ratios"]:
        r = sorted(res["ratios"])
        print(f"new / committed GPU time: median {statistics.median(r):.3f}, range {r[0]:.3f} .. {r[-1]:.3f}")
    for k, o, n, ratio in sorted(res["outside"], key=lambda t: -abs(t[3] - 1.0)):
        print(f"  outside: {name(k)}: {o:.4g} -> {n:.4g} ms ({ratio:.3f}x)")
    if res["host"]:
        r = sorted(t[3] for t in res["host"])
        print(f"host-timed rows ({', '.join(sorted(HOST_TIMED_PATHS))}; not held to the tolerance): "
              f"new / committed {r[0]:.3f} .. {r[-1]:.3f}")
    for k, so, sn in res["status"]:
        print(f"  status: {name(k)}: {so!r} -> {sn!r}")
    for k in res["only_old"]:
        print(f"  only in {a.committed}: {name(k)}")
    for k in res["only_new"]:
        print(f"  only in {a.new}: {name(k)}")
    return 0 if not res["outside"] and not res["status"] else 1


if __name__ == "__main__":
    sys.exit(main())
