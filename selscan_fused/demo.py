"""The main job: `python -m selscan_fused.demo`.

With a CUDA GPU: runs every available path on shape S1 (8 x 2048 x 256, N = 16) in bfloat16 and float32,
checks each against the float64 evaluation and prints a table of times and relative errors (a short
version of benchmarks/ablation_table.py). Without one: says so and checks the reference on a small case.
Either way it ends by naming the full commands and docs/results.md, where their results are.
"""
from __future__ import annotations

import torch

import selscan_fused
from selscan_fused.reference import selective_scan_ref


def make_inputs(batch, L, Dm, N, dtype, device):
    """Layer inputs with the original model's initialisation scales (also used by benchmarks/bench.py)."""
    bound = Dm ** -0.5
    u = lambda *s: (torch.rand(*s, device=device) * 2 - 1) * bound
    return dict(x=torch.randn(batch, L, Dm, device=device).to(dtype), A_log=torch.randn(Dm, N, device=device),
                W_delta=u(Dm, Dm).to(dtype), b_delta=u(Dm), W_B=u(N, Dm).to(dtype), W_C=u(N, Dm).to(dtype),
                D=torch.randn(Dm, device=device))


def _f64(inp):
    f = {k: v.double() for k, v in inp.items()}
    return selective_scan_ref(f["x"], f["A_log"], f["W_delta"], f["b_delta"], f["W_B"], f["W_C"], f["D"])[0]


def _rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


def _time_ms(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return sorted(times)[len(times) // 2]


FULL = ("The full commands: python benchmarks/ablation_table.py (every path, S1-S5 and R, every dtype), "
        "python benchmarks/paper_figure.py (the Mamba paper's efficiency figure), python benchmarks/bench.py "
        "--train (the training step); their results on an H200 and what they mean: docs/results.md.")


def main() -> None:
    print(f"selscan_fused {selscan_fused.__version__}, torch {torch.__version__}")
    if not torch.cuda.is_available():
        print("No CUDA GPU visible: the CUDA paths cannot run here. Checking the reference on a small case.")
        inp = make_inputs(2, 64, 32, 8, torch.float32, "cpu")
        y = selscan_fused.selective_scan(**{k: v for k, v in inp.items()}, impl="reference")
        print(f"reference float32 vs float64 evaluation, (2, 64, 32, N=8): rel L2 error {_rel(y, _f64(inp)):.2e}")
        print(f"CUDA extension built: {selscan_fused.extension_available()}")
        print(FULL)
        return
    if not selscan_fused.extension_available():
        from selscan_fused._extension import extension_error_message
        raise SystemExit(extension_error_message("unfused"))
    print(f"GPU: {torch.cuda.get_device_name()}.  Shape S1: batch 8, L 2048, D 256, N 16.")
    print(f"{'dtype':22} {'path':10} {'ms':>9} {'rel L2 err':>11} {'bound':>7}")
    modes = [("bfloat16", torch.bfloat16, "highest", 1e-2), ("float16", torch.float16, "highest", 3e-3),
             ("float32 ('highest')", torch.float32, "highest", 1e-5), ("float32 ('high')", torch.float32, "high", 1e-3)]
    from selscan_fused.api import unsupported_reason
    probe = torch.empty(1, 1, 256, device="cuda")
    impls = (["fused"] if selscan_fused._extension.fused_extension_available()
             and unsupported_reason("fused", probe, 16) is None else []) + ["unfused", "reference"]
    ok = True
    for name, dtype, prec, bound in modes:
        torch.set_float32_matmul_precision(prec)
        inp = make_inputs(8, 2048, 256, 16, dtype, "cuda")
        y64 = _f64(inp)
        for impl in impls:
            fn = lambda: selscan_fused.selective_scan(**inp, impl=impl)
            err = _rel(fn(), y64)
            ms = _time_ms(fn, reps=3 if impl == "reference" else 20)
            ok &= err < bound
            print(f"{name:22} {impl:10} {ms:9.3f} {err:11.2e} {bound:7.0e}{'' if err < bound else '  FAIL'}")
    torch.set_float32_matmul_precision("highest")
    print("all paths within the bounds of docs/math.md" if ok else "SOME PATHS EXCEED THE BOUNDS OF docs/math.md")
    print(FULL)
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
