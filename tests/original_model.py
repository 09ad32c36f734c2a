"""The original model, written the straightforward way (docs/math.md): nn.Linear projections, every
(B,L,D,N) intermediate materialised, a Python loop over t. Only the tests use it, to check that
SelectiveScan loads its state_dict and computes the same function."""
import torch
import torch.nn.functional as F
from torch import nn


class OriginalSelectiveScan(nn.Module):
    def __init__(self, d_model: int, d_state: int):
        super().__init__()
        self.A_log = nn.Parameter(torch.randn(d_model, d_state))
        self.proj_B = nn.Linear(d_model, d_state, bias=False)
        self.proj_C = nn.Linear(d_model, d_state, bias=False)
        self.proj_delta = nn.Linear(d_model, d_model)
        self.D = nn.Parameter(torch.ones(d_model))

    def forward(self, x, h0=None):
        batch, L, Dm = x.shape
        delta = F.softplus(self.proj_delta(x))  # (B, L, D)
        Bt, Ct = self.proj_B(x), self.proj_C(x)  # (B, L, N)
        A = -torch.exp(self.A_log)  # (D, N)
        dA = torch.exp(delta.unsqueeze(-1) * A)  # (B, L, D, N)
        dBx = delta.unsqueeze(-1) * Bt.unsqueeze(2) * x.unsqueeze(-1)  # (B, L, D, N)
        h = x.new_zeros(batch, Dm, A.shape[1]) if h0 is None else h0
        ys = []
        for t in range(L):
            h = dA[:, t] * h + dBx[:, t]
            ys.append((h * Ct[:, t, None, :]).sum(-1))
        return torch.stack(ys, 1) + self.D * x, h
