"""The decode step of the Mamba-1 block: one token per sequence, the states updated in place.

    out = mamba_block_step(hidden_states, conv_state, ssm_state, in_proj_weight, in_proj_bias, conv_weight,
                           conv_bias, x_proj_weight, dt_proj_weight, dt_proj_bias, A_log, D, out_proj_weight,
                           out_proj_bias, out=None, impl="auto")

Shapes (d_inner channels, N = d_state, R = dt_rank, W = d_conv; the weights as in mamba_block, whose
argument order they keep):

    hidden_states  (batch, d_model)        the token's input
    conv_state     (batch, d_inner, W-1)   the conv's last W-1 inputs (oldest first), in hidden_states' dtype
                                           as mamba_block returns it; updated in place
    ssm_state      (batch, d_inner, N)     the scan state, float32 (float64 for float64 input); updated in place
    out            (batch, d_model)        optional output buffer (hidden_states' dtype), written in place

The math (selscan_fused/block_reference.py's on a sequence of one token):

    [xi | z]          = hidden_states in_proj_weight^T (+ in_proj_bias)
    window            = [conv_state | xi]                     (batch, d_inner, W); conv_state <- window[..., 1:]
    u                 = silu(sum_k conv_weight[:, k] window[..., k] + conv_bias)
    [dt_low | B | C]  = u x_proj_weight^T
    delta             = softplus(dt_low dt_proj_weight^T + dt_proj_bias)
    ssm_state         <- exp(delta A) ssm_state + delta B u   (A = -exp(A_log); float32)
    y                 = (sum_n ssm_state[..., n] C[n] + D u) * silu(z)
    out               = y out_proj_weight^T (+ out_proj_bias)

Dtypes as in mamba_block's CUDA path: the four products run in hidden_states' dtype (their outputs rounded
to it, as cuBLAS writes them), the conv, softplus, the state update, the gate and every sum in float32
(float64 for float64 input). Nothing here synchronises with the host or depends on values, and the
states are only written in place: the step can be captured in a CUDA graph (selscan_fused.generation's
CUDAGraphStep captures a whole model's step).

Paths (`impl=`):

    "torch"   the step in PyTorch operations (about a dozen launches between in_proj and out_proj); any
              device, float64 too
    "kernel"  in_proj and out_proj by the library product, the middle (the conv update, x_proj, dt_proj,
              the state update, D and the gate) by this project's decode kernels (csrc/decode/: one
              cooperative launch, deterministic); CUDA, float32 / bfloat16 / float16, d_state <= 64, dt_rank <= 256,
              d_conv 2-4. It rounds where the torch path rounds (u, x_proj's and dt_proj's outputs to the
              dtype), so the two agree to float32 summation order.
    "auto"    "kernel" where it runs the step (CUDA, its dtypes and envelope above, contiguous states), else
              "torch": the kernel path measured 2.9-4.4x faster than the torch path for the whole model at
              the sizes of mamba-130m and mamba-1.4b, batch 1 to 128, on the H200 (docs/perf/decode.md).

selscan_fused.block_reference.mamba_step_ref gives the same math out of place (the reference of both).

KERNEL_MID_LAUNCHES (module attribute, default 1): how the kernel path launches its middle, 1 for both
phases (the conv with x_proj's partial sums, then dt_proj, the state update and the gate) in one
cooperative launch with a grid-wide barrier between them, 2 for the two kernels of v2 (an ablation for
benchmarks/decode_bench.py; bitwise the same results). Read at each step, so at capture time under a
CUDA graph.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._extension import extension_available

__all__ = ["mamba_block_step", "decode_kernel_reason", "resolve_step_impl", "STEP_IMPLS"]

STEP_IMPLS = ("auto", "kernel", "torch")
KERNEL_MID_LAUNCHES = 1

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_KERNEL_MAX_STATE, _KERNEL_MAX_RANK, _KERNEL_MAX_BATCH = 64, 256, 65535  # csrc/decode/decode_params.h


def _kernel_op_available() -> bool:
    return extension_available() and hasattr(torch.ops.selscan_fused, "decode_mid")


def norm_op_available() -> bool:
    """Whether the decode step's residual add + RMSNorm kernel (torch.ops.selscan_fused.add_rmsnorm) is loaded."""
    return extension_available() and hasattr(torch.ops.selscan_fused, "add_rmsnorm")


def decode_kernel_reason(hidden_states: torch.Tensor, d_state: int, dt_rank: int, d_conv: int) -> str | None:
    """Why impl='kernel' cannot run this step, or None when it can."""
    if not hidden_states.is_cuda:
        return f"hidden_states is on {hidden_states.device}; the decode kernel needs CUDA tensors"
    if hidden_states.dtype not in _KERNEL_DTYPES:
        return f"hidden_states has dtype {hidden_states.dtype}; the decode kernel takes float32, bfloat16, float16"
    if not _kernel_op_available():
        return "the extension selscan_fused._C with the decode kernel (csrc/decode/) is not loaded"
    if not 1 <= d_state <= _KERNEL_MAX_STATE:
        return f"d_state = {d_state}; the decode kernel takes 1 .. {_KERNEL_MAX_STATE}"
    if not 1 <= dt_rank <= _KERNEL_MAX_RANK:
        return f"dt_rank = {dt_rank}; the decode kernel takes 1 .. {_KERNEL_MAX_RANK}"
    if not 2 <= d_conv <= 4:
        return f"d_conv = {d_conv}; the decode kernel takes 2, 3, 4"
    if hidden_states.shape[0] > _KERNEL_MAX_BATCH:
        return f"batch = {hidden_states.shape[0]}; the decode kernel takes up to {_KERNEL_MAX_BATCH}"
    return None


def resolve_step_impl(impl: str, hidden_states: torch.Tensor | None = None, d_state: int = 0, dt_rank: int = 0,
                      d_conv: int = 0, states: tuple = ()) -> str:
    """The path mamba_block_step takes for `impl` (module docstring): 'kernel' and 'torch' as named; 'auto'
    is 'kernel' where decode_kernel_reason finds nothing against these inputs and the states are
    contiguous (the kernel writes them in place), else 'torch' (also without inputs to judge)."""
    if impl not in STEP_IMPLS:
        raise ValueError(f"selscan_fused: impl must be one of {STEP_IMPLS} for the decode step, got {impl!r}")
    if impl != "auto":
        return impl
    if (hidden_states is None or hidden_states.shape[0] == 0
            or decode_kernel_reason(hidden_states, d_state, dt_rank, d_conv) is not None
            or not all(t.is_contiguous() for t in states)):
        return "torch"
    return "kernel"


def _check(hidden_states, conv_state, ssm_state, in_proj_weight, conv_weight, x_proj_weight, dt_proj_weight, A_log,
           out):
    for name, t in (("hidden_states", hidden_states), ("conv_state", conv_state), ("ssm_state", ssm_state)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"selscan_fused: {name} must be a torch.Tensor, got {type(t).__name__}")
    if hidden_states.dim() != 2:
        raise ValueError(f"selscan_fused: hidden_states must have shape (batch, d_model) for one decode step, got "
                         f"{tuple(hidden_states.shape)} (a sequence goes through mamba_block)")
    batch, d_model = hidden_states.shape
    d_inner, N = A_log.shape
    W = conv_weight.shape[-1]
    R = dt_proj_weight.shape[1]
    expected = (("conv_state", conv_state, (batch, d_inner, W - 1)), ("ssm_state", ssm_state, (batch, d_inner, N)),
                ("in_proj_weight", in_proj_weight, (2 * d_inner, d_model)),
                ("x_proj_weight", x_proj_weight, (R + 2 * N, d_inner)))
    for name, t, shape in expected:
        if tuple(t.shape) != shape:
            raise ValueError(f"selscan_fused: {name} has shape {tuple(t.shape)}, expected {shape} (batch = {batch}, "
                             f"d_model = {d_model} from hidden_states; d_inner = {d_inner}, d_state = {N} from A_log; "
                             f"d_conv = {W} from conv_weight; dt_rank = {R} from dt_proj_weight)")
    cd = torch.float64 if hidden_states.dtype == torch.float64 else torch.float32
    if not conv_state.is_floating_point():
        raise TypeError(f"selscan_fused: conv_state must be a floating-point tensor (the conv's last d_conv - 1 "
                        f"inputs, updated in place), got {conv_state.dtype}")
    if ssm_state.dtype != cd:
        raise TypeError(f"selscan_fused: ssm_state must be {cd} for {hidden_states.dtype} hidden_states (it is "
                        f"updated in place), got {ssm_state.dtype}")
    if out is not None and (tuple(out.shape) != (batch, d_model) or out.dtype != hidden_states.dtype):
        raise ValueError(f"selscan_fused: out must be a {hidden_states.dtype} tensor of shape {(batch, d_model)}, got "
                         f"{out.dtype} {tuple(out.shape)}")
    for name, t in (("conv_state", conv_state), ("ssm_state", ssm_state), ("out", out)):
        if t is not None and t.device != hidden_states.device:
            raise ValueError(f"selscan_fused: {name} is on {t.device} but hidden_states is on {hidden_states.device}")
    return d_inner, N, R, W, cd


def _cast(t, dtype):
    return t if t is None or t.dtype == dtype else t.to(dtype)


def mamba_block_step(
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
    out: torch.Tensor | None = None,
    impl: str = "auto",
) -> torch.Tensor:
    """One decode step of the block (module docstring): returns out (batch, d_model) in hidden_states'
    dtype (the `out` buffer when given) and updates conv_state and ssm_state in place."""
    resolve_step_impl(impl)  # the name first
    d_inner, N, R, W, cd = _check(hidden_states, conv_state, ssm_state, in_proj_weight, conv_weight, x_proj_weight,
                                  dt_proj_weight, A_log, out)
    chosen = resolve_step_impl(impl, hidden_states, N, R, W, (conv_state, ssm_state))
    x = hidden_states
    xdt = x.dtype
    xz = F.linear(x, _cast(in_proj_weight, xdt), _cast(in_proj_bias, xdt))         # (batch, 2 d_inner)
    if chosen == "kernel" and x.shape[0] > 0:  # (an empty batch: the torch path's empty tensors)
        reason = decode_kernel_reason(x, N, R, W)
        if reason is not None:
            raise ValueError(f"selscan_fused: impl='kernel' cannot run this decode step: {reason}; use impl='torch'")
        for name, t in (("conv_state", conv_state), ("ssm_state", ssm_state)):
            if not t.is_contiguous():
                raise ValueError(f"selscan_fused: impl='kernel' updates {name} in place and needs it contiguous; "
                                 "use impl='torch' or a contiguous state (MambaLM.allocate_cache makes them so)")
        # The small parameters as they are when they share float32 or x's dtype (a model cast as a whole):
        # no cast in the step; else all in float32.
        small = [conv_weight.reshape(d_inner, W), conv_bias, dt_proj_bias, A_log, D]
        sdt = xdt if all(t is None or t.dtype == xdt for t in small) else torch.float32
        small = [None if t is None else _cast(t, sdt).contiguous() for t in small]
        y = torch.ops.selscan_fused.decode_mid(xz.contiguous(), conv_state, ssm_state, small[0], small[1],
                                               _cast(x_proj_weight, xdt).contiguous(),
                                               _cast(dt_proj_weight, xdt).contiguous(), *small[2:],
                                               launches=KERNEL_MID_LAUNCHES)
        res = F.linear(y, _cast(out_proj_weight, xdt), _cast(out_proj_bias, xdt))
        if out is None:
            return res
        out.copy_(res)
        return out
    xi, z = xz[:, :d_inner], xz[:, d_inner:]
    # The conv over the window [conv_state | xi]; the state keeps the newest W-1 inputs (a new tensor is
    # built first, so the in-place write does not read what it overwrites).
    window = torch.cat([conv_state.to(cd), xi.to(cd).unsqueeze(-1)], dim=-1)      # (batch, d_inner, W)
    conv_state.copy_(window[..., 1:])
    pre = (window * conv_weight.reshape(d_inner, W).to(cd)).sum(-1)
    if conv_bias is not None:
        pre = pre + conv_bias.to(cd)
    u = F.silu(pre).to(xdt)                                                        # as the conv kernel writes u
    xdbl = F.linear(u, _cast(x_proj_weight, xdt))                                  # (batch, R + 2N)
    dt_low, Bt, Ct = xdbl[:, :R], xdbl[:, R:R + N], xdbl[:, R + N:]
    delta = F.softplus(F.linear(dt_low, _cast(dt_proj_weight, xdt)).to(cd) + dt_proj_bias.to(cd))  # (batch, d_inner)
    uc = u.to(cd)
    A = -torch.exp(A_log.to(cd))                                                   # (d_inner, N)
    ssm_state.mul_(torch.exp(delta.unsqueeze(-1) * A))
    ssm_state.add_((delta * uc).unsqueeze(-1) * Bt.to(cd).unsqueeze(1))
    y = torch.einsum("bdn,bn->bd", ssm_state, Ct.to(cd)) + D.to(cd) * uc
    y = (y * F.silu(z.to(cd))).to(xdt)
    res = F.linear(y, _cast(out_proj_weight, xdt), _cast(out_proj_bias, xdt))
    if out is None:
        return res
    out.copy_(res)
    return out


if _kernel_op_available():

    @torch.library.register_fake("selscan_fused::decode_mid")
    def _decode_mid_fake(xz, conv_state, ssm_state, conv_weight, conv_bias, x_proj_weight, dt_proj_weight, dt_bias,
                         A_log, D, launches=1):
        return xz.new_empty((xz.shape[0], A_log.shape[0]))

    @torch.library.register_fake("selscan_fused::add_rmsnorm")
    def _add_rmsnorm_fake(hidden, residual, weight, eps, residual_fp32):
        out_f32 = (residual is not None and residual.dtype == torch.float32) or (
            residual_fp32 and hidden.dtype != torch.float32)
        return hidden.new_empty(hidden.shape), hidden.new_empty(
            hidden.shape, dtype=torch.float32 if out_f32 else hidden.dtype)
