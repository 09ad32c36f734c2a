"""The fused kernel (impl='fused', H100/H200) against the float64 evaluation, and its contract: one
kernel launch, nothing allocated beyond y / final state / workspace, deterministic, a torch op."""
import pytest
import torch

import selscan_fused
from selscan_fused import ScanConfig
from conftest import (DTYPES, TOLERANCE, call, check_against_float64, float64_eval, fresh_seed, make_inputs,
                      matmul_precision, rel_l2, requires_hopper)

pytestmark = [requires_hopper]

# (batch, L, D, N): L = 1, 7, 1000, 4097; batch 1 and 3; D multiples of 64 from 64 to 2048; every N.
SHAPES = [
    (1, 1, 64, 16),
    (3, 7, 128, 8),
    (1, 1000, 256, 32),
    (3, 1000, 1024, 8),
    (3, 4097, 64, 16),
    (1, 4097, 2048, 16),
    (3, 7, 2048, 32),
    (1, 1000, 512, 64),
    (2, 130, 192, 64),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("mode", list(TOLERANCE))
@pytest.mark.parametrize("with_h0", [False, True], ids=["h0=0", "h0"])
def test_fused_matches_float64(shape, mode, with_h0, poisoned_outputs):
    fresh_seed()
    with matmul_precision(mode):
        inp = make_inputs(*shape, dtype=DTYPES[mode], device="cuda", with_h0=with_h0)
        y, h = call(inp, "fused", return_final_state=True)
    check_against_float64(inp, y, h, mode)


@pytest.mark.parametrize("l_segments", [1, 3, 16])
@pytest.mark.parametrize("mode", ["float32-highest", "bfloat16"])
def test_fused_split_along_L(l_segments, mode, poisoned_outputs):
    fresh_seed()
    with matmul_precision(mode):
        inp = make_inputs(2, 3001, 128, 16, dtype=DTYPES[mode], device="cuda", with_h0=True)
        n_seg, seg_len, _ = torch.ops.selscan_fused.fused_plan(inp["x"], 16, l_segments)
        assert (n_seg == 1) == (l_segments == 1) and n_seg <= l_segments and n_seg * seg_len >= 3001
        y, h = call(inp, "fused", return_final_state=True, config=ScanConfig(l_segments=l_segments))
    check_against_float64(inp, y, h, mode)


# More (segment, sequence, channel tile) streams than SMs: CTAs run several streams in each phase of
# the L split, and their role loops must agree on every stream (segments of 2, 2 and 1 tensor-core
# tiles; float32 with the rounding warps as a fourth role; bf16 in both channel tiles).
@pytest.mark.parametrize("mode,channel_tile", [("bfloat16", 64), ("bfloat16", 16), ("float32-high", 0),
                                               ("float32-highest", 0)])
def test_fused_split_more_streams_than_sms(mode, channel_tile, poisoned_outputs):
    fresh_seed()
    with matmul_precision(mode):
        inp = make_inputs(3, 520, 2048, 16, dtype=DTYPES[mode], device="cuda", with_h0=True)
        n_seg, _, tile = torch.ops.selscan_fused.fused_plan(inp["x"], 16, 3, channel_tile)
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        assert n_seg == 3 and 3 * (2048 // tile) * (n_seg - 1) > sms
        assert tile == (channel_tile or 64)
        y, h = call(inp, "fused", return_final_state=True, config=ScanConfig(l_segments=3, channel_tile=channel_tile))
    check_against_float64(inp, y, h, mode)


# Lengths around the 64-token scan tile and the 128-token tensor-core tile (bf16/fp16, N <= 32): the
# last tile's second half empty (skipped by every role), partly filled or full; with L split, the last
# segment is such a tile too. N = 16 in both channel tiles (the narrow layout and the 64-channel one).
@pytest.mark.parametrize("L", [63, 64, 65, 127, 128, 129, 191, 192, 193])
@pytest.mark.parametrize("N,channel_tile", [(16, 16), (16, 64), (32, 0), (64, 0)])
@pytest.mark.parametrize("l_segments", [1, 2])
@pytest.mark.parametrize("mode", ["bfloat16", "float16"])
def test_fused_tile_boundaries(L, N, channel_tile, l_segments, mode, poisoned_outputs):
    fresh_seed()
    with matmul_precision(mode):
        inp = make_inputs(2, L, 128, N, dtype=DTYPES[mode], device="cuda", with_h0=True)
        y, h = call(inp, "fused", return_final_state=True,
                    config=ScanConfig(l_segments=l_segments, channel_tile=channel_tile))
    check_against_float64(inp, y, h, mode)


@pytest.mark.parametrize("shape", [(2, 1000, 256, 16), (1, 777, 128, 64), (3, 130, 64, 8), (1, 3001, 128, 32)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("mode", list(TOLERANCE))
def test_fused_exp_poly_matches_float64(shape, mode, poisoned_outputs):
    """The ablation switch ScanConfig(exp_poly=True): a quarter of the exponentials by polynomial."""
    fresh_seed()
    with matmul_precision(mode):
        inp = make_inputs(*shape, dtype=DTYPES[mode], device="cuda", with_h0=True)
        y, h = call(inp, "fused", return_final_state=True, config=ScanConfig(exp_poly=True, l_segments=2))
    check_against_float64(inp, y, h, mode)


@pytest.mark.parametrize("channel_tile", [16, 64])
def test_fused_exp_poly_both_channel_tiles(channel_tile, poisoned_outputs):
    fresh_seed()
    inp = make_inputs(2, 1000, 256, 16, dtype=torch.bfloat16, device="cuda", with_h0=True)
    y, h = call(inp, "fused", return_final_state=True,
                config=ScanConfig(exp_poly=True, l_segments=2, channel_tile=channel_tile))
    check_against_float64(inp, y, h, "bfloat16")


# bf16/fp16 and float32 "high" with N = 16 have two scan layouts of 64 channels per CTA, chosen by
# stream length (kFusedShortStream = 1024 tokens per L segment): two scan warpgroups for short streams,
# one otherwise. Both sides of the threshold, with and without the L split.
@pytest.mark.parametrize("L,l_segments,short", [(1000, 1, True), (1100, 1, False), (2000, 2, True),
                                                (4100, 2, False)])
@pytest.mark.parametrize("mode", ["bfloat16", "float16", "float32-high"])
def test_fused_both_scan_layouts(L, l_segments, short, mode, poisoned_outputs):
    fresh_seed()
    with matmul_precision(mode):
        inp = make_inputs(2, L, 128, 16, dtype=DTYPES[mode], device="cuda", with_h0=True)
        _, seg_len, tile = torch.ops.selscan_fused.fused_plan(inp["x"], 16, l_segments, 64)
        assert (seg_len <= 1024) == short and tile == 64
        y, h = call(inp, "fused", return_final_state=True,
                    config=ScanConfig(l_segments=l_segments, channel_tile=64))
    check_against_float64(inp, y, h, mode)


# The narrow layout (ScanConfig(channel_tile=16): 16 channels per CTA, 8 scan threads per channel):
# odd L and L around the tiles, batch 1, D from 64, with and without h0 and the L split (phase 1's
# end states, 2 and 3 segments), bf16 and fp16.
@pytest.mark.parametrize("shape,l_segments", [((1, 1, 64, 16), 1), ((3, 7, 128, 16), 1), ((2, 63, 64, 16), 1),
                                              ((2, 129, 192, 16), 2), ((1, 1000, 256, 16), 1),
                                              ((3, 1000, 1024, 16), 3), ((2, 4097, 64, 16), 0),
                                              ((8, 2048, 256, 16), 0), ((1, 3001, 512, 16), 2)],
                         ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v))
@pytest.mark.parametrize("mode", ["bfloat16", "float16"])
@pytest.mark.parametrize("with_h0", [False, True], ids=["h0=0", "h0"])
def test_fused_narrow_layout_matches_float64(shape, l_segments, mode, with_h0, poisoned_outputs):
    fresh_seed()
    with matmul_precision(mode):
        inp = make_inputs(*shape, dtype=DTYPES[mode], device="cuda", with_h0=with_h0)
        n_seg, _, tile = torch.ops.selscan_fused.fused_plan(inp["x"], 16, l_segments, 16)
        assert tile == 16 and (l_segments == 0 or n_seg == min(l_segments, (shape[1] + 127) // 128))
        y, h = call(inp, "fused", return_final_state=True,
                    config=ScanConfig(l_segments=l_segments, channel_tile=16))
    check_against_float64(inp, y, h, mode)


def test_fused_channel_tile_choice_and_errors():
    """channel_tile=0 picks the narrow layout where it avoids the L split's recomputation (S1, S5) and
    64 channels where those already fill the GPU or the split stays (S2, S4); 16 is an error where no
    narrow kernel exists."""
    plan = torch.ops.selscan_fused.fused_plan
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    x = lambda b, L, D, dt=torch.bfloat16: torch.empty(b, L, D, dtype=dt, device="cuda")
    if sms >= 128:  # H100 SXM / H200
        assert plan(x(8, 2048, 256), 16, 0) == [1, 2048, 16]      # S1
        assert plan(x(1, 64, 1024), 16, 0)[2] == 16               # S5
        assert plan(x(8, 4096, 1024), 16, 0) == [1, 4096, 64]     # S2
        assert plan(x(1, 65536, 256), 16, 0)[2] == 64             # S4
        # fewer sequences: 8 segments of the wide layout fill the SMs in one phase pair cheaper than
        # the narrow one's 64 streams (the fixed cost per phase, docs/perf/batch1.md, batch-1 regime)
        assert plan(x(4, 2048, 256), 16, 0) == [8, 256, 64]
        assert plan(x(1, 2048, 1024), 16, 0) == [8, 256, 64]     # shape P at 2K
        assert plan(x(1, 512, 1024), 16, 0) == [1, 512, 16]      # ... at 512: one narrow phase
        assert plan(x(1, 4097, 2048), 16, 0)[2] == 64             # wide D: narrow bound by x loads
        assert plan(x(2, 4096, 1024), 16, 0)[2] == 64
    assert plan(x(8, 2048, 256, torch.float32), 16, 0)[2] == 64  # no narrow layout for float32
    assert plan(x(8, 2048, 256), 32, 0)[2] == 64                 # nor for N != 16
    assert plan(x(8, 2048, 256), 16, 0, 64)[2] == 64
    inp = make_inputs(1, 9, 64, 32, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(RuntimeError, match=r"channel_tile=16\) exists for bfloat16/float16 with N = 16 only"):
        call(inp, "fused", config=ScanConfig(channel_tile=16))
    with pytest.raises(ValueError, match=r"channel_tile=32.*must be 0 \(automatic\), 16 or 64"):
        ScanConfig(channel_tile=32)
    with pytest.raises(ValueError, match="channel_tile=16.*impl='fused' only"):
        call(make_inputs(1, 9, 64, 16, dtype=torch.bfloat16, device="cuda"), "unfused",
             config=ScanConfig(channel_tile=16))


# The ablation switch ScanConfig(ring_stages=...): depths from 2 to the deepest that fits, with L split
# (both phases walk the ring) and odd L, in every dtype mode.
# (bf16 N = 16 in both channel tiles: the narrow layout, which auto picks for this shape, and 64.)
@pytest.mark.parametrize("mode,N,stages,tile", [("bfloat16", 16, 2, 0), ("bfloat16", 16, 3, 0), ("bfloat16", 16, 5, 0),
                                                ("bfloat16", 16, 2, 64), ("bfloat16", 16, 5, 64),
                                                ("bfloat16", 32, 4, 0), ("float16", 64, 2, 0), ("float16", 8, 3, 0),
                                                ("float32-highest", 16, 2, 0), ("float32-highest", 64, 2, 0),
                                                ("float32-high", 16, 2, 0), ("float32-high", 16, 4, 0),
                                                ("float32-high", 8, 5, 0)])
def test_fused_ring_stages_match_float64(mode, N, stages, tile, poisoned_outputs):
    fresh_seed()
    with matmul_precision(mode):
        inp = make_inputs(2, 1000, 256, N, dtype=DTYPES[mode], device="cuda", with_h0=True)
        y, h = call(inp, "fused", return_final_state=True,
                    config=ScanConfig(ring_stages=stages, l_segments=2, channel_tile=tile))
    check_against_float64(inp, y, h, mode)


# NaN and Inf in the inputs reach the outputs as in the reference in every dtype mode: no path may
# turn a NaN into a number (float32 "high" rounds its operands by an integer add, which must leave
# every NaN alone, also the one with all payload bits set, where the add would carry into the sign).
@pytest.mark.parametrize("all_ones_nan", [False, True])
@pytest.mark.parametrize("mode", ["bfloat16", "float16", "float32-highest", "float32-high"])
def test_fused_nan_and_inf_propagate_as_in_reference(mode, all_ones_nan, poisoned_outputs):
    fresh_seed()
    with matmul_precision(mode):
        inp = make_inputs(2, 300, 128, 16, dtype=DTYPES[mode], device="cuda", with_h0=True)
        if all_ones_nan:
            f32 = inp["x"].dtype == torch.float32
            inp["x"].view(torch.int32 if f32 else torch.int16)[1, 20, 5] = 0x7fffffff if f32 else 0x7fff
        else:
            inp["x"][1, 20, 5] = float("nan")
        assert torch.isnan(inp["x"][1, 20, 5])
        inp["D"][3] = float("inf")
        y, h = call(inp, "fused", return_final_state=True)
    y64, h64 = float64_eval(inp)
    for out, ref in ((y, y64), (h, h64)):
        assert torch.equal(torch.isnan(out), torch.isnan(ref))  # also: every element written
        assert torch.equal(torch.isinf(out), torch.isinf(ref))
        finite = torch.isfinite(ref)
        assert rel_l2(out[finite], ref[finite]) < TOLERANCE[mode]


def test_fused_ring_stages_errors():
    inp = make_inputs(1, 9, 64, 16, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(RuntimeError, match=r"ring_stages=6\) is out of range: 0 \(all that fit\) or 2 \.\. 5"):
        call(inp, "fused", config=ScanConfig(ring_stages=6))
    with pytest.raises(ValueError, match="ring_stages=3.*impl='fused' only"):
        call(inp, "unfused", config=ScanConfig(ring_stages=3))


def test_fused_tiny_float32_high_calls_take_3xtf32(poisoned_outputs):
    """Under "high", calls of at most 65,536 outputs use the 3xTF32 split (float32-accurate): TF32 alone
    over 64 outputs exceeded the 1e-3 bound in 1% of random draws (benchmarks/accuracy_sweep.py)."""
    for shape in [(1, 1, 64, 16), (1, 64, 1024, 16)]:
        fresh_seed()
        with matmul_precision("float32-high"):
            inp = make_inputs(*shape, dtype=torch.float32, device="cuda", with_h0=True)
            y, h = call(inp, "fused", return_final_state=True)
        check_against_float64(inp, y, h, "float32-highest")


def test_auto_with_a_fused_switch_runs_the_fused_kernel():
    """impl='auto' where its rule takes the unfused path (one sequence, L = 2048, D = 2048, bf16): a
    ScanConfig switch of the fused kernel makes it run the fused kernel instead of raising."""
    fresh_seed()
    inp = make_inputs(1, 2048, 2048, 16, dtype=torch.bfloat16, device="cuda", with_h0=True)
    assert selscan_fused.resolve_impl("auto", inp["x"], 16) == "unfused"
    cfg = ScanConfig(channel_tile=64)
    y_auto, h_auto = call(inp, "auto", return_final_state=True, config=cfg)
    y_fused, h_fused = call(inp, "fused", return_final_state=True, config=cfg)
    y_unf, _ = call(inp, "unfused", return_final_state=True)
    assert torch.equal(y_auto, y_fused) and torch.equal(h_auto, h_fused)
    assert not torch.equal(y_auto, y_unf)  # the paths round differently: this tells them apart
    check_against_float64(inp, y_auto, h_auto, "bfloat16")


def test_exp_poly_is_fused_only():
    inp = make_inputs(1, 9, 64, 16, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="exp_poly=True.*impl='fused' only"):
        call(inp, "unfused", config=ScanConfig(exp_poly=True))


def test_fused_long_sequence_splits_along_L(poisoned_outputs):
    """S4-like: one sequence of 65,537 tokens; the state travels along L inside the launch."""
    fresh_seed()
    inp = make_inputs(1, 65537, 256, 16, dtype=torch.bfloat16, device="cuda", with_h0=True)
    n_seg, _, _ = torch.ops.selscan_fused.fused_plan(inp["x"], 16, 0)
    assert n_seg >= 16
    y, h = call(inp, "fused", return_final_state=True)
    check_against_float64(inp, y, h, "bfloat16")


@pytest.mark.parametrize("L,l_segments", [(300, 0), (3000, 8)])
def test_one_kernel_and_no_intermediates(L, l_segments):
    fresh_seed()
    inp = make_inputs(2, L, 256, 16, dtype=torch.bfloat16, device="cuda", with_h0=True)
    cfg = ScanConfig(l_segments=l_segments)
    call(inp, "fused", return_final_state=True, config=cfg)  # warm-up (descriptor caches, attributes)
    torch.cuda.synchronize()
    stats0 = torch.cuda.memory_stats()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        y, h = call(inp, "fused", return_final_state=True, config=cfg)
        torch.cuda.synchronize()
    stats1 = torch.cuda.memory_stats()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    names = [e.name for e in kernels]
    print(names)
    assert len(kernels) == 1 and "fused_kernel" in names[0], names
    n_seg, _, _ = torch.ops.selscan_fused.fused_plan(inp["x"], 16, l_segments)
    allocs = stats1["allocation.all.allocated"] - stats0["allocation.all.allocated"]
    # the bytes asked for: allocated_bytes counts the cached block handed out, which can exceed the request
    # by up to 1 MB (the allocator does not split a large block for less), depending on earlier tests
    nbytes = stats1["requested_bytes.all.allocated"] - stats0["requested_bytes.all.allocated"]
    ws = (n_seg - 1) * 2 * 256 * 17 * 4
    budget = y.numel() * y.element_size() + h.numel() * 4 + ws
    assert allocs <= 3 and nbytes <= budget + 3 * 512, (allocs, nbytes, budget)


@pytest.mark.parametrize("l_segments", [1, 8])
@pytest.mark.parametrize("channel_tile", [16, 64])
def test_fused_deterministic(l_segments, channel_tile):
    fresh_seed()
    inp = make_inputs(2, 2500, 512, 16, dtype=torch.bfloat16, device="cuda", with_h0=True)
    cfg = ScanConfig(l_segments=l_segments, channel_tile=channel_tile)
    y1, h1 = call(inp, "fused", return_final_state=True, config=cfg)
    y2, h2 = call(inp, "fused", return_final_state=True, config=cfg)
    assert torch.equal(y1, y2) and torch.equal(h1, h2)


def test_fused_envelope_errors():
    inp = make_inputs(2, 5, 96, 16, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="d_model D = 96 is not supported by impl='fused'.*impl='unfused'"):
        call(inp, "fused")
    inp = make_inputs(2, 5, 128, 12, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="d_state N = 12 is not supported by impl='fused'"):
        call(inp, "fused")
    inp = make_inputs(2, 5, 128, 16, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(RuntimeError, match="d_model D = 96 is not supported by impl='fused'"):
        torch.ops.selscan_fused.fused_fwd(inp["x"][..., :96].contiguous(), inp["A_log"][:96], inp["W_delta"][:96, :96],
                                         inp["b_delta"][:96], inp["W_B"][:, :96], inp["W_C"][:, :96], inp["D"][:96],
                                         None, False, 0)


def test_fused_empty_inputs():
    inp = make_inputs(0, 5, 64, 16, dtype=torch.bfloat16, device="cuda", with_h0=True)
    y, h = call(inp, "fused", return_final_state=True)
    assert y.shape == (0, 5, 64) and h.shape == (0, 64, 16)
    inp = make_inputs(2, 0, 64, 16, dtype=torch.bfloat16, device="cuda", with_h0=True)
    y, h = call(inp, "fused", return_final_state=True)
    torch.testing.assert_close(h, inp["h0"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_opcheck(dtype):
    inp = make_inputs(2, 70, 128, 16, dtype=dtype, device="cuda", with_h0=True)
    args = (inp["x"], inp["A_log"], inp["W_delta"], inp["b_delta"], inp["W_B"], inp["W_C"], inp["D"], inp["h0"],
            True, 0)
    torch.library.opcheck(torch.ops.selscan_fused.fused_fwd.default, args)


def test_fused_compile_and_cuda_graph(poisoned_outputs):
    fresh_seed()
    layer = selscan_fused.SelectiveScan(256, 16, impl="fused").cuda().to(torch.bfloat16)
    x = torch.randn(2, 700, 256, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(layer, fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), layer(x), rtol=0, atol=0)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            layer(x)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        static_x = x.clone()
        with torch.cuda.graph(g):
            static_y = layer(static_x)
        for _ in range(2):
            static_x.copy_(torch.randn_like(static_x))
            g.replay()
            torch.testing.assert_close(static_y, layer(static_x), rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["bfloat16", "float32-highest"])
def test_descriptor_cache_gives_the_uncached_results(mode, poisoned_outputs):
    """The launchers reuse the previous call's TMA descriptors for the same tensors (host overhead). A
    sequence of calls that changes one thing at a time (x's buffer, L, batch, one weight, D, N; L and N
    also with every tensor's address kept, so that only a size tells the calls apart) must give bit for
    bit what encoding every descriptor gives, and match float64."""
    fresh_seed()
    ops = torch.ops.selscan_fused
    with matmul_precision(mode):
        dt = DTYPES[mode]
        base = make_inputs(2, 300, 128, 16, dtype=dt, device="cuda")
        seq = [base, dict(base, x=base["x"].clone()), dict(base, x=base["x"][:, :200].contiguous()),
               dict(base, x=base["x"][:1].contiguous()), dict(base, x=base["x"][:1, :200]),  # same address, L
               dict(base, W_B=base["W_B"][:8], W_C=base["W_C"][:8], A_log=base["A_log"][:, :8].contiguous()),  # N
               dict(base, W_B=base["W_B"].clone() * 0.5), base,
               make_inputs(2, 300, 192, 16, dtype=dt, device="cuda"), make_inputs(2, 300, 128, 32, dtype=dt,
                                                                                  device="cuda"), base]
        cached = [call(inp, "fused", return_final_state=True) for inp in seq]
        ops.fused_set_descriptor_cache(False)
        try:
            fresh = [call(inp, "fused", return_final_state=True) for inp in seq]
        finally:
            ops.fused_set_descriptor_cache(True)
    for inp, (yc, hc), (yf, hf) in zip(seq, cached, fresh):
        assert torch.equal(yc, yf) and torch.equal(hc, hf)
        check_against_float64(inp, yc, hc, mode)
