"""The reference against a float64 evaluation and against the original model; runs on the CPU."""
import pytest
import torch

import selscan_fused
from conftest import call, float64_eval, fresh_seed, make_inputs, rel_l2
from original_model import OriginalSelectiveScan


@pytest.mark.parametrize("batch,L,Dm,N", [(1, 1, 8, 4), (3, 7, 16, 8), (2, 300, 24, 16), (1, 1000, 8, 3)])
@pytest.mark.parametrize("with_h0", [False, True])
def test_reference_float32_matches_float64(batch, L, Dm, N, with_h0):
    fresh_seed()
    inp = make_inputs(batch, L, Dm, N, with_h0=with_h0)
    y, h = call(inp, "reference", return_final_state=True)
    y64, h64 = float64_eval(inp)
    assert y.dtype == torch.float32 and h.dtype == torch.float32
    assert y.shape == (batch, L, Dm) and h.shape == (batch, Dm, N)
    ey, eh = rel_l2(y, y64), rel_l2(h, h64)
    print(f"rel err y={ey:.2e} h={eh:.2e}")
    assert ey < 1e-5 and eh < 1e-5


def test_reference_float64_input_stays_float64():
    fresh_seed()
    inp = make_inputs(2, 9, 16, 4, dtype=torch.float64)
    inp = {k: (v.double() if v is not None else None) for k, v in inp.items()}
    y, h = call(inp, "auto", return_final_state=True)  # auto on CPU: the reference
    assert y.dtype == torch.float64 and h.dtype == torch.float64
    y64, h64 = float64_eval(inp)
    assert rel_l2(y, y64) < 1e-12 and rel_l2(h, h64) < 1e-12


@pytest.mark.parametrize("L", [1, 5, 37])
def test_reference_matches_original_model(L):
    fresh_seed()
    orig = OriginalSelectiveScan(24, 8).double()
    layer = selscan_fused.SelectiveScan(24, 8, impl="reference").double()
    layer.load_state_dict(orig.state_dict(), strict=True)
    x = torch.randn(2, L, 24, dtype=torch.float64)
    h0 = torch.randn(2, 24, 8, dtype=torch.float64)
    y_o, h_o = orig(x, h0)
    y, h = layer(x, h0=h0, return_final_state=True)
    assert rel_l2(y, y_o) < 1e-12 and rel_l2(h, h_o) < 1e-12


def test_state_dict_compatible_both_ways():
    orig = OriginalSelectiveScan(32, 16)
    layer = selscan_fused.SelectiveScan(32, 16)
    assert list(orig.state_dict().keys()) == list(layer.state_dict().keys())
    for k, v in orig.state_dict().items():
        assert layer.state_dict()[k].shape == v.shape, k
    layer.load_state_dict(orig.state_dict(), strict=True)
    orig.load_state_dict(layer.state_dict(), strict=True)
    assert torch.equal(layer.A_log, orig.A_log) and torch.equal(layer.proj_delta.bias, orig.proj_delta.bias)


def test_module_init_matches_spec():
    torch.manual_seed(0)
    layer = selscan_fused.SelectiveScan(64, 16)
    assert torch.equal(layer.D, torch.ones(64))
    assert layer.proj_B.bias is None and layer.proj_C.bias is None
    bound = 64 ** -0.5
    for w in (layer.proj_B.weight, layer.proj_C.weight, layer.proj_delta.weight, layer.proj_delta.bias):
        assert w.abs().max() <= bound
    assert 0.8 < layer.A_log.std().item() < 1.2  # torch.randn


def test_empty_batch_and_length():
    inp = make_inputs(0, 5, 16, 4, with_h0=True)
    y, h = call(inp, "reference", return_final_state=True)
    assert y.shape == (0, 5, 16) and h.shape == (0, 16, 4)
    inp = make_inputs(2, 0, 16, 4, with_h0=True)
    y, h = call(inp, "reference", return_final_state=True)
    assert y.shape == (2, 0, 16)
    torch.testing.assert_close(h, inp["h0"])  # no tokens: the state is h0


def test_nan_and_inf_propagate():
    fresh_seed()
    inp = make_inputs(1, 6, 8, 4)
    inp["x"][0, 3, 2] = float("nan")
    y = call(inp, "reference")
    assert torch.isfinite(y[0, :3]).all()
    assert torch.isnan(y[0, 3:]).all()  # x mixes into every channel's delta, B and C from token 3 on
    inp = make_inputs(1, 4, 8, 4)
    inp["D"][1] = float("inf")
    y = call(inp, "reference")
    assert torch.isinf(y[0, :, 1]).all() and torch.isfinite(y[0, :, 0]).all()


def test_module_reads_replaced_and_parametrized_weights():
    """SelectiveScan reads its parameters from the parameter dictionaries (host overhead), falling back
    to the ordinary lookup: a replaced parameter and a parametrization (torch.nn.utils.parametrize)
    must both be seen, and to_op_dtypes keeps the values."""
    from torch.nn.utils import parametrize
    torch.manual_seed(0)
    layer = selscan_fused.SelectiveScan(64, 8, impl="reference").double()
    x = torch.randn(2, 5, 64, dtype=torch.float64)
    y0 = layer(x)
    args = lambda l: (l.A_log, l.proj_delta.weight, l.proj_delta.bias, l.proj_B.weight, l.proj_C.weight, l.D)  # noqa: E731
    assert torch.equal(y0, selscan_fused.selective_scan(x, *args(layer), impl="reference"))
    layer.proj_B.weight = torch.nn.Parameter(layer.proj_B.weight.detach() * 3)
    y1 = layer(x)
    assert torch.equal(y1, selscan_fused.selective_scan(x, *args(layer), impl="reference")) and not torch.equal(y0, y1)

    class Double(torch.nn.Module):
        def forward(self, w):
            return 2 * w
    parametrize.register_parametrization(layer.proj_delta, "weight", Double())
    y2 = layer(x)
    assert torch.equal(y2, selscan_fused.selective_scan(x, *args(layer), impl="reference")) and not torch.equal(y1, y2)

    layer32 = selscan_fused.SelectiveScan(64, 8, impl="reference")
    w = layer32.proj_delta.weight.detach().clone()
    layer32.to_op_dtypes(torch.bfloat16)
    assert layer32.proj_delta.weight.dtype == torch.bfloat16 and layer32.A_log.dtype == torch.float32
    assert layer32.proj_delta.bias.dtype == torch.float32 and layer32.D.dtype == torch.float32
    assert torch.equal(layer32.proj_delta.weight.float(), w.bfloat16().float())
