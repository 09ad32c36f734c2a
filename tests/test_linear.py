"""selscan_fused._linear: the weight gradients of the library products (G^T X over every token) against
float64, at token counts one past a multiple of 64, where cuBLAS 13.0's split-K kernels on the H100
drop the last row (docs/reliability.md, "cuBLAS split-K and a partial K tile"), and at round ones. GPU
only (on the CPU weight_grad is torch.mm itself)."""
import pytest
import torch
import torch.nn.functional as F

from selscan_fused._linear import linear, weight_grad
from conftest import fresh_seed, rel_l2, requires_cuda

pytestmark = [requires_cuda]

# the dtype's rounding of a long sum of products is ~1.7e-3 (bfloat16), ~2.1e-4 (float16)
BOUND = {torch.bfloat16: 3e-3, torch.float16: 4e-4, torch.float32: 1e-5}


@pytest.mark.parametrize("dtype", list(BOUND), ids=str)
@pytest.mark.parametrize("M,D", [(16, 2048), (256, 256), (80, 1536), (768, 1536)])
@pytest.mark.parametrize("K", [1, 65, 4096, 4097, 16385])
def test_weight_grad_sums_every_row(dtype, M, D, K):
    fresh_seed()
    wide = torch.randn(K, M + 8, device="cuda").to(dtype)
    G = wide[:, 8:]  # a column slice, as the backward's dP and a split F.linear output are
    X = torch.randn(K, D, device="cuda").to(dtype)
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        out = weight_grad(G, X)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    assert out.dtype == dtype and out.shape == (M, D)
    err = rel_l2(out, G.double().t() @ X.double())
    assert err < BOUND[dtype], f"rel err {err:.2e}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("bias", [False, True])
def test_linear_gradients_against_float64(dtype, bias):
    """linear's backward: the input's, weight's and bias's gradients, over 8193 tokens (1 past 128 * 64)."""
    fresh_seed()
    x = torch.randn(1, 8193, 1536, device="cuda").to(dtype).requires_grad_(True)
    w = (torch.randn(80, 1536, device="cuda") * 1536 ** -0.5).to(dtype).requires_grad_(True)
    b = torch.randn(80, device="cuda").to(dtype).requires_grad_(True) if bias else None
    dy = torch.randn(1, 8193, 80, device="cuda").to(dtype)
    out = linear(x, w, b)
    out.backward(dy)
    leaves = [t.detach().double().requires_grad_(True) for t in (x, w) + ((b,) if bias else ())]
    ref = F.linear(*leaves)
    ref.backward(dy.double())
    assert rel_l2(out, ref) < BOUND[dtype]
    for got, r, name in zip((x.grad, w.grad) + ((b.grad,) if bias else ()), leaves, ("x", "weight", "bias")):
        assert got.dtype == dtype
        err = rel_l2(got, r.grad)
        assert err < BOUND[dtype], f"d{name}: rel err {err:.2e}"


def test_linear_is_f_linear_without_autograd():
    x = torch.randn(3, 65, 32, device="cuda")
    w = torch.randn(16, 32, device="cuda", requires_grad=True)
    with torch.no_grad():
        assert torch.equal(linear(x, w), F.linear(x, w))
    assert torch.equal(linear(x, w.detach()), F.linear(x, w.detach()))
