"""The ablation table: every path on the named shapes S1-S5 and R, in every dtype, with its speed, its
share of each floor, its speed-ups and its error against float64, printed and written as CSV.

    python benchmarks/ablation_table.py                         # S1-S5, R; bf16, fp16, fp32, fp32-high
    python benchmarks/ablation_table.py --quick                 # S1 and S5-1 in bf16 (seconds)
    python benchmarks/ablation_table.py --shapes S2 --dtypes bf16 --csv /tmp/s2.csv

Paths: reference (plain PyTorch, where it finishes quickly: L <= 8192, at most --reference-max tokens x D x N),
unfused, fused, scan (this project's scan kernel alone on precomputed projections), and mamba-ssm's
user path and scan kernel when `selective_scan_cuda` imports (benchmarks/peers.py). Columns:
gpu ms (CUDA-graph replay, L2 flushed, median of --reps), eager ms, TFLOP/s of the necessary products
(2 tokens D (D + 2N)), exponentials per second, GB/s (x read, y written), the share of each floor
(floor / time: exponentials, io, GEMM; docs/perf/layer-forward.md), the speed-up over the unfused path and over
mamba-ssm's user path, and the relative L2 error of y against float64 on the same inputs. The paths
differ in what they round: in bf16 the fused kernel keeps the projections in float32, the unfused
path and mamba-ssm's round them to bf16 before the scan; an ablation has to know this.
"""
from __future__ import annotations

import argparse
import csv
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peers  # noqa: E402
from bench import TORCH_DTYPE, make, time_ms  # noqa: E402
from compare_results import HOST_TIMED_PATHS  # noqa: E402
from shapes import floors, shape_dims  # noqa: E402

import selscan_fused  # noqa: E402
from selscan_fused.api import unsupported_reason  # noqa: E402
from selscan_fused.reference import selective_scan_ref  # noqa: E402

# R: prefill of a few prompts (batch 1, 2, 4; L 256 .. 8192; D 1024, 2048)
R_SHAPES = ["1x256x1024x16", "1x2048x1024x16", "1x2048x2048x16", "2x1024x2048x16", "4x8192x1024x16"]
DEFAULT_SHAPES = ["S1", "S2", "S3", "S4", "S5-1", "S5-16", "S5-64"] + R_SHAPES
FIELDS = ["shape", "dtype", "path", "gpu_ms", "eager_ms", "tflops", "texp_s", "gb_s", "share_exp", "share_io",
          "share_gemm", "x_unfused", "x_mamba_user", "rel_err", "status"]


def paths_for(inp, dtype, reference_max):
    """[(name, callable)] for the paths that run these inputs."""
    x = inp["x"]
    b, L, D = x.shape
    N = inp["A_log"].shape[1]
    args = (x, inp["A_log"], inp["W_delta"], inp["b_delta"], inp["W_B"], inp["W_C"], inp["D"])
    out = []
    if L <= 8192 and b * L * D * N <= reference_max:
        out.append(("reference", lambda: selscan_fused.selective_scan(*args, impl="reference")))
    out.append(("unfused", lambda: selscan_fused.selective_scan(*args, impl="unfused")))
    if selscan_fused._extension.fused_extension_available() and unsupported_reason("fused", x, N) is None:
        out.append(("fused", lambda: selscan_fused.selective_scan(*args, impl="fused")))
    proj = (x.reshape(-1, D) @ torch.cat([inp["W_delta"], inp["W_B"], inp["W_C"]]).T).view(b, L, -1)
    out.append(("scan", lambda: torch.ops.selscan_fused.scan_fwd(proj, x, inp["A_log"], inp["b_delta"], inp["D"],
                                                                 None, False, 0)[0]))
    if peers.available():
        out.append(("mamba-user", lambda: peers.user_path(*args)))
        u = x.transpose(1, 2).contiguous()
        delta = proj[..., :D].transpose(1, 2).contiguous()
        Bm = proj[..., D:D + N].transpose(1, 2).contiguous().unsqueeze(1)
        Cm = proj[..., D + N:].transpose(1, 2).contiguous().unsqueeze(1)
        A = -torch.exp(inp["A_log"].float())
        out.append(("mamba-scan", lambda: peers.scan_only(u, delta, A, Bm, Cm, inp["D"].float(),
                                                          inp["b_delta"].float()).transpose(1, 2)))
    return out


def rel_err(y, y64):
    y, y64 = y.double(), y64.double()
    return ((y - y64).norm() / y64.norm()).item()


def table(shapes, dtypes, reps, reference_max):
    rows = []
    for shape in shapes:
        b, L, D, N = shape_dims(shape)
        for dtype in dtypes:
            torch.set_float32_matmul_precision("high" if dtype == "fp32-high" else "highest")
            inp = make(shape, dtype)
            f = floors(shape, dtype)
            with torch.no_grad():
                f64 = {k: v.double() for k, v in inp.items() if v is not None}
                y64, _ = selective_scan_ref(f64["x"], f64["A_log"], f64["W_delta"], f64["b_delta"], f64["W_B"],
                                            f64["W_C"], f64["D"])
                del f64
            res = {}
            for name, fn in paths_for(inp, dtype, reference_max):
                row = dict(shape=shape, dtype=dtype, path=name)
                try:
                    with torch.no_grad():
                        y = fn()
                        y = y[0] if isinstance(y, tuple) else y
                        row["rel_err"] = rel_err(y, y64)
                        del y
                    graph = name not in HOST_TIMED_PATHS  # the reference's Python loop: timed as called
                    row["gpu_ms"] = time_ms(fn, reps if graph else 3, graph=graph)
                    row["eager_ms"] = time_ms(fn, reps if graph else 3)
                    ms = row["gpu_ms"]
                    tokens = b * L
                    row["tflops"] = 2 * tokens * D * (D + 2 * N) / (ms * 1e-3) / 1e12
                    row["texp_s"] = tokens * D * N / (ms * 1e-3) / 1e12
                    row["gb_s"] = tokens * D * 2 * inp["x"].element_size() / (ms * 1e-3) / 1e9
                    row["share_exp"], row["share_io"], row["share_gemm"] = (f.exp_ms / ms, f.io_ms / ms,
                                                                            f.gemm_ms / ms)
                    row["status"] = "ok"
                except (RuntimeError, ValueError) as e:
                    row["status"] = f"error: {str(e).splitlines()[0][:100]}"
                res[name] = row
                rows.append(row)
            for row in res.values():
                for ref, col in (("unfused", "x_unfused"), ("mamba-user", "x_mamba_user")):
                    if row.get("gpu_ms") and res.get(ref, {}).get("gpu_ms"):
                        row[col] = res[ref]["gpu_ms"] / row["gpu_ms"]
            del inp, y64
            torch.cuda.empty_cache()
    torch.set_float32_matmul_precision("highest")
    return rows


def fmt(v, spec):
    return format(v, spec) if isinstance(v, float) else (str(v) if v is not None else "-")


def print_table(rows):
    hdr = (f"{'shape':15} {'dtype':9} {'path':11} {'gpu ms':>8} {'eager':>8} {'TFLOP/s':>7} {'Texp/s':>6} "
           f"{'GB/s':>6} {'exp%':>5} {'io%':>5} {'gemm%':>5} {'x unf':>6} {'x mamba':>7} {'rel err':>8}")
    print(hdr)
    for r in rows:
        if r.get("status") != "ok":
            print(f"{r['shape']:15} {r['dtype']:9} {r['path']:11} {r.get('status')}")
            continue
        pct = lambda v: f"{100 * v:5.0f}"  # noqa: E731
        print(f"{r['shape']:15} {r['dtype']:9} {r['path']:11} {r['gpu_ms']:8.4f} {r['eager_ms']:8.4f} "
              f"{r['tflops']:7.1f} {r['texp_s']:6.2f} {r['gb_s']:6.0f} {pct(r['share_exp'])} {pct(r['share_io'])} "
              f"{pct(r['share_gemm'])} {fmt(r.get('x_unfused'), '6.2f'):>6} {fmt(r.get('x_mamba_user'), '7.2f'):>7} "
              f"{r['rel_err']:8.1e}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(DEFAULT_SHAPES))
    ap.add_argument("--dtypes", default="bf16,fp16,fp32,fp32-high")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--reference-max", type=int, default=2**28,
                    help="largest tokens x D x N timed for the reference (which also needs L <= 8192)")
    ap.add_argument("--csv", default="docs/ablation_table.csv")
    ap.add_argument("--quick", action="store_true", help="S1 and S5-1 in bf16, 5 reps, no CSV unless --csv is given")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available() or not selscan_fused.extension_available():
        sys.exit("benchmarks/ablation_table.py needs a CUDA GPU and the built extension")
    shapes, dtypes, reps = a.shapes.split(","), a.dtypes.split(","), a.reps
    if a.quick:
        shapes, dtypes, reps = ["S1", "S5-1"], ["bf16"], 5
    for d in dtypes:
        if d not in TORCH_DTYPE:
            sys.exit(f"unknown dtype {d!r}; one of {','.join(TORCH_DTYPE)}")
    print(f"ablation table: {torch.cuda.get_device_name()}, torch {torch.__version__}, mamba-ssm kernels: "
          f"{'yes' if peers.available() else 'no (selective_scan_cuda does not import)'}")
    rows = table(shapes, dtypes, reps, a.reference_max)
    print_table(rows)
    if a.csv and not (a.quick and a.csv == ap.get_default("csv")):
        os.makedirs(os.path.dirname(os.path.abspath(a.csv)), exist_ok=True)
        with open(a.csv, "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=FIELDS)
            w.writeheader()
            for r in rows:
                w.writerow({k: (f"{r[k]:.6g}" if isinstance(r.get(k), float) else r.get(k, "")) for k in FIELDS})
        print(f"written: {a.csv}")


if __name__ == "__main__":
    main()
