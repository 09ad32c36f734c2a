"""The library products whose weight gradient sums over every token, formed so that a cuBLAS fault
cannot drop a token.

cuBLAS 13.0 on the H100 (torch 2.11+cu130) picks split-K kernels (nvjet ..._splitK) for G^T X with a
long K and a small output, and those drop the last row when K is one past a multiple of 64 (K = 4097,
8193, 16385, 65537: the product equals the one without that row; a float32 output and
torch.backends.cuda.matmul.allow_{bf16,fp16}_reduced_precision_reduction = False do not change it).
In training, K is batch * L, so the weight gradients of in_proj, x_proj, dt_proj, out_proj and lm_head
of any model on that library are wrong at such token counts. docs/reliability.md ("cuBLAS split-K and
a partial K tile") has the measured map; scripts/diag_mm.py --map measures it on any GPU.

weight_grad(G, X) = G^T X runs over the rows up to a multiple of 64 and over the rest apart (16-bit
products with float32 outputs, summed, rounded once); when K is a multiple of 64 it is the one product,
as before. `linear` is F.linear with that weight gradient. csrc/op_checks.h's weight_grad does the same
for the layer's backward (with a float32 output at every K).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

K_TILE = 64  # the split-K kernels' K tile


def weight_grad(G: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
    """G^T X for G (K, M) and X (K, D): the weight gradient of a product over K tokens, (M, D) in G's dtype."""
    K = G.shape[0]
    if not G.is_cuda or K % K_TILE == 0:
        return torch.mm(G.t(), X)
    half = G.dtype in (torch.float16, torch.bfloat16)
    K0 = K - K % K_TILE

    def prod(a, b):
        return torch.mm(a.t(), b, out_dtype=torch.float32) if half else torch.mm(a.t(), b)

    out = prod(G[K0:], X[K0:])
    if K0:
        out = out + prod(G[:K0], X[:K0])
    return out.to(G.dtype)


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(x, weight, bias):
        return F.linear(x, weight, bias)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias = inputs
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = torch.matmul(grad, weight)
        g2 = grad.reshape(-1, grad.shape[-1])
        if ctx.needs_input_grad[1]:
            dw = weight_grad(g2, x.reshape(-1, x.shape[-1]))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = g2.sum(0)
        return dx, dw, db


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear; on CUDA, while autograd records, with weight_grad's weight gradient."""
    if x.is_cuda and torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad
                                                  or (bias is not None and bias.requires_grad)):
        return _Linear.apply(x, weight, bias)
    return F.linear(x, weight, bias)
