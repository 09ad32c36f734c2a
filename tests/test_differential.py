"""Randomized differential testing (tests/differential.py): 30 cases from a fresh seed in every GPU run
(scripts/differential.py runs 500 and more), and checks that the harness itself catches a wrong answer."""
import os

import pytest
import torch

import selscan_fused
from conftest import requires_cuda, requires_extension
from differential import TOLERANCE, make_case, run_case, supported_impls

SEED = int(os.environ.get("SELSCAN_DIFF_SEED", int.from_bytes(os.urandom(3), "little")))


@requires_cuda
@requires_extension
@pytest.mark.parametrize("index", range(30))
def test_random_case(index):
    c = make_case(SEED, index, supported_impls())
    fails = run_case(c)
    assert not fails, (f"reproduce: python scripts/differential.py --seed {SEED} --only {index}   # {c.line()}\n"
                       + "\n".join(fails))


def _small_reference_cases(n):
    out, i = [], 0
    while len(out) < n:
        c = make_case(11, i, impls=("reference",))
        i += 1
        if c.batch * c.L * c.Dm <= 60_000 and c.L <= 300:
            out.append(c)
    return out


def test_every_case_is_inside_its_paths_envelope():
    """The generator draws only what the path supports (once, seed 4009526 index 381 drew D = 132 for
    the unfused path, whose D must be a multiple of 8: the halving that keeps the float64 evaluation
    quick had left the multiple)."""
    from selscan_fused.api import (FUSED_DIM_MULTIPLE, FUSED_DSTATES, FUSED_MAX_DIM, UNFUSED_DIM_MULTIPLE,
                                   UNFUSED_DSTATES)
    assert make_case(4009526, 381).Dm % UNFUSED_DIM_MULTIPLE == 0
    for seed in (1, 4009526, 12961967):
        for index in range(2000):
            c = make_case(seed, index)
            if c.impl == "fused":
                assert c.Dm % FUSED_DIM_MULTIPLE == 0 and c.Dm <= FUSED_MAX_DIM and c.N in FUSED_DSTATES, c.line()
            else:
                assert c.Dm % UNFUSED_DIM_MULTIPLE == 0 and c.N in UNFUSED_DSTATES, c.line()
            assert c.batch >= 1 and 1 <= c.L <= 4097, c.line()


def test_the_reference_passes_its_own_judge():
    """The harness end to end on the CPU without a false alarm. (The judge's float32 evaluation is the
    reference's own call, so this cannot test the accuracy rule: test_the_judge_catches_wrong_answers
    does.)"""
    for c in _small_reference_cases(6):
        assert run_case(c, device="cpu") == [], c.line()


@pytest.mark.parametrize("mode", ["float32-highest", "float32-high", "bfloat16", "float16"])
@pytest.mark.parametrize("wrong", ["scaled", "nan_in_one_sequence", "final_state", "gradient"])
def test_the_judge_catches_wrong_answers(wrong, mode):
    """In every mode, the bfloat16/float16 ones with the design's evaluation in the judge: an error of a
    few times the mode's bound fails the case."""
    def path(*a, **k):
        y, h = selscan_fused.selective_scan(*a, **k)
        if wrong == "scaled":
            return y * (1 + 3 * TOLERANCE[mode]), h
        if wrong == "nan_in_one_sequence":
            y = y.clone()
            y[0, -1, 0] = float("nan")
            return y, h
        if wrong == "final_state":
            return y, h + 3 * TOLERANCE[mode] * h.abs().max()
        return _ScaleGrad.apply(y), h  # right values, gradients 2x too large

    cases = _small_reference_cases(200)
    c = next(c for c in cases if c.mode == mode and (c.backward or wrong != "gradient"))
    assert run_case(c, device="cpu", path=path) != [], c.line()


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y):
        return y.clone()

    @staticmethod
    def backward(ctx, g):
        return 2 * g


def _small_block_reference_cases(n, want=lambda c: True):
    out, i = [], 0
    while len(out) < n:
        c = make_case(13, i, impls=("block-reference",))
        i += 1
        if c.batch * c.L * c.Dm <= 20_000 and c.L <= 200 and want(c):
            out.append(c)
    return out


def test_block_cases_inside_the_unfused_envelope():
    from selscan_fused.api import UNFUSED_DIM_MULTIPLE, UNFUSED_DSTATES
    from selscan_fused.block import BLOCK_D_CONVS
    for index in range(2000):
        c = make_case(5, index, impls=("block-unfused",))
        assert (2 * c.Dm) % UNFUSED_DIM_MULTIPLE == 0 and c.N in UNFUSED_DSTATES and c.d_conv in BLOCK_D_CONVS, c.line()
        assert c.dt_rank >= 1 and c.batch >= 1 and 1 <= c.L <= 4097, c.line()


def test_the_block_reference_passes_its_own_judge():
    """As test_the_reference_passes_its_own_judge, for the block's cases."""
    for c in _small_block_reference_cases(6):
        assert run_case(c, device="cpu") == [], c.line()


@pytest.mark.parametrize("mode", ["float32-highest", "bfloat16"])
@pytest.mark.parametrize("wrong", ["scaled", "conv_state", "gradient"])
def test_the_judge_catches_wrong_block_answers(wrong, mode):
    def path(*a, **k):
        out, h, conv = selscan_fused.mamba_block(*a, **k)
        if wrong == "scaled":
            return out * (1 + 3 * TOLERANCE[mode]), h, conv
        if wrong == "conv_state":
            return out, h, conv.flip(-1)
        return _ScaleGrad.apply(out), h, conv

    c = _small_block_reference_cases(1, lambda c: c.mode == mode and (c.backward or wrong != "gradient")
                                     and (wrong != "conv_state" or c.d_conv > 2))[0]
    assert run_case(c, device="cpu", path=path) != [], c.line()



def test_packed_cases_are_drawn_and_judged():
    """One unfused case in five packs sequences of different lengths; on the CPU the reference passes the
    judge on packed cases (layer and block), and a path that lets the state run on across sequence
    starts (cu_seqlens ignored) is caught."""
    from dataclasses import replace
    drawn = [make_case(21, i, impls=("unfused", "block-unfused")) for i in range(300)]
    packed = [c for c in drawn if c.lengths]
    assert 30 < len(packed) < 100
    for c in packed:
        assert c.batch == 1 and c.L == sum(c.lengths) and all(n >= 1 for n in c.lengths), c.line()
    base = make_case(5, 0, impls=("reference",))
    for impl, Dm in (("reference", 16), ("block-reference", 8)):
        c = replace(base, impl=impl, Dm=Dm, N=8, lengths=(7, 1, 64, 30), batch=1, L=102, with_h0=True,
                    backward=True, mode="float32-highest", d_conv=4, dt_rank=2)
        assert run_case(c, device="cpu") == [], c.line()

    def ignores_cu(*args, cu_seqlens=None, **kw):  # y with the state running on across the sequence starts
        y_wrong, _ = selscan_fused.selective_scan(*args, **kw)
        _, h = selscan_fused.selective_scan(*args, cu_seqlens=cu_seqlens, **kw)
        return y_wrong, h

    c = replace(base, impl="reference", Dm=16, N=8, lengths=(40, 60), batch=1, L=100, with_h0=False,
                backward=False, mode="float32-highest", a_log_lo=-3.0, a_log_hi=-1.0)
    assert run_case(c, device="cpu", path=ignores_cu) != []


def test_overflow_of_the_dtypes_design_is_accepted_and_nothing_else():
    """A float16 answer that is inf where the design's evaluation (the dtype's intermediates) overflows
    too passes, and its other elements are still judged; inf where the design stays finite fails."""
    from differential import _check
    ref = torch.tensor([1.0, 2.0, 3000.0, 4.0], dtype=torch.float64)
    design = torch.tensor([1.0, 2.0, float("inf"), 4.0])
    out = torch.tensor([1.0, 2.0, float("inf"), 4.0], dtype=torch.float16)
    assert _check("out", out, ref.float(), ref, 1e-2, design) == []
    assert _check("out", out, ref.float(), ref, 1e-2, None) != []          # no design: the float64 rule
    wrong = torch.tensor([1.0, 2.5, float("inf"), 4.0], dtype=torch.float16)
    assert _check("out", wrong, ref.float(), ref, 1e-2, design) != []      # the finite elements still judged
    assert _check("out", out, ref.float(), ref, 1e-2, torch.tensor([1.0, 2.0, 3000.0, 4.0])) != []
