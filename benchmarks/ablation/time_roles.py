"""Where each role of the fused kernel spends its cycles (timing only).

Needs a build with the `SELSCAN_TIME_ROLES` switch of roles.patch (README.md here): every role warp
of every CTA then records its SM clock and global-time stamps and the cycles it spent waiting at each
barrier, and the launcher prints the records after each call (it waits for the kernel: a host sync
per call). This script runs one call per shape (after warm-up calls, the L2 cache flushed before it),
reads those lines and prints, per role, the median over warps (and the largest) of each share of its
cycles and of its cycles per tile, the SM clock the CTAs ran at, and how long the launch took from
the first CTA's start to the last CTA's end.

    python benchmarks/ablation/time_roles.py --shapes S1,S5-64 --dtype bf16

Lines (one per warp; the tensor-core warpgroup's 4 warps and every scan warp; tiles are scan tiles):
    SELSCAN_T mma   cta sm warp ns_begin ns_end cycles k_loop empty_wait x_wait epilogue tiles 0
    SELSCAN_T scan1 cta sm warp ns_begin ns_end cycles full_wait x_wait loop tiles 0 0   (scan0: phase 1 of the L split)
ptxas may schedule a clock read on either side of the barrier next to it: the split between two
adjacent fields can shift (the scan's full_wait and x_wait, say), their sum does not.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench import make  # noqa: E402
from shapes import shape_dims  # noqa: E402

import selscan_fused  # noqa: E402
from selscan_fused import ScanConfig  # noqa: E402

FIELDS = {"mma": ("k_loop", "empty_wait", "x_wait", "epilogue"),
          "scan": ("full_wait", "x_wait", "loop")}


def captured(fn) -> str:
    """Runs fn and returns what the launcher printed to the C-level stdout meanwhile."""
    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 1)
        try:
            fn()
            torch.cuda.synchronize()  # (the launcher already waited for its kernel and flushed stdout)
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        tmp.seek(0)
        return tmp.read().decode(errors="replace")


def summarize(text: str) -> None:
    rows = [ln.split()[1:] for ln in text.splitlines() if ln.startswith("SELSCAN_T ")]
    if not rows:
        raise SystemExit("no SELSCAN_T lines: the extension was not built with -DSELSCAN_TIME_ROLES "
                         "(benchmarks/ablation/README.md)")
    begin = min(int(r[4]) for r in rows)
    end = max(int(r[5]) for r in rows)
    print(f"  launch: first CTA start -> last CTA end {(end - begin) / 1e3:.2f} us; "
          f"CTA starts spread over {(max(int(r[4]) for r in rows) - begin) / 1e3:.2f} us")
    for role in sorted({r[0] for r in rows}):
        rs = [r for r in rows if r[0] == role]
        names = FIELDS[role.rstrip("01")]
        cyc = [int(r[6]) for r in rs]
        mhz = [int(r[6]) / max(1, int(r[5]) - int(r[4])) * 1e3 for r in rs]
        tiles = [int(r[7 + len(names)]) for r in rs]
        print(f"  {role:5s} ({len(rs)} warps): cycles median {statistics.median(cyc):.0f} max {max(cyc)}; "
              f"SM clock median {statistics.median(mhz):.0f} MHz; tiles {min(tiles)}-{max(tiles)}")
        for i, name in enumerate(names):
            v = [int(r[7 + i]) for r in rs]
            share = [a / max(1, c) for a, c in zip(v, cyc)]
            per_tile = [a / max(1, t) for a, t in zip(v, tiles)]
            print(f"      {name:11s} median {100 * statistics.median(share):5.1f}% of its cycles "
                  f"(max {100 * max(share):5.1f}%), {statistics.median(per_tile):8.0f} cycles per tile")
        other = [(c - sum(int(r[7 + i]) for i in range(len(names)))) / max(1, c) for r, c in zip(rs, cyc)]
        print(f"      {'other':11s} median {100 * statistics.median(other):5.1f}%")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="S1,S5-64")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--channel-tile", type=int, default=0, help="ScanConfig(channel_tile=...); 0 = automatic")
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    if "SELSCAN_TIME_ROLES" not in selscan_fused.build_info().get("FUSED_NVCC_EXTRA_FLAGS", ""):
        raise SystemExit("this build has no -DSELSCAN_TIME_ROLES (benchmarks/ablation/README.md)")
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    for shape in args.shapes.split(","):
        b, L, D, N = shape_dims(shape)
        inp = make(shape, args.dtype)
        cfg = ScanConfig(channel_tile=args.channel_tile)
        call = lambda: selscan_fused.selective_scan(  # noqa: E731
            inp["x"], inp["A_log"], inp["W_delta"], inp["b_delta"], inp["W_B"], inp["W_C"], inp["D"],
            impl="fused", config=cfg)
        for _ in range(args.warmup):
            captured(call)
        flush.zero_()
        text = captured(call)
        print(f"{shape} {args.dtype} (batch {b}, L {L}, D {D}, N {N}):")
        summarize(text)


if __name__ == "__main__":
    main()
