"""The exact math of the Mamba-1 block in plain PyTorch: the reference its fast paths are checked against.

Shapes (batch sequences of L tokens; d_inner = expand * d_model channels inside the block, N = d_state,
R = dt_rank, W = d_conv), parameter names as in mamba-ssm's `Mamba` and Hugging Face's `MambaMixer`:

    hidden_states    (batch, L, d_model)  input
    in_proj_weight   (2 d_inner, d_model) in_proj.weight; in_proj_bias (2 d_inner,) or None
    conv_weight      (d_inner, 1, W)      conv1d.weight (or (d_inner, W)); conv_bias (d_inner,) or None
    x_proj_weight    (R + 2N, d_inner)    x_proj.weight, no bias
    dt_proj_weight   (d_inner, R)         dt_proj.weight; dt_proj_bias (d_inner,): the delta bias
    A_log            (d_inner, N)         A = -exp(A_log)
    D                (d_inner,)           skip connection
    out_proj_weight  (d_model, d_inner)   out_proj.weight; out_proj_bias (d_model,) or None
    h0               (batch, d_inner, N)  scan state entering the sequence, zeros when None
    conv_state       (batch, d_inner, W-1) the conv's inputs before the sequence (oldest first), zeros when None

    [xi | z]         = hidden_states in_proj_weight^T (+ in_proj_bias)                  (batch, L, 2 d_inner)
    u[t, c]          = silu(conv_bias[c] + sum_{k<W} conv_weight[c, k] xi[t-W+1+k, c])  (xi before 0: conv_state)
    [dt_low | B | C] = u x_proj_weight^T                                                 (R, N, N columns)
    delta            = softplus(dt_low dt_proj_weight^T + dt_proj_bias)
    h[t]             = exp(delta[t] A) h[t-1] + delta[t] B[t] u[t]
    y[t]             = (sum_n h[t, :, n] C[t, n] + D u[t]) * silu(z[t])
    out              = y out_proj_weight^T (+ out_proj_bias)

Returns (out, final scan state h[L-1] (batch, d_inner, N), final conv state (batch, d_inner, W-1): the
last W-1 inputs of the conv, so that a sequence processed in pieces equals one call). Everything is
computed in the compute dtype (float32, or float64 for float64 input); out is cast back to the input's
dtype, the conv state keeps the input's dtype (it holds input values), the scan state the compute dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .conv import causal_conv1d_ref
from .reference import scan_ref

__all__ = ["mamba_block_ref", "mamba_step_ref"]


def _linear(x, w, b, cd):
    return F.linear(x, w.to(cd), None if b is None else b.to(cd))


def block_terms(x, in_proj_weight, in_proj_bias, conv_weight, conv_bias, x_proj_weight, dt_proj_weight,
                dt_proj_bias, d_inner: int, N: int, conv_state=None, cd: torch.dtype = torch.float32):
    """The block's per-token terms before the scan (module docstring), in the compute dtype cd: u =
    silu(conv(xi)), the gate's z, delta, B, C, and the conv's final state."""
    R = dt_proj_weight.shape[1]
    xz = _linear(x.to(cd), in_proj_weight, in_proj_bias, cd)
    xi, z = xz[..., :d_inner], xz[..., d_inner:]
    # The conv state holds inputs of the conv: in the input's dtype, as the CUDA paths keep it.
    u, conv_final = causal_conv1d_ref(xi, conv_weight.reshape(d_inner, -1).to(cd),
                                      None if conv_bias is None else conv_bias.to(cd),
                                      None if conv_state is None else conv_state.to(cd), activation=True,
                                      compute_dtype=cd)
    xdbl = F.linear(u, x_proj_weight.to(cd))
    dt_low, Bt, Ct = xdbl[..., :R], xdbl[..., R:R + N], xdbl[..., R + N:]
    delta = F.softplus(_linear(dt_low, dt_proj_weight, dt_proj_bias, cd))
    return u, z, delta, Bt, Ct, conv_final


def mamba_block_ref(
    hidden_states: torch.Tensor,
    in_proj_weight: torch.Tensor,
    in_proj_bias: torch.Tensor | None,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    x_proj_weight: torch.Tensor,
    dt_proj_weight: torch.Tensor,
    dt_proj_bias: torch.Tensor,
    A_log: torch.Tensor,
    D: torch.Tensor,
    out_proj_weight: torch.Tensor,
    out_proj_bias: torch.Tensor | None,
    h0: torch.Tensor | None = None,
    conv_state: torch.Tensor | None = None,
    *,
    compute_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The block's forward (module docstring); differentiable in every tensor argument."""
    x = hidden_states
    cd = compute_dtype or (torch.float64 if x.dtype == torch.float64 else torch.float32)
    u, z, delta, Bt, Ct, conv_final = block_terms(x, in_proj_weight, in_proj_bias, conv_weight, conv_bias,
                                                  x_proj_weight, dt_proj_weight, dt_proj_bias, A_log.shape[0],
                                                  A_log.shape[1], conv_state, cd)
    y, h = scan_ref(u, delta, A_log.to(cd), Bt, Ct, D.to(cd), h0)
    y = y * F.silu(z)
    out = _linear(y, out_proj_weight, out_proj_bias, cd)
    return out.to(x.dtype), h, conv_final.to(x.dtype)


def mamba_step_ref(
    hidden_states: torch.Tensor,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    in_proj_weight: torch.Tensor,
    in_proj_bias: torch.Tensor | None,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    x_proj_weight: torch.Tensor,
    dt_proj_weight: torch.Tensor,
    dt_proj_bias: torch.Tensor,
    A_log: torch.Tensor,
    D: torch.Tensor,
    out_proj_weight: torch.Tensor,
    out_proj_bias: torch.Tensor | None,
    *,
    compute_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decode step: hidden_states (batch, d_model) -> (out (batch, d_model), new conv state
    (batch, d_inner, W-1), new scan state (batch, d_inner, N)); the same math as mamba_block_ref on a
    sequence of one token with (h0, conv_state) = (ssm_state, conv_state)."""
    out, h, conv = mamba_block_ref(hidden_states[:, None], in_proj_weight, in_proj_bias, conv_weight, conv_bias,
                                   x_proj_weight, dt_proj_weight, dt_proj_bias, A_log, D, out_proj_weight,
                                   out_proj_bias, ssm_state, conv_state, compute_dtype=compute_dtype)
    return out[:, 0], conv, h
