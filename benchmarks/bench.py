"""Benchmark of every path on the named shapes, side by side in one run.

    python benchmarks/bench.py                       # S1-S5, bf16 and fp32
    python benchmarks/bench.py --shapes S1,S4 --dtypes bf16 --segments 1,4,16,64   # L-split sweep
    python benchmarks/bench.py --shapes 4x2048x256x16 --dtypes bf16 --impls fused --channel-tiles 0,16,64
                                                     # any BxLxDxN; fused channel tiles side by side

Timing: CUDA events, the L2 cache flushed before every call (a 256 MB write, outside the timed
region), warm-up first, median of --reps calls. Two figures per path:
  gpu ms    the call captured in a CUDA graph and replayed: the GPU's time, host overhead excluded
            (all ratios, Texp/s, GB/s and "x floor" use it);
  eager ms  the plain Python call: adds the host's time when the host is slower than the GPU (tiny
            shapes), as a user calling the op eagerly sees it.
Weights are already in x's dtype (no cast in the timed call). mamba-ssm's times are FIELD_NOTES'
figures for the same H200 model (not re-measured here: it cannot be built on the GPU machine).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from shapes import MAMBA_SCAN_ONLY, MAMBA_USER_PATH, floors, shape_dims  # noqa: E402

import selscan_fused  # noqa: E402
from selscan_fused import ScanConfig  # noqa: E402
from selscan_fused.api import unsupported_reason  # noqa: E402
from selscan_fused.demo import make_inputs  # noqa: E402

TORCH_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp32-high": torch.float32}
_flush = None


def time_ms(fn, reps: int, warmup: int = 5, graph: bool = False) -> float:
    global _flush
    if _flush is None:
        _flush = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")
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
    times = []
    with torch.no_grad():
        for _ in range(reps):
            _flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


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
    a = ap.parse_args()
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
    torch.set_float32_matmul_precision("highest")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
