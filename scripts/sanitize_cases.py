#!/usr/bin/env python3
"""The workload scripts/sanitize.sh runs under compute-sanitizer: both CUDA paths, forward and backward,
over a grid that has L = 1, odd L, batch 1, the L split (automatic and forced), the fused kernel's
narrow (16) and wide (64) channel tiles, every N and every dtype / float32 precision. Small sizes: the
tools slow every launch down by orders of magnitude. Checks each result against the float64 evaluation
too (a tool can change timing, never results).

    python scripts/sanitize_cases.py [--quick]      # --quick: a third of the grid (racecheck)
    python scripts/sanitize_cases.py --quick --shard 2/6   # the third of the six parts of that (a slow tool
                                                           # run in parts: K/M runs the runs with index % M == K)
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import torch  # noqa: E402

import selscan_fused  # noqa: E402
from selscan_fused import ScanConfig  # noqa: E402
from conftest import TOLERANCE, float64_eval, make_inputs, rel_l2  # noqa: E402

MODES = {"bfloat16": (torch.bfloat16, "highest"), "float16": (torch.float16, "highest"),
         "float32-highest": (torch.float32, "highest"), "float32-high": (torch.float32, "high")}
# (batch, L, D, N, config)
GRID = [
    (1, 1, 64, 16, {}),
    (3, 7, 128, 8, {}),
    (2, 130, 192, 64, {}),
    (1, 1000, 256, 32, {}),
    (1, 2049, 64, 16, {}),                        # one sequence: the automatic L split
    (2, 600, 128, 16, {"l_segments": 3}),         # a forced L split
    (1, 300, 64, 16, {"channel_tile": 16}),       # fused: the narrow layout (bf16/fp16, N = 16)
    (1, 300, 64, 16, {"channel_tile": 64}),       # fused: the wide layout
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--shard", default="0/1", help="K/M: only the runs whose index modulo M is K")
    args = ap.parse_args()
    k, m = (int(v) for v in args.shard.split("/"))
    index = -1
    hopper = selscan_fused._extension.fused_extension_available() and torch.cuda.get_device_capability() == (9, 0)
    impls = ["unfused"] + (["fused"] if hopper else [])
    runs, worst = 0, 0.0
    for gi, (batch, L, Dm, N, cfg) in enumerate(GRID):
        for mi, (mode, (dt, prec)) in enumerate(MODES.items()):
            if args.quick and (gi + mi) % 3:
                continue
            for impl in impls:
                if impl == "unfused" and "channel_tile" in cfg:
                    continue
                if cfg.get("channel_tile") == 16 and dt == torch.float32:
                    continue
                index += 1
                if index % m != k:
                    continue
                torch.manual_seed(1000 * gi + 10 * mi)
                torch.set_float32_matmul_precision(prec)
                inp = make_inputs(batch, L, Dm, N, dtype=dt, device="cuda", with_h0=bool(gi % 2))
                leaves = {k: v.clone().requires_grad_(True) for k, v in inp.items() if v is not None}
                a = dict(inp, **leaves)
                y, h = selscan_fused.selective_scan(a["x"], a["A_log"], a["W_delta"], a["b_delta"], a["W_B"], a["W_C"],
                                                    a["D"], h0=a["h0"], return_final_state=True, impl=impl,
                                                    config=ScanConfig(**cfg))
                scale = 2.0 ** -6 if dt == torch.float16 else 1.0
                (y.float().sum() * scale + h.sum() * scale).backward()
                with torch.no_grad():
                    y2 = selscan_fused.selective_scan(inp["x"], inp["A_log"], inp["W_delta"], inp["b_delta"],
                                                      inp["W_B"], inp["W_C"], inp["D"], h0=inp["h0"], impl=impl,
                                                      config=ScanConfig(**cfg))
                torch.cuda.synchronize()
                y64, _ = float64_eval(inp)
                err = rel_l2(y2, y64)
                ok = err < TOLERANCE[mode] and torch.equal(y.detach(), y2) and all(
                    bool(torch.isfinite(t.grad).all()) for t in leaves.values())
                print(f"{impl:8s} {mode:16s} {batch}x{L}x{Dm}x{N} {cfg}: rel err {err:.2e} "
                      f"{'ok' if ok else 'WRONG'}", flush=True)
                if not ok:
                    sys.exit(f"wrong result: {impl} {mode} {batch}x{L}x{Dm}x{N} {cfg}")
                runs += 1
                worst = max(worst, err / TOLERANCE[mode])
    torch.set_float32_matmul_precision("highest")
    print(f"{runs} forward+backward runs, all within bounds (worst {worst:.2f} of the bound)")


if __name__ == "__main__":
    main()
