"""The public functional API: selective_scan(), with argument checks that name the bad argument and
the choice between the reference, the unfused path and (later) the fused kernel."""
from __future__ import annotations

import dataclasses
import numbers
import warnings

import torch
import torch.nn.functional as F

from . import _ops  # noqa: F401  (fake implementations and autograd registration)
from ._extension import extension_available, fused_extension_available, require_extension
from ._linear import linear
from .reference import selective_scan_ref
from .varlen import (AUTO_VARLEN_MESSAGE, FLOAT_DTYPES, check_cu_seqlens, check_packed_path, check_float_tensor,
                     check_per_sequence, packed_batch_error, run_per_sequence)

IMPLS = ("auto", "fused", "unfused", "reference")
CUDA_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
UNFUSED_DSTATES = (8, 16, 32, 64)
UNFUSED_DIM_MULTIPLE = 8
FUSED_DSTATES = (8, 16, 32, 64)
FUSED_DIM_MULTIPLE = 64
FUSED_MAX_DIM = 8192
FUSED_MAX_COUNT = 2**31  # batch and L each below this (the kernel's tile coordinates are 32-bit)
# impl='auto' and float32 under matmul precision "highest": the fused kernel (3xTF32) from this many
# tokens (batch x L) on; measured faster than the unfused path (full-precision cuBLAS SGEMM) on S1-S4
# (16K-64K tokens), slower on S5 (<= 64 tokens, launch-bound). docs/perf/layer-forward.md, fused v2 and v3.
FUSED_FP32_MIN_TOKENS = 4096

_is_sm90: dict = {}  # device index -> whether it is an sm_90 GPU (H100/H200)


@torch.compiler.assume_constant_result  # torch.compile bakes in the answer: no guard on the cache, no recompile
def _sm90(device: torch.device) -> bool:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _is_sm90:
        _is_sm90[idx] = torch.cuda.get_device_capability(idx) == (9, 0)
    return _is_sm90[idx]


# ScanConfig.fused_backward -> the fused ops' bwd_mode (fused_bwd's mode).
FUSED_BACKWARD_MODES = {"auto": 0, "kernel": 1, "recompute": 2}

@dataclasses.dataclass(frozen=True)
class ScanConfig:
    """Ablation switches (0 means: chosen by the library's measured defaults).

    l_segments: how many segments each sequence's L is cut into, so that CTAs along L share the work
        (the state is carried between them inside the launch); at most this many, since segments are
        whole token tiles. 0 = automatic: split only when batch x channel tiles cannot fill the GPU.
        Applies to impl='unfused' and impl='fused'.
    exp_poly: impl='fused' only: one exponential in four is computed by a degree-5 polynomial exp2 on
        the FMA pipes instead of the MUFU unit (max rel. error 2.3e-7). Off by default: measured slower
        on the H200, where the fused kernel's scan is bound by instruction issue and latency, not by
        MUFU throughput (docs/perf/layer-forward.md).
    ring_stages: impl='fused' only: how many stages of the kernel's operand ring (the TMA -> tensor core
        pipeline of x and weight tiles) are in use, from 2 to the deepest that fits in shared memory:
        bfloat16/float16 5 / 5 / 4 / 3 at N = 8 / 16 / 32 / 64, float32 TF32 ("high") 5 / 4 / 4 / 4,
        float32 3xTF32 ("highest") 3 / 3 / 3 / 2; a larger value is an error that names the maximum.
        0 = all that fit, the measured default (docs/perf/layer-forward.md, "Ablation switch: operand-ring
        depth": fastest or within noise on S1-S5 in every dtype; 2 stages cost up to 1.7x on S3).
        The narrow layout (channel_tile 16) holds 7 stages and uses them all at 0; a value given
        explicitly is checked against the limits above.
    channel_tile: impl='fused' only: channels per CTA (one stream of tokens each). 64: the layouts of
        v3 (one or two scan warpgroups, 4 threads per channel). 16 (bfloat16/float16 with N = 16 only;
        otherwise an error): the narrow layout, 8 threads per channel with 2 states each, so that a
        batch of few sequences has four times the streams and needs no L split (whose second pass
        recomputes the exponentials of every segment but the last). 0 = chosen per call by a cost
        model of the busiest CTA's scan and operand loads (csrc/fused/fused_api.cu, fused_plan): the
        narrow layout for S1-like shapes (few sequences, D up to ~512) and S5, 64 elsewhere
        (docs/perf/layer-forward.md, v3.7, which lists the shapes it was checked on).
    fused_backward: impl='fused' only: the backward of a training step. "kernel": the fused backward
        kernel (bfloat16/float16 with N = 16; otherwise an error in the backward), which recomputes
        the projections on the tensor cores inside the launch and needs 35-40% less memory than the
        recomputation; "recompute": one library product recomputes the projections, then the
        standalone backward scan kernel runs (every dtype and N); "auto" (default): the kernel for
        the plans where it measured faster (S1-like shapes, and few sequences at short or long L: 2
        to 16 L segments of chosen lengths, csrc/fused/fused_api.h), the recomputation elsewhere
        (S2-S4; docs/perf/batch1.md, "The batch-1 regime: the plans changed").
    """

    l_segments: int = 0
    exp_poly: bool = False
    ring_stages: int = 0
    channel_tile: int = 0
    fused_backward: str = "auto"

    def __post_init__(self):
        for name in ("l_segments", "ring_stages", "channel_tile"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"selscan_fused: ScanConfig({name}={v!r}) must be an int >= 0")
        if self.ring_stages == 1:
            raise ValueError("selscan_fused: ScanConfig(ring_stages=1): the ring needs at least 2 stages "
                             "(0 = all that fit)")
        if not isinstance(self.exp_poly, bool):
            raise ValueError(f"selscan_fused: ScanConfig(exp_poly={self.exp_poly!r}) must be a bool")
        if self.fused_backward not in FUSED_BACKWARD_MODES:
            raise ValueError(f"selscan_fused: ScanConfig(fused_backward={self.fused_backward!r}) must be one of "
                             f"{', '.join(map(repr, FUSED_BACKWARD_MODES))}")
        if self.channel_tile not in (0, 16, 64):
            raise ValueError(f"selscan_fused: ScanConfig(channel_tile={self.channel_tile!r}) must be 0 "
                             "(automatic), 16 or 64")

    def fused_switches(self) -> list[str]:
        """The switches of the layer's fused kernel set here, as ScanConfig arguments ([] for none)."""
        return ((["exp_poly=True"] if self.exp_poly else []) +
                ([f"ring_stages={self.ring_stages}"] if self.ring_stages else []) +
                ([f"channel_tile={self.channel_tile}"] if self.channel_tile else []) +
                ([f"fused_backward={self.fused_backward!r}"] if self.fused_backward != "auto" else []))


DEFAULT_CONFIG = ScanConfig()


def is_int(v) -> bool:
    """An integer (Python's or numpy's), not a bool and not a float with an integral value."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def check_config(config) -> None:
    """config is a ScanConfig or None (a clear error before anything runs, on every path)."""
    if config is not None and not isinstance(config, ScanConfig):
        raise TypeError(f"selscan_fused: config must be a selscan_fused.ScanConfig or None, got "
                        f"{type(config).__name__}")


def _shape_error(name: str, t: torch.Tensor, expected: tuple, why: str) -> ValueError:
    exp = "(" + ", ".join(str(e) for e in expected) + ("," if len(expected) == 1 else "") + ")"
    return ValueError(f"selscan_fused: {name} has shape {tuple(t.shape)}, expected {exp} ({why})")


_NAMES = ("x", "A_log", "W_delta", "b_delta", "W_B", "W_C", "D", "h0")


def _inputs_ok(x, A_log, W_delta, b_delta, W_B, W_C, D, h0) -> bool:
    """The common case, cheaply: every argument a floating-point tensor of the right shape on x's device.
    _diagnose_inputs says what is wrong when this is False."""
    T = torch.Tensor
    if not (isinstance(x, T) and isinstance(A_log, T) and isinstance(W_delta, T) and isinstance(b_delta, T)
            and isinstance(W_B, T) and isinstance(W_C, T) and isinstance(D, T)
            and (h0 is None or isinstance(h0, T))):
        return False
    xs, As = x.shape, A_log.shape
    if len(xs) != 3 or len(As) != 2:
        return False
    batch, _, Dm = xs
    N = As[1]
    dm1 = (Dm,)
    if not (As[0] == Dm and W_delta.shape == (Dm, Dm) and b_delta.shape == dm1 and W_B.shape == (N, Dm)
            and W_C.shape == (N, Dm) and D.shape == dm1 and (h0 is None or h0.shape == (batch, Dm, N))):
        return False
    dev = x.device
    if not (A_log.device == dev and W_delta.device == dev and b_delta.device == dev and W_B.device == dev
            and W_C.device == dev and D.device == dev and (h0 is None or h0.device == dev)):
        return False
    fl = FLOAT_DTYPES
    return (x.dtype in fl and A_log.dtype in fl and W_delta.dtype in fl and b_delta.dtype in fl
            and W_B.dtype in fl and W_C.dtype in fl and D.dtype in fl and (h0 is None or h0.dtype in fl))


def _check_inputs(x, A_log, W_delta, b_delta, W_B, W_C, D, h0):
    if not _inputs_ok(x, A_log, W_delta, b_delta, W_B, W_C, D, h0):
        _diagnose_inputs(x, A_log, W_delta, b_delta, W_B, W_C, D, h0)


def _diagnose_inputs(x, A_log, W_delta, b_delta, W_B, W_C, D, h0):
    """Raises the error that names what is wrong: the argument, what was expected and where the
    expectation comes from (D from x's last dimension, N from the parameters)."""
    named = dict(zip(_NAMES, (x, A_log, W_delta, b_delta, W_B, W_C, D, h0)))
    if h0 is None:
        del named["h0"]
    for name, t in named.items():
        check_float_tensor(name, t)
    if x.dim() != 3:
        raise ValueError(f"selscan_fused: x must have shape (batch, L, D), got {tuple(x.shape)}")
    if A_log.dim() != 2:
        raise ValueError(f"selscan_fused: A_log must have shape (D, N), got {tuple(A_log.shape)}")
    batch, _, Dm = x.shape
    # d_model as each parameter gives it; when they all agree on another width than x's, x is wrong.
    widths = {"A_log": A_log.shape[0], "W_delta": tuple(W_delta.shape), "b_delta": tuple(b_delta.shape),
              "W_B": W_B.shape[-1] if W_B.dim() == 2 else None, "W_C": W_C.shape[-1] if W_C.dim() == 2 else None,
              "D": tuple(D.shape)}
    P = A_log.shape[0]
    if P != Dm and widths["W_delta"] == (P, P) and widths["b_delta"] == (P,) and widths["D"] == (P,) \
            and widths["W_B"] == P and widths["W_C"] == P:
        raise ValueError(
            f"selscan_fused: x has D = {Dm} channels (its last dimension; x has shape {tuple(x.shape)}), but "
            f"the parameters are for D = {P} (A_log {tuple(A_log.shape)}, W_delta {tuple(W_delta.shape)}, "
            f"b_delta {tuple(b_delta.shape)}, W_B {tuple(W_B.shape)}, W_C {tuple(W_C.shape)}, D {tuple(D.shape)}): "
            "x's last dimension must be the parameters' d_model")
    # d_state: A_log's second dimension, unless W_B and W_C agree on another one.
    N = A_log.shape[1]
    nB = W_B.shape[0] if W_B.dim() == 2 else None
    nC = W_C.shape[0] if W_C.dim() == 2 else None
    if nB is not None and nB == nC and nB != N and A_log.shape[0] == Dm:
        raise ValueError(
            f"selscan_fused: A_log has shape {tuple(A_log.shape)}, expected ({Dm}, {nB}) (d_state N = {nB} from "
            f"W_B {tuple(W_B.shape)} and W_C {tuple(W_C.shape)}, D = {Dm} from x's last dimension)")
    why_d = f"D = {Dm} from x's last dimension"
    why_dn = f"D = {Dm} from x's last dimension, N = {N} from A_log's second"
    expected = {"A_log": ((Dm, N), why_d), "W_delta": ((Dm, Dm), why_d), "b_delta": ((Dm,), why_d),
                "W_B": ((N, Dm), why_dn), "W_C": ((N, Dm), why_dn), "D": ((Dm,), why_d),
                "h0": ((batch, Dm, N), f"batch = {batch} from x, {why_dn}")}
    for name, t in named.items():
        if name != "x" and tuple(t.shape) != expected[name][0]:
            raise _shape_error(name, t, *expected[name])
    for name, t in named.items():
        if t.device != x.device:
            raise ValueError(f"selscan_fused: {name} is on {t.device} but x is on {x.device}; "
                             "all tensors must be on the same device")
    raise AssertionError("selscan_fused: _diagnose_inputs found nothing wrong")  # _inputs_ok disagrees


def cuda_input_reason(impl: str, x: torch.Tensor, name: str = "x") -> str | None:
    """Why a CUDA path cannot take the input `name` (its device or dtype), or None: shared by the
    layer's and the block's (selscan_fused.block) envelope checks."""
    if not x.is_cuda:
        return f"{name} is on {x.device}; impl='{impl}' needs CUDA tensors (impl='reference' runs on the CPU)"
    if x.dtype not in CUDA_DTYPES:
        return (f"{name} has dtype {x.dtype}; impl='{impl}' takes float32, bfloat16 or float16 "
                "(impl='reference' also takes float64)")
    return None


def unfused_dstate_reason(impl: str, d_state: int) -> str | None:
    """Why the scan kernels (the unfused paths of the layer and the block) cannot take d_state, or None."""
    if d_state not in UNFUSED_DSTATES:
        return (f"d_state N = {d_state} is not supported by impl='{impl}' (supported: "
                f"{', '.join(map(str, UNFUSED_DSTATES))}); use impl='reference'")
    return None


def unsupported_reason(impl: str, x: torch.Tensor, d_state: int) -> str | None:
    """Why `impl` cannot run these inputs, or None when it can. impl: 'unfused' or 'fused'."""
    reason = cuda_input_reason(impl, x)
    if reason is not None:
        return reason
    Dm = x.shape[2]
    if impl == "fused":
        if not _sm90(x.device):
            return f"impl='fused' needs an sm_90 GPU (H100/H200), {x.device} is not one; use impl='unfused'"
        if d_state not in FUSED_DSTATES:
            return (f"d_state N = {d_state} is not supported by impl='fused' (supported: "
                    f"{', '.join(map(str, FUSED_DSTATES))}); use impl='unfused'")
        if Dm % FUSED_DIM_MULTIPLE != 0 or not FUSED_DIM_MULTIPLE <= Dm <= FUSED_MAX_DIM:
            return (f"d_model D = {Dm} is not supported by impl='fused' (a multiple of {FUSED_DIM_MULTIPLE} "
                    f"from {FUSED_DIM_MULTIPLE} to {FUSED_MAX_DIM}); use impl='unfused'")
        if x.shape[0] >= FUSED_MAX_COUNT or x.shape[1] >= FUSED_MAX_COUNT:
            return (f"impl='fused' takes batch and L below 2^31 (got batch = {x.shape[0]}, L = {x.shape[1]}); "
                    "use impl='unfused', or split the sequences into calls of fewer tokens, each passing "
                    "its final state on as the next call's h0")
        return None
    reason = unfused_dstate_reason(impl, d_state)
    if reason is not None:
        return reason
    if Dm % UNFUSED_DIM_MULTIPLE != 0:
        return (f"d_model D = {Dm} is not supported by impl='{impl}' (D must be a multiple of "
                f"{UNFUSED_DIM_MULTIPLE}); use impl='reference'")
    return None


def _tf32_allowed() -> bool:
    """Whether float32 products may use TF32: False under torch.set_float32_matmul_precision("highest"),
    True under "high"/"medium" (or torch.backends.cuda.matmul.allow_tf32 = True). Read through
    torch._C._get_cublas_allow_tf32, which torch.compile folds to a constant and guards on
    (torch.get_float32_matmul_precision() breaks the graph, and raises once the legacy and the new
    precision APIs have both been used). The CUDA ops read the same flag (allowTF32CuBLAS)."""
    return torch._C._get_cublas_allow_tf32()


def auto_choice(dtype: torch.dtype, batch: int, L: int, D: int, *, tf32: bool, training: bool) -> str:
    """impl='auto' where both CUDA paths support the inputs: 'fused' or 'unfused', whichever measured
    faster on the H200 for this dtype and shape (docs/perf/api-and-host.md, "Which path impl='auto' takes";
    tests/test_auto_rule.py checks it against every row of the committed tables docs/ablation_table.csv,
    docs/paper_figure.csv, docs/fwd_plan_check.csv and docs/train_check.csv). A rule by regions, each drawn around measured rows:

    bfloat16/float16, the forward: the fused kernel (1.2-2x faster on S1-S5), except
      - D >= 2048 with at most 64 channel tiles (batch x D <= 4096): the unfused path's cuBLAS products
        and its finer L split lead there (6-9% at (1, 2048, 2048), (2, 1024, 2048) and (1, 8192, 2048),
        at every L split the fused plan can take);
      - one stream group of 16 channel tiles (batch x D <= 1024, D >= 1024) from L = 16384 on: the
        unfused plan's 16 segments of 32-channel items lead the fused kernel's 8 (2% at 16K, 7% at
        512K; shape P, 2026-12-03).
    bfloat16/float16, a training step (training=True, a gradient will be asked for): the unfused path
      for every D >= 2048 (its step 2-8% faster at (1, 2048, 2048), (2, 1024, 2048) and S3, where the
      fused backward's recomputed projections cost more than the fused forward saves;
      docs/train_check.csv, 2026-12-03); for one stream group of 16 channel tiles (batch x D <= 1024, D >= 1024) the
      unfused path for 2048 <= L < 8192 (its step measured 4% faster at P's 2K and 4K) and the fused
      one elsewhere (up to 1.2x faster from 8K on, 1.2x at 512; shape P, 2026-12-03).
    float32, matmul precision "highest" (no TF32): the fused kernel (3xTF32) only from
      FUSED_FP32_MIN_TOKENS tokens on, and only where D <= 256, or D <= 1024 with at least 128 channel
      tiles (batch x D / 64) so that no L split is needed (S1, S2, S4: 4-9% faster); elsewhere the
      unfused path (S3 8%, batch <= 4 at D 1024-2048 1.6-2.6x, S5 1.8x faster).
    float32 under "high"/"medium" (TF32): the unfused path (cuBLAS TF32 is 1.4-2x faster where the
      products dominate), except the forward at D <= 256 from FUSED_FP32_MIN_TOKENS tokens on, where
      the fused kernel leads by 0-6% (S1, S4); a training step there is 4-5% faster unfused.
    """
    tokens = batch * L
    if dtype in (torch.bfloat16, torch.float16):
        if D >= 2048 and (training or batch * D <= 4096):
            return "unfused"
        if D >= 1024 and batch * D <= 1024:
            if training:
                return "unfused" if 2048 <= L < 8192 else "fused"
            return "unfused" if L >= 16384 else "fused"
        return "fused"
    if dtype == torch.float32 and tokens >= FUSED_FP32_MIN_TOKENS:
        if not tf32 and (D <= 256 or (D <= 1024 and batch * D >= 128 * 64)):
            return "fused"
        if tf32 and D <= 256 and not training:
            return "fused"
    return "unfused"


def resolve_impl(impl: str, x: torch.Tensor, d_state: int, training: bool = False) -> str:
    """The path selective_scan() takes for these inputs: 'auto' becomes the fastest that supports them
    (auto_choice). training: whether a gradient will be asked for (selective_scan passes True when grad
    mode is on and an input requires grad), since the fastest path of a training step can differ."""
    if impl not in IMPLS:
        raise ValueError(f"selscan_fused: impl must be one of {IMPLS}, got {impl!r}")
    if impl != "auto":
        return impl
    if not x.is_cuda or x.dtype == torch.float64:
        return "reference"
    fused_ok = fused_extension_available() and unsupported_reason("fused", x, d_state) is None
    unfused_ok = extension_available() and unsupported_reason("unfused", x, d_state) is None
    if fused_ok and unfused_ok:
        tf32 = x.dtype == torch.float32 and _tf32_allowed()
        return auto_choice(x.dtype, x.shape[0], x.shape[1], x.shape[2], tf32=tf32, training=training)
    if fused_ok:  # (no shape the fused kernel takes is refused by the unfused path today)
        return "fused"
    if unfused_ok:
        return "unfused"
    if not extension_available():
        require_extension("auto")  # a CUDA tensor but no extension: say why and how to rebuild
    return "reference"


def selective_scan(
    x: torch.Tensor,
    A_log: torch.Tensor,
    W_delta: torch.Tensor,
    b_delta: torch.Tensor,
    W_B: torch.Tensor,
    W_C: torch.Tensor,
    D: torch.Tensor,
    *,
    h0: torch.Tensor | None = None,
    return_final_state: bool = False,
    impl: str = "auto",
    config: ScanConfig | None = None,
    cu_seqlens: torch.Tensor | None = None,
    validate: bool = True,
):
    """Selective state-space scan (Mamba-1 style, full-rank delta projection); see selscan_fused.reference
    for the math and every tensor's shape.

    Returns y (batch, L, D) in x's dtype, or (y, final_state) with final_state (batch, D, N) float32
    (float64 for impl='reference' on float64 x) when return_final_state is True.

    Packed sequences (selscan_fused/varlen.py): with cu_seqlens (int32, (num_seqs + 1,)), x holds the
    tokens of num_seqs sequences packed as (1, total_tokens, D); the state restarts at every sequence
    start (from h0[s] when h0, (num_seqs, D, N), is given) and final_state is (num_seqs, D, N): each
    sequence's result is that of running it alone. validate=True checks cu_seqlens' values on the host
    (one synchronisation); validate=False trusts them (the kernels clamp every range into the packed
    row: a bad value gives wrong sequences, never an access outside the tensors). Paths: 'unfused' (the
    library product, then the scan kernel with one work item per sequence and channel tile, its
    backward likewise), 'fused' (the fused kernel over (sequence, channel tile) streams, its training
    step's backward the unfused path's packed backward; not in a build with
    SELSCAN_FUSED_NVCC_FLAGS=-DSELSCAN_FUSED_NO_PACKED) and 'reference'; 'auto' takes 'unfused' for CUDA
    tensors it supports (the reference, with a warning, for the rest).

    Dtypes: x in float32, bfloat16 or float16 (float64: reference only). The projection weights are used
    in x's dtype; A_log, b_delta, D, h0, the state and all accumulation are float32. float32 products
    follow torch.get_float32_matmul_precision(). Under torch.autocast (CUDA), float32 x and the weights
    are cast to the autocast dtype first, as torch.nn.functional.linear would.

    impl: 'reference' (plain PyTorch, any device), 'unfused' (cuBLAS projections + this project's scan
    kernel), 'fused' (one CUTLASS/CuTe kernel launch, H100/H200), 'auto' (the fastest of these that
    supports the inputs, by measurement on the H200: mostly 'fused' on H100/H200 for bfloat16/float16,
    'unfused' for float32 under TF32 and for most float32 shapes under "highest", the rule by shape
    in auto_choice(); a ScanConfig switch of the fused kernel makes it 'fused'; the reference on CPU or
    for float64). resolve_impl() tells which one 'auto' picks.
    """
    if impl not in IMPLS:
        raise ValueError(f"selscan_fused: impl must be one of {IMPLS}, got {impl!r}")
    check_config(config)
    if cu_seqlens is None:
        _check_inputs(x, A_log, W_delta, b_delta, W_B, W_C, D, h0)
    else:
        _check_inputs(x, A_log, W_delta, b_delta, W_B, W_C, D, None)
        if x.shape[0] != 1:
            raise packed_batch_error("x", x, "D")
        num_seqs = check_cu_seqlens(cu_seqlens, x.shape[1], x.device, validate=validate)
        if h0 is not None:
            check_per_sequence("h0", h0, (num_seqs,) + tuple(A_log.shape),
                               lambda: f"num_seqs = {num_seqs} from cu_seqlens, (D, N) from A_log", x.device)
    cfg = DEFAULT_CONFIG if config is None else config
    if x.is_cuda and x.dtype == torch.float32 and torch.is_autocast_enabled("cuda"):
        x = x.to(torch.get_autocast_dtype("cuda"))
    N = A_log.shape[1]
    # Training: the ops that also return what the backward needs (the checkpoints, and the unfused
    # path's projections); their autograd formula runs the backward kernel (selscan_fused/_ops.py).
    train = torch.is_grad_enabled() and (
        x.requires_grad or A_log.requires_grad or W_delta.requires_grad or b_delta.requires_grad
        or W_B.requires_grad or W_C.requires_grad or D.requires_grad or (h0 is not None and h0.requires_grad))
    fused_only = cfg is not DEFAULT_CONFIG and bool(cfg.fused_switches())
    if impl == "auto" and fused_only and x.is_cuda and fused_extension_available() and \
            unsupported_reason("fused", x, N) is None:
        chosen = "fused"  # a switch of the fused kernel's asks for it
    else:
        chosen = resolve_impl(impl, x, N, train)
    if cu_seqlens is not None and chosen != "reference":
        if impl == "auto":  # the unfused path's packed kernels (docs/design.md, "Packed sequences")
            if extension_available() and unsupported_reason("unfused", x, N) is None:
                chosen = "unfused"
            else:
                chosen = "reference"
                warnings.warn(f"selscan_fused: {AUTO_VARLEN_MESSAGE}")
        else:
            check_packed_path(chosen)
    elif impl == "auto" and chosen == "reference" and x.is_cuda:
        warnings.warn("selscan_fused: no CUDA path supports these inputs "
                      f"({unsupported_reason('unfused', x, N)}); impl='auto' runs the slow reference")
    if fused_only and chosen != "fused":
        raise ValueError(f"selscan_fused: ScanConfig({', '.join(cfg.fused_switches())}) applies to impl='fused' only; "
                         f"this call runs impl={chosen!r}")
    # Parameter dtypes: weights in x's dtype, the rest float32 (the reference keeps float64 for float64 x).
    # Converted only where they differ (a .to() that changes nothing still costs a dispatch).
    xdt = x.dtype
    pdt = torch.float64 if (chosen == "reference" and xdt == torch.float64) else torch.float32
    W_delta, W_B, W_C = _as(W_delta, xdt), _as(W_B, xdt), _as(W_C, xdt)
    A_log, b_delta, D = _as(A_log, pdt), _as(b_delta, pdt), _as(D, pdt)
    if h0 is not None:
        h0 = _as(h0, pdt)

    if chosen == "reference":
        with torch.autocast(x.device.type, enabled=False):
            if cu_seqlens is None:
                y, h = selective_scan_ref(x, A_log, W_delta, b_delta, W_B, W_C, D, h0)
            else:  # one sequence at a time: the definition of the packed result
                y, h = run_per_sequence(lambda xs, hs: selective_scan_ref(xs, A_log, W_delta, b_delta, W_B, W_C, D,
                                                                          hs), x, cu_seqlens, (h0,))
        return (y, h) if return_final_state else y

    if impl != "auto":  # 'auto' only picks a path that supports the inputs
        reason = unsupported_reason(chosen, x, N)
        if reason is not None:
            raise ValueError(f"selscan_fused: {reason}")
    require_extension(chosen)
    if cu_seqlens is not None:  # packed: the library product, then the scan kernel over the sequences
        if cfg is not DEFAULT_CONFIG and cfg.l_segments:
            raise ValueError("selscan_fused: ScanConfig(l_segments=...) does not apply to packed sequences (their "
                             "scan is never split along L)")
        if chosen == "fused":  # fused_packed_available(): every build but one with -DSELSCAN_FUSED_NO_PACKED
            if fused_only:
                raise ValueError(f"selscan_fused: ScanConfig({', '.join(cfg.fused_switches())}) does not apply to "
                                 "packed sequences (their fused kernel has one layout)")
            with torch.autocast("cuda", enabled=False):
                y, h, _ = torch.ops.selscan_fused.fused_fwd_packed(x, A_log, W_delta, b_delta, W_B, W_C, D, h0,
                                                                   cu_seqlens, return_final_state, train)
            return (y, h) if return_final_state else y
        with torch.autocast("cuda", enabled=False):
            proj = linear(x, torch.cat([W_delta, W_B, W_C], 0))  # weight gradient: _linear.weight_grad
            delta, bc = proj.split([x.shape[-1], 2 * N], dim=-1)  # one concatenation in the backward
            y, h, _ = torch.ops.selscan_fused.scan_fwd_packed(delta, bc, x, None, A_log, b_delta, D, h0, cu_seqlens,
                                                                 return_final_state, train)
        return (y, h) if return_final_state else y
    if train:
        if chosen == "fused":
            y, h, _ = torch.ops.selscan_fused.fused_fwd_res(x, A_log, W_delta, b_delta, W_B, W_C, D, h0,
                                                            cfg.l_segments, cfg.exp_poly, cfg.ring_stages,
                                                            cfg.channel_tile, FUSED_BACKWARD_MODES[cfg.fused_backward])
        else:
            y, h, _, _ = torch.ops.selscan_fused.unfused_fwd_res(x, A_log, W_delta, b_delta, W_B, W_C, D, h0,
                                                                 cfg.l_segments)
        return (y, h) if return_final_state else y
    # No gradient needed. In eager mode the op is called below the autograd dispatch key: its autograd
    # kernel (torch.library's, in Python) would only pass the call on, at a few microseconds per call.
    if torch.compiler.is_compiling():
        y, h = _forward_op(chosen, x, A_log, W_delta, b_delta, W_B, W_C, D, h0, return_final_state, cfg)
    else:
        with torch._C._AutoDispatchBelowAutograd():
            y, h = _forward_op(chosen, x, A_log, W_delta, b_delta, W_B, W_C, D, h0, return_final_state, cfg)
    return (y, h) if return_final_state else y


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def _forward_op(chosen, x, A_log, W_delta, b_delta, W_B, W_C, D, h0, return_final_state, cfg):
    if chosen == "fused":
        if cfg is DEFAULT_CONFIG:  # the schema's defaults for the rest (each argument passed costs a conversion)
            return torch.ops.selscan_fused.fused_fwd(x, A_log, W_delta, b_delta, W_B, W_C, D, h0, return_final_state, 0)
        return torch.ops.selscan_fused.fused_fwd(x, A_log, W_delta, b_delta, W_B, W_C, D, h0, return_final_state,
                                                 cfg.l_segments, cfg.exp_poly, cfg.ring_stages, cfg.channel_tile,
                                                 FUSED_BACKWARD_MODES[cfg.fused_backward])
    return torch.ops.selscan_fused.unfused_fwd(x, A_log, W_delta, b_delta, W_B, W_C, D, h0, return_final_state,
                                               cfg.l_segments)
