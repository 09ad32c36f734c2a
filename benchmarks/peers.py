"""mamba-ssm as the peer: its selective-scan CUDA kernels (the module `selective_scan_cuda`, from an
installed mamba-ssm or built by the project's peer build script from a copy of state-spaces/mamba),
driven the way a mamba-ssm user drives them for this layer: cuBLAS projections into mamba's
(batch, D, L) layout, its fused softplus / bias, its forward and backward kernels, y back in
(batch, L, D). None of mamba's code is in this repository; this calls its kernels' documented entry
points (fwd(u, delta, A, B, C, D, z, delta_bias, delta_softplus) -> [out, x, ...] and bwd(...)).

    available()            whether selective_scan_cuda imports
    mamba_lm(model)        mamba-ssm's MambaLMHeadModel with a selscan_fused.MambaLM's config and weights
    user_path(x, A_log, W_delta, b_delta, W_B, W_C, D) -> y   differentiable (mamba's backward kernel)
    scan_only(u, delta, A, B, C, D, delta_bias)       -> y   the scan kernel alone, (batch, D, L) inputs
"""
from __future__ import annotations

import torch

try:
    import selective_scan_cuda  # type: ignore
except ImportError:  # not installed and not built: benchmarks print "-" in mamba's columns
    selective_scan_cuda = None


def available() -> bool:
    return selective_scan_cuda is not None


class _MambaScan(torch.autograd.Function):
    """mamba's selective scan with softplus(delta + delta_bias) inside, no z gate."""

    @staticmethod
    def forward(ctx, u, delta, A, B, C, D, delta_bias):
        out, states, *_ = selective_scan_cuda.fwd(u, delta, A, B, C, D, None, delta_bias, True)
        ctx.save_for_backward(u, delta, A, B, C, D, delta_bias, states)
        return out

    @staticmethod
    def backward(ctx, dout):
        u, delta, A, B, C, D, delta_bias, states = ctx.saved_tensors
        du, ddelta, dA, dB, dC, dD, ddelta_bias, *_ = selective_scan_cuda.bwd(
            u, delta, A, B, C, D, None, delta_bias, dout.contiguous(), states, None, None, True, False)
        return du, ddelta, dA, dB, dC, dD, ddelta_bias


def user_path(x, A_log, W_delta, b_delta, W_B, W_C, D):
    """y (batch, L, D) as a mamba-ssm user computes this layer; weights cast to x's dtype first."""
    dt = x.dtype
    u = x.transpose(1, 2).contiguous()                                   # (batch, D, L)
    delta = (x @ W_delta.to(dt).T).transpose(1, 2).contiguous()          # pre-activation
    Bm = (x @ W_B.to(dt).T).transpose(1, 2).contiguous().unsqueeze(1)    # (batch, 1, N, L)
    Cm = (x @ W_C.to(dt).T).transpose(1, 2).contiguous().unsqueeze(1)
    A = -torch.exp(A_log.float())
    y = _MambaScan.apply(u, delta, A, Bm, Cm, D.float(), b_delta.float())
    return y.transpose(1, 2)


def scan_only(u, delta, A, B, C, D, delta_bias):
    return selective_scan_cuda.fwd(u, delta, A, B, C, D, None, delta_bias, True)[0]


def mamba_lm(model):
    """mamba-ssm's MambaLMHeadModel built with `model`'s (a selscan_fused.MambaLM) configuration, device and
    dtype, holding its weights (the same names); (peer, None), or (None, why) when mamba_ssm does not
    import (its Python package and kernels: the peers' build scripts)."""
    try:
        from mamba_ssm.models.config_mamba import MambaConfig  # type: ignore
        from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel  # type: ignore
    except Exception as e:  # noqa: BLE001  (any import failure: the caller's rows say why)
        return None, f"{type(e).__name__}: {e}"
    c = model.config
    w = model.lm_head.weight
    peer = MambaLMHeadModel(MambaConfig(d_model=c.d_model, n_layer=c.n_layer, vocab_size=c.vocab_size,
                                        pad_vocab_size_multiple=c.pad_vocab_size_multiple,
                                        tie_embeddings=c.tie_embeddings),
                            device=w.device, dtype=w.dtype).eval()
    peer.load_state_dict(model.state_dict(), strict=False)
    return peer, None
