"""The Mamba paper's efficiency figure (Gu and Dao 2023, Fig. 8 left, App. E.5) on this GPU: shape P,
batch 1, D = 1024, N = 16, bfloat16, L = 512 ... 512K, one row per (path, L, mode), written to a CSV.

    python benchmarks/paper_figure.py                           # every path, forward and forward+backward
    python benchmarks/paper_figure.py --max-L 65536 --paths fused,attention --modes fwd
    python benchmarks/plot_results.py figure docs/paper_figure.csv docs/paper_figure.png

Paths:
    fused          this project's fused layer, x -> y with the projections
    unfused        this project's unfused layer (cuBLAS projections + scan kernel)
    scan           this project's scan kernel alone on precomputed projections (forward only; the paper
                   times its scan without the projections)
    mamba-scan     mamba-ssm's scan kernel alone (when selective_scan_cuda imports; benchmarks/peers.py)
    mamba-user     mamba-ssm's layer as its users run it: cuBLAS projections + its scan kernels
    attention      torch's scaled_dot_product_attention, causal, 16 heads x 64, the flash backend
                   (FlashAttention-2's kernel inside PyTorch)
    pytorch-scan   a standard parallel scan in PyTorch that materialises (L, D, N): log2(L) doubling
                   steps, each over the whole (L, D, N) tensors (the paper's "standard scan" baseline)
    fft-conv       an FFT convolution of length L (torch.fft; the paper's convolution baseline)

Timing (CUDA): "gpu ms" is the call captured in a CUDA graph and replayed (events, L2 flushed, median
of --reps; falls back to the plain call where capture fails, marked in the status), "eager ms" the plain
call with the host. Forward + backward rows time the forward and torch.autograd.grad of a random
upstream gradient. A path that runs out of memory at some L is marked "oom" there and not tried at
larger L. Rows already in the CSV (same path, mode, L, dtype, GPU) are kept and skipped: a long sweep
resumes where it stopped. --device cpu runs the PyTorch baselines on the CPU (a smoke test).
"""
from __future__ import annotations

import argparse
import csv
import datetime
import math
import os
import sys
import time

import torch
import torch.nn.attention  # noqa: F401  (sdpa_kernel)
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peers  # noqa: E402

import selscan_fused  # noqa: E402

PATHS = ["fused", "unfused", "scan", "mamba-scan", "mamba-user", "attention", "pytorch-scan", "fft-conv"]
FORWARD_ONLY = {"scan"}
FIELDS = ["path", "mode", "L", "batch", "D", "N", "dtype", "gpu_ms", "eager_ms", "status", "gpu", "torch", "date"]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class Unavailable(Exception):
    """The path cannot run here (no kernel, no GPU); the row says why."""


def _layer_inputs(L, Dm, N, dt, device, grad):
    g = torch.Generator(device="cpu").manual_seed(L)
    bound = Dm ** -0.5

    def u(*s):
        return ((torch.rand(*s, generator=g) * 2 - 1) * bound).to(device)
    inp = dict(x=torch.randn(1, L, Dm, generator=g).to(device, dt), A_log=torch.randn(Dm, N, generator=g).to(device),
               W_delta=u(Dm, Dm).to(dt), b_delta=u(Dm), W_B=u(N, Dm).to(dt), W_C=u(N, Dm).to(dt),
               D=torch.randn(Dm, generator=g).to(device))
    if grad:
        for v in inp.values():
            v.requires_grad_(True)
    return inp


def _pytorch_scan(x, A_log, W_delta, b_delta, W_B, W_C, D):
    """The standard parallel scan: dA = exp(delta A) and dBx (L, D, N) in memory, then Hillis-Steele
    doubling (h_t = a_t h_{t-k} + h_t, a_t = a_t a_{t-k}) over log2(L) steps, float32."""
    xf = x.float()
    delta = F.softplus(xf @ W_delta.float().T + b_delta)             # (1, L, D)
    Bt, Ct = xf @ W_B.float().T, xf @ W_C.float().T                  # (1, L, N)
    a = torch.exp(delta[..., None] * -torch.exp(A_log))              # (1, L, D, N)
    h = (delta * xf)[..., None] * Bt[:, :, None, :]
    k = 1
    while k < x.shape[1]:
        h = torch.cat([h[:, :k], a[:, k:] * h[:, :-k] + h[:, k:]], dim=1)
        a = torch.cat([a[:, :k], a[:, k:] * a[:, :-k]], dim=1)
        k *= 2
    return (torch.einsum("bldn,bln->bld", h, Ct) + D * xf).to(x.dtype)


def _fft_conv(x, kernel):
    """y = x * k along L (causal), one kernel per channel: rfft of length 2L."""
    L = x.shape[1]
    X = torch.fft.rfft(x.float(), n=2 * L, dim=1)
    K = torch.fft.rfft(kernel.float(), n=2 * L, dim=0)
    return torch.fft.irfft(X * K, n=2 * L, dim=1)[:, :L].to(x.dtype)


def build(path, L, Dm, N, dt, device, train):
    """A callable running the path once (forward, or forward + backward when train)."""
    cuda = device == "cuda"
    if path in ("fused", "unfused", "scan", "mamba-scan", "mamba-user") and not cuda:
        raise Unavailable("needs CUDA")
    if path in ("fused", "unfused", "scan") and not selscan_fused.extension_available():
        raise Unavailable("the extension is not built")
    if path == "fused":
        probe = torch.empty(1, 1, Dm, device=device, dtype=dt)
        reason = selscan_fused.api.unsupported_reason("fused", probe, N)
        if reason or not selscan_fused._extension.fused_extension_available():
            raise Unavailable(reason or "the fused extension did not load")
    if path.startswith("mamba") and not peers.available():
        raise Unavailable("selective_scan_cuda does not import")
    inp = _layer_inputs(L, Dm, N, dt, device, train and path not in FORWARD_ONLY)
    names = ("x", "A_log", "W_delta", "b_delta", "W_B", "W_C", "D")
    args = [inp[k] for k in names]
    if path in ("fused", "unfused"):
        def fwd():
            return selscan_fused.selective_scan(*args, impl=path)
    elif path == "scan":
        with torch.no_grad():
            proj = (inp["x"] @ torch.cat([inp["W_delta"], inp["W_B"], inp["W_C"]]).T).contiguous()

        def fwd():
            return torch.ops.selscan_fused.scan_fwd(proj, inp["x"], inp["A_log"], inp["b_delta"], inp["D"], None,
                                                    False, 0)
    elif path == "mamba-user":
        def fwd():
            return peers.user_path(*args)
    elif path == "mamba-scan":
        x = inp["x"]
        with torch.no_grad():
            u = x.transpose(1, 2).contiguous()
            delta = (x @ inp["W_delta"].T).transpose(1, 2).contiguous()
            Bm = (x @ inp["W_B"].T).transpose(1, 2).contiguous().unsqueeze(1)
            Cm = (x @ inp["W_C"].T).transpose(1, 2).contiguous().unsqueeze(1)
            A = -torch.exp(inp["A_log"].detach().float())
        mamba_args = [t.detach().requires_grad_(train) for t in (u, delta, A, Bm, Cm, inp["D"].detach().float(),
                                                                 inp["b_delta"].detach().float())]
        args = mamba_args

        def fwd():
            return peers._MambaScan.apply(*mamba_args)
    elif path == "attention":
        heads, hd = 16, Dm // 16
        g = torch.Generator(device="cpu").manual_seed(L + 1)
        qkv = [torch.randn(1, heads, L, hd, generator=g).to(device, dt).requires_grad_(train) for _ in range(3)]
        args = qkv

        def fwd():
            if cuda:
                with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
                    return F.scaled_dot_product_attention(*qkv, is_causal=True)
            return F.scaled_dot_product_attention(*qkv, is_causal=True)
    elif path == "pytorch-scan":
        def fwd():
            return _pytorch_scan(*args)
    elif path == "fft-conv":
        g = torch.Generator(device="cpu").manual_seed(L + 2)
        kernel = (torch.randn(L, Dm, generator=g) / math.sqrt(L)).to(device).requires_grad_(train)
        args = [inp["x"], kernel]

        def fwd():
            return _fft_conv(inp["x"], kernel)
    else:
        raise ValueError(f"unknown path {path!r}; the paths are {PATHS}")
    if not train:
        return fwd
    leaves = [t for t in args if t.requires_grad]
    out = fwd()
    dy = torch.randn_like(out)
    del out

    def step():
        return torch.autograd.grad(fwd(), leaves, dy)
    return step


def _median_cpu_ms(fn, reps):
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def measure(fn, device, reps, train):
    """(gpu ms, eager ms, status)."""
    if device != "cuda":
        with torch.set_grad_enabled(train):
            fn()
            ms = _median_cpu_ms(fn, reps)
        return ms, ms, "ok (cpu: wall time)"
    from bench import median_ms, time_ms, time_train  # noqa: E402  (CUDA only: events, L2 flush)
    try:
        if train:
            gpu, eager, _ = time_train(fn, reps)
        else:
            eager = time_ms(fn, reps)
            gpu = time_ms(fn, reps, graph=True)
        return gpu, eager, "ok"
    except torch.cuda.OutOfMemoryError:  # a RuntimeError too: the sweep marks the length
        raise
    except RuntimeError as e:  # not capturable: the plain call's time, marked
        torch.cuda.synchronize()
        with torch.set_grad_enabled(train):
            eager = median_ms(fn, reps)
        return eager, eager, f"ok (no graph: {str(e).splitlines()[0][:80]})"


def read_rows(path):
    if not os.path.exists(path):
        return []
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def write_rows(path, rows):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in FIELDS})


def lengths(min_L, max_L):
    out, L = [], min_L
    while L <= max_L:
        out.append(L)
        L *= 2
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--min-L", type=int, default=512)
    ap.add_argument("--max-L", type=int, default=512 * 1024)
    ap.add_argument("--paths", default=",".join(PATHS))
    ap.add_argument("--modes", default="fwd,fwd+bwd")
    ap.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    ap.add_argument("--D", type=int, default=1024)
    ap.add_argument("--N", type=int, default=16)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--csv", default="docs/paper_figure.csv")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    a = ap.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("benchmarks/paper_figure.py: no CUDA GPU (--device cpu runs the PyTorch baselines)")
    gpu = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
    paths = a.paths.split(",")
    for p in paths:
        if p not in PATHS:
            sys.exit(f"unknown path {p!r}; the paths are {','.join(PATHS)}")
    rows = read_rows(a.csv)
    done = {(r["path"], r["mode"], int(r["L"]), r["dtype"], r["gpu"]) for r in rows}
    jobs = [(p, m, L) for m in a.modes.split(",") for p in paths for L in lengths(a.min_L, a.max_L)
            if not (m == "fwd+bwd" and p in FORWARD_ONLY)]
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is optional (pip install .[bench])
        def tqdm(it, **kw):
            return it
    out_of_memory = {(r["path"], r["mode"]) for r in rows if r["status"] == "oom" and r["gpu"] == gpu}
    dt = DTYPES[a.dtype]
    for path, mode, L in tqdm(jobs, desc="paper figure", unit="row"):
        key = (path, mode, L, a.dtype, gpu)
        if key in done:
            continue
        row = dict(path=path, mode=mode, L=L, batch=1, D=a.D, N=a.N, dtype=a.dtype, gpu=gpu, torch=torch.__version__,
                   date=datetime.date.today().isoformat())
        if (path, mode) in out_of_memory:
            row["status"] = "oom"
        else:
            fn = None
            try:
                fn = build(path, L, a.D, a.N, dt, a.device, mode == "fwd+bwd")
                row["gpu_ms"], row["eager_ms"], row["status"] = measure(fn, a.device, a.reps, mode == "fwd+bwd")
            except Unavailable as e:
                row["status"] = f"unavailable: {e}"
            except torch.cuda.OutOfMemoryError:
                row["status"] = "oom"
                out_of_memory.add((path, mode))
            finally:
                del fn
                if a.device == "cuda":
                    torch.cuda.empty_cache()
        for k in ("gpu_ms", "eager_ms"):
            if isinstance(row.get(k), float):
                row[k] = f"{row[k]:.4f}"
        rows.append(row)
        done.add(key)
        write_rows(a.csv, rows)  # after every row: a stopped sweep resumes here
    print_summary(rows, gpu, a.dtype)


def print_summary(rows, gpu, dtype):
    """The table, and the paper's claims against what this GPU measured."""
    mine = [r for r in rows if r["gpu"] == gpu and r["dtype"] == dtype]
    for mode in ("fwd", "fwd+bwd"):
        sel = [r for r in mine if r["mode"] == mode]
        if not sel:
            continue
        paths = [p for p in PATHS if any(r["path"] == p for r in sel)]
        Ls = sorted({int(r["L"]) for r in sel})
        print(f"\n{mode}, {dtype}, {gpu}: gpu ms")
        print("L".rjust(8) + "".join(p.rjust(14) for p in paths))
        for L in Ls:
            cells = []
            for p in paths:
                r = next((r for r in sel if r["path"] == p and int(r["L"]) == L), None)
                cells.append("-" if r is None else (r["gpu_ms"] if r["status"].startswith("ok") else r["status"][:12]))
            print(f"{L:8d}" + "".join(c.rjust(14) for c in cells))
    for line in claims(mine):
        print(line)


def _ms(rows, path, mode, L):
    r = next((r for r in rows if r["path"] == path and r["mode"] == mode and int(r["L"]) == L
              and r["status"].startswith("ok")), None)
    return float(r["gpu_ms"]) if r else None


def claims(rows, mode="fwd"):
    """The paper's three efficiency claims, each against this project's paths as measured."""
    out = [f"\nThe paper's claims ({'forward' if mode == 'fwd' else 'forward + backward'}, gpu ms):"]
    Ls = sorted({int(r["L"]) for r in rows})
    for ours in ("scan", "fused", "unfused"):
        faster = [L for L in Ls if (_ms(rows, ours, mode, L) or math.inf) < (_ms(rows, "attention", mode, L) or 0)]
        if faster:
            out.append(f"- faster than FlashAttention-2 beyond 2K: {ours} is faster from L = {min(faster)} "
                       f"(at {len(faster)} of the {len(Ls)} lengths)")
        ratios = [(L, _ms(rows, "pytorch-scan", mode, L) / _ms(rows, ours, mode, L)) for L in Ls
                  if _ms(rows, "pytorch-scan", mode, L) and _ms(rows, ours, mode, L)]
        if ratios:
            lo, hi = min(r for _, r in ratios), max(r for _, r in ratios)
            out.append(f"- 20-40x faster than a standard PyTorch scan: {ours} {lo:.1f}x to {hi:.1f}x "
                       f"(L = {ratios[0][0]} .. {ratios[-1][0]})")
        a32, o32 = _ms(rows, "attention", mode, 32768), _ms(rows, ours, mode, 32768)
        if a32 and o32:
            out.append(f"- 7x faster than attention at 32K: {ours} {a32 / o32:.1f}x")
    return out


if __name__ == "__main__":
    main()
