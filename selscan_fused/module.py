"""SelectiveScan: the layer as an nn.Module, with the original model's parameter names, shapes and init,
so that its state_dict loads with strict=True."""
from __future__ import annotations

import torch
from torch import nn

from .api import ScanConfig, selective_scan


class SelectiveScan(nn.Module):
    """Selective state-space layer (Mamba-1 style, full-rank delta projection).

    Parameters (as in the original model):
        A_log              (d_model, d_state)  torch.randn
        proj_B.weight      (d_state, d_model)  nn.Linear default, no bias
        proj_C.weight      (d_state, d_model)  nn.Linear default, no bias
        proj_delta.weight  (d_model, d_model)  nn.Linear default
        proj_delta.bias    (d_model,)          nn.Linear default
        D                  (d_model,)          ones

    forward(x (batch, L, d_model), h0=None (batch, d_model, d_state), return_final_state=False) returns y,
    or (y, final_state); see selscan_fused.selective_scan for dtypes and `impl`.
    """

    def __init__(self, d_model: int, d_state: int, impl: str = "auto", config: ScanConfig | None = None,
                 device=None, dtype=None):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.d_model, self.d_state, self.impl, self.config = d_model, d_state, impl, config
        self.A_log = nn.Parameter(torch.randn(d_model, d_state, **factory))
        self.proj_B = nn.Linear(d_model, d_state, bias=False, **factory)
        self.proj_C = nn.Linear(d_model, d_state, bias=False, **factory)
        self.proj_delta = nn.Linear(d_model, d_model, **factory)
        self.D = nn.Parameter(torch.ones(d_model, **factory))

    def forward(self, x: torch.Tensor, h0: torch.Tensor | None = None, return_final_state: bool = False):
        return selective_scan(
            x, self.A_log, self.proj_delta.weight, self.proj_delta.bias, self.proj_B.weight,
            self.proj_C.weight, self.D, h0=h0, return_final_state=return_final_state, impl=self.impl,
            config=self.config)

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, d_state={self.d_state}, impl={self.impl!r}"
