"""Benchmark of every path on the named shapes, side by side in one run.

    python benchmarks/bench.py                       # S1-S5, bf16 and fp32
    python benchmarks/bench.py --train --shapes S1,S2,S3,S4 --dtypes bf16,fp32-high
                                                     # the training step (forward + backward)
    python benchmarks/bench.py --shapes S1,S4 --dtypes bf16 --segments 1,4,16,64   # L-split sweep
    python benchmarks/bench.py --shapes 4x2048x256x16 --dtypes bf16 --impls fused --channel-tiles 0,16,64
                                                     # any BxLxDxN; fused channel tiles side by side

Timing: CUDA events, the L2 cache flushed before every call (a 256 MB write, outside the timed
region), warm-up first, median of --reps calls. Two figures per path:
  gpu ms    the call captured in a CUDA graph and replayed: the GPU's time, host overhead excluded
            (all ratios, Texp/s, GB/s and "x floor" use it);
  eager ms  the plain Python call: adds the host's time when the host is slower than the GPU (tiny
            shapes), as a user calling the op eagerly sees it.
Weights are already in x's dtype (no cast in the timed call). mamba-ssm's columns are the figures
recorded in docs/perf/layer-forward.md for the same H200 model.

--train: one training step of the layer, y = f(x); gradients of x and every parameter for a random
dy (torch.autograd.grad, so nothing accumulates between calls), as a user trains it: float32
parameters, x in the dtype (weights cast inside the step); "gpu ms" is the step captured in a CUDA
graph and replayed, "eager ms" the plain step (host included), medians of --reps, L2 flushed; "peak
MiB" is the step's peak allocation above what was allocated before it. Paths: this project's fused and unfused layer and, when `selective_scan_cuda`
imports (benchmarks/peers.py), mamba-ssm's user path, measured in the same run; the ratios are to it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from shapes import MAMBA_SCAN_ONLY, MAMBA_USER_PATH, floors, shape_dims  # noqa: E402
import peers  # noqa: E402

import selscan_fused  # noqa: E402
from selscan_fused import ScanConfig  # noqa: E402
from selscan_fused.api import unsupported_reason  # noqa: E402
from selscan_fused.demo import make_inputs  # noqa: E402

TORCH_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp32-high": torch.float32}
_flush = None


def median_ms(run, reps: int, flush: bool = True) -> float:
    """Median CUDA-event time of run() over reps calls, the L2 flushed (a 256 MB write) before each
    (flush=False: not flushed, for calls whose inputs are far larger than the L2 anyway)."""
    global _flush
    if flush and _flush is None:
        _flush = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")
    times = []
    for _ in range(reps):
        if flush:
            _flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def time_ms(fn, reps: int, warmup: int = 5, graph: bool = False) -> float:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    run = fn
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(g):
            fn()
        run = g.replay
    with torch.no_grad():
        return median_ms(run, reps)


def make(shape: str, dtype: str):
    b, L, D, N = shape_dims(shape)
    return make_inputs(b, L, D, N, TORCH_DTYPE[dtype], "cuda")


def _has_channel_tile(inp, tile: int) -> bool:
    """Whether the fused kernel has this channel tile for x's dtype and N (asks its planner)."""
    try:
        torch.ops.selscan_fused.fused_plan(inp["x"], inp["A_log"].shape[1], 0, tile)
        return True
    except RuntimeError:
        return False


def paths(inp, impls, segments, rings=(0,), tiles=(0,)):
    """(name, callable) for every path asked for."""
    out = []
    W = torch.cat([inp["W_delta"], inp["W_B"], inp["W_C"]])
    x2 = inp["x"].reshape(-1, inp["x"].shape[-1])
    proj = (x2 @ W.T).view(*inp["x"].shape[:2], -1)
    args = (inp["x"], inp["A_log"], inp["W_delta"], inp["b_delta"], inp["W_B"], inp["W_C"], inp["D"])
    for seg in segments:
        tag = "" if seg == 0 else f"[seg={seg}]"
        if "unfused" in impls:
            cfg = ScanConfig(l_segments=seg)
            out.append((f"unfused{tag}", lambda cfg=cfg: selscan_fused.selective_scan(*args, impl="unfused", config=cfg)))
        if "scan" in impls:
            out.append((f"scan-kernel{tag}", lambda seg=seg: torch.ops.selscan_fused.scan_fwd(
                proj, inp["x"], inp["A_log"], inp["b_delta"], inp["D"], None, False, seg)))
    if "gemm" in impls:
        out.append(("cublas-projections", lambda: x2 @ W.T))
    if (selscan_fused._extension.fused_extension_available()
            and unsupported_reason("fused", inp["x"], inp["A_log"].shape[1]) is None):
        for seg in segments:
            tag = "" if seg == 0 else f"[seg={seg}]"
            # fused-poly: the ablation switch ScanConfig(exp_poly=True); [ring=k]: ScanConfig(ring_stages=k);
            # [tile=c]: ScanConfig(channel_tile=c) (skipped where that layout does not exist).
            for name, poly in (("fused", False), ("fused-poly", True)):
                if name in impls:
                    for ring in rings:
                        for tile in tiles:
                            if not _has_channel_tile(inp, tile):
                                continue
                            rtag = ("" if ring == 0 else f"[ring={ring}]") + ("" if tile == 0 else f"[tile={tile}]")
                            cfg = ScanConfig(l_segments=seg, exp_poly=poly, ring_stages=ring, channel_tile=tile)
                            out.append((f"{name}{tag}{rtag}", lambda cfg=cfg: selscan_fused.selective_scan(
                                *args, impl="fused", config=cfg)))
    return out


def train_step_fn(shape: str, dtype: str, impl: str):
    """A closure running one training step of `impl` ('fused', 'unfused' or 'mamba') on fresh inputs."""
    b, L, D, N = shape_dims(shape)
    inp = make_inputs(b, L, D, N, torch.float32, "cuda")
    params = {k: v.requires_grad_(True) for k, v in inp.items() if k != "x"}
    x = inp["x"].to(TORCH_DTYPE[dtype]).requires_grad_(True)
    dy = torch.randn(b, L, D, device="cuda", dtype=x.dtype)
    leaves = [x, *params.values()]
    names = ("A_log", "W_delta", "b_delta", "W_B", "W_C", "D")

    def step():
        if impl == "mamba":
            y = peers.user_path(x, *(params[k] for k in names))
        else:
            y = selscan_fused.selective_scan(x, *(params[k] for k in names), impl=impl)
        return torch.autograd.grad(y, leaves, dy)
    return step


def time_train(step, reps: int, warmup: int = 3):
    """(gpu ms: median of the step captured in a CUDA graph and replayed; eager ms: median of the plain
    step, host included; peak MiB above the memory allocated before the step)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    eager = median_ms(step, reps)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    gpu = median_ms(g.replay, reps)
    del g
    return gpu, eager, peak


def main_train(a):
    impls = [i for i in a.impls.split(",") if i in ("fused", "unfused")] or ["fused", "unfused"]
    if peers.available():
        impls.append("mamba")
    print(f"training step: device {torch.cuda.get_device_name()}  torch {torch.__version__}  "
          f"mamba-ssm kernels: {'yes' if peers.available() else 'no (selective_scan_cuda does not import)'}")
    print(f"{'shape':6} {'dtype':9} {'path':8} {'gpu ms':>8} {'eager ms':>8} {'peak MiB':>9} {'x mamba':>8} "
          f"{'mem/mamba':>9}")
    rows = []
    for shape in a.shapes.split(","):
        for dtype in a.dtypes.split(","):
            torch.set_float32_matmul_precision("high" if dtype == "fp32-high" else "highest")
            res = {}
            for impl in impls:
                probe = torch.empty(1, 1, shape_dims(shape)[2], device="cuda", dtype=TORCH_DTYPE[dtype])
                if impl == "fused" and (not selscan_fused._extension.fused_extension_available()
                                        or unsupported_reason("fused", probe, shape_dims(shape)[3])):
                    continue
                step = train_step_fn(shape, dtype, impl)
                res[impl] = time_train(step, a.reps)
                del step
                torch.cuda.empty_cache()
            m = res.get("mamba")
            for impl, (ms, eager, peak) in res.items():
                sp = f"{m[0] / ms:8.2f}" if m else "       -"
                mem = f"{peak / m[2]:9.2f}" if m else "        -"
                print(f"{shape:6} {dtype:9} {impl:8} {ms:8.3f} {eager:8.3f} {peak:9.1f} {sp} {mem}")
                rows.append(dict(shape=shape, dtype=dtype, path=impl, step_ms=ms, eager_ms=eager, peak_mib=peak,
                                 mamba_step_ms=m[0] if m else None, mamba_peak_mib=m[2] if m else None))
    torch.set_float32_matmul_precision("highest")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rows, fh, indent=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="S1,S2,S3,S4,S5-1,S5-16,S5-64")
    ap.add_argument("--dtypes", default="bf16,fp32,fp32-high")
    ap.add_argument("--impls", default="fused,unfused,scan,gemm",
                    help="comma list of: fused, fused-poly (ScanConfig(exp_poly=True)), unfused, scan, gemm")
    ap.add_argument("--segments", default="0", help="L-split values to time (0 = automatic)")
    ap.add_argument("--ring-stages", default="0",
                    help="fused operand-ring depths to time (ScanConfig(ring_stages=...); 0 = all that fit)")
    ap.add_argument("--channel-tiles", default="0",
                    help="fused channel tiles to time (ScanConfig(channel_tile=...); 0 = automatic, 16, 64)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--train", action="store_true", help="time the training step instead (see above)")
    a = ap.parse_args()
    if a.train:
        return main_train(a)
    impls = set(a.impls.split(","))
    segments = [int(s) for s in a.segments.split(",")]
    rings = [int(s) for s in a.ring_stages.split(",")]
    tiles = [int(s) for s in a.channel_tiles.split(",")]
    rows = []
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  selscan_fused {selscan_fused.__version__}")
    hdr = (f"{'shape':6} {'dtype':9} {'path':28} {'gpu ms':>8} {'eager ms':>8} {'Texp/s':>7} {'GB/s':>6} "
           f"{'x floor':>7} {'mamba':>7}")
    print(hdr)
    for shape in a.shapes.split(","):
        for dtype in a.dtypes.split(","):
            torch.set_float32_matmul_precision("high" if dtype == "fp32-high" else "highest")
            b, L, D, N = shape_dims(shape)
            inp = make(shape, dtype)
            f = floors(shape, dtype)
            largest = max(f.exp_ms, f.io_ms, f.gemm_ms)
            mamba_key = (shape, dtype)
            for name, fn in paths(inp, impls, segments, rings, tiles):
                ms = time_ms(fn, a.reps, graph=True)
                eager = time_ms(fn, a.reps)
                exps = b * L * D * N / (ms * 1e-3) / 1e12
                gbs = b * L * D * 2 * inp["x"].element_size() / (ms * 1e-3) / 1e9
                peer = MAMBA_SCAN_ONLY.get(mamba_key) if name.startswith("scan") else (
                    MAMBA_USER_PATH.get(mamba_key) if name.startswith(("unfused", "fused")) else None)
                peer_s = f"{peer:7.3f}" if peer else "      -"
                print(f"{shape:6} {dtype:9} {name:28} {ms:8.4f} {eager:8.4f} {exps:7.2f} {gbs:6.0f} {ms / largest:7.2f} {peer_s}")
                rows.append(dict(shape=shape, dtype=dtype, path=name, ms=ms, eager_ms=eager, exp_per_s=exps * 1e12, gb_per_s=gbs,
                                 floor_exp_ms=f.exp_ms, floor_io_ms=f.io_ms, floor_gemm_ms=f.gemm_ms,
                                 mamba_ms=peer))
            del inp
            if a.json:  # after every shape, so that a sweep cut short keeps what it measured
                with open(a.json, "w") as fh:
                    json.dump(rows, fh, indent=1)
    torch.set_float32_matmul_precision("highest")


if __name__ == "__main__":
    main()
