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

    def forward(self, x: torch.Tensor, h0: torch.Tensor | None = None, return_final_state: bool = False,
                cu_seqlens: torch.Tensor | None = None, validate: bool = True):
        A_log, W_delta, b_delta, W_B, W_C, D = self._weights()
        if cu_seqlens is not None:  # packed sequences (selective_scan's docstring)
            return selective_scan(x, A_log, W_delta, b_delta, W_B, W_C, D, h0=h0,
                                  return_final_state=return_final_state, impl=self.impl, config=self.config,
                                  cu_seqlens=cu_seqlens, validate=validate)
        return selective_scan(x, A_log, W_delta, b_delta, W_B, W_C, D, h0=h0, return_final_state=return_final_state,
                              impl=self.impl, config=self.config)

    def _weights(self):
        """(A_log, W_delta, b_delta, W_B, W_C, D), read from the parameter dictionaries: nn.Module's
        attribute lookup costs about 6 us for the eight names of a call, most of a short call's host
        time beyond selective_scan's. A name that is not a plain parameter there (a parametrization,
        say) takes the ordinary lookup."""
        p, m = self._parameters, self._modules
        try:
            pd = m["proj_delta"]._parameters
            return (p["A_log"], pd["weight"], pd["bias"], m["proj_B"]._parameters["weight"],
                    m["proj_C"]._parameters["weight"], p["D"])
        except KeyError:
            return (self.A_log, self.proj_delta.weight, self.proj_delta.bias, self.proj_B.weight,
                    self.proj_C.weight, self.D)

    def to_op_dtypes(self, dtype: torch.dtype) -> "SelectiveScan":
        """Stores every parameter in the dtype the op computes with for x of `dtype`, so that no call
        converts one: the three projection weights in `dtype`, A_log, the delta bias and D in float32
        (as the op keeps them). With float32 parameters and bfloat16/float16 x, every call otherwise casts
        the weights first (three cast kernels per call, which dominate the host time of short calls).
        Meant for inference; for training keep float32 parameters (under torch.autocast or not).
        Returns self."""
        with torch.no_grad():
            for lin in (self.proj_delta, self.proj_B, self.proj_C):
                lin.weight.data = lin.weight.data.to(dtype)
            self.proj_delta.bias.data = self.proj_delta.bias.data.float()
            self.A_log.data = self.A_log.data.float()
            self.D.data = self.D.data.float()
        return self

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, d_state={self.d_state}, impl={self.impl!r}"
