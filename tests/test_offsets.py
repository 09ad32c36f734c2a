"""More than 2^31 elements in x and y: every offset of both CUDA paths must be 64-bit. GPU only; the
inputs take ~13 GB while they are made and each path ~9-14 GB more, so this skips on GPUs with less
than 40 GB of memory (it runs on the H100/H200)."""
import pytest
import torch

from conftest import (call, check_against_float64, fresh_seed, make_inputs, requires_extension, requires_gpu_memory,
                      requires_hopper)

BATCH, L, DM, N = 520, 4099, 1024, 16  # 2,182,635,520 elements in x and in y (2^31 = 2,147,483,648)

pytestmark = [
    requires_extension,
    requires_gpu_memory(40),
]


@pytest.fixture(scope="module")
def big():
    fresh_seed()
    inp = make_inputs(BATCH, L, DM, N, dtype=torch.bfloat16, device="cuda", with_h0=True)
    assert inp["x"].numel() > 2**31
    yield inp
    del inp
    torch.cuda.empty_cache()


@pytest.mark.parametrize("impl", ["unfused", pytest.param("fused", marks=requires_hopper)])
def test_more_than_2_31_elements(impl, big, poisoned_outputs):
    y, h = call(big, impl, return_final_state=True)
    # Every element written (the outputs were NaN-poisoned), the ones past 2^31 included.
    assert bool(torch.isfinite(y.view(-1)[2**31 - 4096:]).all()), "elements past 2^31 unwritten or wrong"
    assert bool(torch.isfinite(y).all()) and bool(torch.isfinite(h).all())
    # The first sequence and the last two (which lie wholly past 2^31 elements) against float64.
    for rows in (slice(0, 1), slice(BATCH - 2, BATCH)):
        sub = {k: (v[rows] if k in ("x", "h0") else v) for k, v in big.items()}
        check_against_float64(sub, y[rows], h[rows], "bfloat16")
    del y, h
    torch.cuda.empty_cache()
