"""torch.compile(fullgraph=True) in every dtype and float32 matmul precision, in the default and the
"reduce-overhead" (CUDA graph) modes, for the forward and for a whole training step: no graph break,
and the compiled results equal the eager ones (the same kernels run). GPU only."""
import pytest
import torch

import selscan_fused
from conftest import (DTYPES, TOLERANCE, float64_eval, fresh_seed, matmul_precision, rel_l2, requires_cuda,
                      requires_extension, requires_hopper)

pytestmark = [requires_cuda, requires_extension]

MODES = list(DTYPES)  # float32-highest, float32-high, bfloat16, float16
IMPLS = ["unfused", pytest.param("fused", marks=requires_hopper)]
BATCH, L, DM, N = 2, 2100, 128, 16  # 4200 tokens: 'auto' takes the fused kernel for float32 "highest" too


def _layer_and_x(mode, impl):
    layer = selscan_fused.SelectiveScan(DM, N, impl=impl).cuda()
    layer.A_log.data = torch.randn(DM, N, device="cuda") * 0.5 - 1.0
    x = torch.randn(BATCH, L, DM, device="cuda").to(DTYPES[mode])
    return layer, x


def _check_forward(mode, impl, compile_mode):
    fresh_seed()
    torch._dynamo.reset()
    with matmul_precision(mode):
        layer, x = _layer_and_x(mode, impl)
        compiled = torch.compile(layer, fullgraph=True, dynamic=False, mode=compile_mode)
        with torch.no_grad():
            for _ in range(3):  # reduce-overhead records a CUDA graph on a later call and replays it
                y_c, h_c = compiled(x, return_final_state=True)
                y_c, h_c = y_c.clone(), h_c.clone()
            y_e, h_e = layer(x, return_final_state=True)
    torch.testing.assert_close(y_c, y_e, rtol=0, atol=0)
    torch.testing.assert_close(h_c, h_e, rtol=0, atol=0)
    inp = dict(x=x, A_log=layer.A_log.detach(), W_delta=layer.proj_delta.weight.detach().to(x.dtype),
               b_delta=layer.proj_delta.bias.detach(), W_B=layer.proj_B.weight.detach().to(x.dtype),
               W_C=layer.proj_C.weight.detach().to(x.dtype), D=layer.D.detach(), h0=None)
    y64, _ = float64_eval(inp)
    assert rel_l2(y_c, y64) < TOLERANCE[mode]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("impl", IMPLS)
def test_compile_forward(mode, impl):
    _check_forward(mode, impl, "default")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("compile_mode", ["default", "reduce-overhead"])
def test_compile_forward_auto(mode, compile_mode):
    _check_forward(mode, "auto", compile_mode)


def _loss(layer, x, dy):
    y, h = layer(x, return_final_state=True)
    return (y.float() * dy).sum() + h.square().sum()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("impl", IMPLS)
def test_compile_training_step(mode, impl):
    """Forward, loss and backward: the forward and the loss as one graph (fullgraph), the backward graph
    from the ops' autograd formulas; gradients as in eager mode."""
    fresh_seed()
    torch._dynamo.reset()
    with matmul_precision(mode):
        layer, x = _layer_and_x(mode, impl)
        x.requires_grad_(True)
        dy = torch.randn(BATCH, L, DM, device="cuda")
        leaves = [*layer.parameters(), x]
        compiled = torch.compile(_loss, fullgraph=True, dynamic=False)
        loss_c = compiled(layer, x, dy)
        loss_c.backward()
        grads_c = [t.grad.clone() for t in leaves]
        for t in leaves:
            t.grad = None
        loss_e = _loss(layer, x, dy)
        loss_e.backward()
        grads_e = [t.grad for t in leaves]
    assert rel_l2(loss_c.detach(), loss_e.detach()) < TOLERANCE[mode]
    for gc, ge in zip(grads_c, grads_e):
        assert torch.isfinite(gc).all()
        assert rel_l2(gc, ge) < TOLERANCE[mode]
