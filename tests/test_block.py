"""The Mamba-1 block (selscan_fused.Mamba, selscan_fused.mamba_block): parameter names, shapes and
initialisation against mamba-ssm's and Hugging Face's; the reference against Hugging Face's MambaMixer
(its PyTorch path, which it takes without mamba-ssm's kernels) and against itself in pieces; the unfused CUDA path against float64 values and
gradients, transformers, chunked calls, determinism, torch.compile, CUDA graphs and opcheck."""
import math

import pytest
import torch

import selscan_fused
from selscan_fused import Mamba, mamba_block
from selscan_fused.block_reference import mamba_block_ref, mamba_step_ref
from conftest import (DTYPES, TOLERANCE, fresh_seed, matmul_precision, rel_l2, requires_cuda,
                      requires_extension, requires_hopper, short_sum_bound)

try:
    import transformers
except ImportError:  # a test dependency (scripts/install_and_run.sh installs it); its tests skip without it
    transformers = None
requires_transformers = pytest.mark.skipif(transformers is None, reason="transformers (a test dependency: "
                                           "pip install transformers) is not installed")

ARGS = ("hidden_states", "in_proj_weight", "in_proj_bias", "conv_weight", "conv_bias", "x_proj_weight",
        "dt_proj_weight", "dt_proj_bias", "A_log", "D", "out_proj_weight", "out_proj_bias", "h0", "conv_state")
# mamba-ssm's Mamba state_dict keys (bias=False, conv_bias=True), as its checkpoints hold them.
MAMBA_SSM_KEYS = ("in_proj.weight", "conv1d.weight", "conv1d.bias", "x_proj.weight", "dt_proj.weight",
                  "dt_proj.bias", "A_log", "D", "out_proj.weight")


def hf_mixer(block: Mamba, dtype=torch.float32):
    """Hugging Face's MambaMixer with the block's sizes, loaded from the block's state_dict (strict)."""
    cfg = transformers.MambaConfig(hidden_size=block.d_model, state_size=block.d_state, conv_kernel=block.d_conv,
                                   expand=block.expand, time_step_rank=block.dt_rank,
                                   use_bias=block.in_proj.bias is not None,
                                   use_conv_bias=block.conv1d.bias is not None)
    mixer = transformers.models.mamba.modeling_mamba.MambaMixer(cfg, layer_idx=0)
    mixer.load_state_dict(block.state_dict(), strict=True)
    return mixer.to(device=block.A_log.device, dtype=dtype)


def block_args(block: Mamba, x, h0=None, conv_state=None):
    return dict(zip(ARGS, (x,) + block.weights() + (h0, conv_state)))


def randomize(block: Mamba, seed_scale=0.5):
    """Moves A_log, D and the conv/dt biases off their initial values (never test on the init's
    symmetric values alone: every row of A_log is log(1..N) at init)."""
    with torch.no_grad():
        block.A_log.add_(torch.randn_like(block.A_log) * seed_scale)
        block.D.add_(torch.randn_like(block.D) * seed_scale)
        if block.conv1d.bias is not None:
            block.conv1d.bias.add_(torch.randn_like(block.conv1d.bias) * 0.1)
    return block


# The layer's bounds (docs/math.md, "Accuracy"), but for float32 under TF32 ("high"): the block chains
# four TF32 products (in_proj, x_proj, dt_proj, out_proj; and their transposes in the backward), each
# rounding its operands to 10 mantissa bits, where the layer has one (docs/math.md, "Accuracy of the block").
BLOCK_TOLERANCE = dict(TOLERANCE, **{"float32-high": 3e-3})

# ---- parameters: names, shapes, initialisation, state_dict both ways (CPU) ----

def test_parameters_match_mamba_ssm_and_hugging_face():
    fresh_seed()
    b = Mamba(768)  # mamba-130m's layer
    assert (b.d_inner, b.dt_rank) == (1536, 48)
    shapes = {k: tuple(v.shape) for k, v in b.state_dict().items()}
    assert shapes == {"in_proj.weight": (3072, 768), "conv1d.weight": (1536, 1, 4), "conv1d.bias": (1536,),
                      "x_proj.weight": (80, 1536), "dt_proj.weight": (1536, 48), "dt_proj.bias": (1536,),
                      "A_log": (1536, 16), "D": (1536,), "out_proj.weight": (768, 1536)}
    assert set(shapes) == set(MAMBA_SSM_KEYS)
    # Initialisation: A_log = log(1..N) on every row, D = 1, dt_proj's weight in U(-s, s), its bias the
    # inverse softplus of dt in [dt_min, dt_max].
    assert torch.equal(b.A_log, torch.log(torch.arange(1, 17, dtype=torch.float32)).repeat(1536, 1))
    assert torch.equal(b.D, torch.ones(1536))
    s = 48 ** -0.5
    assert b.dt_proj.weight.abs().max() <= s and b.dt_proj.weight.abs().max() > 0.9 * s
    dt = torch.nn.functional.softplus(b.dt_proj.bias)
    assert dt.min() >= 1e-3 * (1 - 1e-5) and dt.max() <= 0.1 * (1 + 1e-5)
    assert b.dt_proj.weight.std().item() == pytest.approx(s / math.sqrt(3), rel=0.05)
    c = Mamba(64, d_state=8, d_conv=2, expand=2, dt_rank=5, dt_init="constant", dt_scale=2.0, bias=True,
              conv_bias=False)
    assert torch.all(c.dt_proj.weight == 5 ** -0.5 * 2.0)
    assert c.in_proj.bias is not None and c.out_proj.bias is not None and c.conv1d.bias is None


@requires_transformers
def test_state_dict_loads_both_ways_with_hugging_face_and_mamba_ssm_names():
    fresh_seed()
    for kw in ({}, {"bias": True, "conv_bias": False, "d_state": 8, "d_conv": 3}):
        b = Mamba(96, **kw)
        mixer = hf_mixer(b)  # ours -> Hugging Face, strict
        fresh = Mamba(96, **kw)
        fresh.load_state_dict(mixer.state_dict(), strict=True)  # Hugging Face -> ours, strict
        for k, v in b.state_dict().items():
            assert torch.equal(v, fresh.state_dict()[k]), k


def test_state_dict_with_mamba_ssm_names_loads_strictly():
    """mamba-ssm's naming: a state_dict written with its keys loads strictly."""
    fresh_seed()
    b = Mamba(64)
    shapes = {k: tuple(v.shape) for k, v in b.state_dict().items()}
    sd = {k: torch.randn(shapes[k]) for k in MAMBA_SSM_KEYS}
    b.load_state_dict(sd, strict=True)
    assert torch.equal(b.x_proj.weight, sd["x_proj.weight"])


# ---- the reference against Hugging Face's MambaMixer, and against itself (CPU) ----

@requires_transformers
@pytest.mark.parametrize("L,d_conv,N,bias", [(1, 4, 16, False), (7, 2, 8, True), (33, 3, 16, False)])
def test_reference_equals_hugging_face_mixer(L, d_conv, N, bias):
    """Values and every parameter's gradient of the reference (float64) against MambaMixer's
    forward (PyTorch, without mamba-ssm's kernels; float32) on the same weights."""
    fresh_seed()
    block = randomize(Mamba(48, d_state=N, d_conv=d_conv, bias=bias, conv_bias=not bias, impl="reference"))
    mixer = hf_mixer(block)
    x = torch.randn(2, L, 48)
    out_hf = mixer(x.clone().requires_grad_(True))
    dy = torch.randn_like(out_hf)
    (out_hf * dy).sum().backward()
    b64 = Mamba(48, d_state=N, d_conv=d_conv, bias=bias, conv_bias=not bias, impl="reference").double()
    b64.load_state_dict(block.state_dict())
    x64 = x.double().requires_grad_(True)
    out = b64(x64)
    (out * dy.double()).sum().backward()
    print(f"rel err out={rel_l2(out_hf, out):.2e}")
    assert rel_l2(out_hf, out) < 1e-5
    hf_params = dict(mixer.named_parameters())
    for name, p in b64.named_parameters():
        e = rel_l2(hf_params[name].grad, p.grad)
        print(f"d{name}: rel err {e:.2e}")
        assert e < 1e-4, name


def test_reference_in_pieces_equals_one_call_and_steps():
    fresh_seed()
    block = randomize(Mamba(32, d_state=8, impl="reference")).double()
    x = torch.randn(2, 23, 32, dtype=torch.float64)
    out, h, conv = block(x, return_final_state=True)
    assert conv.shape == (2, 64, 3) and h.shape == (2, 64, 8)
    # three pieces, of 2, 1 and 20 tokens (the first shorter than the conv window)
    o1, h1, c1 = block(x[:, :2], return_final_state=True)
    o2, h2, c2 = block(x[:, 2:3], h0=h1, conv_state=c1, return_final_state=True)
    o3, h3, c3 = block(x[:, 3:], h0=h2, conv_state=c2, return_final_state=True)
    torch.testing.assert_close(torch.cat([o1, o2, o3], 1), out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(h3, h, rtol=1e-12, atol=1e-12)
    # the conv state is in_proj's output for the last tokens: the same values, up to the rounding of a
    # product over a different number of rows (BLAS may block it differently)
    torch.testing.assert_close(c3, conv, rtol=1e-12, atol=1e-12)
    # the decode step, token by token, from zero states
    cs = torch.zeros(2, 64, 3, dtype=torch.float64)
    ss = torch.zeros(2, 64, 8, dtype=torch.float64)
    for t in range(x.shape[1]):
        o, cs, ss = mamba_step_ref(x[:, t], cs, ss, *block.weights())
        torch.testing.assert_close(o, out[:, t], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ss, h, rtol=1e-12, atol=1e-12)


def test_errors_name_the_argument():
    block = Mamba(32, d_state=8, impl="reference")
    x = torch.randn(2, 5, 32)
    a = block_args(block, x)
    with pytest.raises(ValueError, match=r"x_proj_weight has shape \(3, 64\), expected \(18, 64\)"):
        mamba_block(*[torch.randn(3, 64) if k == "x_proj_weight" else a[k] for k in ARGS[:12]])
    with pytest.raises(ValueError, match=r"conv_state has shape \(2, 64, 4\), expected \(2, 64, 3\)"):
        block(x, conv_state=torch.randn(2, 64, 4))
    with pytest.raises(ValueError, match=r"h0 has shape"):
        block(x, h0=torch.randn(2, 64, 16))
    with pytest.raises(ValueError, match=r"in_proj_weight has shape"):
        block(torch.randn(2, 5, 31))
    with pytest.raises(ValueError, match="impl must be one of"):
        Mamba(32, impl="fast")
    with pytest.raises(ValueError, match="impl='fused' needs CUDA tensors"):
        Mamba(32, impl="fused")(x)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        Mamba(32, impl="unfused")(x)


# ---- the CUDA paths (GPU): 'unfused' (sm_80+) and 'fused' (sm_90) ----

CUDA_IMPLS = ["unfused", pytest.param("fused", marks=requires_hopper)]

def cuda_block(d_model, N, d_conv, bias, impl, expand=2, dt_rank="auto"):
    b = randomize(Mamba(d_model, d_state=N, d_conv=d_conv, expand=expand, dt_rank=dt_rank, bias=bias,
                        conv_bias=not bias, impl=impl, device="cuda"))
    return b


def rounded(block: Mamba, dtype):
    """The block with its four projection weights (and biases) rounded to dtype, as the CUDA path uses
    them; float32 parameters otherwise."""
    b = Mamba(block.d_model, d_state=block.d_state, d_conv=block.d_conv, expand=block.expand, dt_rank=block.dt_rank,
              bias=block.in_proj.bias is not None, conv_bias=block.conv1d.bias is not None, impl=block.impl,
              device="cuda")
    b.load_state_dict(block.state_dict())
    with torch.no_grad():
        for lin in (b.in_proj, b.x_proj, b.dt_proj, b.out_proj):
            lin.weight.copy_(lin.weight.to(dtype).float())
            if lin is not b.dt_proj and lin.bias is not None:
                lin.bias.copy_(lin.bias.to(dtype).float())
    return b


# (batch, L, d_model, N, d_conv, bias, with_states, expand)
SHAPES = [
    (1, 1, 64, 16, 4, False, True, 2),
    (3, 7, 64, 8, 2, True, False, 2),
    (1, 1000, 128, 16, 4, False, True, 2),
    (3, 1000, 96, 32, 3, False, False, 2),
    (1, 4097, 64, 16, 4, False, True, 2),
    (2, 300, 48, 64, 4, True, True, 2),
    (2, 300, 64, 64, 4, True, True, 2),  # d_inner 128: N = 64 on the fused path too
    (3, 130, 768, 16, 4, False, True, 2),
]


@requires_cuda
@requires_extension
@pytest.mark.parametrize("impl", CUDA_IMPLS)
@pytest.mark.parametrize("mode", list(DTYPES))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:5])))
def test_cuda_values_and_gradients_against_float64(impl, mode, shape, poisoned_outputs):
    errs = block_errors_against_float64(impl, mode, shape)
    if errs is None:  # outside the path's envelope; the error was checked
        return
    bad = {k: v for k, v in errs.items() if not v < block_bound(k, mode, shape)}
    assert not bad, f"over the {mode} bound {BLOCK_TOLERANCE[mode]:.0e}: {bad}"


# The block's gradients that sum over tokens with cancelling terms (conftest.short_sum_bound).
SHORT_SUMS = ("dA_log", "ddt_proj.weight", "ddt_proj.bias")


def block_bound(quantity, mode, shape):
    """The bound of one quantity of block_errors_against_float64 for a case of `shape`."""
    tol = BLOCK_TOLERANCE[mode]
    return short_sum_bound(tol, shape[0] * shape[1]) if quantity in SHORT_SUMS else tol


def block_errors_against_float64(impl, mode, shape, seed=None):
    """The block on `impl` in `mode` against its float64 evaluation, forward and backward with random
    output gradients: {quantity: relative L2 error} (None where `shape` is outside the path's envelope,
    after checking the error that says so). `seed` None: a fresh one (printed); scripts/diag_block_tail.py
    samples the errors' distribution over many seeds with it."""
    batch, L, d_model, N, d_conv, bias, with_states, expand = shape
    if seed is None:
        fresh_seed()
    else:
        torch.manual_seed(seed)
    dtype = DTYPES[mode]
    base = cuda_block(d_model, N, d_conv, bias, impl, expand)
    block = rounded(base, dtype)
    x = torch.randn(batch, L, d_model, device="cuda").to(dtype)
    if impl == "fused" and block.d_inner % 64 != 0:  # outside the fused kernel's envelope: the error says so
        with pytest.raises(ValueError, match=f"d_inner = {block.d_inner} is not supported by impl='fused'.*"
                                             "impl='unfused'"):
            block(x)
        return None
    di = block.d_inner
    h0 = torch.randn(batch, di, N, device="cuda") * 0.5 if with_states else None
    cs = torch.randn(batch, di, d_conv - 1, device="cuda").to(dtype) if with_states else None
    dy = torch.randn(batch, L, d_model, device="cuda").to(dtype)
    dhT = torch.randn(batch, di, N, device="cuda") if with_states else None
    dcT = torch.randn(batch, di, d_conv - 1, device="cuda").to(dtype) if with_states else None

    def run(blk, xx, h, c, impl_dtype):
        leaves = [xx.detach().clone().requires_grad_(True)]
        hh = h.detach().clone().to(impl_dtype).requires_grad_(True) if h is not None else None
        cc = c.detach().clone().to(impl_dtype).requires_grad_(True) if c is not None else None
        out, hT, cT = blk(leaves[0], h0=hh, conv_state=cc, return_final_state=True)
        loss = (out.to(impl_dtype) * dy.to(impl_dtype)).sum()
        if with_states:
            loss = loss + (hT.to(impl_dtype) * dhT.to(impl_dtype)).sum() + (cT.to(impl_dtype) * dcT.to(impl_dtype)).sum()
        loss.backward()
        grads = {"x": leaves[0].grad, **{n: p.grad for n, p in blk.named_parameters()}}
        if with_states:
            grads.update(h0=hh.grad, conv_state=cc.grad)
        return out, hT, cT, grads

    with matmul_precision(mode):
        out, hT, cT, grads = run(block, x, h0, cs, torch.float32)
    ref = Mamba(d_model, d_state=N, d_conv=d_conv, expand=expand, bias=bias, conv_bias=not bias,
                impl="reference", device="cuda").double()
    ref.load_state_dict(block.state_dict())
    out64, h64, c64, g64 = run(ref, x.double(), h0, cs, torch.float64)
    assert out.dtype == dtype and hT.dtype == torch.float32 and cT.dtype == dtype
    assert torch.isfinite(out).all() and torch.isfinite(hT).all()
    errs = {"out": rel_l2(out, out64), "final state": rel_l2(hT, h64), "conv state": rel_l2(cT, c64)}
    errs.update({f"d{k}": rel_l2(v, g64[k]) for k, v in grads.items()})
    if seed is None:
        print(mode, " ".join(f"{k}={v:.1e}" for k, v in errs.items()))
    for k, v in grads.items():
        assert torch.isfinite(v).all(), f"d{k} has non-finite elements"
    return errs


@requires_cuda
@requires_extension
@pytest.mark.parametrize("impl", CUDA_IMPLS)
def test_weight_gradients_with_tokens_one_past_a_multiple_of_64(impl, poisoned_outputs):
    """batch * L = 8193 with x_proj's (80, 1536) weight: cuBLAS 13.0's split-K kernels on the H100 drop the
    last token from such a weight gradient (selscan_fused/_linear.py); the block's products must not."""
    test_cuda_values_and_gradients_against_float64(impl, "bfloat16", (1, 8193, 768, 16, 4, False, False, 2),
                                                   poisoned_outputs)


@requires_transformers
@requires_cuda
@requires_extension
@pytest.mark.parametrize("impl", CUDA_IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_against_hugging_face_on_the_gpu(dtype, impl):
    """Each CUDA path and transformers' MambaMixer (its PyTorch forward; float32, same weights)."""
    fresh_seed()
    block = cuda_block(128, 16, 4, False, impl)
    rblock = rounded(block, dtype)
    mixer = hf_mixer(rblock)
    x = torch.randn(2, 257, 128, device="cuda").to(dtype)
    with matmul_precision("float32-highest"):
        out = rblock(x.clone().requires_grad_(True))
        out_hf = mixer(x.float().requires_grad_(True))
    dy = torch.randn_like(out_hf)
    (out.float() * dy).sum().backward()
    (out_hf * dy).sum().backward()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    e = rel_l2(out, out_hf)
    print(f"{dtype}: out rel err {e:.2e}")
    assert e < tol
    hf = dict(mixer.named_parameters())
    for name, p in rblock.named_parameters():
        e = rel_l2(p.grad, hf[name].grad)
        print(f"  d{name} rel err {e:.2e}")
        assert e < (1e-4 if dtype == torch.float32 else 1e-2), name


@requires_cuda
@requires_extension
@pytest.mark.parametrize("impl", CUDA_IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_in_pieces_equals_one_call(impl, dtype):
    fresh_seed()
    block = rounded(cuda_block(64, 16, 4, False, impl), dtype)
    x = torch.randn(2, 1000, 64, device="cuda").to(dtype)
    with torch.no_grad():
        out, h, c = block(x, return_final_state=True)
        o1, h1, c1 = block(x[:, :2], return_final_state=True)
        o2, h2, c2 = block(x[:, 2:515], h0=h1, conv_state=c1, return_final_state=True)
        o3, h3, c3 = block(x[:, 515:], h0=h2, conv_state=c2, return_final_state=True)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_l2(torch.cat([o1, o2, o3], 1), out) < tol
    assert rel_l2(h3, h) < 1e-5
    assert torch.equal(c3, c)


@requires_cuda
@requires_extension
@pytest.mark.parametrize("impl", CUDA_IMPLS)
def test_cuda_backward_is_deterministic(impl):
    fresh_seed()
    block = cuda_block(128, 16, 4, False, impl).to(torch.bfloat16)
    x = torch.randn(3, 1000, 128, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    grads = []
    for _ in range(2):
        block.zero_grad(set_to_none=True)
        xx = x.clone().requires_grad_(True)
        out = block(xx)
        out.backward(dy)
        grads.append([xx.grad.clone()] + [p.grad.clone() for p in block.parameters()])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


@requires_cuda
@requires_extension
def test_unfused_block_ops_opcheck():
    fresh_seed()
    batch, L, di, N = 2, 70, 64, 16
    f = dict(device="cuda", dtype=torch.bfloat16)
    delta = torch.randn(batch, L, di, **f)
    xdbl = torch.randn(batch, L, 4 + 2 * N, **f)
    u = torch.randn(batch, L, di, **f)
    xz = torch.randn(batch, L, 2 * di, **f)
    A_log = torch.randn(di, N, device="cuda")
    b = torch.randn(di, device="cuda")
    D = torch.randn(di, device="cuda")
    h0 = torch.randn(batch, di, N, device="cuda")
    args = (delta, xdbl[..., 4:], u, xz[..., di:], A_log, b, D, h0, True, True, 0)
    torch.library.opcheck(torch.ops.selscan_fused.gated_scan_fwd, args,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
    _, _, ckpt = torch.ops.selscan_fused.gated_scan_fwd(*args)
    dy = torch.randn(batch, L, di, **f)
    for gate_z in (None, xz[..., di:]):
        torch.library.opcheck(torch.ops.selscan_fused.scan_bwd,
                              (delta, xdbl[..., 4:], u, A_log, b, D, h0, dy, None, ckpt, 0), dict(gate_z=gate_z))


@requires_cuda
@requires_extension
@pytest.mark.parametrize("impl", CUDA_IMPLS)
def test_cuda_compiles_and_captures_a_training_step(impl):
    """torch.compile(fullgraph=True) of a training step and CUDA-graph replay of a forward equal eager."""
    fresh_seed()
    block = cuda_block(64, 16, 4, False, impl)
    x = torch.randn(2, 200, 64, device="cuda")

    def loss_fn(xx):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = block(xx)
        return out.float().square().mean()

    # The forward and the loss as one graph (fullgraph), the backward through the compiled graph's own.
    eager = loss_fn(x)
    eager.backward()
    g_eager = [p.grad.clone() for p in block.parameters()]
    block.zero_grad(set_to_none=True)
    compiled = torch.compile(loss_fn, fullgraph=True, dynamic=False)(x)
    compiled.backward()
    g_comp = [p.grad.clone() for p in block.parameters()]
    assert rel_l2(compiled, eager) < 1e-2
    for a, b in zip(g_comp, g_eager):
        assert rel_l2(a, b) < 2e-2
    # CUDA graph of the no-grad forward, replayed on new input.
    static_x = torch.randn(2, 200, 64, device="cuda")
    with torch.no_grad():
        block(static_x)  # warm-up (plans, allocator)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            block(static_x)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            static_out = block(static_x)
        new_x = torch.randn_like(static_x)
        static_x.copy_(new_x)
        g.replay()
        torch.testing.assert_close(static_out, block(new_x), rtol=0, atol=0)


@requires_cuda
@requires_extension
def test_unfused_block_memory_has_no_state_sized_tensor():
    """No (batch, L, d_inner, N) tensor: the peak of a no-grad forward stays within a few (batch, L,
    2 d_inner) activations."""
    fresh_seed()
    block = cuda_block(256, 16, 4, False, "unfused").to(torch.bfloat16)
    x = torch.randn(4, 4096, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        block(x)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        block(x)
        peak = torch.cuda.max_memory_allocated() - base
    state_sized = 4 * 4096 * 512 * 16 * 2
    act = 4 * 4096 * 1024 * 2  # one (batch, L, 2 d_inner) bf16 tensor
    print(f"peak extra {peak / 2**20:.1f} MiB, one in_proj output {act / 2**20:.1f} MiB")
    assert peak < 4 * act < state_sized


@requires_cuda
@requires_extension
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch,L,d,N,l_segments", [(1, 1, 8, 16, 0), (2, 7, 40, 8, 0), (3, 1000, 96, 16, 0),
                                                     (1, 4097, 64, 32, 0), (2, 777, 64, 64, 0), (1, 3000, 64, 16, 5)])
def test_backward_scan_with_the_gate_against_float64(dtype, batch, L, d, N, l_segments, poisoned_outputs):
    """The backward scan kernel's gate policy (scan_bwd with gate_z, z the strided right half of in_proj's
    output as the block passes it): dy is the gradient of y * silu(z); the kernel recomputes y before the
    gate from the checkpoints (the forward keeps none) and returns the gate's gradient beside the scan's.
    Every gradient against float64 autograd of the same gated scan; N 8-64, L across chunks and sub-chunks,
    a forced L split; every element written (poisoned outputs)."""
    from selscan_fused.reference import scan_ref
    fresh_seed()
    f = dict(device="cuda", dtype=dtype)
    delta = (torch.randn(batch, L, d, device="cuda") * 0.5 - 1).to(dtype)
    bc = torch.randn(batch, L, 2 * N, **f)
    u = torch.randn(batch, L, d, **f)
    xz = (torch.randn(batch, L, 2 * d, device="cuda") * 2).to(dtype)
    z = xz[..., d:]
    A_log = torch.randn(d, N, device="cuda") * 0.5
    b = torch.randn(d, device="cuda") * 0.5
    D = torch.randn(d, device="cuda")
    h0 = torch.randn(batch, d, N, device="cuda")
    dy = torch.randn(batch, L, d, **f)
    dhT = torch.randn(batch, d, N, device="cuda")
    _, _, ckpt = torch.ops.selscan_fused.gated_scan_fwd(delta, bc, u, z, A_log, b, D, h0, True, True, l_segments)
    dP, du, dA, db, dD, dh0, dz = torch.ops.selscan_fused.scan_bwd(delta, bc, u, A_log, b, D, h0, dy, dhT, ckpt,
                                                                   l_segments, gate_z=z)
    leaves = [t.detach().double().requires_grad_(True) for t in (delta, bc, u, z, A_log, b, D, h0)]
    d64, bc64, u64, z64, A64, b64, D64, h064 = leaves
    y64, h64 = scan_ref(u64, torch.nn.functional.softplus(d64 + b64), A64, bc64[..., :N], bc64[..., N:], D64, h064)
    ((y64 * torch.nn.functional.silu(z64) * dy.double()).sum() + (h64 * dhT.double()).sum()).backward()
    tol = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}[dtype]
    got = dict(d_delta=dP[..., :d], d_bc=dP[..., d:], du=du, dz=dz, dA_log=dA, db=db, dD=dD, dh0=dh0)
    for (name, g), leaf in zip(got.items(), leaves):
        assert g.shape == leaf.shape, name
        assert torch.isfinite(g).all(), name
        assert rel_l2(g, leaf.grad) < tol, (name, rel_l2(g, leaf.grad))
    # without the gate the same call returns no gate gradient
    assert torch.ops.selscan_fused.scan_bwd(delta, bc, u, A_log, b, D, h0, dy, dhT, ckpt, l_segments)[6].numel() == 0
    with pytest.raises(RuntimeError, match="gate_z"):
        torch.ops.selscan_fused.scan_bwd(delta, bc, u, A_log, b, D, h0, dy, dhT, ckpt, l_segments, gate_z=z[:, :, 1:])


@requires_cuda
@requires_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_block_equals_unfused_and_writes_no_conv_output_or_delta(dtype):
    """The fused block against the unfused one on the same weights (both round the products alike but
    delta: the fused kernel keeps dt_proj's product in float32), the auto rule unchanged, and the fused
    forward's peak memory at least two (batch, L, d_inner) tensors (the conv's output u and delta) below
    the unfused one's."""
    fresh_seed()
    base = cuda_block(256, 16, 4, False, "unfused").to(dtype)
    x = torch.randn(4, 4096, 256, device="cuda", dtype=dtype)
    assert selscan_fused.resolve_block_impl("auto", x, base.d_inner, 16, 4) == "unfused"
    peaks, outs = {}, {}
    with torch.no_grad():
        for impl in ("unfused", "fused"):
            base.impl = impl
            base(x)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            outs[impl] = base(x)
            peaks[impl] = torch.cuda.max_memory_allocated() - before
    act_bytes = 4 * 4096 * base.d_inner * 2  # one (batch, L, d_inner) tensor
    print(f"peak extra MiB: unfused {peaks['unfused'] / 2**20:.1f}, fused {peaks['fused'] / 2**20:.1f}; "
          f"(batch, L, d_inner) {act_bytes / 2**20:.1f}; fused vs unfused rel {rel_l2(outs['fused'], outs['unfused']):.2e}")
    assert peaks["fused"] <= peaks["unfused"] - 1.9 * act_bytes
    assert rel_l2(outs["fused"], outs["unfused"]) < 1e-2


def fused_block_case(batch, L, di, N, R, W, dtype, with_states=True):
    """Random inputs of torch.ops.selscan_fused.fused_block_fwd (xz, conv weight/bias/state, x_proj's and
    dt_proj's weights, A_log, dt bias, D, h0)."""
    f = dict(device="cuda", dtype=dtype)
    xz = torch.randn(batch, L, 2 * di, **f)
    cw = torch.randn(di, W, device="cuda") * 0.5
    cb = torch.randn(di, device="cuda") * 0.1
    cs = torch.randn(batch, di, W - 1, **f).float() if with_states else None
    wx = (torch.randn(R + 2 * N, di, device="cuda") * di ** -0.5).to(dtype)
    dt_w = (torch.randn(di, R, device="cuda") * 0.3).to(dtype)
    A_log = torch.randn(di, N, device="cuda")
    b = torch.randn(di, device="cuda") - 3
    D = torch.randn(di, device="cuda")
    h0 = torch.randn(batch, di, N, device="cuda") if with_states else None
    return xz, cw, cb, cs, wx, dt_w, A_log, b, D, h0


@requires_cuda
@requires_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("batch,L,di,N,R,W", [(1, 1, 64, 16, 4, 4), (3, 7, 128, 8, 3, 2), (2, 1000, 192, 16, 12, 3),
                                               (1, 4097, 64, 16, 160, 4), (2, 65, 64, 64, 200, 4)])
def test_fused_block_xproj_kernel_against_float64(dtype, batch, L, di, N, R, W, poisoned_outputs):
    """The fused block's first kernel (block_xproj.cu: the conv + SiLU per token tile in shared memory,
    then x_proj): xdbl against float64 products of the conv kernel's u (which the kernel's u equals
    bitwise), every element within the dtype's rounding plus float32 accumulation; R + 2N over both
    fragment layouts (<= 192 and up to 384), conv_state and zeros, L across token tiles."""
    fresh_seed()
    for with_states in (True, False):
        xz, cw, cb, cs, wx, dt_w, A_log, b, D, h0 = fused_block_case(batch, L, di, N, R, W, dtype, with_states)
        y, hT, ckpt, xdbl = torch.ops.selscan_fused.fused_block_fwd(
            xz, cw, cb, cs, wx, None, dt_w, A_log, b, D, h0, True, False, 0)
        u = torch.ops.selscan_fused.causal_conv1d_fwd(xz[..., :di], cw, cb, cs, True, False)[0]
        want = u.double() @ wx.double().T
        scale = u.double().abs() @ wx.double().abs().T
        eps = {torch.float32: 2 ** -20, torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11}[dtype]
        assert xdbl.shape == (batch, L, R + 2 * N) and xdbl.dtype == dtype
        assert torch.isfinite(xdbl).all()
        err = (xdbl.double() - want).abs()
        assert (err <= eps * want.abs() + 1e-5 * scale + 1e-30).all(), (err / (want.abs() + scale)).max().item()
        assert torch.isfinite(y).all() and torch.isfinite(hT).all()


@requires_cuda
@requires_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("batch,L,di,W,l_segments", [(1, 1, 64, 4, 0), (3, 7, 128, 2, 0), (2, 1000, 192, 3, 0),
                                                      (1, 4097, 128, 4, 0), (1, 4097, 64, 4, 8), (2, 300, 64, 4, 3)])
def test_fused_block_conv_in_kernel_equals_conv_kernel(dtype, batch, L, di, W, l_segments, poisoned_outputs):
    """The fused kernel's in-kernel conv (u made in shared memory from xz; the W - 1 inputs before a
    tile from the previous tile, from xz at an L segment's start, from conv_state before token 0): y and
    the final state against a float64 scan of the conv kernel's u (bitwise the in-kernel one) with the
    kernel's own xdbl, forced L splits included."""
    fresh_seed()
    N, R = 16, 4
    xz, cw, cb, cs, wx, dt_w, A_log, b, D, h0 = fused_block_case(batch, L, di, N, R, W, dtype)
    y, hT, _, xdbl = torch.ops.selscan_fused.fused_block_fwd(
        xz, cw, cb, cs, wx, None, dt_w, A_log, b, D, h0, True, False, l_segments)
    # float64 from the conv kernel's u (bitwise the in-kernel one) and the kernel's own xdbl
    from selscan_fused.reference import scan_ref
    u = torch.ops.selscan_fused.causal_conv1d_fwd(xz[..., :di], cw, cb, cs, True, False)[0]
    xd = xdbl.double()
    delta = torch.nn.functional.softplus(xd[..., :R] @ dt_w.double().T + b.double())
    y64, h64 = scan_ref(u.double(), delta, A_log.double(), xd[..., R:R + N], xd[..., R + N:], D.double(), h0.double())
    y64 = y64 * torch.nn.functional.silu(xz[..., di:].double())
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.isfinite(y).all()
    assert rel_l2(y, y64) < tol, rel_l2(y, y64)
    assert rel_l2(hT, h64) < tol, rel_l2(hT, h64)


@requires_cuda
@requires_hopper
def test_fused_block_envelope_errors_name_the_argument():
    """x_proj's outputs beyond the first kernel's 384: an error naming the argument and the path to use;
    the unfused path runs the same block. (A packed call's: tests/test_varlen.py,
    test_fused_packed_op_says_how_it_is_built.)"""
    fresh_seed()
    block = cuda_block(64, 64, 4, False, "fused", dt_rank=300).to(torch.bfloat16)
    x = torch.randn(1, 9, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"dt_rank \+ 2 d_state up to 384.*300 \+ 2 \* 64 = 428.*impl='unfused'"):
        block(x)
    block.impl = "unfused"
    assert torch.isfinite(block(x)).all()


@requires_hopper
def test_fused_block_op_opcheck():
    fresh_seed()
    batch, L, di, N, R, W = 2, 70, 64, 16, 3, 4  # R + 2N = 35: the padded product operand
    xz, cw, cb, cs, wx, dt_w, A_log, b, D, h0 = fused_block_case(batch, L, di, N, R, W, torch.bfloat16)
    for args in ((xz, cw, cb, cs, wx, None, dt_w, A_log, b, D, h0, True, True, 0),
                 (xz, cw, None, None, None, torch.randn(batch, L, R + 2 * N, device="cuda", dtype=torch.bfloat16),
                  dt_w, A_log, b, D, None, False, True, 0)):
        torch.library.opcheck(torch.ops.selscan_fused.fused_block_fwd, args,
                              test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


@requires_hopper
def test_fused_block_training_forward_keeps_no_inner_sized_tensor():
    """What the fused block's op keeps for its backward (saved_tensors_hooks see every tensor autograd
    saves): in_proj's output, [dt_low | B | C], the weights and the state checkpoints; no (batch, L,
    d_inner) tensor (u, delta or y before the gate: the backward scan recomputes y before the gate)."""
    fresh_seed()
    batch, L, di, N, R, W = 2, 300, 128, 16, 8, 4
    xz, cw, cb, cs, wx, dt_w, A_log, b, D, h0 = fused_block_case(batch, L, di, N, R, W, torch.bfloat16)
    leaves = [t.requires_grad_(True) for t in (xz, cw, wx, dt_w, A_log, b, D)]
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y, _, _, _ = torch.ops.selscan_fused.fused_block_fwd(xz, cw, cb, cs, wx, None, dt_w, A_log, b, D, h0, True,
                                                             True, 0)
    assert (batch, L, 2 * di) in saved and (batch, L, R + 2 * N) in saved, saved
    assert (batch, L, di) not in saved, saved
    y.float().square().sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in leaves)
