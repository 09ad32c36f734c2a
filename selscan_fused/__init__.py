"""selscan_fused: a selective state-space (Mamba-1 style) layer for PyTorch.

    import selscan_fused
    y = selscan_fused.selective_scan(x, A_log, W_delta, b_delta, W_B, W_C, D)   # functional
    layer = selscan_fused.SelectiveScan(d_model, d_state)                      # nn.Module
    block = selscan_fused.Mamba(d_model)          # the Mamba-1 block (mamba-ssm / Hugging Face names)

See README.md for the paths (impl='fused' | 'unfused' | 'reference' | 'auto'), dtypes and shapes.
"""
from . import reference
from ._extension import build_info, extension_available
from .api import IMPLS, ScanConfig, resolve_impl, selective_scan
from .block import Mamba, mamba_block, resolve_block_impl
from .module import SelectiveScan
from .model import MambaLM, MambaLMConfig
from .generation import generate, stream_generate

__version__ = "0.3.0.dev0"

__all__ = [
    "selective_scan",
    "SelectiveScan",
    "mamba_block",
    "Mamba",
    "resolve_block_impl",
    "MambaLM",
    "MambaLMConfig",
    "generate",
    "stream_generate",
    "ScanConfig",
    "resolve_impl",
    "reference",
    "extension_available",
    "build_info",
    "IMPLS",
]
