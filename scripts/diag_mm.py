"""Accuracy and time of the backward's weight-gradient products dW = G^T X (a long K = batch * L) on this
GPU, for several ways of calling the library, against float64 (GPU).

G is a column slice of a wider (K, P) 16-bit tensor, as the backward's dP is; X is (K, D). Prints, per
shape and variant: the relative L2 error against the float64 product of the same values, the median
time (benchmarks/bench.py's median_ms: CUDA events, the L2 flushed before each of 20 runs, after a
warm-up) and the library kernels that ran (torch.profiler).

    python scripts/diag_mm.py
"""
import contextlib
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from bench import median_ms  # noqa: E402
from selscan_fused._linear import weight_grad  # noqa: E402

SHAPES = [  # (K, M, D, P): G = P[:, off:off+M] of a (K, P) tensor, X (K, D); dW (M, D)
    (4097, 16, 2048, 2080),
    (16385, 256, 256, 288),
    (16385, 16, 256, 288),
    (4097, 2048, 2048, 2080),
    (8 * 2048, 80, 1536, 80),
    (16384, 2048, 2048, 2080),
]


@contextlib.contextmanager
def flags(reduced: bool):
    m = torch.backends.cuda.matmul
    old = (m.allow_bf16_reduced_precision_reduction, m.allow_fp16_reduced_precision_reduction)
    m.allow_bf16_reduced_precision_reduction = reduced
    m.allow_fp16_reduced_precision_reduction = reduced
    try:
        yield
    finally:
        m.allow_bf16_reduced_precision_reduction, m.allow_fp16_reduced_precision_reduction = old


def chunked(G, X, chunk=2048):
    out = torch.zeros(G.shape[1], X.shape[1], device=G.device, dtype=torch.float32)
    for k in range(0, G.shape[0], chunk):
        out += torch.mm(G[k:k + chunk].t(), X[k:k + chunk], out_dtype=torch.float32)
    return out


VARIANTS = {
    "mm (default)": lambda G, X: torch.mm(G.t(), X),
    "mm, reduced-precision reduction off": None,  # same call under flags(False)
    "mm out_dtype=float32": lambda G, X: torch.mm(G.t(), X, out_dtype=torch.float32),
    "mm of a contiguous G^T": lambda G, X: torch.mm(G.t().contiguous(), X),
    "mm X^T G, transposed": lambda G, X: torch.mm(X.t(), G).t(),
    "float32 inputs (no TF32)": lambda G, X: torch.mm(G.float().t(), X.float()),
    "K chunks of 2048, float32 sum": chunked,
}


def timed(fn, n=20):
    for _ in range(3):  # warm-up (the library's heuristics and workspace)
        fn()
    return median_ms(fn, n)


def kernels(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sorted(set(n[:70] for n in names))


def main():
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    print(torch.cuda.get_device_name(), torch.__version__, "cuBLAS", torch.backends.cuda.preferred_blas_library())
    for dtype in (torch.bfloat16, torch.float16):
        for K, M, Dm, P in SHAPES:
            off = P - M if P > M else 0
            Pt = torch.randn(K, P, device="cuda").to(dtype)
            G = Pt[:, off:off + M]
            X = torch.randn(K, Dm, device="cuda").to(dtype)
            ref = G.double().t() @ X.double()
            print(f"\n{dtype} K={K} M={M} D={Dm} (G a slice of width {P})")
            for name, fn in VARIANTS.items():
                reduced = name != "mm, reduced-precision reduction off"
                f = fn or VARIANTS["mm (default)"]
                try:
                    with flags(reduced):
                        out = f(G, X)
                        err = ((out.double() - ref).norm() / ref.norm()).item()
                        ms = timed(lambda: f(G, X))
                        ks = kernels(lambda: f(G, X))
                    print(f"  {name:38s} rel err {err:.2e}  {ms * 1e3:8.1f} us  {ks}")
                except Exception as e:  # noqa: BLE001
                    print(f"  {name:38s} failed: {type(e).__name__}: {str(e)[:120]}")


if __name__ == "__main__" and "--map" not in __import__("sys").argv:
    main()


def trigger_map():
    """Which K (= batch * L) give a wrong product, for the backward's and the block's weight-gradient shapes."""
    torch.manual_seed(1)
    Ks = [1, 7, 63, 64, 65, 1000, 1001, 2047, 2048, 2049, 4095, 4096, 4097, 4100, 4104, 4112, 4128, 4160,
          8193, 16383, 16384, 16385, 16448, 65537]
    shapes = [(16, 2048), (32, 2048), (256, 256), (16, 256), (80, 1536), (1536, 48), (160, 5120), (5120, 160),
              (2048, 2048), (3072, 768), (768, 1536)]
    for dtype, level in ((torch.bfloat16, 4e-3), (torch.float16, 6e-4)):
        print(f"\n{dtype}: relative error of torch.mm(G^T, X) against float64, printed where above {level:.0e}"
              " (G a column slice of a wider tensor, as F.linear's and the backward's weight gradients)")
        bad = 0
        for M, Dm in shapes:
            for K in Ks:
                Pt = torch.randn(K, M + 8, device="cuda").to(dtype)
                G = Pt[:, 8:]
                X = torch.randn(K, Dm, device="cuda").to(dtype)
                ref = G.double().t() @ X.double()
                err = lambda o, r=ref: ((o.double() - r).norm() / r.norm()).item()  # noqa: E731
                e = err(torch.mm(G.t(), X))
                es = err(weight_grad(G, X))
                if e > level or es > level:
                    bad += 1
                    drop = err(torch.mm(G.t(), X), G[:-1].double().t() @ X[:-1].double()) if K > 1 else float("nan")
                    print(f"  M={M:5d} D={Dm:5d} K={K:6d}: mm {e:.2e} (vs the product without the last row: "
                          f"{drop:.2e}); _linear.weight_grad {es:.2e}; {kernels(lambda: torch.mm(G.t(), X))}")
        print(f"  {bad} wrong of {len(shapes) * len(Ks)}")


if __name__ == "__main__" and len(__import__("sys").argv) > 1 and __import__("sys").argv[1] == "--map":
    trigger_map()
