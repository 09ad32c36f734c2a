"""The Mamba-1 block: `mamba_block()` (functional, every tensor named) and `Mamba` (nn.Module with
mamba-ssm's and Hugging Face's parameter names, shapes and initialisation).

The math and every tensor's shape are in selscan_fused/block_reference.py and docs/math.md ("The
Mamba-1 block"). Paths (`impl=`):
    "reference"  plain PyTorch (block_reference.mamba_block_ref), any device, float64 too
    "unfused"    library products for in_proj / x_proj / dt_proj / out_proj (cuBLAS; their weight
                 gradients through _linear.weight_grad, which no token count can make drop a token),
                 this project's causal-conv kernel with the SiLU fused (csrc/conv/), and the layer's scan
                 kernel with the block's gate (csrc/scan/: delta_pre from dt_proj's product, [B | C] read
                 in place from x_proj's output, y = (scan + D u) * silu(z) written by the kernel);
                 backward: the layer's backward scan kernel with the gate's derivative inside it, the
                 conv's backward kernel, the products
    "fused"      (sm_90: H100/H200) in_proj and out_proj by cuBLAS; between them two kernels
                 (torch.ops.selscan_fused.fused_block_fwd): block_xproj (the conv + SiLU per token tile in
                 shared memory, x_proj on the tensor cores: [dt_low | B | C]) and the layer's fused kernel
                 with the block's policies: the conv recomputed for its own channels (u in shared memory
                 only), delta from the low rank (dt_proj on the tensor cores inside the scan's launch) and
                 the gated output (y * silu(z) stored by the kernel). No (batch, L, d_inner) tensor of u,
                 delta or y before the gate in device memory, in training either; backward: u recomputed
                 by the conv kernel, dt_proj's product recomputed, then the unfused path's backward scan
                 kernel with the gate (y before the gate recomputed there), x_proj's products, the conv's
                 backward
    "auto"       the unfused path where it supports the inputs (CUDA), the reference otherwise ('fused'
                 is chosen by measurement, once measured: docs/perf/block.md)
"""
from __future__ import annotations

import math
import numbers
import warnings

import torch
from torch import nn

from . import _ops  # noqa: F401  (fake implementations and autograd of the CUDA ops)
from ._extension import extension_available, require_extension
from ._linear import linear
from ._extension import fused_extension_available
from .api import (FUSED_DIM_MULTIPLE, FUSED_DSTATES, FUSED_MAX_COUNT, FUSED_MAX_DIM, IMPLS, UNFUSED_DIM_MULTIPLE,
                  ScanConfig, _sm90, check_config, cuda_input_reason, is_int, unfused_dstate_reason)
from .block_reference import mamba_block_ref
from .conv import causal_conv1d, causal_conv1d_packed
from .varlen import (check_cu_seqlens, check_packed_path, check_per_sequence,
                     packed_batch_error, run_per_sequence)

__all__ = ["Mamba", "mamba_block", "resolve_block_impl", "BLOCK_D_CONVS", "conv_tail"]

BLOCK_D_CONVS = (2, 3, 4)  # conv widths the CUDA conv kernel is compiled for
# dt_rank + 2 d_state: x_proj's outputs in the fused block's first kernel, at most kBlockXprojMaxOut
# (csrc/fused/fused_api.h; tests/test_build.py checks that the two agree)
FUSED_BLOCK_MAX_XPROJ = 384


def _names_shapes(hidden_states, in_proj_weight, in_proj_bias, conv_weight, conv_bias, x_proj_weight,
                  dt_proj_weight, dt_proj_bias, A_log, D, out_proj_weight, out_proj_bias, h0, conv_state):
    """Checks every argument's type, shape and device against the sizes the parameters imply, naming
    the argument and where the expectation comes from. Returns (d_model, d_inner, N, R, W)."""
    T = torch.Tensor
    named = {"hidden_states": hidden_states, "in_proj_weight": in_proj_weight, "in_proj_bias": in_proj_bias,
             "conv_weight": conv_weight, "conv_bias": conv_bias, "x_proj_weight": x_proj_weight,
             "dt_proj_weight": dt_proj_weight, "dt_proj_bias": dt_proj_bias, "A_log": A_log, "D": D,
             "out_proj_weight": out_proj_weight, "out_proj_bias": out_proj_bias, "h0": h0, "conv_state": conv_state}
    for name, t in named.items():
        if t is None and name in ("in_proj_bias", "conv_bias", "out_proj_bias", "h0", "conv_state"):
            continue
        if not isinstance(t, T):
            raise TypeError(f"selscan_fused: {name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"selscan_fused: {name} must be a floating-point tensor, got {t.dtype}")
    if hidden_states.dim() != 3:
        raise ValueError(f"selscan_fused: hidden_states must have shape (batch, L, d_model), got "
                         f"{tuple(hidden_states.shape)}")
    if A_log.dim() != 2:
        raise ValueError(f"selscan_fused: A_log must have shape (d_inner, d_state), got {tuple(A_log.shape)}")
    if dt_proj_weight.dim() != 2:
        raise ValueError(f"selscan_fused: dt_proj_weight must have shape (d_inner, dt_rank), got "
                         f"{tuple(dt_proj_weight.shape)}")
    batch, _, d_model = hidden_states.shape
    d_inner, N = A_log.shape
    R = dt_proj_weight.shape[1]
    if conv_weight.dim() == 3 and conv_weight.shape[:2] == (d_inner, 1):
        W = conv_weight.shape[2]
    elif conv_weight.dim() == 2 and conv_weight.shape[0] == d_inner:
        W = conv_weight.shape[1]
    else:
        raise ValueError(f"selscan_fused: conv_weight has shape {tuple(conv_weight.shape)}, expected "
                         f"({d_inner}, 1, d_conv) or ({d_inner}, d_conv) (d_inner = {d_inner} from A_log)")
    why_i = f"d_inner = {d_inner} from A_log's first dimension"
    why_m = f"d_model = {d_model} from hidden_states' last dimension"
    expected = {
        "in_proj_weight": ((2 * d_inner, d_model), f"{why_i}, {why_m}"),
        "in_proj_bias": ((2 * d_inner,), why_i),
        "conv_bias": ((d_inner,), why_i),
        "x_proj_weight": ((R + 2 * N, d_inner), f"dt_rank = {R} from dt_proj_weight, d_state = {N} from A_log, {why_i}"),
        "dt_proj_weight": ((d_inner, R), why_i),
        "dt_proj_bias": ((d_inner,), why_i),
        "D": ((d_inner,), why_i),
        "out_proj_weight": ((d_model, d_inner), f"{why_m}, {why_i}"),
        "out_proj_bias": ((d_model,), why_m),
        "h0": ((batch, d_inner, N), f"batch = {batch} from hidden_states, {why_i}, d_state = {N} from A_log"),
        "conv_state": ((batch, d_inner, W - 1), f"batch = {batch} from hidden_states, {why_i}, d_conv = {W} "
                                                "from conv_weight: the last d_conv - 1 inputs of the conv"),
    }
    for name, (shape, why) in expected.items():
        t = named[name]
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(f"selscan_fused: {name} has shape {tuple(t.shape)}, expected {shape} ({why})")
    for name, t in named.items():
        if t is not None and t.device != hidden_states.device:
            raise ValueError(f"selscan_fused: {name} is on {t.device} but hidden_states is on "
                             f"{hidden_states.device}; all tensors must be on the same device")
    return d_model, d_inner, N, R, W


def block_unsupported_reason(impl: str, x: torch.Tensor, d_inner: int, d_state: int, d_conv: int,
                             dt_rank: int | None = None) -> str | None:
    """Why `impl` ('unfused' or 'fused') cannot run the block on these inputs, or None when it can
    (dt_rank: checked when given)."""
    if impl == "fused":
        reason = cuda_input_reason(impl, x, "hidden_states")
        if reason is not None:
            return reason
        if not _sm90(x.device):
            return f"impl='fused' needs an sm_90 GPU (H100/H200), {x.device} is not one; use impl='unfused'"
        if not fused_extension_available():
            return "impl='fused' needs the extension selscan_fused._fused (sm_90a build); use impl='unfused'"
        if d_state not in FUSED_DSTATES:
            return (f"d_state N = {d_state} is not supported by impl='fused' (supported: "
                    f"{', '.join(map(str, FUSED_DSTATES))}); use impl='unfused'")
        if d_inner % FUSED_DIM_MULTIPLE != 0 or not FUSED_DIM_MULTIPLE <= d_inner <= FUSED_MAX_DIM:
            return (f"d_inner = {d_inner} is not supported by impl='fused' (a multiple of {FUSED_DIM_MULTIPLE} "
                    f"from {FUSED_DIM_MULTIPLE} to {FUSED_MAX_DIM}); use impl='unfused'")
        if d_conv not in BLOCK_D_CONVS:
            return (f"d_conv = {d_conv} is not supported by impl='fused' (supported: "
                    f"{', '.join(map(str, BLOCK_D_CONVS))}); use impl='reference'")
        if dt_rank is not None and dt_rank + 2 * d_state > FUSED_BLOCK_MAX_XPROJ:
            return (f"impl='fused' takes dt_rank + 2 d_state up to {FUSED_BLOCK_MAX_XPROJ} (x_proj's outputs; got "
                    f"{dt_rank} + 2 * {d_state} = {dt_rank + 2 * d_state}); use impl='unfused'")
        if x.shape[0] >= FUSED_MAX_COUNT or x.shape[1] >= FUSED_MAX_COUNT:
            return (f"impl='fused' takes batch and L below 2^31 (got batch = {x.shape[0]}, L = {x.shape[1]}); "
                    "use impl='unfused'")
        return None
    reason = cuda_input_reason(impl, x, "hidden_states") or unfused_dstate_reason(impl, d_state)
    if reason is not None:
        return reason
    if d_inner % UNFUSED_DIM_MULTIPLE != 0:
        return (f"d_inner = {d_inner} is not supported by impl='{impl}' (a multiple of {UNFUSED_DIM_MULTIPLE}); "
                "use impl='reference'")
    if d_conv not in BLOCK_D_CONVS:
        return (f"d_conv = {d_conv} is not supported by impl='{impl}' (supported: "
                f"{', '.join(map(str, BLOCK_D_CONVS))}); use impl='reference'")
    return None


def resolve_block_impl(impl: str, x: torch.Tensor, d_inner: int, d_state: int, d_conv: int) -> str:
    """The path mamba_block() takes: 'auto' becomes 'unfused' where it supports the inputs and the
    extension is built, else 'reference' (with a warning for CUDA tensors)."""
    if impl not in IMPLS:
        raise ValueError(f"selscan_fused: impl must be one of {IMPLS}, got {impl!r}")
    if impl != "auto":
        return impl
    if not x.is_cuda or x.dtype == torch.float64:
        return "reference"
    if not extension_available():
        require_extension("auto")  # a CUDA tensor but no extension: say why and how to rebuild
    reason = block_unsupported_reason("unfused", x, d_inner, d_state, d_conv)
    if reason is None:
        return "unfused"
    warnings.warn(f"selscan_fused: no CUDA path of the Mamba block supports these inputs ({reason}); "
                  "impl='auto' runs the slow reference")
    return "reference"


def _as(t, dtype):
    return t if t is None or t.dtype == dtype else t.to(dtype)


def conv_tail(xi: torch.Tensor, conv_state: torch.Tensor | None, W: int) -> torch.Tensor:
    """The conv's final state: its last W - 1 inputs (batch, d_inner, W - 1) in xi's dtype, conv_state's
    (or zeros) where the sequence is shorter than W - 1; differentiable in xi and conv_state (the fused
    path's, which writes no conv output; the conv kernel returns the same values)."""
    batch, L, d_inner = xi.shape
    tail = xi[:, max(L - (W - 1), 0):]
    if L < W - 1:
        before = (conv_state.transpose(1, 2) if conv_state is not None
                  else xi.new_zeros((batch, W - 1, d_inner)))
        tail = torch.cat([before.to(xi.dtype), tail], dim=1)[:, L:]
    return tail.transpose(1, 2).contiguous()


def mamba_block(
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
    *,
    h0: torch.Tensor | None = None,
    conv_state: torch.Tensor | None = None,
    return_final_state: bool = False,
    impl: str = "auto",
    config: ScanConfig | None = None,
    cu_seqlens: torch.Tensor | None = None,
    validate: bool = True,
):
    """The Mamba-1 block (selscan_fused/block_reference.py gives the math and every shape).

    Returns out (batch, L, d_model) in hidden_states' dtype, or, with return_final_state=True,
    (out, ssm_state, conv_state): the scan state after the last token (batch, d_inner, N) float32
    (float64 for the reference on float64 input) and the conv's last d_conv - 1 inputs (batch,
    d_inner, d_conv - 1) in hidden_states' dtype; passed back as h0 / conv_state, a sequence processed
    in pieces gives the result of one call.

    Dtypes: hidden_states in float32, bfloat16 or float16 (float64: reference only). The four
    projection weights (and their biases) are used in the input's dtype; the conv's weight and bias,
    A_log, the delta bias (dt_proj_bias), D, h0, the state and all accumulation are float32. Under
    torch.autocast (CUDA) float32 input is cast to the autocast dtype first, as nn.Linear would be.
    config: ScanConfig(l_segments=...) for the scan kernel (the fused kernel's switches do not apply).

    Packed sequences (selscan_fused/varlen.py): with cu_seqlens (int32, (num_seqs + 1,)),
    hidden_states holds num_seqs sequences packed as (1, total_tokens, d_model); the scan state and the
    conv window restart at every sequence start (from h0[s], (num_seqs, d_inner, N), and conv_state[s],
    (num_seqs, d_inner, d_conv - 1), when given) and the final states are per sequence: each
    sequence's result is that of running it alone. validate=True checks cu_seqlens' values on the host
    (one synchronisation); validate=False trusts them (the kernels clamp every range into the packed
    row). Paths: 'unfused' (the conv kernel's and the scan kernel's packed policies: a run or a work item
    never crosses a sequence start), 'fused' (the packed conv and x_proj as on 'unfused', then dt_proj, the
    scan and the gate in the fused kernel; not in a build with
    SELSCAN_FUSED_NVCC_FLAGS=-DSELSCAN_FUSED_NO_PACKED) and 'reference'; 'auto' takes 'unfused' for CUDA
    tensors it supports (the reference, with a warning, for the rest).
    """
    check_config(config)
    packed = cu_seqlens is not None
    d_model, d_inner, N, R, W = _names_shapes(hidden_states, in_proj_weight, in_proj_bias, conv_weight, conv_bias,
                                              x_proj_weight, dt_proj_weight, dt_proj_bias, A_log, D,
                                              out_proj_weight, out_proj_bias, None if packed else h0,
                                              None if packed else conv_state)
    x = hidden_states
    if packed:
        if x.shape[0] != 1:
            raise packed_batch_error("hidden_states", x, "d_model")
        S = check_cu_seqlens(cu_seqlens, x.shape[1], x.device, validate=validate, x_name="hidden_states")
        why = f"from cu_seqlens, d_inner = {d_inner} from A_log"  # num_seqs formatted only for an error
        if h0 is not None:
            check_per_sequence("h0", h0, (S, d_inner, N), lambda: f"num_seqs = {S} {why}, d_state = {N} from A_log",
                               x.device, "hidden_states")
        if conv_state is not None:
            check_per_sequence("conv_state", conv_state, (S, d_inner, W - 1),
                               lambda: f"num_seqs = {S} {why}, d_conv = {W} from conv_weight: the last d_conv - 1 "
                               "inputs of the conv", x.device, "hidden_states")
    if x.is_cuda and x.dtype == torch.float32 and torch.is_autocast_enabled("cuda"):
        x = x.to(torch.get_autocast_dtype("cuda"))
    # 'auto' gives 'unfused' or 'reference', the paths that take packed sequences too
    chosen = resolve_block_impl(impl, x, d_inner, N, W)
    if packed:
        check_packed_path(chosen)
    cfg = config or ScanConfig()
    if cfg.fused_switches():  # on every path
        raise ValueError("selscan_fused: ScanConfig's exp_poly, ring_stages, channel_tile and fused_backward "
                         "apply to the layer's fused kernel; the Mamba block takes l_segments only")
    if chosen == "reference":
        weights = (in_proj_weight, in_proj_bias, conv_weight, conv_bias, x_proj_weight, dt_proj_weight,
                   dt_proj_bias, A_log, D, out_proj_weight, out_proj_bias)
        with torch.autocast(x.device.type, enabled=False):
            if not packed:
                out, h, conv = mamba_block_ref(x, *weights, h0, conv_state)
            else:  # one sequence at a time: the definition of the packed result
                out, h, conv = run_per_sequence(lambda xs, hs, cs: mamba_block_ref(xs, *weights, hs, cs), x,
                                                cu_seqlens, (h0, conv_state), "hidden_states")
        return (out, h, conv) if return_final_state else out
    reason = block_unsupported_reason(chosen, x, d_inner, N, W, R)
    if reason is not None:
        raise ValueError(f"selscan_fused: {reason}")
    if packed and cfg.l_segments:
        raise ValueError("selscan_fused: ScanConfig(l_segments=...) does not apply to packed sequences (their scan "
                         "is never split along L)")
    require_extension(chosen)
    xdt = x.dtype
    f32 = torch.float32
    with torch.autocast("cuda", enabled=False):
        xz = linear(x, _as(in_proj_weight, xdt), _as(in_proj_bias, xdt))            # (batch, L, 2 d_inner)
        if chosen == "fused" and not packed:
            # The conv, x_proj, dt_proj, the scan, D and the gate in two kernels from in_proj's output:
            # block_xproj (conv + SiLU per token tile, x_proj: [dt_low | B | C]) and the fused kernel
            # (the conv again for its channels, dt_proj on the tensor cores, the scan, the gate); neither
            # u, delta nor y before the gate reaches device memory.
            cs = _as(conv_state, xdt)  # the unfused path's rounding of a float32 conv_state
            cw = _as(conv_weight, f32).reshape(d_inner, W)
            A_log, dt_bias, D, h0 = _as(A_log, f32), _as(dt_proj_bias, f32), _as(D, f32), _as(h0, f32)
            wx, dt_w = _as(x_proj_weight, xdt), _as(dt_proj_weight, xdt)
            train = torch.is_grad_enabled() and any(
                t is not None and t.requires_grad for t in (xz, cw, conv_bias, cs, wx, dt_w, A_log, dt_bias, D, h0))
            y, h, _, _ = torch.ops.selscan_fused.fused_block_fwd(
                xz, cw, _as(conv_bias, f32), _as(cs, f32), wx, None, dt_w, A_log, dt_bias, D, h0,
                return_final_state, train, cfg.l_segments)
            out = linear(y, _as(out_proj_weight, xdt), _as(out_proj_bias, xdt))
            if not return_final_state:
                return out
            return out, h, conv_tail(xz[..., :d_inner], cs, W)
        xi, z = xz.split(d_inner, dim=-1)  # one concatenation in the backward (slices would add two full zeros)
        if packed:  # the window restarts at every sequence start; conv_state and conv_T per sequence
            u, conv_T = causal_conv1d_packed(xi, _as(conv_weight, f32).reshape(d_inner, W), _as(conv_bias, f32),
                                             _as(conv_state, xdt), cu_seqlens, activation=True,
                                             return_final_state=True)
        else:
            u, conv_T = causal_conv1d(xi, _as(conv_weight, f32).reshape(d_inner, W), _as(conv_bias, f32),
                                      _as(conv_state, xdt), activation=True, return_final_state=True)
        xdbl = linear(u, _as(x_proj_weight, xdt))                                    # (batch, L, R + 2N)
        if packed and chosen == "fused":  # fused_packed_available(), checked above
            # the conv and x_proj above, then dt_proj on the tensor cores, the scan, D and the gate in the
            # fused kernel over (sequence, channel tile) streams
            A_log, dt_bias, D, h0 = _as(A_log, f32), _as(dt_proj_bias, f32), _as(D, f32), _as(h0, f32)
            dt_w = _as(dt_proj_weight, xdt)
            train = torch.is_grad_enabled() and any(
                t is not None and t.requires_grad for t in (xdbl, u, z, dt_w, A_log, dt_bias, D, h0))
            y, h, _ = torch.ops.selscan_fused.fused_block_scan_packed(u, xdbl, z, dt_w, A_log, dt_bias, D, h0,
                                                                      cu_seqlens, return_final_state, train)
            out = linear(y, _as(out_proj_weight, xdt), _as(out_proj_bias, xdt))
            return (out, h, conv_T) if return_final_state else out
        delta = linear(xdbl[..., :R], _as(dt_proj_weight, xdt))                      # delta_pre, no bias
        A_log, dt_bias, D, h0 = _as(A_log, f32), _as(dt_proj_bias, f32), _as(D, f32), _as(h0, f32)
        # Whether a backward can follow (the scan then keeps its checkpoints).
        train = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (delta, xdbl, u, z, A_log, dt_bias, D, h0, dt_proj_weight))
        if packed:  # the scan kernel with one work item per (sequence, channel tile)
            y, h, _ = torch.ops.selscan_fused.scan_fwd_packed(
                delta, xdbl[..., R:], u, z, A_log, dt_bias, D, h0, cu_seqlens, return_final_state, train)
        else:
            y, h, _ = torch.ops.selscan_fused.gated_scan_fwd(
                delta, xdbl[..., R:], u, z, A_log, dt_bias, D, h0, return_final_state, train, cfg.l_segments)
        out = linear(y, _as(out_proj_weight, xdt), _as(out_proj_bias, xdt))
    return (out, h, conv_T) if return_final_state else out


class Mamba(nn.Module):
    """The Mamba-1 block (mamba-ssm's `Mamba`, Hugging Face's `MambaMixer`) with their parameter names,
    shapes and initialisation, so that either's state_dict loads with strict=True:

        in_proj   nn.Linear(d_model, 2 d_inner, bias=bias)
        conv1d    nn.Conv1d(d_inner, d_inner, d_conv, groups=d_inner, padding=d_conv - 1, bias=conv_bias)
        x_proj    nn.Linear(d_inner, dt_rank + 2 d_state, bias=False)
        dt_proj   nn.Linear(dt_rank, d_inner): weight U(-s, s) (s = dt_scale dt_rank^-0.5, or the constant s
                  with dt_init="constant"); bias = softplus^-1(dt), dt log-uniform in [dt_min, dt_max],
                  clamped below at dt_init_floor
        A_log     log(1 .. d_state) on every row (d_inner, d_state)
        D         ones (d_inner,)
        out_proj  nn.Linear(d_inner, d_model, bias=bias)

    d_inner = expand * d_model; dt_rank = ceil(d_model / 16) when "auto".
    forward(hidden_states (batch, L, d_model), h0=None, conv_state=None, return_final_state=False,
    cu_seqlens=None, validate=True): see selscan_fused.mamba_block (impl, config, dtypes, the states,
    packed sequences).
    """

    def __init__(self, d_model: int, d_state: int = 16, d_conv: int = 4, expand: int = 2, dt_rank="auto",
                 dt_min: float = 0.001, dt_max: float = 0.1, dt_init: str = "random", dt_scale: float = 1.0,
                 dt_init_floor: float = 1e-4, conv_bias: bool = True, bias: bool = False, impl: str = "auto",
                 config: ScanConfig | None = None, layer_idx: int | None = None, device=None, dtype=None):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        if impl not in IMPLS:
            raise ValueError(f"selscan_fused: impl must be one of {IMPLS}, got {impl!r}")
        if dt_init not in ("random", "constant"):
            raise ValueError(f"selscan_fused: dt_init must be 'random' or 'constant', got {dt_init!r}")
        check_config(config)
        for name, v in (("d_model", d_model), ("d_state", d_state), ("d_conv", d_conv),
                        ("dt_rank", 1 if isinstance(dt_rank, str) and dt_rank == "auto" else dt_rank)):
            if not is_int(v) or v < 1:
                raise ValueError(f"selscan_fused: {name} must be an int >= 1" + (" or 'auto'" if name == "dt_rank"
                                                                               else "") + f", got {v!r}")
        if isinstance(expand, bool) or not isinstance(expand, numbers.Real) or int(expand * d_model) < 1:
            raise ValueError(f"selscan_fused: expand must be a number with int(expand * d_model) >= 1 (d_inner), got "
                             f"{expand!r}")
        if not (isinstance(dt_min, numbers.Real) and isinstance(dt_max, numbers.Real) and 0 < dt_min <= dt_max):
            raise ValueError(f"selscan_fused: dt_min and dt_max must be numbers with 0 < dt_min <= dt_max, got "
                             f"dt_min = {dt_min!r}, dt_max = {dt_max!r}")
        d_model, d_state, d_conv = int(d_model), int(d_state), int(d_conv)
        self.d_model, self.d_state, self.d_conv, self.expand = d_model, d_state, d_conv, expand
        self.d_inner = int(expand * d_model)
        self.dt_rank = math.ceil(d_model / 16) if dt_rank == "auto" else int(dt_rank)
        self.impl, self.config, self.layer_idx = impl, config, layer_idx
        self.in_proj = nn.Linear(d_model, 2 * self.d_inner, bias=bias, **factory)
        self.conv1d = nn.Conv1d(self.d_inner, self.d_inner, d_conv, groups=self.d_inner, padding=d_conv - 1,
                                bias=conv_bias, **factory)
        self.x_proj = nn.Linear(self.d_inner, self.dt_rank + 2 * d_state, bias=False, **factory)
        self.dt_proj = nn.Linear(self.dt_rank, self.d_inner, bias=True, **factory)
        std = self.dt_rank ** -0.5 * dt_scale
        if dt_init == "constant":
            nn.init.constant_(self.dt_proj.weight, std)
        else:
            nn.init.uniform_(self.dt_proj.weight, -std, std)
        dt = torch.exp(torch.rand(self.d_inner, **factory) * (math.log(dt_max) - math.log(dt_min))
                       + math.log(dt_min)).clamp(min=dt_init_floor)
        inv_dt = dt + torch.log(-torch.expm1(-dt))  # softplus^-1(dt)
        with torch.no_grad():
            self.dt_proj.bias.copy_(inv_dt)
        self.dt_proj.bias._no_reinit = True
        A = torch.arange(1, d_state + 1, dtype=torch.float32, device=device).repeat(self.d_inner, 1)
        self.A_log = nn.Parameter(torch.log(A).to(dtype) if dtype is not None else torch.log(A))
        self.A_log._no_weight_decay = True
        self.D = nn.Parameter(torch.ones(self.d_inner, **factory))
        self.D._no_weight_decay = True
        self.out_proj = nn.Linear(self.d_inner, d_model, bias=bias, **factory)

    def weights(self) -> tuple:
        """The parameters in mamba_block's argument order (in_proj_weight .. out_proj_bias)."""
        return (self.in_proj.weight, self.in_proj.bias, self.conv1d.weight, self.conv1d.bias, self.x_proj.weight,
                self.dt_proj.weight, self.dt_proj.bias, self.A_log, self.D, self.out_proj.weight, self.out_proj.bias)

    def forward(self, hidden_states: torch.Tensor, h0: torch.Tensor | None = None,
                conv_state: torch.Tensor | None = None, return_final_state: bool = False,
                cu_seqlens: torch.Tensor | None = None, validate: bool = True):
        return mamba_block(hidden_states, *self.weights(), h0=h0, conv_state=conv_state,
                           return_final_state=return_final_state, impl=self.impl, config=self.config,
                           cu_seqlens=cu_seqlens, validate=validate)

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, d_inner={self.d_inner}, d_state={self.d_state}, d_conv={self.d_conv}, "
                f"dt_rank={self.dt_rank}, impl={self.impl!r}")
