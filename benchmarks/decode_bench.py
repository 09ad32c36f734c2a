"""Decoding: one token through a whole Mamba language model (embedding, every block's step, norms, LM
head), ms per token, this project's step paths against mamba-ssm's, side by side in one run; with
--prefill, the prompt's prefill too (ours on the unfused and fused sequence paths, mamba-ssm's forward).

    python benchmarks/decode_bench.py [--sizes 130M,1.4B] [--batches 1,16,64,128] [--reps 50]
                                      [--paths torch,kernel,kernel-2,mamba-ssm]
                                      [--dtype bf16] [--csv docs/decode_bench.csv]
                                      [--prefill 1,4,16 --prefill-len 2048 --prefill-csv docs/prefill_bench.csv]

Rows per (size, batch):
  torch      MambaLM.step with decode_impl='torch' (selscan_fused.decode: PyTorch operations)
  kernel     MambaLM.step with decode_impl='kernel' (the decode kernels of csrc/decode/: the middle of a
             layer in one cooperative launch)
  kernel-2   the same with the middle in two kernels (selscan_fused.decode.KERNEL_MID_LAUNCHES = 2: the
             ablation of the one launch; bitwise the same tokens)
  mamba-ssm  mamba-ssm's MambaLMHeadModel on the same weights, its decode path (Mamba.step: causal-conv1d's
             update kernel, the Triton selective_state_update, its fused add + RMSNorm), when mamba_ssm,
             causal_conv1d and their kernels import (the peers' build scripts; kept in the git-ignored
             .peer/ folder, put on PYTHONPATH for this script only). Without them the row says why.
Every path runs the whole token step under one CUDA graph (as both projects' generation does), replayed
--reps times after warm-up, each replay timed by CUDA events; the median is reported. The states are
those of a 16-token prefill. The floor is the bytes a step must move (every weight read once, the
states read and written) over 4.8 TB/s (the H200's memory bandwidth; 4.21 TB/s is its measured copy
rate). Random weights with the models' initialisation; the sizes are the released models'
(d_model, n_layer): 130M (768, 24), 370M (1024, 48), 1.4B (2048, 48), 2.8B (2560, 64); "tiny" (64, 2)
is for a smoke run on the CPU (eager steps, host timer).
"""
from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peers  # noqa: E402
from selscan_fused.block import block_unsupported_reason  # noqa: E402
import selscan_fused.decode as selscan_decode  # noqa: E402
from selscan_fused.decode import decode_kernel_reason  # noqa: E402
from selscan_fused.generation import CUDAGraphStep  # noqa: E402
from selscan_fused.model import MambaLM, MambaLMConfig  # noqa: E402

SIZES = {"tiny": (64, 2), "130M": (768, 24), "370M": (1024, 48), "1.4B": (2048, 48), "2.8B": (2560, 64)}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
BANDWIDTH = 4.8e12
FIELDS = ["size", "batch", "path", "ms_per_token", "floor_ms", "x_floor", "vs_mamba_ssm", "status"]


def build(size: str, dtype, device) -> MambaLM:
    d_model, n_layer = SIZES[size]
    cfg = MambaLMConfig(d_model=d_model, n_layer=n_layer, vocab_size=50277)
    torch.manual_seed(0)
    return MambaLM(cfg, impl="auto", device=device, dtype=dtype).eval()


def floor_ms(model: MambaLM, batch: int) -> float:
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    m = model.backbone.layers[0].mixer
    state = len(model.backbone.layers) * batch * m.d_inner * (m.d_state * 4 + (m.d_conv - 1) * 2)
    return (weights + 2 * state) / BANDWIDTH * 1e3


def time_replays(step, reps: int, cuda: bool) -> float:
    times = []
    for _ in range(3):
        step()
    for _ in range(reps):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            step()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def ours(model: MambaLM, batch: int, path: str, reps: int):
    device = model.lm_head.weight.device
    probe = torch.empty(batch, model.config.d_model, device=device, dtype=model.lm_head.weight.dtype)
    m = model.backbone.layers[0].mixer
    impl = "kernel" if path.startswith("kernel") else path
    if impl == "kernel":
        reason = decode_kernel_reason(probe, m.d_state, m.dt_rank, m.d_conv)
        if reason is not None:
            return None, f"unavailable: {reason}"
    # the middle's launches, read when the step is captured (below)
    selscan_decode.KERNEL_MID_LAUNCHES = 2 if path == "kernel-2" else 1
    model.decode_impl = impl
    cache = model.allocate_cache(batch)
    ids = torch.randint(0, model.config.vocab_size, (batch, 16), device=device)
    with torch.no_grad():
        model.prefill(ids, cache)
        tok = ids[:, -1].clone()
        if device.type == "cuda":
            stepper = CUDAGraphStep(model, cache)
            return time_replays(lambda: stepper(tok), reps, True), "ok"
        return time_replays(lambda: model.step(tok, cache), reps, False), "ok (eager, host timer)"


def mamba_ssm_step(model: MambaLM, batch: int, reps: int):
    """mamba-ssm's decode on the same weights, one CUDA graph per token step; (ms, status)."""
    if model.lm_head.weight.device.type != "cuda":
        return None, "unavailable: needs CUDA"
    try:
        from mamba_ssm.utils.generation import InferenceParams  # type: ignore
        import causal_conv1d  # type: ignore  # noqa: F401
    except Exception as e:  # noqa: BLE001  (any import failure: the row says why)
        return None, f"unavailable: {type(e).__name__}: {e}"
    peer, why = peers.mamba_lm(model)
    if peer is None:
        return None, f"unavailable: {why}"
    c = model.config
    w = model.lm_head.weight
    ip = InferenceParams(max_seqlen=32, max_batch_size=batch)
    ip.key_value_memory_dict = peer.allocate_inference_cache(batch, 32, dtype=w.dtype)
    ids = torch.randint(0, c.vocab_size, (batch, 16), device=w.device)
    with torch.no_grad():
        peer(ids, inference_params=ip)
        ip.seqlen_offset = 16
        tok = ids[:, -1:].clone()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                peer(tok, inference_params=ip, num_last_tokens=1)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            peer(tok, inference_params=ip, num_last_tokens=1)
    return time_replays(graph.replay, reps, True), "ok"


def prefill_rows(model: MambaLM, batches, length: int, reps: int):
    """Prefill (the forward of a whole prompt into the decode cache): ours on each sequence path
    available, and mamba-ssm's forward of the same model; CUDA events, median of reps."""
    device = model.lm_head.weight.device
    rows = []
    for batch in batches:
        ids = torch.randint(0, model.config.vocab_size, (batch, length), device=device)
        res = {}
        for impl in ("unfused", "fused"):
            m = model.backbone.layers[0].mixer
            probe = torch.empty(1, 1, model.config.d_model, device=device, dtype=model.lm_head.weight.dtype)
            reason = block_unsupported_reason(impl, probe, m.d_inner, m.d_state, m.d_conv)
            if reason is not None:
                res[impl] = (None, f"unavailable: {reason}")
                continue
            cache = model.allocate_cache(batch)

            def run():
                cache.reset()
                model.prefill(ids, cache, impl=impl)
            with torch.no_grad():
                res[impl] = (time_replays(run, reps, device.type == "cuda"), "ok")
        res["mamba-ssm"] = (None, "unavailable: needs CUDA") if device.type != "cuda" else _peer_prefill(
            model, ids, reps)
        peer = res["mamba-ssm"][0]
        for path, (ms, status) in res.items():
            rows.append(dict(batch=batch, length=length, path=path, ms="" if ms is None else f"{ms:.3f}",
                             vs_mamba_ssm="" if ms is None or peer is None else f"{peer / ms:.2f}", status=status))
    return rows


def _peer_prefill(model: MambaLM, ids, reps):
    peer, why = peers.mamba_lm(model)
    if peer is None:
        return None, f"unavailable: {why}"
    with torch.no_grad():
        ms = time_replays(lambda: peer(ids, num_last_tokens=1), reps, True)
    return ms, "ok"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="130M,1.4B")
    ap.add_argument("--batches", default="1,16,64,128")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--csv", default=None)
    ap.add_argument("--paths", default="torch,kernel,kernel-2,mamba-ssm", help="the rows to measure (comma-separated)")
    ap.add_argument("--prefill", default="", help="batches of a prefill table too (e.g. 1,4,16), prompt --prefill-len")
    ap.add_argument("--prefill-len", type=int, default=2048)
    ap.add_argument("--prefill-csv", default=None)
    args = ap.parse_args(argv)
    unknown = set(args.paths.split(",")) - {"torch", "kernel", "kernel-2", "mamba-ssm"}
    if unknown:
        ap.error(f"--paths: unknown {sorted(unknown)}; the rows are torch, kernel, kernel-2, mamba-ssm")
    device = torch.device(args.device)
    rows = []
    print(f"{'size':>5} {'batch':>5} {'path':>10} {'ms/token':>9} {'floor':>7} {'x floor':>8} {'vs mamba-ssm':>12}  status")
    for size in args.sizes.split(","):
        model = build(size, DTYPES[args.dtype], device)
        for batch in [int(b) for b in args.batches.split(",")]:
            fl = floor_ms(model, batch)
            paths = args.paths.split(",")
            results = {p: ours(model, batch, p, args.reps) for p in ("torch", "kernel", "kernel-2") if p in paths}
            selscan_decode.KERNEL_MID_LAUNCHES = 1
            if "mamba-ssm" in paths:
                results["mamba-ssm"] = mamba_ssm_step(model, batch, args.reps)
            peer_ms = results.get("mamba-ssm", (None, ""))[0]
            for path, (ms, status) in results.items():
                row = dict(size=size, batch=batch, path=path, ms_per_token="" if ms is None else f"{ms:.4f}",
                           floor_ms=f"{fl:.6f}", x_floor="" if ms is None else f"{ms / fl:.2f}",
                           vs_mamba_ssm="" if ms is None or peer_ms is None else f"{peer_ms / ms:.2f}", status=status)
                rows.append(row)
                print(f"{size:>5} {batch:>5} {path:>10} {row['ms_per_token'] or '-':>9} {fl:7.3f} "
                      f"{row['x_floor'] or '-':>8} {row['vs_mamba_ssm'] or '-':>12}  {status}")
        if args.prefill:
            prows = prefill_rows(model, [int(b) for b in args.prefill.split(",")], args.prefill_len, args.reps)
            for r in prows:
                r["size"] = size
                print(f"prefill {size:>5} {r['batch']:>4}x{r['length']} {r['path']:>10}: {r['ms'] or '-':>9} ms "
                      f"({r['vs_mamba_ssm'] or '-'} x mamba-ssm)  {r['status']}")
            if args.prefill_csv:
                new_file = not os.path.exists(args.prefill_csv) or size == args.sizes.split(",")[0]
                with open(args.prefill_csv, "w" if new_file else "a", newline="") as f:
                    w = csv.DictWriter(f, fieldnames=["size", "batch", "length", "path", "ms", "vs_mamba_ssm",
                                                      "status"])
                    if new_file:
                        w.writeheader()
                    w.writerows(prows)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=FIELDS)
            w.writeheader()
            w.writerows(rows)
    return rows


if __name__ == "__main__":
    main()
