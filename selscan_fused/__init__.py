"""selscan_fused: a selective state-space (Mamba-1 style) layer for PyTorch.

    import selscan_fused
    y = selscan_fused.selective_scan(x, A_log, W_delta, b_delta, W_B, W_C, D)   # functional
    layer = selscan_fused.SelectiveScan(d_model, d_state)                      # nn.Module

See README.md for the paths (impl='fused' | 'unfused' | 'reference' | 'auto'), dtypes and shapes.
"""
from . import reference
from ._extension import build_info, extension_available
from .api import IMPLS, ScanConfig, resolve_impl, selective_scan
from .module import SelectiveScan

__version__ = "0.1.0"

__all__ = [
    "selective_scan",
    "SelectiveScan",
    "ScanConfig",
    "resolve_impl",
    "reference",
    "extension_available",
    "build_info",
    "IMPLS",
]
