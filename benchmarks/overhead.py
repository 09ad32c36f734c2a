"""Host overhead of one eager call, beside one F.linear on the same input (docs/perf/api-and-host.md, "Host
overhead of an eager call").

    python benchmarks/overhead.py                       # S5-1 (1 x 1 x 1024, N = 16), bfloat16
    python benchmarks/overhead.py --shape S5-16 --dtype float32

The host time of a call is the time the Python thread spends in it: `--calls` calls (default 2000) in
batches of 100, the GPU drained between batches (so that a full launch queue never blocks the host), the
median batch's time per call. All variants run interleaved batch by batch in one process, so the
ratios to F.linear are side by side (each the median over the rounds of the ratio to that round's
F.linear batch). No gradient is needed (torch.no_grad): a decode-like call.

Variants:
    F.linear            F.linear(x, W_delta): one cuBLAS product and its output allocation
    op                  torch.ops.selscan_fused.<path>_fwd called as a user would (its autograd kernel
                        passes the call on)
    op (below autograd) the same under torch._C._AutoDispatchBelowAutograd (what selective_scan does)
    selective_scan      the functional API, impl='auto' (its checks, path choice and the op)
    module              SelectiveScan after .to_op_dtypes(dtype) (no parameter converted per call)
    module, f32 params  SelectiveScan with float32 parameters: the three weights cast in every call
    no descriptor cache impl='fused' with the TMA descriptor cache off (every descriptor encoded)
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import selscan_fused  # noqa: E402
from shapes import shape_dims  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def host_us_per_call(fns, calls, batch=100, warmup=200):
    """{name: [host microseconds per call of each batch]} over calls // batch rounds, each round one batch
    of every variant in turn. A variant is a callable, or (callable, before, after) with before/after run
    around each batch, untimed."""
    fns = {k: (v if isinstance(v, tuple) else (v, None, None)) for k, v in fns.items()}
    for f, before, after in fns.values():
        if before:
            before()
        for _ in range(warmup):
            f()
        if after:
            after()
    torch.cuda.synchronize()
    times = {k: [] for k in fns}
    for _ in range(max(1, calls // batch)):
        for k, (f, before, after) in fns.items():
            if before:
                before()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(batch):
                f()
            t1 = time.perf_counter()
            if after:
                after()
            times[k].append((t1 - t0) / batch * 1e6)
    torch.cuda.synchronize()
    return times


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="S5-1", help="a named shape (benchmarks/shapes.py) or BxLxDxN")
    ap.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args()
    if not torch.cuda.is_available() or not selscan_fused.extension_available():
        sys.exit("benchmarks/overhead.py needs a CUDA GPU and the built extension")
    batch, L, Dm, N = shape_dims(args.shape)
    dt = DTYPES[args.dtype]
    torch.manual_seed(0)
    layer32 = selscan_fused.SelectiveScan(Dm, N).cuda()
    layer = selscan_fused.SelectiveScan(Dm, N).cuda()
    layer.load_state_dict(layer32.state_dict())
    if hasattr(layer, "to_op_dtypes"):
        layer.to_op_dtypes(dt)
    else:  # a build from before 2026-12-01 (measuring the before figures)
        for m in (layer.proj_delta, layer.proj_B, layer.proj_C):
            m.weight.data = m.weight.data.to(dt)
    x = torch.randn(batch, L, Dm, device="cuda", dtype=dt)
    A, b, D = layer.A_log.detach(), layer.proj_delta.bias.detach(), layer.D.detach()
    Wd, WB, WC = (m.weight.detach() for m in (layer.proj_delta, layer.proj_B, layer.proj_C))
    path = selscan_fused.resolve_impl("auto", x, N)
    ops = torch.ops.selscan_fused
    if path == "fused":
        op = lambda: ops.fused_fwd(x, A, Wd, b, WB, WC, D, None, False, 0, False, 0, 0)  # noqa: E731
    else:
        op = lambda: ops.unfused_fwd(x, A, Wd, b, WB, WC, D, None, False, 0)  # noqa: E731

    def op_below():
        with torch._C._AutoDispatchBelowAutograd():
            return op()

    fns = {
        "F.linear": lambda: F.linear(x, Wd),
        f"op ({path}_fwd)": op,
        "op (below autograd)": op_below,
        "selective_scan": lambda: selscan_fused.selective_scan(x, A, Wd, b, WB, WC, D),
        "module": lambda: layer(x),
        "module, f32 params": lambda: layer32(x),
    }
    fused_ok = selscan_fused._extension.fused_extension_available() and \
        selscan_fused.api.unsupported_reason("fused", x, N) is None
    if fused_ok:
        fns["selective_scan fused"] = lambda: selscan_fused.selective_scan(x, A, Wd, b, WB, WC, D, impl="fused")
        if hasattr(ops, "fused_set_descriptor_cache"):
            # (call, before the batch, after it): the switch is flipped outside the timed calls
            fns["  no descriptor cache"] = (fns["selective_scan fused"], lambda: ops.fused_set_descriptor_cache(False),
                                            lambda: ops.fused_set_descriptor_cache(True))
    fns["selective_scan unfused"] = lambda: selscan_fused.selective_scan(x, A, Wd, b, WB, WC, D, impl="unfused")
    with torch.no_grad():
        times = host_us_per_call(fns, args.calls)
    # The host's speed drifts between processes and over seconds (F.linear alone: 17-22 us per call
    # across runs on the H200's host). Each variant's ratio is taken round by round against the
    # F.linear batch of the same round, and the median over the rounds is reported.
    us = {k: statistics.median(v) for k, v in times.items()}
    ratio = {k: statistics.median(a / b for a, b in zip(v, times["F.linear"])) for k, v in times.items()}
    print(f"host time per eager call, {args.shape} ({batch} x {L} x {Dm}, N = {N}) {args.dtype}, "
          f"impl='auto' -> {path}, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"{args.calls} calls per variant in {len(times['F.linear'])} interleaved rounds")
    print(f"{'variant':<26} {'us/call':>8} {'x F.linear':>11}")
    for k in us:
        print(f"{k:<26} {us[k]:8.1f} {ratio[k]:11.2f}")
    ok_fn = ratio["selective_scan"] <= 1.5
    ok_mod = ratio["module"] <= 1.7
    print(f"targets: selective_scan <= 1.5x F.linear: {'met' if ok_fn else 'MISSED'} "
          f"({ratio['selective_scan']:.2f}x); module <= 1.7x: {'met' if ok_mod else 'MISSED'} "
          f"({ratio['module']:.2f}x)")

if __name__ == "__main__":
    main()
