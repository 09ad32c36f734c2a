"""The exact math of the layer in plain PyTorch: the reference every fast path is checked against.

Shapes (batch sequences of L tokens, D = d_model channels, N = d_state states per channel):

    x        (batch, L, D)   input
    A_log    (D, N)          A = -exp(A_log), the (negated) decay rates
    W_delta  (D, D)          delta projection weight  (proj_delta.weight)
    b_delta  (D,)            delta projection bias    (proj_delta.bias)
    W_B      (N, D)          B projection weight      (proj_B.weight), no bias
    W_C      (N, D)          C projection weight      (proj_C.weight), no bias
    D        (D,)            skip connection
    h0       (batch, D, N)   initial state, zeros when None

    delta[b,t,d] = softplus(sum_k x[b,t,k] W_delta[d,k] + b_delta[d])
    Bt[b,t,n]    = sum_k x[b,t,k] W_B[n,k]
    Ct[b,t,n]    = sum_k x[b,t,k] W_C[n,k]
    h[b,t,d,n]   = exp(delta[b,t,d] A[d,n]) h[b,t-1,d,n] + delta[b,t,d] Bt[b,t,n] x[b,t,d]
    y[b,t,d]     = sum_n h[b,t,d,n] Ct[b,t,n] + D[d] x[b,t,d]

Everything is upcast to the compute dtype (float32, or float64 when x is float64) and y is cast back to
x's dtype at the end; the final state h[:, L-1] stays in the compute dtype. Runs on any device.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["selective_scan_ref", "scan_ref"]


def selective_scan_ref(
    x: torch.Tensor,
    A_log: torch.Tensor,
    W_delta: torch.Tensor,
    b_delta: torch.Tensor,
    W_B: torch.Tensor,
    W_C: torch.Tensor,
    D: torch.Tensor,
    h0: torch.Tensor | None = None,
    *,
    compute_dtype: torch.dtype | None = None,
    projection_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (y, final_state): y (batch, L, D) in x.dtype, final_state (batch, D, N) in compute_dtype.

    compute_dtype defaults to float64 for float64 x and float32 otherwise. float32 products follow
    torch.get_float32_matmul_precision(), as any torch matmul does. projection_dtype, when given: the
    three projections are F.linear of x and the weights in that dtype (rounded to it, as the unfused
    path's cuBLAS products are), and under autograd their gradients are rounded to it too and the
    products of the backward run in it (the unfused path's design; tests/differential.py judges by it).
    """
    cd = compute_dtype or (torch.float64 if x.dtype == torch.float64 else torch.float32)
    batch, L, Dm = x.shape
    N = A_log.shape[1]
    xf = x.to(cd)
    if projection_dtype is None:
        zt = xf @ W_delta.to(cd).T
        Bt = xf @ W_B.to(cd).T  # (batch, L, N)
        Ct = xf @ W_C.to(cd).T  # (batch, L, N)
    else:
        xp = x.to(projection_dtype)
        zt, Bt, Ct = (F.linear(xp, W.to(projection_dtype)).to(cd) for W in (W_delta, W_B, W_C))
    delta = F.softplus(zt + b_delta.to(cd))  # (batch, L, D)
    return scan_ref(xf, delta, A_log.to(cd), Bt, Ct, D.to(cd), h0, out_dtype=x.dtype)


def scan_ref(
    u: torch.Tensor,
    delta: torch.Tensor,
    A_log: torch.Tensor,
    Bt: torch.Tensor,
    Ct: torch.Tensor,
    D: torch.Tensor,
    h0: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence shared by the layer and the Mamba-1 block, in u's dtype (the compute dtype):

        u (batch, L, D), delta (batch, L, D) (after softplus), A_log (D, N), Bt, Ct (batch, L, N), D (D,)
        h[t] = exp(delta[t] A) h[t-1] + delta[t] Bt[t] u[t],  A = -exp(A_log)
        y[t] = sum_n h[t, :, n] Ct[t, n] + D u[t]

    Returns (y in out_dtype (default u's), final state h[L-1] (batch, D, N) in u's dtype)."""
    cd = u.dtype
    batch, L, Dm = u.shape
    N = A_log.shape[1]
    A = -torch.exp(A_log.to(cd))  # (D, N)
    Bt, Ct = Bt.to(cd), Ct.to(cd)
    h = torch.zeros(batch, Dm, N, dtype=cd, device=u.device) if h0 is None else h0.to(cd).clone()
    y = torch.empty(batch, L, Dm, dtype=cd, device=u.device)
    # Materialise exp(delta*A) and delta*B*u (batch, T, D, N) for T tokens at a time, bounding memory.
    chunk = max(1, min(256, (1 << 26) // max(1, batch * Dm * N)))
    for t0 in range(0, L, chunk):
        t1 = min(L, t0 + chunk)
        dA = torch.exp(delta[:, t0:t1, :, None] * A)  # (batch, T, D, N)
        dBx = (delta[:, t0:t1] * u[:, t0:t1])[..., None] * Bt[:, t0:t1, None, :]  # (batch, T, D, N)
        for t in range(t1 - t0):
            h = dA[:, t] * h + dBx[:, t]
            y[:, t0 + t] = torch.einsum("bdn,bn->bd", h, Ct[:, t0 + t])
    y = y + D.to(cd) * u
    return y.to(out_dtype or cd), h
