"""The Mamba paper's synthetic tasks (Gu and Dao 2023, section 4.1; Appendix E.1) with this package's
Mamba-1 block (`selscan_fused.Mamba`): Selective Copying (Table 1) and Induction Heads (Table 2).

    python benchmarks/paper_tasks.py selective-copying                 # impl unfused, 16000 steps
    python benchmarks/paper_tasks.py induction-heads                   # train at 256, test 2^6 .. 2^20
    python benchmarks/paper_tasks.py induction-heads --time-invariant  # the ablation: no selection
    python benchmarks/paper_tasks.py induction-heads --impls unfused,reference --steps 300 --out /tmp/ih_cmp
    python benchmarks/paper_tasks.py induction-heads --impls fused,unfused       # the two CUDA paths, same seed
    python benchmarks/paper_tasks.py selective-copying --smoke         # CPU, reference, seconds

Tasks (token layouts; docs/results.md, "The paper's synthetic tasks", says which details are the
paper's and which are chosen here):

  selective-copying  vocabulary V (default 16) = noise token 0, data tokens 1 .. V-2, marker V-1 (the
                     S4 repository's copying generator with variable=True, whose layout matches the
                     paper's description: 16 tokens, the noise token among them). A sequence of
                     --length tokens (default 4096, markers included):
                     K = --copy (16) data tokens at random positions of the first length - K, noise
                     elsewhere, then K copies of the marker; at the i-th marker the model outputs the
                     i-th data token. Loss and accuracy over the K outputs.
  induction-heads    vocabulary V (16) = ordinary tokens 0 .. V-2 and the special token V-1. A sequence
                     of random ordinary tokens, the special token at one uniform position p in
                     [0, length - 3], and again at the end; the model outputs, at the last position,
                     the token at p + 1 (associative recall of the token after the first occurrence).
                     Trained at --length 256, tested at 2^6 .. 2^20 without retraining.

Model: embedding -> n_layer x (pre-norm residual: x + Mamba(norm(x))) -> norm -> head (TinyLM below);
d_model 64, 2 layers, Mamba(d_model, d_state=16, d_conv=4, expand=2, impl=...), RMSNorm, the
residual stream in float32, bf16 autocast on CUDA. --time-invariant replaces each block by
TimeInvariantMamba: x_proj's output [dt_low | B | C] is a learned constant vector broadcast over the
tokens, so delta = softplus(dt_proj(dt_low) + bias), B and C do not depend on the input (the gate z
still does): the same block with selection taken out.

Training: AdamW (betas 0.9/0.95, weight decay 0.1 on matrices, none on A_log, D, biases, norms and
constants), lr 1e-3 with a linear warmup and a cosine decay to 10% (--schedule constant: the paper's
constant rate), gradient clipping at 1.0, a fresh batch every step. Every impl of --impls starts from
the same weights (--seed) and sees the same batches. --ckpt PATH makes a run resumable: model,
optimiser, step, the data generator's and torch's RNG states and the loss log are saved every
--ckpt-every steps, at --stop-after and on SIGTERM/SIGINT; the same command line continues where it
stopped, with the same batches (the losses equal an uninterrupted run's).

Evaluation: fixed validation sets (--eval-seed) at every length of the paper's table (induction heads:
2^6 .. 2^20; selective copying: the training length), --eval-n sequences each; long sequences go through
TinyLM.forward_chunked (pieces of --eval-chunk tokens, each block's final (ssm_state, conv_state)
carried to the next piece), and only the positions that are scored get logits.

Outputs (PREFIX = --out, default docs/paper_tasks_<task>; rows of other runs (impl, variant, --seed)
already in a CSV are kept, this run's replaced, so that several seeds of one path sit side by side):
PREFIX_loss.csv (task, impl, variant, seed, step, loss, accuracy, lr),
PREFIX_accuracy.csv (per test length, with the paper's Mamba figure beside), and with matplotlib
PREFIX_loss.png (loss curves of every impl/variant) and PREFIX_accuracy.png (accuracy per length
against the paper's row). --smoke writes under the temporary directory unless --out is given.

Wall time on one H200 (measured 2026-12-05 with several runs sharing the GPU, so upper bounds; each
run prints its own; docs/results.md, section 6): selective-copying, 16000 steps of 64 x 4096 tokens,
under 5.5 minutes per impl and variant (49 steps a second with two runs sharing the GPU);
induction-heads, 8000 steps of 64 x 256 tokens, about 2.4 minutes with eight runs sharing it, plus
85-100 s of evaluation up to 2^20 (512 sequences a length). impl reference is a Python loop over the tokens: about 0.1-0.2 s per induction-heads step (so
--steps 300 for a side-by-side run), a second or more per selective-copying step, and test lengths above
--reference-max-eval-len (8192) are skipped. With --ckpt, a run stopped by SIGTERM or Ctrl-C saves its
checkpoint at the next step boundary, and one killed outright keeps the last save (every --ckpt-every
= 250 steps); the same command continues it.
"""
from __future__ import annotations

import argparse
import csv
import math
import os
import signal
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import selscan_fused  # noqa: E402
from selscan_fused.block import block_unsupported_reason, conv_tail, resolve_block_impl  # noqa: E402
from selscan_fused.conv import causal_conv1d, causal_conv1d_ref  # noqa: E402
from selscan_fused.reference import scan_ref  # noqa: E402

TASKS = ("selective-copying", "induction-heads")
REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")

# The paper's figures (Gu and Dao 2023): Table 1, Mamba (S6) on Selective Copying; the time-invariant
# layers of the same table span 18.3-57.0%. Table 2: Mamba 100% at every test length 2^6 .. 2^20.
PAPER_MAMBA = {"selective-copying": 99.8, "induction-heads": 100.0}
PAPER_TIME_INVARIANT_RANGE = (18.3, 57.0)

# Per-task defaults; --smoke swaps in the second set. An option given on the command line wins.
DEFAULTS = {
    "selective-copying": dict(length=4096, copy=16, vocab=16, batch=64, steps=16000, lr=1e-3, eval_n=1024,
                              eval_lengths=None, eval_chunk=65536),
    "induction-heads": dict(length=256, copy=1, vocab=16, batch=64, steps=8000, lr=1e-3, eval_n=512,
                            eval_lengths=[2 ** k for k in range(6, 21)], eval_chunk=65536),
}
SMOKE = {
    "selective-copying": dict(length=48, copy=4, batch=8, steps=12, eval_n=16, eval_lengths=None, eval_chunk=20),
    "induction-heads": dict(length=32, copy=1, batch=8, steps=12, eval_n=16, eval_lengths=[16, 32, 64, 128],
                            eval_chunk=48),
}
COMMON = dict(seed=0, d_model=64, n_layer=2, d_state=16, d_conv=4, expand=2, norm="rms",
              warmup=None, schedule="cosine", weight_decay=0.1, clip=1.0, eval_seed=1234, eval_tokens=1 << 22,
              reference_max_eval_len=8192, log_every=50, ckpt_every=250)


# ---------------------------------------------------------------------------------------------------
# Data

def selective_copying_batch(gen: torch.Generator, batch: int, length: int, copy: int, vocab: int, device=None):
    """tokens (batch, length) int64 and targets (batch, copy): noise 0 everywhere in the first
    length - copy positions except `copy` data tokens (values 1 .. vocab-2) at distinct random positions
    in increasing order, then `copy` markers (vocab-1). targets[:, i] is the i-th data token, to be output
    at the i-th marker (position length - copy + i)."""
    if vocab < 3 or copy < 1 or length < 2 * copy:
        raise ValueError(f"selective copying needs vocab >= 3 (noise, marker, data), copy >= 1 and length >= "
                         f"2 copy; got vocab {vocab}, copy {copy}, length {length}")
    device = gen.device if device is None else torch.device(device)
    region = length - copy
    data = torch.randint(1, vocab - 1, (batch, copy), generator=gen, device=gen.device)
    pos = torch.rand(batch, region, generator=gen, device=gen.device).topk(copy, dim=1).indices.sort(dim=1).values
    tokens = torch.zeros(batch, length, dtype=torch.long, device=gen.device)
    tokens.scatter_(1, pos, data)
    tokens[:, region:] = vocab - 1
    return tokens.to(device), data.to(device)


def induction_heads_batch(gen: torch.Generator, batch: int, length: int, vocab: int, device=None):
    """tokens (batch, length) int64 and targets (batch, 1): ordinary tokens 0 .. vocab-2 drawn uniformly,
    the special token vocab-1 at one position p uniform in [0, length-3] and at position length-1 (nowhere
    else); targets[:, 0] = tokens[:, p + 1] (an ordinary token), to be output at the last position."""
    if vocab < 3 or length < 4:
        raise ValueError(f"induction heads needs vocab >= 3 and length >= 4; got vocab {vocab}, length {length}")
    device = gen.device if device is None else torch.device(device)
    tokens = torch.randint(0, vocab - 1, (batch, length), generator=gen, device=gen.device)
    first = torch.randint(0, length - 2, (batch,), generator=gen, device=gen.device)
    rows = torch.arange(batch, device=gen.device)
    tokens[rows, first] = vocab - 1
    target = tokens[rows, first + 1].clone()
    tokens[:, length - 1] = vocab - 1
    return tokens.to(device), target[:, None].to(device)


def make_batch(task: str, gen, batch: int, length: int, a) -> tuple[torch.Tensor, torch.Tensor]:
    if task == "selective-copying":
        return selective_copying_batch(gen, batch, length, a.copy, a.vocab)
    return induction_heads_batch(gen, batch, length, a.vocab)


def n_scored(task: str, a) -> int:
    """How many final positions are scored: the markers, or the last position."""
    return a.copy if task == "selective-copying" else 1


# ---------------------------------------------------------------------------------------------------
# Model

class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight in float32 (float64 for float64 input), returned in x's dtype."""

    def __init__(self, d: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        cd = torch.float64 if x.dtype == torch.float64 else torch.float32
        xf = x.to(cd)
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.to(cd)).to(x.dtype)


class TimeInvariantMamba(selscan_fused.Mamba):
    """The Mamba block with selection taken out: x_proj's output [dt_low | B | C] (R + 2N values per token)
    is replaced by one learned vector broadcast over the tokens, so delta = softplus(dt_proj(dt_low) +
    dt_proj.bias) (one value per channel), B and C are the same at every token: a time-invariant SSM inside
    the same block (in_proj, conv, gate, out_proj unchanged). x_proj is removed.

    Initialisation: dt_low zeros (delta starts at the block's dt initialisation, softplus of the bias),
    B ones, C normal(0, 1/N). The paths: "reference" (selscan_fused's conv and scan references) and
    "unfused" (the conv kernel and the block's gated scan kernel on the broadcast constants: the calls of
    selscan_fused.mamba_block's unfused path with x_proj's product replaced) and "fused" (the block's
    fused kernel, fused_block_fwd, on the broadcast [dt_low | B | C]). forward has the block's signature
    and states."""

    def __init__(self, d_model: int, **kw):
        super().__init__(d_model, **kw)
        del self.x_proj
        N, R = self.d_state, self.dt_rank
        self.dt_low = nn.Parameter(torch.zeros(R))
        self.B_const = nn.Parameter(torch.ones(N))
        self.C_const = nn.Parameter(torch.randn(N) * N ** -0.5)
        for p in (self.dt_low, self.B_const, self.C_const):
            p._no_weight_decay = True

    def weights(self):
        raise NotImplementedError("TimeInvariantMamba has no x_proj: its forward computes the block itself")

    def forward(self, hidden_states, h0=None, conv_state=None, return_final_state: bool = False):
        x = hidden_states
        if x.is_cuda and x.dtype == torch.float32 and torch.is_autocast_enabled("cuda"):
            x = x.to(torch.get_autocast_dtype("cuda"))
        d_inner, N, W = self.d_inner, self.d_state, self.d_conv
        impl = resolve_block_impl(self.impl, x, d_inner, N, W)
        if impl != "reference":
            reason = block_unsupported_reason(impl, x, d_inner, N, W)
            if reason is not None:
                raise ValueError(f"selscan_fused: {reason}")
        batch, L, _ = x.shape
        conv_w = self.conv1d.weight.reshape(d_inner, W)
        conv_b = self.conv1d.bias
        if impl == "reference":
            cd = torch.float64 if x.dtype == torch.float64 else torch.float32
            with torch.autocast(x.device.type, enabled=False):
                xz = F.linear(x.to(cd), self.in_proj.weight.to(cd),
                              None if self.in_proj.bias is None else self.in_proj.bias.to(cd))
                xi, z = xz[..., :d_inner], xz[..., d_inner:]
                u, conv_T = causal_conv1d_ref(xi, conv_w.to(cd), None if conv_b is None else conv_b.to(cd),
                                              None if conv_state is None else conv_state.to(cd), activation=True,
                                              compute_dtype=cd)
                delta = F.softplus(F.linear(self.dt_low.to(cd), self.dt_proj.weight.to(cd), self.dt_proj.bias.to(cd)))
                y, h = scan_ref(u, delta.expand(batch, L, d_inner), self.A_log.to(cd),
                                self.B_const.to(cd).expand(batch, L, N), self.C_const.to(cd).expand(batch, L, N),
                                self.D.to(cd), h0)
                out = F.linear(y * F.silu(z), self.out_proj.weight.to(cd),
                               None if self.out_proj.bias is None else self.out_proj.bias.to(cd))
            out, conv_T = out.to(x.dtype), conv_T.to(x.dtype)
            return (out, h, conv_T) if return_final_state else out
        if not selscan_fused.extension_available():
            raise RuntimeError("selscan_fused: impl='unfused' needs the CUDA extension selscan_fused._C, which did "
                               "not load (python -c 'import selscan_fused; selscan_fused.Mamba(64, impl=\"unfused\")' "
                               "says why)")
        xdt, f32 = x.dtype, torch.float32
        with torch.autocast("cuda", enabled=False):
            xz = F.linear(x, self.in_proj.weight.to(xdt),
                          None if self.in_proj.bias is None else self.in_proj.bias.to(xdt))
            xi, z = xz[..., :d_inner], xz[..., d_inner:]
            A_log, dt_bias, D = self.A_log.to(f32), self.dt_proj.bias.to(f32), self.D.to(f32)
            h0f = None if h0 is None else h0.to(f32)
            cs = None if conv_state is None else conv_state.to(xdt)
            if impl == "fused":  # the fused kernels on the broadcast constants [dt_low | B | C] (given xdbl)
                R = self.dt_rank
                xdbl = torch.cat([self.dt_low, self.B_const, self.C_const]).to(xdt).expand(batch, L, R + 2 * N)
                xdbl = xdbl.contiguous()
                dt_w = self.dt_proj.weight.to(xdt)
                cw, cb = conv_w.to(f32), None if conv_b is None else conv_b.to(f32)
                csf = None if cs is None else cs.to(f32)
                train = torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                                        for t in (xdbl, dt_w, xz, cw, cb, csf, A_log, dt_bias, D, h0f))
                y, h, _, _ = torch.ops.selscan_fused.fused_block_fwd(xz, cw, cb, csf, None, xdbl, dt_w, A_log,
                                                                        dt_bias, D, h0f, return_final_state, train, 0)
                conv_T = conv_tail(xi, cs, W)
            else:
                u, conv_T = causal_conv1d(xi, conv_w.to(f32), None if conv_b is None else conv_b.to(f32), cs,
                                          activation=True, return_final_state=True)
                delta = F.linear(self.dt_low.to(xdt), self.dt_proj.weight.to(xdt))        # delta_pre, (d_inner,)
                delta = delta.expand(batch, L, d_inner).contiguous()
                bc = torch.cat([self.B_const, self.C_const]).to(xdt).expand(batch, L, 2 * N).contiguous()
                train = torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                                        for t in (delta, bc, u, z, A_log, dt_bias, D, h0f))
                y, h, _ = torch.ops.selscan_fused.gated_scan_fwd(delta, bc, u, z, A_log, dt_bias, D, h0f,
                                                                    return_final_state, train, 0)
            out = F.linear(y, self.out_proj.weight.to(xdt),
                           None if self.out_proj.bias is None else self.out_proj.bias.to(xdt))
        return (out, h, conv_T) if return_final_state else out


class TinyLM(nn.Module):
    """embedding -> n_layer x (x + mixer(norm(x))) -> norm_f -> head, the residual stream in float32.

    forward(ids, states=None, return_states=False, n_last=None): logits (batch, n, vocab) of the last n_last
    positions (all when None; None is returned for n_last=0); with return_states also per layer
    (ssm_state, conv_state) after the last token, which passed back as states= continue the sequences.
    forward_chunked(ids, chunk, n_last): the same logits, the sequence fed `chunk` tokens at a time."""

    def __init__(self, vocab: int, d_model: int = 64, n_layer: int = 2, d_state: int = 16, d_conv: int = 4,
                 expand: int = 2, impl: str = "unfused", time_invariant: bool = False, norm: str = "rms"):
        super().__init__()
        mixer = TimeInvariantMamba if time_invariant else selscan_fused.Mamba
        make_norm = (lambda: RMSNorm(d_model)) if norm == "rms" else (lambda: nn.LayerNorm(d_model))
        self.embedding = nn.Embedding(vocab, d_model)
        self.norms = nn.ModuleList(make_norm() for _ in range(n_layer))
        self.mixers = nn.ModuleList(mixer(d_model, d_state=d_state, d_conv=d_conv, expand=expand, impl=impl,
                                          layer_idx=i) for i in range(n_layer))
        self.norm_f = make_norm()
        self.head = nn.Linear(d_model, vocab, bias=False)
        # mamba-ssm's initialisation of its LM (mixer_seq_simple._init_weights): the embedding normal(0, 0.02),
        # Linear biases zero but dt_proj's, out_proj kaiming-uniform divided by sqrt(n_layer).
        nn.init.normal_(self.embedding.weight, std=0.02)
        for m in self.mixers:
            nn.init.kaiming_uniform_(m.out_proj.weight, a=math.sqrt(5))
            with torch.no_grad():
                m.out_proj.weight /= math.sqrt(n_layer)
            for lin in (m.in_proj, m.out_proj):
                if lin.bias is not None:
                    nn.init.zeros_(lin.bias)

    def set_impl(self, impl: str):
        for m in self.mixers:
            m.impl = impl
        return self

    def forward(self, ids, states=None, return_states: bool = False, n_last: int | None = None):
        x = self.embedding(ids).float()
        new_states = []
        for i, (norm, mixer) in enumerate(zip(self.norms, self.mixers)):
            h0, c0 = states[i] if states is not None else (None, None)
            if return_states:
                out, h, c = mixer(norm(x), h0=h0, conv_state=c0, return_final_state=True)
                new_states.append((h, c))
            else:
                out = mixer(norm(x), h0=h0, conv_state=c0)
            x = x + out.float()
        if n_last == 0:
            logits = None
        else:
            if n_last is not None:
                x = x[:, x.shape[1] - n_last:]
            logits = self.head(self.norm_f(x))
        return (logits, new_states) if return_states else logits

    @torch.no_grad()
    def forward_chunked(self, ids, chunk: int, n_last: int = 1):
        """The logits of the last n_last positions (batch, n_last, vocab), the sequence processed `chunk`
        tokens at a time with every block's final (ssm_state, conv_state) carried from piece to piece."""
        L = ids.shape[1]
        if not 1 <= n_last <= L:
            raise ValueError(f"n_last must be in [1, {L}], got {n_last}")
        states, outs = None, []
        for s in range(0, L, chunk):
            e = min(L, s + chunk)
            need = max(0, e - max(s, L - n_last))  # scored positions in [s, e): the piece's tail
            logits, states = self(ids[:, s:e], states=states, return_states=True, n_last=need)
            if need:
                outs.append(logits)
        return torch.cat(outs, dim=1)


def param_groups(model: nn.Module, weight_decay: float):
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.dim() >= 2 and not getattr(p, "_no_weight_decay", False):
            decay.append(p)
        else:
            no_decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def lr_at(step: int, a) -> float:
    """The learning rate of step `step` (0-based): linear warmup over a.warmup steps, then constant
    (schedule 'constant') or a cosine decay to 10% at the last step (schedule 'cosine')."""
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    if a.schedule == "constant":
        return a.lr
    t = (step - a.warmup) / max(1, a.steps - a.warmup - 1)
    return a.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


# ---------------------------------------------------------------------------------------------------
# Training, checkpoints, evaluation

class _Stop:
    """SIGTERM / SIGINT ask the training loop to save its checkpoint and stop at the next step boundary."""
    requested = False

    @classmethod
    def install(cls):
        cls.requested = False

        def handler(signum, frame):
            if cls.requested:  # a second signal: stop now
                raise KeyboardInterrupt
            cls.requested = True
            print(f"\nsignal {signum}: saving the checkpoint at the next step boundary", flush=True)

        try:
            return {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
        except ValueError:  # not the main thread
            return {}

    @staticmethod
    def restore(old):
        for s, h in old.items():
            signal.signal(s, h)


# The options a checkpoint must agree on to be resumed (the rest: evaluation, outputs, logging).
CKPT_KEYS = ("task", "length", "copy", "vocab", "batch", "steps", "lr", "warmup", "schedule", "weight_decay", "clip",
             "seed", "d_model", "n_layer", "d_state", "d_conv", "expand", "norm")


def load_ckpt(path):
    if path and os.path.exists(path):
        return torch.load(path, map_location="cpu", weights_only=False)
    return None


def save_ckpt(path, store):
    tmp = path + ".tmp"
    torch.save(store, tmp)
    os.replace(tmp, path)


def _rng_state(gen, device):
    st = {"data": gen.get_state(), "torch_cpu": torch.get_rng_state()}
    if device.type == "cuda":
        st["torch_cuda"] = torch.cuda.get_rng_state(device)
    return st


def _set_rng_state(st, gen, device):
    gen.set_state(st["data"])
    torch.set_rng_state(st["torch_cpu"])
    if device.type == "cuda" and "torch_cuda" in st:
        torch.cuda.set_rng_state(st["torch_cuda"], device)


def run_key(impl: str, a) -> str:
    return f"{impl}/{variant(a)}"


def variant(a) -> str:
    return "time-invariant" if a.time_invariant else "selective"


def build_model(impl: str, a, device) -> TinyLM:
    torch.manual_seed(a.seed)  # the same initial weights for every impl (drawn on the CPU)
    return TinyLM(a.vocab, a.d_model, a.n_layer, a.d_state, a.d_conv, a.expand, impl=impl,
                  time_invariant=a.time_invariant, norm=a.norm).to(device)


def train(impl: str, a, device, store) -> tuple[TinyLM, list, str]:
    """Trains (or resumes) one impl. Returns (model, log [(step, loss, accuracy, lr)], status) with status
    'done' or 'stopped' (checkpoint saved, rerun to continue)."""
    model = build_model(impl, a, device)
    opt = torch.optim.AdamW(param_groups(model, a.weight_decay), lr=a.lr, betas=(0.9, 0.95),
                            fused=device.type == "cuda")
    gen = torch.Generator(device=device).manual_seed(a.seed + 1)  # the same batches for every impl
    key = run_key(impl, a)
    log, start = [], 0
    saved = store["runs"].get(key) if store is not None else None
    if saved is not None:
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        _set_rng_state(saved["rng"], gen, device)
        log, start = list(saved["log"]), saved["step"]
        print(f"{key}: resuming at step {start} of {a.steps} from {a.ckpt}")

    def save(step):
        if store is None:
            return
        store["runs"][key] = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step,
                              "rng": _rng_state(gen, device), "log": list(log)}
        save_ckpt(a.ckpt, store)

    n_last = n_scored(a.task, a)
    use_amp = device.type == "cuda"
    pending = []  # (step, lr, tensor[loss, acc]) not yet copied to the host: one sync per a.log_every steps

    def flush():
        if pending:
            vals = torch.stack([p[2] for p in pending]).tolist()
            for (s, lr, _), (loss, acc) in zip(pending, vals):
                log.append((s, loss, acc, lr))
            pending.clear()

    bar = None
    if not a.no_progress:
        try:
            from tqdm import tqdm
            bar = tqdm(total=a.steps, initial=start, desc=f"{a.task} {key}", mininterval=2.0)
        except ImportError:  # plain prints instead
            pass
    print_every = max(1, a.steps // 20)
    status = "done"
    model.train()
    t0 = time.time()
    for step in range(start, a.steps):
        if _Stop.requested or (a.stop_after is not None and step >= a.stop_after):
            flush()
            save(step)
            status = "stopped"
            break
        tokens, target = make_batch(a.task, gen, a.batch, a.length, a)
        lr = lr_at(step, a)
        for g in opt.param_groups:
            g["lr"] = lr
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_amp):
            logits = model(tokens, n_last=n_last)
        logits = logits.float()
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if a.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip)
        opt.step()
        acc = (logits.argmax(-1) == target).float().mean()
        pending.append((step, lr, torch.stack([loss.detach(), acc])))
        last = step + 1 == a.steps
        if (step + 1) % a.log_every == 0 or last:
            flush()
            if bar is not None:
                bar.set_postfix(loss=f"{log[-1][1]:.4f}", acc=f"{log[-1][2]:.3f}", refresh=False)
        if bar is not None:
            bar.update(1)
        elif (step + 1) % print_every == 0 or last:
            flush()
            print(f"{a.task} {key} step {step + 1}/{a.steps}: loss {log[-1][1]:.4f}, accuracy {log[-1][2]:.3f}, "
                  f"{time.time() - t0:.0f} s", flush=True)
        if store is not None and ((step + 1) % a.ckpt_every == 0 or last):
            flush()
            save(step + 1)
    else:
        if start >= a.steps:
            print(f"{key}: already trained ({a.steps} steps) in {a.ckpt}")
    if bar is not None:
        bar.close()
    flush()
    if status == "stopped":
        where = f"; rerun the same command to continue from {a.ckpt}" if store is not None else (
            " (no --ckpt: nothing saved)")
        print(f"{key}: stopped at step {len(log)} of {a.steps}{where}")
    return model, log, status


@torch.no_grad()
def evaluate(model: TinyLM, impl: str, a, device) -> list[dict]:
    """Accuracy at every test length on fixed validation sets (the same for every impl and variant)."""
    model.eval()
    n_last = n_scored(a.task, a)
    use_amp = device.type == "cuda"
    rows = []
    for L in a.eval_lengths:
        row = {"task": a.task, "impl": impl, "variant": variant(a), "seed": a.seed, "length": L,
               "train_length": a.length,
               "steps": a.steps, "n_sequences": a.eval_n, "accuracy": "", "exact": "",
               "paper_mamba": PAPER_MAMBA[a.task] if (a.task == "induction-heads" or L == 4096) else "",
               "status": "ok"}
        if impl == "reference" and L > a.reference_max_eval_len:
            row["status"] = (f"skipped: the reference is a Python loop over tokens (--reference-max-eval-len "
                             f"{a.reference_max_eval_len})")
            rows.append(row)
            print(f"  {impl}/{variant(a)} L={L}: {row['status']}")
            continue
        gen = torch.Generator(device=device).manual_seed(a.eval_seed + L)
        chunk = min(L, a.eval_chunk)
        per_call = max(1, min(a.eval_n, a.eval_tokens // chunk))
        correct = exact = 0
        t0 = time.time()
        for s in range(0, a.eval_n, per_call):
            b = min(per_call, a.eval_n - s)
            tokens, target = make_batch(a.task, gen, b, L, a)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_amp):
                logits = model.forward_chunked(tokens, chunk, n_last) if chunk < L else model(tokens, n_last=n_last)
            hit = logits.float().argmax(-1) == target
            correct += int(hit.sum())
            exact += int(hit.all(dim=1).sum())
            del tokens, logits
        row["accuracy"] = f"{100.0 * correct / (a.eval_n * n_last):.2f}"
        row["exact"] = f"{100.0 * exact / a.eval_n:.2f}"
        rows.append(row)
        print(f"  {impl}/{variant(a)} L={L}: accuracy {row['accuracy']}% ({a.eval_n} sequences, "
              f"{time.time() - t0:.1f} s)", flush=True)
    model.train()
    return rows


def probe(impl: str, a, device) -> str | None:
    """Why `impl` cannot run the block here (None when it can): one tiny forward, as the run would call it."""
    mixer = (TimeInvariantMamba if a.time_invariant else selscan_fused.Mamba)(a.d_model, d_state=a.d_state,
                                                                                d_conv=a.d_conv, expand=a.expand,
                                                                                impl=impl).to(device)
    x = torch.randn(1, 8, a.d_model, device=device)
    try:
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            mixer(x)
    except (ValueError, RuntimeError, NotImplementedError) as e:
        return str(e).removeprefix("selscan_fused: ")
    return None


# ---------------------------------------------------------------------------------------------------
# Outputs

LOSS_FIELDS = ["task", "impl", "variant", "seed", "step", "loss", "accuracy", "lr"]
ACC_FIELDS = ["task", "impl", "variant", "seed", "length", "train_length", "steps", "n_sequences", "accuracy", "exact",
              "paper_mamba", "status"]


def read_rows(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def run_of(row: dict) -> tuple[str, str, str]:
    """A CSV row's run: (impl, variant, seed), the seed as text ("0" for rows written before the column)."""
    return row.get("impl"), row.get("variant"), str(row.get("seed") or 0)


def merge_write(path: str, fields: list[str], new_rows: list[dict], replace: set[tuple[str, str, str]]):
    """Writes the CSV: its rows of the runs (impl, variant, seed) in `replace` are replaced by new_rows,
    the other runs' rows kept."""
    rows = [r for r in read_rows(path) if run_of(r) not in replace] + new_rows
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)


def run_label(groups: dict, impl: str, var: str, seed: str) -> str:
    """A run's legend: "impl, variant", with its seed where the runs have several seeds."""
    seeds = {k[2] for k in groups}
    return f"{impl}, {var}" + (f", seed {seed}" if len(seeds) > 1 else "")


def plot(prefix: str, task: str) -> list[str]:
    """PREFIX_loss.png and PREFIX_accuracy.png from the CSVs (every impl/variant in them)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots (pip install .[bench])")
        return []
    written = []
    loss_rows = read_rows(prefix + "_loss.csv")
    if loss_rows:
        fig, ax = plt.subplots(figsize=(7, 4))
        groups = {}
        for r in loss_rows:
            groups.setdefault(run_of(r), []).append((int(r["step"]), float(r["loss"])))
        for (impl, var, seed), pts in sorted(groups.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], lw=0.8, label=run_label(groups, impl, var, seed),
                    ls="-" if var == "selective" else "--")
        ax.set(xlabel="step", ylabel="cross-entropy (scored positions)", yscale="log",
               title=f"{task}: training loss")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(prefix + "_loss.png", dpi=120)
        plt.close(fig)
        written.append(prefix + "_loss.png")
    acc_rows = [r for r in read_rows(prefix + "_accuracy.csv") if r["accuracy"] != ""]
    if acc_rows:
        fig, ax = plt.subplots(figsize=(7, 4))
        groups = {}
        for r in acc_rows:
            groups.setdefault(run_of(r), []).append((int(r["length"]), float(r["accuracy"])))
        if task == "induction-heads":
            lengths = sorted({L for pts in groups.values() for L, _ in pts})
            ax.plot(lengths, [PAPER_MAMBA[task]] * len(lengths), "k:", lw=2, label="paper: Mamba (Table 2)")
            for (impl, var, seed), pts in sorted(groups.items()):
                pts.sort()
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3,
                        ls="-" if var == "selective" else "--", label=run_label(groups, impl, var, seed))
            train_L = int(acc_rows[0]["train_length"])
            ax.axvline(train_L, color="gray", lw=0.8)
            ax.text(train_L, 2, " trained here", fontsize=7, color="gray")
            ax.set(xscale="log", xlabel="test sequence length", title="Induction Heads: accuracy per length")
            ax.set_xscale("log", base=2)
        else:
            train_L = int(acc_rows[0]["train_length"])
            names = ["paper: Mamba (S6), L 4096"] + [run_label(groups, *k) for k in sorted(groups)]
            # each run's accuracy at its training length (the first test length when it was not tested there)
            vals = [PAPER_MAMBA[task]] + [dict(groups[k]).get(train_L, groups[k][0][1]) for k in sorted(groups)]
            bars = ax.bar(range(len(names)), vals, zorder=2,
                          color=["k"] + ["C0" if "selective" in n else "C1" for n in names[1:]])
            ax.bar_label(bars, fmt="%.1f", fontsize=8)
            ax.axhspan(*PAPER_TIME_INVARIANT_RANGE, color="C1", alpha=0.15, zorder=0,
                       label="paper: time-invariant layers (Table 1), 18.3-57.0")
            ax.set_xticks(range(len(names)), names, rotation=15, fontsize=8)
            ax.set(title=f"Selective Copying: accuracy at length {train_L}")
        ax.set(ylabel="accuracy (%)", ylim=(0, 102))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(prefix + "_accuracy.png", dpi=120)
        plt.close(fig)
        written.append(prefix + "_accuracy.png")
    return written


# ---------------------------------------------------------------------------------------------------

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("task", choices=TASKS)
    ap.add_argument("--impl", default=None, help="one path: unfused (default), fused, reference")
    ap.add_argument("--impls", default=None, help="several paths, comma-separated, each from the same seed and batches")
    ap.add_argument("--time-invariant", action="store_true", help="the ablation: delta, B, C input-independent")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny run: short sequences, few steps, impl reference on the CPU (options given still win)")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--batch", type=int)
    ap.add_argument("--length", type=int, help="training sequence length (markers included)")
    ap.add_argument("--copy", type=int, help="selective copying: data tokens to copy")
    ap.add_argument("--vocab", type=int, help="vocabulary, special tokens included")
    ap.add_argument("--lr", type=float)
    ap.add_argument("--warmup", type=int, help="warmup steps (default 5%% of --steps)")
    ap.add_argument("--schedule", choices=("cosine", "constant"))
    ap.add_argument("--weight-decay", type=float)
    ap.add_argument("--clip", type=float, help="gradient-norm clipping (0: none)")
    ap.add_argument("--seed", type=int)
    ap.add_argument("--device", default=None, help="default: cuda when available (cpu with --smoke)")
    ap.add_argument("--d-model", type=int)
    ap.add_argument("--n-layer", type=int)
    ap.add_argument("--d-state", type=int)
    ap.add_argument("--d-conv", type=int)
    ap.add_argument("--expand", type=int)
    ap.add_argument("--norm", choices=("rms", "layer"))
    ap.add_argument("--eval-lengths", default=None,
                    help="comma-separated test lengths (default: the paper's; selective copying: --length)")
    ap.add_argument("--eval-n", type=int, help="validation sequences per test length")
    ap.add_argument("--eval-chunk", type=int, help="tokens per piece when a test sequence is longer")
    ap.add_argument("--eval-tokens", type=int, help="tokens per evaluation call (sequences x piece)")
    ap.add_argument("--eval-seed", type=int)
    ap.add_argument("--reference-max-eval-len", type=int,
                    help="impl reference: longer test lengths are skipped (a Python loop over tokens)")
    ap.add_argument("--ckpt", default=None, help="checkpoint file: resume from it, save to it")
    ap.add_argument("--ckpt-every", type=int)
    ap.add_argument("--stop-after", type=int, default=None, help="save the checkpoint and stop at this step")
    ap.add_argument("--log-every", type=int, help="steps between host copies of the losses")
    ap.add_argument("--out", default=None, help="output prefix (default docs/paper_tasks_<task>)")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar (plain prints instead)")
    a = ap.parse_args(argv)
    fill = dict(COMMON)
    fill.update(DEFAULTS[a.task])
    if a.smoke:
        fill.update(SMOKE[a.task])
    for k, v in fill.items():
        if getattr(a, k, None) is None:
            setattr(a, k, v)
    if a.impl is not None and a.impls is not None:
        ap.error("give --impl or --impls, not both")
    if a.impl is not None:
        a.impls = a.impl
    elif a.impls is None:
        a.impls = "reference" if a.smoke else "unfused"
    a.impls = [s.strip() for s in a.impls.split(",") if s.strip()]
    for i in a.impls:
        if i not in ("unfused", "fused", "reference"):
            ap.error(f"unknown impl {i!r}: unfused, fused or reference")
    if a.warmup is None:
        a.warmup = max(1, a.steps // 20)
    if a.eval_lengths is None:
        a.eval_lengths = [a.length]
    elif isinstance(a.eval_lengths, str):
        a.eval_lengths = [int(s) for s in a.eval_lengths.split(",") if s.strip()]
    if a.device is None:
        a.device = "cpu" if a.smoke or not torch.cuda.is_available() else "cuda"
    if a.out is None:
        base = os.path.join(tempfile.gettempdir(), "selscan_paper_tasks") if a.smoke else os.path.join(REPO, "docs")
        a.out = os.path.join(base, f"paper_tasks_{a.task.replace('-', '_')}")
    if a.task == "induction-heads":
        a.copy = 1
    return a


def main(argv=None) -> dict:
    a = parse_args(argv)
    device = torch.device(a.device)
    for impl in a.impls:
        why = probe(impl, a, device)
        if why is not None:
            print(f"impl '{impl}' cannot run the block here: {why}\nstopping (nothing trained).")
            raise SystemExit(2)
    store = None
    if a.ckpt:
        store = load_ckpt(a.ckpt)
        cfg = {k: getattr(a, k) for k in CKPT_KEYS}
        if store is None:
            store = {"format": 1, "config": cfg, "runs": {}}
        else:
            diff = [f"{k}: {store['config'].get(k)!r} in the checkpoint, {cfg[k]!r} now" for k in CKPT_KEYS
                    if store["config"].get(k) != cfg[k]]
            if diff:
                raise SystemExit(f"{a.ckpt} was written by a run with other settings ({'; '.join(diff)}); "
                                 "give the same options, or another --ckpt")
    print(f"{a.task}: length {a.length}, vocabulary {a.vocab}"
          + (f", {a.copy} tokens to copy" if a.task == "selective-copying" else "")
          + f"; {a.n_layer} x Mamba(d_model {a.d_model}, d_state {a.d_state}, d_conv {a.d_conv}, expand {a.expand})"
          + f", {variant(a)}; batch {a.batch}, {a.steps} steps, lr {a.lr}; device {device}; impls {','.join(a.impls)}")
    old = _Stop.install()
    # On the CPU the reference's decaying states reach subnormal floats after a few hundred steps, which
    # run ~10x slower there: flush them to zero (torch sets this for the calling thread only, so a long
    # CPU run is fastest with OMP_NUM_THREADS=1). Restored at the end (torch's default is off).
    flush_denormal = device.type == "cpu" and torch.set_flush_denormal(True)
    results = {"logs": {}, "accuracy": {}, "status": {}, "seconds": {}}
    try:
        for impl in a.impls:
            t0 = time.time()
            model, log, status = train(impl, a, device, store)
            results["logs"][impl], results["status"][impl] = log, status
            if status != "done":
                break
            n_params = sum(p.numel() for p in model.parameters())
            tail = log[-min(len(log), 20):]
            if tail:
                print(f"{impl}/{variant(a)}: {n_params} parameters; last {len(tail)} steps: loss "
                      f"{sum(r[1] for r in tail) / len(tail):.4f}, accuracy {sum(r[2] for r in tail) / len(tail):.3f}; "
                      f"{time.time() - t0:.0f} s")
            t1 = time.time()
            results["accuracy"][impl] = evaluate(model, impl, a, device)
            results["seconds"][impl] = (t1 - t0, time.time() - t1)
            key = {(impl, variant(a), str(a.seed))}
            merge_write(a.out + "_loss.csv", LOSS_FIELDS,
                        [{"task": a.task, "impl": impl, "variant": variant(a), "seed": a.seed, "step": s,
                          "loss": f"{loss:.6f}",
                          "accuracy": f"{acc:.6f}", "lr": f"{lr:.3e}"} for s, loss, acc, lr in log], key)
            merge_write(a.out + "_accuracy.csv", ACC_FIELDS, results["accuracy"][impl], key)
            print(f"{impl}/{variant(a)}: training {t1 - t0:.0f} s, evaluation {time.time() - t1:.0f} s")
    finally:
        _Stop.restore(old)
        if flush_denormal:
            torch.set_flush_denormal(False)
    if all(results["status"].get(i) == "done" for i in a.impls):
        if len(a.impls) >= 2:
            l0 = results["logs"][a.impls[0]]
            for other in a.impls[1:]:
                gap = max((abs(r0[1] - r1[1]) for r0, r1 in zip(l0, results["logs"][other])), default=0.0)
                print(f"largest per-step loss difference, {a.impls[0]} against {other}: {gap:.4f}")
        print(f"wrote {a.out}_loss.csv and {a.out}_accuracy.csv")
        if not a.no_plot:
            for p in plot(a.out, a.task):
                print(f"wrote {p}")
    return results


if __name__ == "__main__":
    main()
