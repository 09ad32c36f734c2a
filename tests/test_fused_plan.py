"""The fused forward's automatic plan (csrc/fused/fused_api.cu, fused_plan: L split and channel tile)
against its restatement in benchmarks/plan_model.py (plan_library), which docs/perf/batch1.md ("The
batch-1 regime") evaluates on the committed sweep of every split (docs/fwd_split_sweep.csv). The
plan reads the sizes only and is made for the SM count of the device, so the comparison needs the
sm_90 GPU with the model's 132 SMs (an H200 / H100 SXM); the CPU part checks the model's own rows."""
import os
import sys

import pytest
import torch

from conftest import requires_hopper

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import plan_model  # noqa: E402

SHAPES = [(b, L, D) for b in (1, 2, 3, 4, 8, 16) for L in (1, 7, 128, 256, 300, 512, 1000, 1024, 2048, 4096, 8192,
                                                               65537) for D in (64, 256, 1024, 2048)]


def test_model_takes_the_measured_split_on_the_sweep():
    """On each shape of docs/fwd_split_sweep.csv the model's plan was among the forced splits and ran
    within 3% of the fastest (the recorded times; timing itself stays in benchmarks)."""
    measured = plan_model.read_sweep(os.path.join(os.path.dirname(__file__), "..", "docs", "fwd_split_sweep.csv"))
    assert len(measured) >= 15
    for shape, times in measured.items():
        (b, L, D, N), by_plan = plan_model.times_by_plan(shape, times)
        got = by_plan.get(plan_model.plan_library(b, L, D, N))
        assert got is not None and got <= 1.03 * min(by_plan.values()), (shape, got, by_plan)


@requires_hopper
@pytest.mark.parametrize("dtype,N", [(torch.bfloat16, 16), (torch.float16, 16), (torch.bfloat16, 64),
                                     (torch.float32, 16)])
def test_op_plan_is_the_model(dtype, N):
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if sms != plan_model.SMS:
        pytest.skip(f"the model is written for {plan_model.SMS} SMs; this device has {sms}")
    narrow = dtype != torch.float32 and N == 16
    elem = 4.0 if dtype == torch.float32 else 2.0
    wrong = []
    for b, L, D in SHAPES:
        x = torch.empty(1, 1, D, device="cuda", dtype=dtype).expand(b, L, D)
        got = tuple(torch.ops.selscan_fused.fused_plan(x, N, 0))
        n, seg, tile = got
        want = plan_model.plan_library(b, L, D, N, narrow=narrow, elem=elem)
        if (tile, n, seg) != want:
            wrong.append(((b, L, D), (tile, n, seg), want))
        assert n * seg >= L and seg % plan_model.TOKEN_TILE == 0 and (n - 1) * seg < max(L, 1)
    assert not wrong, wrong[:10]
