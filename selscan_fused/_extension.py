"""Loads the CUDA extension selscan_fused._C and explains, when it cannot, why and how to rebuild."""
from __future__ import annotations

from pathlib import Path

import torch

_C = None
_fused = None
_load_error: BaseException | None = None
_fused_load_error: BaseException | None = None

try:
    from . import _C  # noqa: F401  (registers the torch.ops.selscan_fused.* CUDA ops)
except (ImportError, OSError) as e:  # not built, or built against another torch
    _load_error = e
if _C is not None:
    try:
        from . import _fused  # noqa: F401  (registers torch.ops.selscan_fused.fused_*)
    except (ImportError, OSError) as e:
        _fused_load_error = e

if _fused is not None:
    # A build with the timing-only switches of benchmarks/ablation/roles.patch computes wrong results
    # (the SELSCAN_ABLATE_ switches) or synchronises and prints in every call (SELSCAN_TIME_ROLES);
    # the SELSCAN_TRIAL_ switches (roles.patch, narrow_rs.patch) are layouts measured and not kept.
    try:
        from . import _build_info as _bi
        _flags = getattr(_bi, "FUSED_NVCC_EXTRA_FLAGS", "")
        if any(k in _flags for k in ("SELSCAN_ABLATE_", "SELSCAN_TRIAL_", "SELSCAN_TIME_ROLES")):
            import warnings
            warnings.warn("selscan_fused: the fused kernel was built with the timing-only switches of "
                          f"benchmarks/ablation/ ({_flags}): its results are wrong but for the layout "
                          "switches SELSCAN_ABLATE_TWO_SCAN_WARPGROUPS and SELSCAN_TRIAL_ (slower layouts, "
                          "not the measured default), and SELSCAN_TIME_ROLES synchronises and prints in "
                          "every call. Rebuild without SELSCAN_FUSED_NVCC_FLAGS.", stacklevel=2)
    except ImportError:
        pass

REBUILD_COMMAND = (
    f"pip install --no-build-isolation --no-deps --force-reinstall {Path(__file__).resolve().parent.parent}"
    "   (in a checkout: pip install --no-build-isolation -e .)"
)


def extension_available() -> bool:
    """True when the CUDA ops are registered (the extension was built and loads with this torch)."""
    return _C is not None


def fused_extension_available() -> bool:
    """True when the fused kernel's extension (selscan_fused._fused) loaded too."""
    return _fused is not None


@torch.compiler.assume_constant_result  # as api._sm90: a compiled caller neither guards on nor retraces the cache
def fused_packed_available() -> bool:
    """True when the fused kernel takes packed sequences (cu_seqlens): its extension is loaded and was
    not built with SELSCAN_FUSED_NVCC_FLAGS=-DSELSCAN_FUSED_NO_PACKED (the switch that leaves the batch
    layout's kernel alone: docs/design.md, "Packed sequences"). Asked of the extension once."""
    global _fused_packed
    if _fused_packed is None:
        _fused_packed = bool(_fused is not None and hasattr(torch.ops.selscan_fused, "fused_packed_built")
                             and torch.ops.selscan_fused.fused_packed_built())
    return _fused_packed


_fused_packed = None


def build_info() -> dict:
    """What the extension was built against (empty when it was never built)."""
    try:
        from . import _build_info
    except ImportError:
        return {}
    return {k: v for k, v in vars(_build_info).items() if k.isupper()}


def extension_error_message(impl: str) -> str:
    if _C is not None and impl == "fused" and _fused is None:
        return (f"selscan_fused: impl='fused' needs the extension selscan_fused._fused, which did not load: "
                f"{_fused_load_error}. Rebuild with:\n    {REBUILD_COMMAND}")
    info = build_info()
    if not info:
        why = ("the package was installed without it (no CUDA toolkit found at build time, "
               "or SELSCAN_SKIP_CUDA=1)")
    elif info.get("TORCH_VERSION") != torch.__version__:
        why = (f"it was built against torch {info.get('TORCH_VERSION')} but torch {torch.__version__} "
               f"is installed ({_load_error})")
    else:
        why = str(_load_error)
    return (f"selscan_fused: impl='{impl}' needs the CUDA extension selscan_fused._C, which did not load: "
            f"{why}. Rebuild it against the installed torch with:\n    {REBUILD_COMMAND}")


def require_extension(impl: str) -> None:
    if _C is None or (impl == "fused" and _fused is None):
        raise RuntimeError(extension_error_message(impl))
