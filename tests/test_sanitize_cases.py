"""scripts/sanitize_cases.py's block workload for initcheck (`_block_ops_without_cublas`), run on the CPU
with the project's references standing in for the CUDA ops: its float64 checks (the gated y, the decode
step, the RMSNorm) agree with the references' own math, and every op is called with the shapes and
arguments its schema takes, so that on the GPU only the kernels are under test. CPU only."""
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import sanitize_cases  # noqa: E402

from selscan_fused.block_reference import mamba_step_ref  # noqa: E402
from selscan_fused.conv import causal_conv1d_ref  # noqa: E402
from selscan_fused.model import RMSNorm, add_norm  # noqa: E402
from selscan_fused.reference import scan_ref  # noqa: E402
from selscan_fused.varlen import run_per_sequence  # noqa: E402


def _gated(delta_pre, bc, u, z, A_log, dt_bias, D, h0):
    """The gated scan from delta before its bias and softplus, in float32, y in u's dtype."""
    N = A_log.shape[1]
    y, h = scan_ref(u.float(), F.softplus(delta_pre.float() + dt_bias), A_log, bc[..., :N].float(),
                    bc[..., N:].float(), D, h0)
    return (y * F.silu(z.float())).to(u.dtype), h


def _zeros(*ts):
    return [torch.zeros_like(t) if t is not None else torch.zeros(0) for t in ts]


class FakeOps(types.SimpleNamespace):
    """torch.ops.selscan_fused's ops that the workload calls, by the project's references (the backward
    ops, whose results the workload only checks for finiteness, as zeros of their outputs' shapes).
    Each records that it was called."""

    def __init__(self):
        super().__init__(called=set())

    def causal_conv1d_fwd(self, x, w, b, h, silu, return_final_state):
        self.called.add("causal_conv1d_fwd")
        assert h.dtype == torch.float32 and w.shape == (x.shape[2], h.shape[2] + 1)
        return causal_conv1d_ref(x, w, b, h, activation=silu)

    def causal_conv1d_bwd(self, x, w, b, h, dout, dfinal, silu):
        self.called.add("causal_conv1d_bwd")
        assert dout.shape == x.shape and dout.dtype == x.dtype
        return _zeros(x, w, b, h)

    def gated_scan_fwd(self, delta, bc, u, z, A_log, dt_bias, D, h0, return_final_state, training, l_segments):
        self.called.add("gated_scan_fwd")
        assert delta.shape == u.shape == z.shape and bc.shape[-1] == 2 * A_log.shape[1]
        y, h = _gated(delta, bc, u, z, A_log, dt_bias, D, h0)
        return y, h, torch.zeros(1)

    def scan_bwd(self, delta, bc, x, A_log, b, D, h0, dy, dhT, ckpt, l_segments, gate_z=None):
        self.called.add("scan_bwd")
        assert dy.shape == x.shape and dhT.shape == h0.shape and gate_z.shape == x.shape
        return _zeros(torch.cat([delta, bc], -1), x, A_log, b, D, h0, x)

    def fused_block_fwd(self, xz, cw, cb, cs, wx, xdbl, dt_w, A_log, dt_bias, D, h0, return_final_state, training,
                        l_segments):
        self.called.add("fused_block_fwd")
        d_inner, R = A_log.shape[0], dt_w.shape[1]
        assert xdbl is None and cs.dtype == torch.float32 and wx.shape[1] == d_inner
        u, _ = causal_conv1d_ref(xz[..., :d_inner], cw, cb, cs, activation=True)
        xd = (u.float() @ wx.float().T).to(xz.dtype)
        delta = (xd[..., :R].float() @ dt_w.float().T).to(xz.dtype)
        y, h = _gated(delta, xd[..., R:], u, xz[..., d_inner:], A_log, dt_bias, D, h0)
        return y, h, torch.zeros(1), xd

    def decode_mid(self, xz, conv_state, ssm_state, cw, cb, wx, dt_w, dt_bias, A_log, D, launches=1):
        """mamba_step_ref with in_proj and out_proj the identity: the step between them (either launch form)."""
        assert launches in (1, 2)
        self.called.add("decode_mid")
        d_inner = A_log.shape[0]
        assert conv_state.dtype == xz.dtype and ssm_state.dtype == torch.float32 and xz.is_contiguous()
        eye_in, eye_out = torch.eye(2 * d_inner), torch.eye(d_inner)
        out, conv, h = mamba_step_ref(xz.float(), conv_state, ssm_state, eye_in, None, cw, cb, wx.float(), dt_w.float(),
                                      dt_bias, A_log, D, eye_out, None)
        conv_state.copy_(conv)
        ssm_state.copy_(h)
        return out.to(xz.dtype)

    def add_rmsnorm(self, hidden, residual, weight, eps, residual_fp32):
        self.called.add("add_rmsnorm")
        norm = RMSNorm(hidden.shape[-1], eps=eps, dtype=weight.dtype)
        with torch.no_grad():
            norm.weight.copy_(weight)
        return add_norm(norm, hidden, residual, residual_fp32)

    def causal_conv1d_packed_fwd(self, x, w, b, h, cu, silu, return_final_state):
        self.called.add("causal_conv1d_packed_fwd")
        return run_per_sequence(lambda xs, hs: causal_conv1d_ref(xs, w, b, hs, activation=silu), x, cu, (h,))

    def causal_conv1d_packed_bwd(self, x, w, b, h, dout, dfinal, cu, silu):
        self.called.add("causal_conv1d_packed_bwd")
        assert dout.shape == x.shape and h.shape[0] == cu.shape[0] - 1
        return _zeros(x, w, b, h)

    def scan_fwd_packed(self, delta, bc, x, z, A_log, b, D, h0, cu, return_final_state, training):
        self.called.add("scan_fwd_packed")
        assert h0.shape[0] == cu.shape[0] - 1 and z.shape == x.shape
        ys, hs, bounds = [], [], cu.tolist()
        for s, (a, e) in enumerate(zip(bounds[:-1], bounds[1:])):
            y, h = _gated(delta[:, a:e], bc[:, a:e], x[:, a:e], z[:, a:e], A_log, b, D, h0[s:s + 1])
            ys.append(y)
            hs.append(h)
        return torch.cat(ys, 1), torch.cat(hs, 0), torch.zeros(1)

    def scan_bwd_packed(self, delta, bc, x, A_log, b, D, h0, dy, dhT, ckpt, cu, gate_z=None):
        self.called.add("scan_bwd_packed")
        assert dy.shape == x.shape and dhT.shape == h0.shape and gate_z.shape == x.shape
        return _zeros(torch.cat([delta, bc], -1), x, A_log, b, D, h0, x)


@pytest.mark.parametrize("mode", ["bfloat16", "float32-highest"])
@pytest.mark.parametrize("grid", [0, 1, 2])
def test_block_initcheck_workload_agrees_with_the_references(grid, mode):
    batch, L, Dm, N, W = sanitize_cases.BLOCK_GRID[grid]
    dt = sanitize_cases.MODES[mode][0]
    ops = FakeOps()
    err, ok = sanitize_cases._block_ops_without_cublas(dt, batch, L, Dm, N, W, seed=grid, fused=True, ops=ops,
                                                       device="cpu")
    assert ok
    assert err < sanitize_cases.BLOCK_TOLERANCE[mode], err
    assert ops.called == {name for name in dir(FakeOps) if not name.startswith("_")} - {"called"}
