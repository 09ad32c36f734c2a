"""The Mamba paper's Figure 8 (right): inference throughput, tokens generated per second, for a prompt of
2048 tokens and 128 generated tokens, batch 1 to 128: Mamba-1.4B (this project's MambaLM, and mamba-ssm's
MambaLMHeadModel when it imports) against a Transformer of 1.3B as a user runs it (transformers' GPT-NeoX at
Pythia-1.4B's configuration, SDPA attention, its static cache, greedy generate). Random weights (throughput
does not depend on them; every model generates all 128 tokens: no end-of-sequence token).

    python benchmarks/inference_throughput.py [--batches 1,2,4,8,16,32,64,128] [--prompt 2048] [--gen 128]
        [--models ours,ours-torch,ours-fused,mamba-ssm,transformer] [--csv docs/inference_throughput.csv]
        [--png docs/inference_throughput.png]

Rows: ours (selscan_fused.generate: the prefill through the blocks' sequence path, impl='auto', then the
decode step under a CUDA graph, decode_impl='auto': the decode kernels on CUDA), ours-torch (the same with
the step in PyTorch operations, decode_impl='torch'), ours-fused (the prefill through the blocks' fused
path, impl='fused' (H100/H200), and the decode kernels),
mamba-ssm (its generate(cg=True): its prefill, then its step under its cached CUDA graph), transformer.
Each point: one untimed call (warm-up, graph capture and kernel autotuning included there), then the
median wall time of --reps calls (CUDA synchronised at both ends); throughput = batch x gen / time, the
prompt's prefill included as in the paper. Out of memory is a point of its own (status 'oom').
bfloat16 everywhere. --tiny: models of d_model 64 and 2 layers (a CPU smoke run).
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
import selscan_fused  # noqa: E402
from selscan_fused.block import block_unsupported_reason  # noqa: E402
from selscan_fused.decode import decode_kernel_reason  # noqa: E402
from selscan_fused.model import MambaLM, MambaLMConfig  # noqa: E402

FIELDS = ["model", "batch", "prompt", "gen", "total_ms", "tokens_per_s", "status"]
PAPER = ("the paper (A100 80GB, prompt 2048, 128 generated): Mamba-1.4B reaches 4-5x the throughput of a "
         "Transformer of similar size, which runs out of memory at the largest batches")


def mamba_config(tiny: bool) -> MambaLMConfig:
    return MambaLMConfig(d_model=64 if tiny else 2048, n_layer=2 if tiny else 48, vocab_size=50277)


def build_ours(tiny, device, dtype):
    torch.manual_seed(0)
    return MambaLM(mamba_config(tiny), impl="auto", device=device, dtype=dtype).eval()


def build_transformer(tiny, device, dtype):
    """GPT-NeoX at Pythia-1.4B's configuration (2048 wide, 24 layers, 16 heads, rotary on a quarter)."""
    import transformers
    cfg = transformers.GPTNeoXConfig(
        hidden_size=64 if tiny else 2048, num_hidden_layers=2 if tiny else 24, num_attention_heads=4 if tiny else 16,
        intermediate_size=256 if tiny else 8192, vocab_size=50304, rotary_pct=0.25, max_position_embeddings=4096,
        use_parallel_residual=True, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
        pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPTNeoXForCausalLM._from_config(cfg, attn_implementation="sdpa", dtype=dtype)
    return model.to(device).eval()


def build_mamba_ssm(ours: MambaLM):
    peer, why = peers.mamba_lm(ours)
    if peer is None:
        raise ImportError(why)
    return peer


def generator(name, model, gen):
    """A function ids -> generated ids for `name`."""
    if name in ("ours", "ours-torch", "ours-fused"):
        def run(ids):
            model.decode_impl = {"ours": "auto", "ours-torch": "torch"}.get(name, "kernel")
            model.set_impl("fused" if name == "ours-fused" else "auto")
            try:
                return selscan_fused.generate(model, ids, gen, cuda_graph=ids.is_cuda)
            finally:
                model.set_impl("auto")
        return run
    if name == "mamba-ssm":
        return lambda ids: model.generate(ids, max_length=ids.shape[1] + gen, cg=True, top_k=1)
    return lambda ids: model.generate(ids, max_new_tokens=gen, min_new_tokens=gen, do_sample=False,
                                      cache_implementation="static", pad_token_id=0)


def measure(run, ids, reps, cuda):
    times = []
    with torch.no_grad():
        out = run(ids)  # warm-up: graph capture, autotuning
        for _ in range(reps):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = run(ids)
            if cuda:
                torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,2,4,8,16,32,64,128")
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--models", default="ours,ours-torch,ours-fused,mamba-ssm,transformer")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--csv", default=None)
    ap.add_argument("--png", default=None)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    rows = []
    ours = None
    for name in args.models.split(","):
        status0 = None
        try:
            if name in ("ours", "ours-torch", "ours-fused", "mamba-ssm"):
                ours = ours or build_ours(args.tiny, device, dtype)
                model = build_mamba_ssm(ours) if name == "mamba-ssm" else ours
            elif name == "transformer":
                model = build_transformer(args.tiny, device, dtype)
            else:
                raise SystemExit(f"unknown model {name!r}")
        except SystemExit:
            raise
        except Exception as e:  # noqa: BLE001  (a peer that does not import: the rows say why)
            model, status0 = None, f"unavailable: {type(e).__name__}: {e}"
        if name == "mamba-ssm" and not cuda:
            model, status0 = None, "unavailable: needs CUDA"
        if name == "ours-fused" and model is not None:
            m = model.backbone.layers[0].mixer
            probe = torch.empty(1, 1, model.config.d_model, device=device, dtype=dtype)
            reason = decode_kernel_reason(probe[0], m.d_state, m.dt_rank, m.d_conv)
            if reason is None:
                reason = block_unsupported_reason("fused", probe, m.d_inner, m.d_state, m.d_conv)
            if reason is not None:
                model, status0 = None, f"unavailable: {reason}"
        oom = False
        for batch in [int(b) for b in args.batches.split(",")]:
            row = dict(model=name, batch=batch, prompt=args.prompt, gen=args.gen, total_ms="", tokens_per_s="")
            if model is None:
                row["status"] = status0
            elif oom:
                row["status"] = "oom"  # a smaller batch ran out of memory already
            else:
                ids = torch.randint(1, 50000, (batch, args.prompt), device=device)
                try:
                    ms, out = measure(generator(name, model, args.gen), ids, args.reps, cuda)
                    n_new = (out.sequences if hasattr(out, "sequences") else out).shape[1] - args.prompt
                    row.update(total_ms=f"{ms:.2f}", tokens_per_s=f"{batch * args.gen / ms * 1e3:.1f}",
                               status="ok" if n_new == args.gen else f"ok, but {n_new} tokens generated")
                except torch.OutOfMemoryError:
                    oom, row["status"] = True, "oom"
                del ids
                if cuda:
                    torch.cuda.empty_cache()
            rows.append(row)
            if args.csv:  # after every point: a run stopped early keeps what it measured
                write_csv(args.csv, rows)
            print(f"{name:>12} batch {batch:>4}: {row['tokens_per_s'] or '-':>10} tokens/s  "
                  f"{row['total_ms'] or '-':>10} ms  {row['status']}", flush=True)
        model = None
        if cuda:
            torch.cuda.empty_cache()
    print(PAPER)  # the CSV holds every row already (written after each)
    if args.png:
        plot(rows, args.png)
    return rows


def write_csv(path, rows):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(rows)


def plot(rows, png):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, name in enumerate(dict.fromkeys(r["model"] for r in rows)):
        pts = [r for r in rows if r["model"] == name]
        ok = [(r["batch"], float(r["tokens_per_s"])) for r in pts if r["status"].startswith("ok")]
        if ok:
            ax.plot(*zip(*ok), marker="o", color=f"C{i}", label=name)
        ooms = [r["batch"] for r in pts if r["status"] == "oom"]
        if ooms:
            y = ok[-1][1] if ok else 1.0
            ax.scatter(ooms, [y] * len(ooms), marker="x", color=f"C{i}", label=f"{name}: out of memory")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch")
    ax.set_ylabel("tokens generated per second")
    ax.set_title("prompt 2048, 128 generated (bf16)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
