"""Plots of the committed results (matplotlib, PNG): the paper figure's CSV (benchmarks/paper_figure.py)
as time against L, log-log, one line per path, forward and forward + backward side by side.

    python benchmarks/plot_results.py figure docs/paper_figure.csv docs/paper_figure.png

matplotlib is an optional extra (pip install .[bench]); the op never needs it.
"""
from __future__ import annotations

import argparse
import csv
import sys


def plot_figure(csv_path, png_path, gpu=None):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    with open(csv_path, newline="") as fh:
        rows = [r for r in csv.DictReader(fh) if r["status"].startswith("ok") and (gpu is None or r["gpu"] == gpu)]
    if not rows:
        raise SystemExit(f"{csv_path}: no measured rows")
    modes = [m for m in ("fwd", "fwd+bwd") if any(r["mode"] == m for r in rows)]
    fig, axes = plt.subplots(1, len(modes), figsize=(6.5 * len(modes), 4.8), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        sel = [r for r in rows if r["mode"] == mode]
        for path in dict.fromkeys(r["path"] for r in sel):
            pts = sorted((int(r["L"]), float(r["gpu_ms"])) for r in sel if r["path"] == path)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=path)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length L (batch 1)")
        ax.set_ylabel("GPU time, ms")
        r0 = sel[0]
        ax.set_title(f"{'forward' if mode == 'fwd' else 'forward + backward'}: D = {r0['D']}, N = {r0['N']}, "
                     f"{r0['dtype']}, {r0['gpu']}", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path, dpi=130)
    return png_path


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["figure"])
    ap.add_argument("csv")
    ap.add_argument("png")
    ap.add_argument("--gpu", default=None, help="only the rows measured on this GPU (its name)")
    a = ap.parse_args(argv)
    print(plot_figure(a.csv, a.png, a.gpu))


if __name__ == "__main__":
    sys.exit(main())
