"""The Selective Copying task (Gu and Dao 2023, section 4.1), trained with SelectiveScan layers: the
ablation use of this package, fused against unfused from the same seed.

Each sequence holds K data tokens (from a vocabulary of V) at random positions among L noise tokens,
then K recall markers (marker i asks for the i-th data token); at the markers the model must output
the data tokens in their order. A
model with input-independent dynamics cannot do this (the positions are random); a selective one
can: its step size decides, per token, what the state keeps.

Model: token embedding, n_layers x (RMSNorm -> SelectiveScan -> residual, RMSNorm -> MLP -> residual),
RMSNorm, linear head; bfloat16 autocast, float32 parameters, AdamW. Every path trains from the same
initial weights on the same batches; the loss (cross-entropy at the markers) and the accuracy (share
of data tokens recalled correctly) are logged per step.

    python benchmarks/selective_copying.py                       # fused and unfused, 2000 steps
    python benchmarks/selective_copying.py --impls unfused --steps 100 --out /tmp/sc
Writes OUT.csv (step, path, loss, accuracy) and OUT.png (both curves); OUT defaults to
docs/selective_copying. Needs matplotlib and tqdm (pip install .[bench]).
"""
from __future__ import annotations

import argparse
import csv
import os
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import selscan_fused  # noqa: E402


class Block(nn.Module):
    def __init__(self, d: int, n: int, impl: str):
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.scan = selscan_fused.SelectiveScan(d, n, impl=impl)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x):
        x = x + self.scan(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Model(nn.Module):
    def __init__(self, vocab: int, d: int, n: int, layers: int, impl: str):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, n, impl) for _ in range(layers))
        self.norm = nn.RMSNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


def make_batch(gen: torch.Generator, batch: int, L: int, K: int, V: int, device):
    """tokens (batch, L + K): data tokens 0..V-1 at K random positions of L, noise V, markers V + 1 + i;
    targets (batch, K): the data tokens in order."""
    data = torch.randint(0, V, (batch, K), generator=gen)
    pos = torch.rand(batch, L, generator=gen).argsort(dim=1)[:, :K].sort(dim=1).values
    tokens = torch.full((batch, L + K), V, dtype=torch.long)
    tokens.scatter_(1, pos, data)
    tokens[:, L:] = V + 1 + torch.arange(K)
    return tokens.to(device), data.to(device)


def train(impl: str, a, device) -> list[tuple[int, float, float]]:
    torch.manual_seed(a.seed)
    model = Model(a.vocab + 1 + a.copy, a.d_model, a.d_state, a.layers, impl).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=a.lr, total_steps=a.steps, pct_start=0.1)
    gen = torch.Generator().manual_seed(a.seed + 1)  # the same batches for every path
    log = []
    try:
        from tqdm import tqdm
        steps = tqdm(range(a.steps), desc=impl, mininterval=2.0, disable=a.no_progress)
    except ImportError:
        steps = range(a.steps)
    for step in steps:
        tokens, target = make_batch(gen, a.batch, a.length, a.copy, a.vocab, device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(tokens)[:, a.length:].float()
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        acc = (logits.argmax(-1) == target).float().mean().item()
        log.append((step, loss.item(), acc))
        if hasattr(steps, "set_postfix"):
            steps.set_postfix(loss=f"{log[-1][1]:.3f}", acc=f"{acc:.3f}")
    return log


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--impls", default="fused,unfused")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--length", type=int, default=256, help="noise + data tokens before the markers")
    ap.add_argument("--copy", type=int, default=16, help="data tokens to copy")
    ap.add_argument("--vocab", type=int, default=16)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--d-state", type=int, default=16)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-progress", action="store_true", help="no progress bar (logs)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs",
                                                  "selective_copying"))
    a = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    impls = a.impls.split(",")
    logs = {}
    for impl in impls:
        t0 = time.time()
        logs[impl] = train(impl, a, device)
        last = logs[impl][-20:]
        print(f"{impl}: final loss {sum(r[1] for r in last) / len(last):.4f}, accuracy (mean of the last 20 steps) "
              f"{sum(r[2] for r in last) / len(last):.4f}, {time.time() - t0:.0f} s")
    if len(impls) == 2:
        a0, a1 = (logs[i] for i in impls)
        gap = max(abs(r0[1] - r1[1]) for r0, r1 in zip(a0, a1))
        print(f"largest per-step loss difference between {impls[0]} and {impls[1]}: {gap:.4f}")
    with open(a.out + ".csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["step", "path", "loss", "accuracy"])
        for impl, log in logs.items():
            for step, loss, acc in log:
                w.writerow([step, impl, f"{loss:.6f}", f"{acc:.6f}"])
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install .[bench])")
        return
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(10, 3.8))
    for impl, log in logs.items():
        ax0.plot([r[0] for r in log], [r[1] for r in log], label=impl, lw=1)
        ax1.plot([r[0] for r in log], [r[2] for r in log], label=impl, lw=1)
    ax0.set(xlabel="step", ylabel="cross-entropy at the markers", yscale="log", title="Selective Copying: loss")
    ax1.set(xlabel="step", ylabel="tokens recalled correctly", ylim=(0, 1.02), title="accuracy")
    for ax in (ax0, ax1):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{a.layers} SelectiveScan blocks, d_model {a.d_model}, N {a.d_state}; {a.copy} of "
                 f"{a.length} tokens to copy, vocabulary {a.vocab}; batch {a.batch}, seed {a.seed}", fontsize=9)
    fig.tight_layout()
    fig.savefig(a.out + ".png", dpi=120)
    print(f"wrote {a.out}.csv and {a.out}.png")


if __name__ == "__main__":
    main()
