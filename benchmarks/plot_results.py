"""Plots of the committed results (matplotlib, PNG): the paper figure's CSV (benchmarks/paper_figure.py)
as time against L, log-log, one line per path, forward and forward + backward side by side; the
ablation table's CSV (benchmarks/ablation_table.py) as each path's speed-up over mamba-ssm's user path,
one panel per dtype, one group of bars per shape (log scale; 1 = mamba-ssm's user path).

    python benchmarks/plot_results.py figure docs/paper_figure.csv docs/paper_figure.png
    python benchmarks/plot_results.py table docs/ablation_table.csv docs/ablation_table.png

matplotlib is an optional extra (pip install .[bench]); the op never needs it.
"""
from __future__ import annotations

import argparse
import csv
import sys


# one colour per path in every panel and plot
COLOURS = {p: f"C{i}" for i, p in enumerate(["fused", "unfused", "scan", "mamba-scan", "mamba-user", "attention",
                                             "pytorch-scan", "fft-conv", "reference"])}


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _measured_rows(csv_path, keep):
    with open(csv_path, newline="") as fh:
        return [r for r in csv.DictReader(fh) if r["status"].startswith("ok") and keep(r)]


def plot_figure(csv_path, png_path, gpu=None):
    plt = _pyplot()
    rows = _measured_rows(csv_path, lambda r: gpu is None or r["gpu"] == gpu)
    if not rows:
        raise SystemExit(f"{csv_path}: no measured rows")
    modes = [m for m in ("fwd", "fwd+bwd") if any(r["mode"] == m for r in rows)]
    fig, axes = plt.subplots(1, len(modes), figsize=(6.5 * len(modes), 4.8), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        sel = [r for r in rows if r["mode"] == mode]
        for path in dict.fromkeys(r["path"] for r in sel):
            pts = sorted((int(r["L"]), float(r["gpu_ms"])) for r in sel if r["path"] == path)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=path,
                    color=COLOURS.get(path))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length L (batch 1)")
        ax.set_ylabel("GPU time, ms")
        r0 = sel[0]
        ax.set_title(f"{'forward' if mode == 'fwd' else 'forward + backward'}: D = {r0['D']}, N = {r0['N']}, "
                     f"{r0['dtype']}, {r0['gpu']}", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, png_path)


def _save(fig, png_path):
    fig.tight_layout()
    fig.savefig(png_path, dpi=130)
    return png_path


TABLE_PATHS = ("unfused", "fused", "scan", "mamba-scan")


def plot_table(csv_path, png_path):
    plt = _pyplot()
    rows = _measured_rows(csv_path, lambda r: r["x_mamba_user"] not in ("", "nan"))
    if not rows:
        raise SystemExit(f"{csv_path}: no rows with mamba-ssm's user path beside them")
    dtypes = list(dict.fromkeys(r["dtype"] for r in rows))
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    paths = [p for p in TABLE_PATHS if any(r["path"] == p for r in rows)]
    ncol = 2 if len(dtypes) > 1 else 1
    nrow = (len(dtypes) + ncol - 1) // ncol
    fig, axes = plt.subplots(nrow, ncol, figsize=(7.5 * ncol, 3.6 * nrow), squeeze=False)
    width = 0.8 / max(1, len(paths))
    for k, dtype in enumerate(dtypes):
        ax = axes[k // ncol][k % ncol]
        for j, path in enumerate(paths):
            xs, ys = [], []
            for i, shape in enumerate(shapes):
                r = next((r for r in rows if r["dtype"] == dtype and r["shape"] == shape and r["path"] == path), None)
                if r is not None:
                    xs.append(i + (j - (len(paths) - 1) / 2) * width)
                    ys.append(float(r["x_mamba_user"]))
            ax.bar(xs, ys, width=width, label=path, color=COLOURS.get(path))
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_yscale("log")
        ax.set_xticks(range(len(shapes)))
        ax.set_xticklabels(shapes, rotation=30, ha="right", fontsize=7)
        ax.set_ylabel("speed-up over mamba-ssm's user path")
        ax.set_title(f"forward, {dtype} (GPU time)", fontsize=9)
        ax.grid(True, axis="y", which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for k in range(len(dtypes), nrow * ncol):
        axes[k // ncol][k % ncol].axis("off")
    return _save(fig, png_path)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["figure", "table"])
    ap.add_argument("csv")
    ap.add_argument("png")
    ap.add_argument("--gpu", default=None, help="only the rows measured on this GPU (its name)")
    a = ap.parse_args(argv)
    print(plot_figure(a.csv, a.png, a.gpu) if a.what == "figure" else plot_table(a.csv, a.png))


if __name__ == "__main__":
    sys.exit(main())
