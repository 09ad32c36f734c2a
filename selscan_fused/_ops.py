"""Python side of the torch.library ops defined in csrc/torch_ops.cpp: fake (meta) implementations,
so that torch.compile traces them without running them, and the autograd registration."""
from __future__ import annotations

import torch

from ._extension import extension_available, fused_extension_available

BACKWARD_MESSAGE = (
    "selscan_fused: the backward pass of the CUDA paths (impl='unfused', 'fused') is not implemented; "
    "use impl='reference' to differentiate through the layer")


def _fake_outputs(x: torch.Tensor, A_log: torch.Tensor, return_final_state: bool):
    batch, _, Dm = x.shape
    y = x.new_empty(x.shape)
    if return_final_state:
        h = x.new_empty((batch, Dm, A_log.shape[1]), dtype=torch.float32)
    else:
        h = x.new_empty((0,), dtype=torch.float32)
    return y, h


def _no_backward(ctx, *grads):
    raise NotImplementedError(BACKWARD_MESSAGE)


def _no_setup(ctx, inputs, output):
    pass


if extension_available():

    @torch.library.register_fake("selscan_fused::unfused_fwd")
    def _unfused_fwd_fake(x, A_log, W_delta, b_delta, W_B, W_C, D, h0, return_final_state, l_segments):
        return _fake_outputs(x, A_log, return_final_state)

    @torch.library.register_fake("selscan_fused::scan_fwd")
    def _scan_fwd_fake(proj, x, A_log, b_delta, D, h0, return_final_state, l_segments):
        return _fake_outputs(x, A_log, return_final_state)

    for _name in ("selscan_fused::unfused_fwd", "selscan_fused::scan_fwd"):
        torch.library.register_autograd(_name, _no_backward, setup_context=_no_setup)


if fused_extension_available():

    @torch.library.register_fake("selscan_fused::fused_fwd")
    def _fused_fwd_fake(x, A_log, W_delta, b_delta, W_B, W_C, D, h0, return_final_state, l_segments,
                        exp_poly=False, ring_stages=0, channel_tile=0):
        return _fake_outputs(x, A_log, return_final_state)

    torch.library.register_autograd("selscan_fused::fused_fwd", _no_backward, setup_context=_no_setup)
