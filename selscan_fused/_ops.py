"""Python side of the torch.library ops defined in csrc/torch_ops.cpp and csrc/fused/fused_ops.cpp:
fake (meta) implementations, so that torch.compile traces them without running them, and the autograd
registrations.

Training goes through the ops with residuals: `unfused_fwd_res` (y, final state, proj, checkpoints)
and `fused_fwd_res` (y, final state, checkpoints). The unfused path's backward is one call of
`unfused_bwd` (the backward scan kernel and the library products); the fused path's is one call of
`fused_bwd` (the fused backward kernel, which recomputes the projections on the tensor cores, and the
library products; where that kernel does not exist it recomputes proj with one product and runs
`unfused_bwd`'s kernel). The plain forward ops are differentiable too: their backward reruns the
forward with residuals first.
"""
from __future__ import annotations

import torch

from ._extension import extension_available, fused_extension_available
from ._linear import weight_grad

CKPT_EVERY = 64  # tokens between the forward's checkpoints (csrc/common/checkpoints.h)

SCAN_BACKWARD_MESSAGE = (
    "selscan_fused: torch.ops.selscan_fused.scan_fwd (the scan kernel alone on precomputed projections) "
    "has no backward; differentiate through selscan_fused.selective_scan (impl='unfused' or 'fused')")


def _fake_outputs(x: torch.Tensor, A_log: torch.Tensor, return_final_state: bool):
    batch, _, Dm = x.shape
    y = x.new_empty(x.shape)
    if return_final_state:
        h = x.new_empty((batch, Dm, A_log.shape[1]), dtype=torch.float32)
    else:
        h = x.new_empty((0,), dtype=torch.float32)
    return y, h


def _fake_ckpt(x: torch.Tensor, A_log: torch.Tensor):
    batch, L, Dm = x.shape
    return x.new_empty((batch, (L + CKPT_EVERY - 1) // CKPT_EVERY, Dm, A_log.shape[1]), dtype=torch.float32)


def _backward(x, A_log, W_delta, b_delta, W_B, W_C, D, h0, proj, ckpt, l_segments, dy, dhT, bwd_mode=0):
    """Gradients of (x, A_log, W_delta, b_delta, W_B, W_C, D, h0) through one backward op call."""
    if dy is None:
        dy = torch.zeros_like(x)
    if dhT is not None and dhT.numel() == 0:  # the final state was not returned
        dhT = None
    if proj is None and fused_extension_available():
        # The fused path: its backward kernel where it exists, else the recomputation (fused_bwd decides).
        g = torch.ops.selscan_fused.fused_bwd(x, A_log, W_delta, b_delta, W_B, W_C, D, h0, dy, dhT, ckpt,
                                              l_segments, bwd_mode)
    else:
        g = torch.ops.selscan_fused.unfused_bwd(x, A_log, W_delta, b_delta, W_B, W_C, D, h0, dy, dhT, proj, ckpt,
                                                l_segments)
    dx, dA_log, dW_delta, db_delta, dW_B, dW_C, dD, dh0 = g
    return dx, dA_log, dW_delta, db_delta, dW_B, dW_C, dD, (dh0 if h0 is not None else None)


def _setup_res(ctx, inputs, output):
    """fused_fwd_res / unfused_fwd_res: keep the inputs and the residuals."""
    x, A_log, W_delta, b_delta, W_B, W_C, D, h0, l_segments = inputs[:9]
    if len(output) == 4:  # unfused: (y, final state, proj, ckpt)
        proj, ckpt = output[2], output[3]
    else:  # fused: (y, final state, ckpt); the backward recomputes proj (bwd_mode: how, fused_bwd's mode)
        proj, ckpt = None, output[2]
    ctx.bwd_mode = inputs[12] if len(output) == 3 and len(inputs) > 12 else 0
    ctx.save_for_backward(x, A_log, W_delta, b_delta, W_B, W_C, D, h0, proj, ckpt)
    ctx.l_segments = l_segments
    ctx.n_inputs = len(inputs)
    ctx.set_materialize_grads(False)


def _backward_res(ctx, dy, dhT, *unused):
    x, A_log, W_delta, b_delta, W_B, W_C, D, h0, proj, ckpt = ctx.saved_tensors
    grads = _backward(x, A_log, W_delta, b_delta, W_B, W_C, D, h0, proj, ckpt, ctx.l_segments, dy, dhT,
                      ctx.bwd_mode)
    return grads + (None,) * (ctx.n_inputs - 8)


def _setup_plain(ctx, inputs, output):
    """unfused_fwd / fused_fwd: keep the inputs; the backward reruns the forward with residuals."""
    ctx.save_for_backward(*inputs[:8])
    ctx.rest = inputs[8:]  # return_final_state, l_segments[, exp_poly, ring_stages, channel_tile, bwd_mode]
    ctx.set_materialize_grads(False)


def _make_backward_plain(fused: bool):
    def backward(ctx, dy, dhT):
        x, A_log, W_delta, b_delta, W_B, W_C, D, h0 = ctx.saved_tensors
        l_segments = ctx.rest[1]
        if fused:
            _, _, ckpt = torch.ops.selscan_fused.fused_fwd_res(x, A_log, W_delta, b_delta, W_B, W_C, D, h0,
                                                               l_segments, *ctx.rest[2:])
            proj = None
        else:
            _, _, proj, ckpt = torch.ops.selscan_fused.unfused_fwd_res(x, A_log, W_delta, b_delta, W_B, W_C, D,
                                                                       h0, l_segments)
        bwd_mode = ctx.rest[5] if fused and len(ctx.rest) > 5 else 0
        grads = _backward(x, A_log, W_delta, b_delta, W_B, W_C, D, h0, proj, ckpt, l_segments, dy, dhT, bwd_mode)
        return grads + (None,) * len(ctx.rest)
    return backward


def _no_backward(ctx, *grads):
    raise NotImplementedError(SCAN_BACKWARD_MESSAGE)


def _no_setup(ctx, inputs, output):
    pass


if extension_available():

    @torch.library.register_fake("selscan_fused::unfused_fwd")
    def _unfused_fwd_fake(x, A_log, W_delta, b_delta, W_B, W_C, D, h0, return_final_state, l_segments):
        return _fake_outputs(x, A_log, return_final_state)

    @torch.library.register_fake("selscan_fused::unfused_fwd_res")
    def _unfused_fwd_res_fake(x, A_log, W_delta, b_delta, W_B, W_C, D, h0, l_segments):
        y, h = _fake_outputs(x, A_log, True)
        batch, L, Dm = x.shape
        proj = x.new_empty((batch, L, Dm + 2 * A_log.shape[1]))
        return y, h, proj, _fake_ckpt(x, A_log)

    @torch.library.register_fake("selscan_fused::unfused_bwd")
    def _unfused_bwd_fake(x, A_log, W_delta, b_delta, W_B, W_C, D, h0, dy, dhT, proj, ckpt, l_segments):
        batch, _, Dm = x.shape
        return [torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(A_log),
                torch.empty_like(W_delta), torch.empty_like(b_delta), torch.empty_like(W_B),
                torch.empty_like(W_C), torch.empty_like(D),
                x.new_empty((batch, Dm, A_log.shape[1]), dtype=torch.float32)]

    @torch.library.register_fake("selscan_fused::scan_fwd")
    def _scan_fwd_fake(proj, x, A_log, b_delta, D, h0, return_final_state, l_segments):
        return _fake_outputs(x, A_log, return_final_state)

    torch.library.register_autograd("selscan_fused::unfused_fwd_res", _backward_res, setup_context=_setup_res)
    torch.library.register_autograd("selscan_fused::unfused_fwd", _make_backward_plain(False),
                                    setup_context=_setup_plain)
    torch.library.register_autograd("selscan_fused::scan_fwd", _no_backward, setup_context=_no_setup)


def _gated_scan_setup(ctx, inputs, output):
    """gated_scan_fwd: keep what scan_bwd needs (no y before the gate: the backward scan recomputes it)."""
    delta, bc, u, z, A_log, b_delta, D, h0, _, training, l_segments = inputs
    _, _, ckpt = output
    ctx.training = training
    ctx.l_segments = l_segments
    ctx.save_for_backward(delta, bc, u, z, A_log, b_delta, D, h0, ckpt)
    ctx.set_materialize_grads(False)


def _dy_or_zeros(dy, like):
    """The output's gradient for the backward scan kernel: zeros when only the final state's flows."""
    return torch.zeros_like(like) if dy is None else dy


def _gated_fake(u, A_log, return_final_state, training):
    """gated_scan_fwd's and fused_block_fwd's outputs: y, the final state and the checkpoints (empty
    along the batch unless training)."""
    y, h = _fake_outputs(u, A_log, return_final_state)
    _, L, Dm = u.shape
    ckpt = _fake_ckpt(u, A_log) if training else u.new_empty((0, (L + CKPT_EVERY - 1) // CKPT_EVERY, Dm,
                                                              A_log.shape[1]), dtype=torch.float32)
    return y, h, ckpt


def _gated_scan_backward(ctx, dy, dhT, *unused):
    """The backward scan kernel with the gate (scan_bwd with gate_z): for y_out = y * silu(z) it takes
    dy_out, recomputes y from the checkpoints and returns the gate's gradient dz = dy_out * y * silu'(z)
    beside the scan's."""
    if not ctx.training:
        raise RuntimeError("selscan_fused: gated_scan_fwd was called with training=False and keeps nothing for "
                           "a backward; call it with training=True (selscan_fused.mamba_block does)")
    delta, bc, u, z, A_log, b_delta, D, h0, ckpt = ctx.saved_tensors
    Dm = u.shape[-1]
    if dhT is not None and dhT.numel() == 0:  # the final state was not returned
        dhT = None
    dP, du, dA_log, db, dD, dh0, dz = torch.ops.selscan_fused.scan_bwd(
        delta, bc, u, A_log, b_delta, D, h0, _dy_or_zeros(dy, u), dhT, ckpt, ctx.l_segments, gate_z=z)
    return (dP[..., :Dm], dP[..., Dm:], du, dz, dA_log, db, dD, dh0 if h0 is not None else None, None, None, None)


if extension_available():

    @torch.library.register_fake("selscan_fused::gated_scan_fwd")
    def _gated_scan_fwd_fake(delta, bc, u, z, A_log, b_delta, D, h0, return_final_state, training, l_segments):
        return _gated_fake(u, A_log, return_final_state, training)

    @torch.library.register_fake("selscan_fused::scan_bwd")
    def _scan_bwd_fake(delta, bc, x, A_log, b_delta, D, h0, dy, dhT, ckpt, l_segments, gate_z=None):
        batch, L, Dm = x.shape
        N = A_log.shape[1]
        return [x.new_empty((batch, L, Dm + 2 * N)), x.new_empty((batch, L, Dm)), torch.empty_like(A_log),
                torch.empty_like(b_delta), torch.empty_like(D), x.new_empty((batch, Dm, N), dtype=torch.float32),
                x.new_empty((batch if gate_z is not None else 0, L, Dm))]

    torch.library.register_autograd("selscan_fused::gated_scan_fwd", _gated_scan_backward,
                                    setup_context=_gated_scan_setup)


def _packed_fake_outputs(x, A_log, cu_seqlens, return_final_state, with_ckpt):
    """The packed forward ops' outputs: y shaped as x (1, T, D), the final states (num_seqs, D, N) or (0,),
    the checkpoints in the packed slot layout (1 or 0, T // 64 + num_seqs, D, N)."""
    _, T, Dm = x.shape
    N = A_log.shape[1]
    S = cu_seqlens.shape[0] - 1
    f32 = dict(dtype=torch.float32)
    h = x.new_empty((S, Dm, N), **f32) if return_final_state else x.new_empty((0,), **f32)
    ckpt = x.new_empty((1 if with_ckpt else 0, T // CKPT_EVERY + S, Dm, N), **f32)
    return x.new_empty(x.shape), h, ckpt


def _packed_setup(ctx, inputs, output):
    """scan_fwd_packed: keep what scan_bwd_packed needs."""
    delta, bc, x, z, A_log, b_delta, D, h0, cu_seqlens, _, training = inputs
    _, _, ckpt = output
    ctx.training = training
    ctx.save_for_backward(delta, bc, x, z, A_log, b_delta, D, h0, cu_seqlens, ckpt)
    ctx.set_materialize_grads(False)


def _packed_backward(ctx, dy, dhT, *unused):
    """Packed sequences: the backward scan kernel over the sequences (scan_bwd_packed, with the block's
    gate when z is given); delta_pre's, B's and C's gradients go back through the caller's products."""
    if not ctx.training:
        raise RuntimeError("selscan_fused: scan_fwd_packed was called with training=False and keeps nothing for "
                           "a backward; call it with training=True (selscan_fused's packed paths do)")
    delta, bc, x, z, A_log, b_delta, D, h0, cu_seqlens, ckpt = ctx.saved_tensors
    if dhT is not None and dhT.numel() == 0:  # the final state was not returned
        dhT = None
    dP, dx, dA_log, db, dD, dh0, dz = torch.ops.selscan_fused.scan_bwd_packed(
        delta, bc, x, A_log, b_delta, D, h0, _dy_or_zeros(dy, x), dhT, ckpt, cu_seqlens, gate_z=z)
    if z is None:
        dz = None
    Dm = x.shape[-1]
    return (dP[..., :Dm], dP[..., Dm:], dx, dz, dA_log, db, dD, dh0 if h0 is not None else None, None, None, None)


if extension_available() and hasattr(torch.ops.selscan_fused, "scan_fwd_packed"):

    @torch.library.register_fake("selscan_fused::scan_fwd_packed")
    def _scan_fwd_packed_fake(delta, bc, x, z, A_log, b_delta, D, h0, cu_seqlens, return_final_state, training):
        return _packed_fake_outputs(x, A_log, cu_seqlens, return_final_state, training)

    @torch.library.register_fake("selscan_fused::scan_bwd_packed")
    def _scan_bwd_packed_fake(delta, bc, x, A_log, b_delta, D, h0, dy, dhT, ckpt, cu_seqlens, gate_z=None):
        _, T, Dm = x.shape
        N = A_log.shape[1]
        S = cu_seqlens.shape[0] - 1
        return [x.new_empty((1, T, Dm + 2 * N)), x.new_empty(x.shape), torch.empty_like(A_log),
                torch.empty_like(b_delta), torch.empty_like(D), x.new_empty((S, Dm, N), dtype=torch.float32),
                x.new_empty((1 if gate_z is not None else 0, T, Dm))]

    torch.library.register_autograd("selscan_fused::scan_fwd_packed", _packed_backward, setup_context=_packed_setup)


def _xdbl_grads(dP, dt_low, dt_w):
    """The block's dt_proj backward from the scan's dP = [d delta_pre | d B | d C]: (the gradient of x_proj's
    output [dt_low | B | C], the gradient of dt_proj's weight)."""
    Dm, R = dt_w.shape
    d_delta, d_bc = dP[..., :Dm], dP[..., Dm:]
    d_dt_low = torch.matmul(d_delta, dt_w)                                        # (batch, L, R)
    d_dt_w = weight_grad(d_delta.reshape(-1, Dm), dt_low.reshape(-1, R))         # (d_inner, R)
    return torch.cat([d_dt_low, d_bc], dim=-1), d_dt_w


def _fused_block_setup(ctx, inputs, output):
    """fused_block_fwd: keep what the backward needs: in_proj's output xz (u is recomputed from it),
    x_proj's output (made by the op or given) and the checkpoints (y before the gate is recomputed by the
    backward scan kernel)."""
    xz, conv_w, conv_b, conv_state, wx, xdbl_in, dt_w, A_log, dt_bias, D, h0, _, training, l_segments = inputs
    _, _, ckpt, xdbl_out = output
    ctx.training, ctx.l_segments = training, l_segments
    ctx.save_for_backward(xz, conv_w, conv_b, conv_state, wx, xdbl_out if wx is not None else xdbl_in, dt_w, A_log,
                          dt_bias, D, h0, ckpt)
    ctx.set_materialize_grads(False)


def _fused_block_backward(ctx, dy, dhT, d_ckpt, d_xdbl_out):
    """The fused block's backward: u recomputed by the conv kernel (bitwise the forward's), dt_proj's
    product recomputed by the library (delta_pre, rounded to the dtype as the unfused path holds it),
    the unfused path's backward scan kernel with the gate (y before the gate recomputed there), then the
    products' gradients (dt_proj: d dt_low = d delta_pre W, d W = d delta_pre^T dt_low; x_proj: du +=
    d xdbl W_x, d W_x = d xdbl^T u) and the conv's backward kernel."""
    if not ctx.training:
        raise RuntimeError("selscan_fused: fused_block_fwd was called with training=False and keeps nothing for "
                           "a backward; call it with training=True (selscan_fused.mamba_block does)")
    xz, conv_w, conv_b, conv_state, wx, xdbl, dt_w, A_log, dt_bias, D, h0, ckpt = ctx.saved_tensors
    Dm, R = A_log.shape[0], dt_w.shape[1]
    if dhT is not None and dhT.numel() == 0:  # the final state was not returned
        dhT = None
    xi, z = xz[..., :Dm], xz[..., Dm:]
    dt_low, bc = xdbl[..., :R], xdbl[..., R:]
    with torch.autocast("cuda", enabled=False):
        u, _ = torch.ops.selscan_fused.causal_conv1d_fwd(xi, conv_w, conv_b, conv_state, True, False)
        delta = torch.nn.functional.linear(dt_low, dt_w)
        dP, du, dA_log, db, dD, dh0, dz = torch.ops.selscan_fused.scan_bwd(
            delta, bc, u, A_log, dt_bias, D, h0, _dy_or_zeros(dy, u), dhT, ckpt, ctx.l_segments, gate_z=z)
        dxdbl, d_dt_w = _xdbl_grads(dP, dt_low, dt_w)
        if d_xdbl_out is not None and d_xdbl_out.numel() > 0:
            dxdbl = dxdbl + d_xdbl_out
        d_wx = d_xdbl_in = None
        if wx is not None:  # x_proj inside the op: its gradients, and its share of du
            du = du + torch.matmul(dxdbl, wx)
            d_wx = weight_grad(dxdbl.reshape(-1, dxdbl.shape[-1]), u.reshape(-1, Dm))
        else:
            d_xdbl_in = dxdbl
        dxi, d_cw, d_cb, d_cs = torch.ops.selscan_fused.causal_conv1d_bwd(xi, conv_w, conv_b, conv_state, du, None,
                                                                           True)
        dxz = torch.cat([dxi, dz], dim=-1)
    return (dxz, d_cw, d_cb if conv_b is not None else None, d_cs if conv_state is not None else None, d_wx,
            d_xdbl_in, d_dt_w, dA_log, db, dD, dh0 if h0 is not None else None, None, None, None)


if fused_extension_available():

    @torch.library.register_fake("selscan_fused::fused_block_fwd")
    def _fused_block_fwd_fake(xz, conv_w, conv_b, conv_state, wx, xdbl, dt_w, A_log, dt_bias, D, h0,
                              return_final_state, training, l_segments):
        batch, L, _ = xz.shape
        Dm, N = A_log.shape
        y, h, ckpt = _gated_fake(xz.new_empty((batch, L, Dm)), A_log, return_final_state, training)
        xd = xz.new_empty((batch, L, dt_w.shape[1] + 2 * N) if wx is not None else (0,))
        return y, h, ckpt, xd

    torch.library.register_autograd("selscan_fused::fused_block_fwd", _fused_block_backward,
                                    setup_context=_fused_block_setup)

    @torch.library.register_fake("selscan_fused::fused_fwd")
    def _fused_fwd_fake(x, A_log, W_delta, b_delta, W_B, W_C, D, h0, return_final_state, l_segments,
                        exp_poly=False, ring_stages=0, channel_tile=0, bwd_mode=0):
        return _fake_outputs(x, A_log, return_final_state)

    @torch.library.register_fake("selscan_fused::fused_fwd_res")
    def _fused_fwd_res_fake(x, A_log, W_delta, b_delta, W_B, W_C, D, h0, l_segments, exp_poly=False,
                            ring_stages=0, channel_tile=0, bwd_mode=0):
        y, h = _fake_outputs(x, A_log, True)
        return y, h, _fake_ckpt(x, A_log)

    @torch.library.register_fake("selscan_fused::fused_bwd")
    def _fused_bwd_fake(x, A_log, W_delta, b_delta, W_B, W_C, D, h0, dy, dhT, ckpt, l_segments, mode=0,
                        threads_per_channel=0):
        return _unfused_bwd_fake(x, A_log, W_delta, b_delta, W_B, W_C, D, h0, dy, dhT, None, ckpt, l_segments)

    torch.library.register_autograd("selscan_fused::fused_fwd_res", _backward_res, setup_context=_setup_res)
    torch.library.register_autograd("selscan_fused::fused_fwd", _make_backward_plain(True),
                                    setup_context=_setup_plain)


def _fused_packed_setup(ctx, inputs, output):
    """fused_fwd_packed and fused_block_scan_packed (nine tensor inputs, cu_seqlens last, then
    return_final_state and with_ckpt): keep the tensors and the checkpoints (the products are recomputed)."""
    ctx.with_ckpt = inputs[10]
    ctx.save_for_backward(*inputs[:9], output[2])
    ctx.set_materialize_grads(False)


def _fused_packed_backward(ctx, dy, dhT, *unused):
    """The fused packed forward's backward, as the fused layer's "recompute" backward for a batch: the
    projections by one library product, the unfused path's packed backward scan kernel on the fused
    forward's checkpoints (their packed slot layout is scan_bwd_packed's), then the product's gradients."""
    if not ctx.with_ckpt:
        raise RuntimeError("selscan_fused: fused_fwd_packed was called with with_ckpt=False and keeps nothing for "
                           "a backward; call it with with_ckpt=True (selective_scan does when training)")
    x, A_log, W_delta, b_delta, W_B, W_C, D, h0, cu_seqlens, ckpt = ctx.saved_tensors
    if dhT is not None and dhT.numel() == 0:  # the final state was not returned
        dhT = None
    Dm, N = x.shape[-1], A_log.shape[1]
    with torch.autocast("cuda", enabled=False):
        W = torch.cat([W_delta, W_B, W_C], 0)
        proj = torch.nn.functional.linear(x, W)
        delta, bc = proj.split([Dm, 2 * N], dim=-1)
        dP, dx, dA_log, db, dD, dh0, _ = torch.ops.selscan_fused.scan_bwd_packed(
            delta, bc, x, A_log, b_delta, D, h0, _dy_or_zeros(dy, x), dhT, ckpt, cu_seqlens)
        dx = dx + torch.matmul(dP, W)
        dW = weight_grad(dP.reshape(-1, Dm + 2 * N), x.reshape(-1, Dm))
    dWd, dWb, dWc = dW.split([Dm, N, N], 0)
    return (dx, dA_log, dWd, db, dWb, dWc, dD, dh0 if h0 is not None else None, None, None, None)


if fused_extension_available() and hasattr(torch.ops.selscan_fused, "fused_fwd_packed"):

    @torch.library.register_fake("selscan_fused::fused_fwd_packed")
    def _fused_fwd_packed_fake(x, A_log, W_delta, b_delta, W_B, W_C, D, h0, cu_seqlens, return_final_state,
                               with_ckpt):
        return _packed_fake_outputs(x, A_log, cu_seqlens, return_final_state, with_ckpt)

    torch.library.register_autograd("selscan_fused::fused_fwd_packed", _fused_packed_backward,
                                    setup_context=_fused_packed_setup)


def _fused_block_packed_backward(ctx, dy, dhT, *unused):
    """As the fused block's backward for a batch, the conv and x_proj left to their own ops' autograd:
    dt_proj's product recomputed by the library, the packed backward scan kernel with the gate on the
    fused forward's checkpoints, then dt_proj's gradients."""
    if not ctx.with_ckpt:
        raise RuntimeError("selscan_fused: fused_block_scan_packed was called with with_ckpt=False and keeps nothing "
                           "for a backward; call it with with_ckpt=True (mamba_block does when training)")
    u, xdbl, z, dt_w, A_log, dt_bias, D, h0, cu_seqlens, ckpt = ctx.saved_tensors
    if dhT is not None and dhT.numel() == 0:  # the final state was not returned
        dhT = None
    R = dt_w.shape[1]
    dt_low, bc = xdbl[..., :R], xdbl[..., R:]
    with torch.autocast("cuda", enabled=False):
        delta = torch.nn.functional.linear(dt_low, dt_w)
        dP, du, dA_log, db, dD, dh0, dz = torch.ops.selscan_fused.scan_bwd_packed(
            delta, bc, u, A_log, dt_bias, D, h0, _dy_or_zeros(dy, u), dhT, ckpt, cu_seqlens, gate_z=z)
        dxdbl, d_dt_w = _xdbl_grads(dP, dt_low, dt_w)
    return (du, dxdbl, dz, d_dt_w, dA_log, db, dD, dh0 if h0 is not None else None, None, None, None)


if fused_extension_available() and hasattr(torch.ops.selscan_fused, "fused_block_scan_packed"):

    @torch.library.register_fake("selscan_fused::fused_block_scan_packed")
    def _fused_block_scan_packed_fake(u, xdbl, z, dt_w, A_log, dt_bias, D, h0, cu_seqlens, return_final_state,
                                      with_ckpt):
        return _packed_fake_outputs(u, A_log, cu_seqlens, return_final_state, with_ckpt)

    torch.library.register_autograd("selscan_fused::fused_block_scan_packed", _fused_block_packed_backward,
                                    setup_context=_fused_packed_setup)
