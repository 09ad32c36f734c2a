"""Packed variable-length sequences: the `cu_seqlens` argument of selective_scan() and of the Mamba block.

Several sequences of different lengths travel as one row of packed tokens, x of shape
(1, total_tokens, D), with

    cu_seqlens   int32 (num_seqs + 1,): 0 = cu_seqlens[0] < cu_seqlens[1] < ... < cu_seqlens[-1] = total_tokens

(FlashAttention's varlen convention): sequence s is tokens cu_seqlens[s] .. cu_seqlens[s+1] - 1. The
scan state (and the block's conv window) starts afresh at every sequence start: from h0[s] (and
conv_state[s]) when given, from zeros otherwise, and the final states come back per sequence,
(num_seqs, ...). The result is that of running each sequence alone.

Checks. The tensor's type, dtype, shape and device are checked on every call (metadata only, no
synchronisation). Its values (the first 0, the last total_tokens, every sequence at least one token)
are checked when validate=True, which reads cu_seqlens on the host: one synchronisation with the
device. validate=False skips that read where the caller promises valid values (a training loop that
builds cu_seqlens itself, torch.compile, CUDA graphs). impl='reference' always reads the values on
the host, since it runs the sequences one by one, and so always checks them.
"""
from __future__ import annotations

from typing import Callable

import torch

from ._extension import fused_packed_available

__all__ = ["check_cu_seqlens", "sequence_bounds"]


def check_cu_seqlens(cu_seqlens, total_tokens: int, device: torch.device, *, validate: bool,
                     name: str = "cu_seqlens", x_name: str = "x") -> int:
    """Checks cu_seqlens against packed input of total_tokens tokens on `device` (see the module's
    docstring for what is checked when) and returns the number of sequences. Errors name `name`."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"selscan_fused: {name} must be a torch.Tensor (int32, (num_seqs + 1,)), "
                        f"got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32:
        raise TypeError(f"selscan_fused: {name} has dtype {cu_seqlens.dtype}; it must be torch.int32 "
                        "(the cumulative sequence lengths, FlashAttention's varlen convention)")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError(f"selscan_fused: {name} has shape {tuple(cu_seqlens.shape)}, expected (num_seqs + 1,) "
                         "with num_seqs >= 1: 0, then the end of every sequence in the packed tokens")
    if cu_seqlens.device != device:
        raise ValueError(f"selscan_fused: {name} is on {cu_seqlens.device} but {x_name} is on {device}; "
                         "all tensors must be on the same device")
    if not isinstance(validate, bool):
        raise TypeError(f"selscan_fused: validate must be a bool, got {type(validate).__name__}")
    if validate:
        _check_values(cu_seqlens.tolist(), total_tokens, name, x_name)  # the one host synchronisation
    return cu_seqlens.shape[0] - 1


def _check_values(vals: list, total_tokens: int, name: str, x_name: str) -> None:
    if vals[0] != 0:
        raise ValueError(f"selscan_fused: {name}[0] = {vals[0]}; it must be 0 (the first sequence starts "
                         "at the first packed token)")
    for s in range(len(vals) - 1):
        if vals[s + 1] <= vals[s]:
            raise ValueError(
                f"selscan_fused: {name} must be strictly increasing (every sequence at least one token), but "
                f"{name}[{s + 1}] = {vals[s + 1]} <= {name}[{s}] = {vals[s]}")
    if vals[-1] != total_tokens:
        raise ValueError(f"selscan_fused: {name}[-1] = {vals[-1]}, but {x_name} holds {total_tokens} packed "
                         f"tokens (its dimension 1); the last entry must be the number of packed tokens")


def sequence_bounds(cu_seqlens: torch.Tensor, total_tokens: int, name: str = "cu_seqlens",
                    x_name: str = "x") -> list[tuple[int, int]]:
    """[(start, end), ...] of every sequence, read on the host and checked (the reference's way)."""
    vals = cu_seqlens.tolist()
    _check_values(vals, total_tokens, name, x_name)
    return list(zip(vals[:-1], vals[1:]))


def run_per_sequence(fn, x: torch.Tensor, cu_seqlens: torch.Tensor, states: tuple, x_name: str = "x"):
    """The packed result by its definition (the reference's way): fn(x_s, *states_s) on each sequence
    alone (x_s its tokens, states_s each per-sequence state's row or None); fn returns a tuple whose
    first entry is per token and the rest per sequence, concatenated along dims 1 and 0."""
    parts = [fn(x[:, a:b], *(None if t is None else t[s:s + 1] for t in states))
             for s, (a, b) in enumerate(sequence_bounds(cu_seqlens, x.shape[1], x_name=x_name))]
    return tuple(torch.cat([p[i] for p in parts], 1 if i == 0 else 0) for i in range(len(parts[0])))


def packed_batch_error(name: str, t: torch.Tensor, what: str) -> ValueError:
    return ValueError(f"selscan_fused: with cu_seqlens, {name} holds the packed tokens of all sequences as "
                      f"(1, total_tokens, {what}); got shape {tuple(t.shape)} (batch {t.shape[0]})")


FLOAT_DTYPES = frozenset((torch.float32, torch.bfloat16, torch.float16, torch.float64))


def check_float_tensor(name: str, t) -> None:
    """t is a tensor of a dtype the paths take (float32, bfloat16, float16; float64 for the reference)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"selscan_fused: {name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"selscan_fused: {name} must be a floating-point tensor, got {t.dtype}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"selscan_fused: {name} has dtype {t.dtype}; supported: float32, bfloat16, float16 "
                        "(and float64 with impl='reference')")


def check_per_sequence(name: str, t, shape: tuple, why: Callable[[], str], device: torch.device,
                       x_name: str = "x") -> None:
    """A per-sequence state (h0, conv_state) given with cu_seqlens: a floating-point tensor of `shape`
    (num_seqs first) on `device`. `why` (where the expected sizes come from) is a callable returning the
    text, called only for the error: formatting num_seqs into a string would make torch.compile specialise
    the graph on the number of sequences."""
    check_float_tensor(name, t)
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"selscan_fused: {name} has shape {tuple(t.shape)}, expected {tuple(shape)} ({why()})")
    if t.device != device:
        raise ValueError(f"selscan_fused: {name} is on {t.device} but {x_name} is on {device}; "
                         "all tensors must be on the same device")


CUDA_VARLEN_MESSAGE = ("cu_seqlens (packed sequences) runs on impl='unfused' and impl='reference', and on "
                       "impl='fused' only where the fused kernel's extension is loaded (CUDA tensors, Hopper) and "
                       "was not built with SELSCAN_FUSED_NVCC_FLAGS=-DSELSCAN_FUSED_NO_PACKED: here it is not "
                       "(selscan_fused._extension.fused_packed_available() is False)")


def check_packed_path(chosen: str) -> None:
    """Raises, naming the paths that take them, unless path `chosen` takes packed sequences: 'reference'
    and 'unfused' always, 'fused' where its kernel was built with them (fused_packed_available())."""
    if chosen not in ("reference", "unfused") and not (chosen == "fused" and fused_packed_available()):
        raise ValueError(f"selscan_fused: {CUDA_VARLEN_MESSAGE}")


AUTO_VARLEN_MESSAGE = ("impl='auto' runs these packed sequences (cu_seqlens) on the slow reference: the unfused "
                       "path, whose kernels run packed sequences, does not take these inputs (or the extension "
                       "is not built)")
