"""The depthwise causal conv1d of the Mamba-1 block, with SiLU fused (mamba-ssm's `causal_conv1d_fn`):
a plain-PyTorch reference and the CUDA op (csrc/conv/) with its autograd formula.

For x of shape (batch, L, C) (channels last; x may be a strided view, e.g. the first C columns of
in_proj's (batch, L, 2C) output), weight (C, W) (or nn.Conv1d's (C, 1, W)), bias (C,) or None and
initial_state (batch, C, W-1) or None (zeros):

    pre[b,t,c] = bias[c] + sum_{k<W} weight[c,k] * xx[b, t-W+1+k, c]
    xx[b,s,c]  = x[b,s,c] for s >= 0, initial_state[b,c,W-1+s] for s < 0
    out        = silu(pre) if activation else pre                       (batch, L, C), x's dtype
    final_state[b,c,j] = xx[b, L-(W-1)+j, c], j < W-1                    (batch, C, W-1), x's dtype

so that two calls, the second given the first's final_state as its initial_state, equal one call on
the concatenated sequence. The CUDA op computes in float32 (x and out in float32, bfloat16 or float16;
W = 2, 3 or 4) and its backward is bitwise deterministic.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._extension import extension_available, extension_error_message

__all__ = ["causal_conv1d_ref", "causal_conv1d", "causal_conv1d_packed", "conv_op_available"]


def _weight_2d(weight: torch.Tensor, C: int) -> torch.Tensor:
    """weight as (C, W): nn.Conv1d(C, C, W, groups=C) stores it as (C, 1, W)."""
    if weight.dim() == 3:
        if weight.shape[1] != 1:
            raise ValueError(f"causal_conv1d: weight of shape {tuple(weight.shape)} is not depthwise "
                             "((C, 1, W) as nn.Conv1d(C, C, W, groups=C) stores it, or (C, W))")
        weight = weight.squeeze(1)
    if weight.dim() != 2 or weight.shape[0] != C:
        raise ValueError(f"causal_conv1d: weight must have shape (C, W) or (C, 1, W) with C = {C} (x's last "
                         f"dimension), got {tuple(weight.shape)}")
    return weight


def causal_conv1d_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                      initial_state: torch.Tensor | None = None, activation: bool = True,
                      compute_dtype: torch.dtype | None = None):
    """The math above in plain PyTorch, as an explicit sum over the W taps (differentiable; any device;
    float64 capable). compute_dtype: the arithmetic's dtype (default float64 for float64 x, else
    float32). Returns (out, final_state), both in x's dtype."""
    if x.dim() != 3:
        raise ValueError(f"causal_conv1d: x must have shape (batch, L, C), got {tuple(x.shape)}")
    batch, L, C = x.shape
    w = _weight_2d(weight, C)
    W = w.shape[1]
    if W < 1:
        raise ValueError("causal_conv1d: weight has width 0")
    cd = compute_dtype or (torch.float64 if x.dtype == torch.float64 else torch.float32)
    if initial_state is None:
        head = x.new_zeros((batch, W - 1, C), dtype=cd)
    else:
        if tuple(initial_state.shape) != (batch, C, W - 1):
            raise ValueError(f"causal_conv1d: initial_state must have shape {(batch, C, W - 1)} (batch, C, W - 1), "
                             f"got {tuple(initial_state.shape)}")
        head = initial_state.to(cd).transpose(1, 2)
    xx = torch.cat([head, x.to(cd)], dim=1)  # (batch, W-1+L, C): xx[:, W-1+s] = xx[s]
    wc = w.to(cd)
    pre = xx[:, 0:L] * wc[:, 0]
    for k in range(1, W):
        pre = pre + xx[:, k:k + L] * wc[:, k]
    if bias is not None:
        pre = pre + bias.to(cd)
    out = F.silu(pre) if activation else pre
    final_state = xx[:, L:L + W - 1].transpose(1, 2)  # xx[L-(W-1) .. L-1]
    return out.to(x.dtype), final_state.to(x.dtype).contiguous()


def conv_op_available() -> bool:
    """True when the CUDA extension is loaded and was built with the conv ops."""
    return extension_available() and hasattr(torch.ops.selscan_fused, "causal_conv1d_fwd")


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  initial_state: torch.Tensor | None = None, activation: bool = True,
                  return_final_state: bool = False):
    """The CUDA op (torch.ops.selscan_fused.causal_conv1d_fwd), differentiable in x, weight, bias and
    initial_state. weight, bias and initial_state are cast to float32 (differentiably). Returns out, or
    (out, final_state) with return_final_state."""
    if not conv_op_available():
        msg = extension_error_message("unfused") if not extension_available() else (
            "selscan_fused: the loaded extension selscan_fused._C was built without the conv ops (csrc/conv/); "
            "rebuild it")
        raise RuntimeError(msg.replace("impl='unfused' needs", "causal_conv1d needs"))
    if x.dim() != 3:
        raise ValueError(f"causal_conv1d: x must have shape (batch, L, C), got {tuple(x.shape)}")
    w = _weight_2d(weight, x.shape[2]).float()
    b = bias.float() if bias is not None else None
    h = initial_state.float() if initial_state is not None else None
    out, final_state = torch.ops.selscan_fused.causal_conv1d_fwd(x, w, b, h, activation, return_final_state)
    return (out, final_state) if return_final_state else out


def causal_conv1d_packed(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         initial_state: torch.Tensor | None, cu_seqlens: torch.Tensor, activation: bool = True,
                         return_final_state: bool = False):
    """Packed sequences (selscan_fused.varlen): x (1, total_tokens, C) holds num_seqs sequences, rows
    [cu_seqlens[s], cu_seqlens[s + 1]); the window restarts at every sequence start from initial_state[s]
    ((num_seqs, C, W-1), or zeros) and final_state is per sequence: every token's output is bitwise that
    of its sequence run alone (torch.ops.selscan_fused.causal_conv1d_packed_fwd). Differentiable in x,
    weight, bias and initial_state. Returns out, or (out, final_state)."""
    if not conv_op_available() or not hasattr(torch.ops.selscan_fused, "causal_conv1d_packed_fwd"):
        raise RuntimeError(extension_error_message("unfused").replace("impl='unfused' needs", "causal_conv1d needs"))
    if x.dim() != 3:
        raise ValueError(f"causal_conv1d: x must have shape (1, total_tokens, C), got {tuple(x.shape)}")
    w = _weight_2d(weight, x.shape[2]).float()
    b = bias.float() if bias is not None else None
    h = initial_state.float() if initial_state is not None else None
    out, final_state = torch.ops.selscan_fused.causal_conv1d_packed_fwd(x, w, b, h, cu_seqlens, activation,
                                                                         return_final_state)
    return (out, final_state) if return_final_state else out


def _setup_packed(ctx, inputs, output):
    x, weight, bias, initial_state, cu_seqlens, silu, _ = inputs
    ctx.save_for_backward(x, weight, bias, initial_state, cu_seqlens)
    ctx.silu = silu
    ctx.set_materialize_grads(False)


def _backward_packed(ctx, dout, dfinal_state):
    x, weight, bias, initial_state, cu_seqlens = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros(x.shape, dtype=x.dtype, device=x.device)
    if dfinal_state is not None and dfinal_state.numel() == 0:  # the final state was not returned
        dfinal_state = None
    dx, dweight, dbias, dinit = torch.ops.selscan_fused.causal_conv1d_packed_bwd(
        x, weight, bias, initial_state, dout, dfinal_state, cu_seqlens, ctx.silu)
    return (dx, dweight, dbias if bias is not None else None, dinit if initial_state is not None else None,
            None, None, None)


def _setup_fwd(ctx, inputs, output):
    x, weight, bias, initial_state, silu, _ = inputs
    ctx.save_for_backward(x, weight, bias, initial_state)
    ctx.silu = silu
    ctx.set_materialize_grads(False)


def _backward_fwd(ctx, dout, dfinal_state):
    x, weight, bias, initial_state = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros(x.shape, dtype=x.dtype, device=x.device)
    if dfinal_state is not None and dfinal_state.numel() == 0:  # the final state was not returned
        dfinal_state = None
    dx, dweight, dbias, dinit = torch.ops.selscan_fused.causal_conv1d_bwd(
        x, weight, bias, initial_state, dout, dfinal_state, ctx.silu)
    return (dx, dweight, dbias if bias is not None else None, dinit if initial_state is not None else None,
            None, None)


if conv_op_available():

    @torch.library.register_fake("selscan_fused::causal_conv1d_fwd")
    def _causal_conv1d_fwd_fake(x, weight, bias, initial_state, silu, return_final_state):
        batch, _, C = x.shape
        out = x.new_empty(x.shape)
        if return_final_state:
            fs = x.new_empty((batch, C, weight.shape[1] - 1))
        else:
            fs = x.new_empty((0,))
        return out, fs

    @torch.library.register_fake("selscan_fused::causal_conv1d_bwd")
    def _causal_conv1d_bwd_fake(x, weight, bias, initial_state, dout, dfinal_state, silu):
        batch, _, C = x.shape
        f32 = dict(dtype=torch.float32)
        return [x.new_empty(x.shape), weight.new_empty((C, weight.shape[1]), **f32),
                weight.new_empty((C,) if bias is not None else (0,), **f32),
                weight.new_empty((batch, C, weight.shape[1] - 1) if initial_state is not None else (0,), **f32)]

    torch.library.register_autograd("selscan_fused::causal_conv1d_fwd", _backward_fwd, setup_context=_setup_fwd)

if conv_op_available() and hasattr(torch.ops.selscan_fused, "causal_conv1d_packed_fwd"):

    @torch.library.register_fake("selscan_fused::causal_conv1d_packed_fwd")
    def _causal_conv1d_packed_fwd_fake(x, weight, bias, initial_state, cu_seqlens, silu, return_final_state):
        C, W = x.shape[2], weight.shape[1]
        fs = x.new_empty((cu_seqlens.shape[0] - 1, C, W - 1)) if return_final_state else x.new_empty((0,))
        return x.new_empty(x.shape), fs

    @torch.library.register_fake("selscan_fused::causal_conv1d_packed_bwd")
    def _causal_conv1d_packed_bwd_fake(x, weight, bias, initial_state, dout, dfinal_state, cu_seqlens, silu):
        C, W = x.shape[2], weight.shape[1]
        f32 = dict(dtype=torch.float32)
        return [x.new_empty(x.shape), weight.new_empty((C, W), **f32),
                weight.new_empty((C,) if bias is not None else (0,), **f32),
                weight.new_empty((cu_seqlens.shape[0] - 1, C, W - 1) if initial_state is not None else (0,), **f32)]

    torch.library.register_autograd("selscan_fused::causal_conv1d_packed_fwd", _backward_packed,
                                    setup_context=_setup_packed)
