"""How long a trained Induction Heads model can remember, from its weights: for each block of a
checkpoint written by `benchmarks/paper_tasks.py induction-heads --ckpt PATH`, delta on test sequences
(the block's math in float32, on the CPU), and per channel the half-life of its slowest state over the
ordinary tokens, ln 2 / (mean delta x min_n |A[d, n]|) tokens: the stored token's trace in that channel
halves every that many tokens of filler. Prints the longest three channels' half-lives per block, beside
the median, for every run in the checkpoint.

    python scripts/diag_ih_memory.py CKPT [CKPT ...] [--length 4096] [--n 8]
"""
import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import paper_tasks  # noqa: E402  (puts the checkout on the path too)
from selscan_fused.block_reference import block_terms  # noqa: E402


def block_delta(mixer, h: torch.Tensor) -> torch.Tensor:
    """delta (batch, L, d_inner) of a Mamba block on its input h, as the block's reference makes it
    (float32)."""
    w = mixer.weights()  # in_proj's weight and bias, conv's, x_proj's, dt_proj's, A_log, D, out_proj's
    return block_terms(h, *w[:7], mixer.d_inner, mixer.d_state)[2]


@torch.no_grad()
def half_lives(model, ids: torch.Tensor, special: int) -> list[torch.Tensor]:
    """Per block, each channel's slowest-state half-life in ordinary tokens."""
    out, x = [], model.embedding(ids).float()
    ordinary = (ids != special).unsqueeze(-1)
    for norm, mixer in zip(model.norms, model.mixers):
        h = norm(x)
        mean_delta = (block_delta(mixer, h) * ordinary).sum((0, 1)) / ordinary.sum()
        slowest = torch.exp(mixer.A_log.float()).min(1).values
        out.append(math.log(2) / (mean_delta * slowest))
        x = x + mixer(h)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ckpt", nargs="+")
    ap.add_argument("--length", type=int, default=4096, help="test sequence length")
    ap.add_argument("--n", type=int, default=8, help="test sequences")
    a = ap.parse_args()
    for path in a.ckpt:
        store = torch.load(path, map_location="cpu", weights_only=False)
        cfg = store["config"]
        if cfg["task"] != "induction-heads":
            sys.exit(f"{path}: a {cfg['task']} checkpoint; this reads induction-heads ones")
        ids, _ = paper_tasks.induction_heads_batch(torch.Generator().manual_seed(7), a.n, a.length, cfg["vocab"])
        for run, r in store["runs"].items():
            if run.endswith("time-invariant"):  # its delta does not depend on the input: nothing to read here
                print(f"{os.path.basename(path)} {run}: left out (time-invariant)")
                continue
            model = paper_tasks.TinyLM(cfg["vocab"], d_model=cfg["d_model"], n_layer=cfg["n_layer"],
                                       d_state=cfg["d_state"], d_conv=cfg["d_conv"], expand=cfg["expand"],
                                       impl="reference", norm=cfg["norm"])
            model.load_state_dict(r["model"])
            print(f"{os.path.basename(path)} seed {cfg['seed']} {run} (step {r['step']}):")
            for i, hl in enumerate(half_lives(model, ids, cfg["vocab"] - 1)):
                top = torch.sort(hl, descending=True).values[:3].tolist()
                print(f"  block {i}: longest half-lives {', '.join(f'{v:,.0f}' for v in top)} tokens; "
                      f"median {hl.median().item():,.0f}")


if __name__ == "__main__":
    main()
