"""The block's decode step on its two paths (selscan_fused.decode.mamba_block_step): impl='kernel' (the
decode kernels of csrc/decode/) against the float64 evaluation of the step and against impl='torch',
several steps in a row carrying both states, odd sizes (channels not a multiple of the kernel's tiles,
odd d_inner, d_state 4-64, dt_rank 3-256, d_conv 2-4, batch 1-6), every element of y and of both states
checked, determinism (also across batch sizes), CUDA-graph replay, the model's step and the errors."""
import math

import pytest
import torch

from selscan_fused.block_reference import mamba_step_ref
from selscan_fused.decode import STEP_IMPLS, mamba_block_step, resolve_step_impl
from selscan_fused.generation import CUDAGraphStep
from selscan_fused.model import MambaLM, MambaLMConfig
from conftest import fresh_seed, matmul_precision, rel_l2, requires_cuda, requires_extension, requires_hopper


def block_weights(d_model, d_inner, N, R, W, bias=True, conv_bias=True, dtype=torch.float64, device="cpu"):
    """The step's 11 weights (mamba_block's order), random at the scales of a trained block (never zeros)."""
    g = lambda *s, scale=1.0: (torch.randn(*s, dtype=torch.float64) * scale).to(device)  # noqa: E731
    w = dict(
        in_proj_weight=g(2 * d_inner, d_model, scale=d_model ** -0.5),
        in_proj_bias=g(2 * d_inner, scale=0.1) if bias else None,
        conv_weight=g(d_inner, 1, W, scale=0.5),
        conv_bias=g(d_inner, scale=0.2) if conv_bias else None,
        x_proj_weight=g(R + 2 * N, d_inner, scale=d_inner ** -0.5),
        dt_proj_weight=g(d_inner, R, scale=R ** -0.5),
        dt_proj_bias=(torch.rand(d_inner, dtype=torch.float64) * 4 - 5).to(device),  # softplus^-1 of dt ~ 1e-3..0.1
        A_log=(torch.log(torch.arange(1, N + 1, dtype=torch.float64)).repeat(d_inner, 1)
               + 0.3 * torch.randn(d_inner, N, dtype=torch.float64)).to(device),
        D=g(d_inner),
        out_proj_weight=g(d_model, d_inner, scale=d_inner ** -0.5),
        out_proj_bias=g(d_model, scale=0.1) if bias else None,
    )
    # The products' weights in the run's dtype; the small parameters stay float32 as the module keeps them.
    low = ("in_proj_weight", "in_proj_bias", "x_proj_weight", "dt_proj_weight", "out_proj_weight", "out_proj_bias")
    return {k: (None if v is None else v.to(dtype if k in low else
                                             (torch.float64 if dtype == torch.float64 else torch.float32)))
            for k, v in w.items()}


def as64(w):
    return {k: (None if v is None else v.double().cpu()) for k, v in w.items()}


def order(w):
    return [w[k] for k in ("in_proj_weight", "in_proj_bias", "conv_weight", "conv_bias", "x_proj_weight",
                           "dt_proj_weight", "dt_proj_bias", "A_log", "D", "out_proj_weight", "out_proj_bias")]


# ---- CPU: the path's choice and its errors ----

def test_step_impls_and_auto():
    assert STEP_IMPLS == ("auto", "kernel", "torch")
    assert resolve_step_impl("auto") == "torch" and resolve_step_impl("kernel") == "kernel"
    # 'auto' takes the kernel only where decode_kernel_reason finds nothing: never on the CPU
    x = torch.randn(2, 32)
    assert resolve_step_impl("auto", x, 8, 2, 4, (torch.zeros(2, 64, 3),)) == "torch"
    assert resolve_step_impl("torch", x, 8, 2, 4) == "torch"
    with pytest.raises(ValueError, match="impl must be one of"):
        resolve_step_impl("fused")


def test_kernel_refuses_the_cpu_naming_the_other_path():
    fresh_seed()
    w = block_weights(32, 64, 8, 2, 4, dtype=torch.float32)
    x = torch.randn(2, 32)
    conv, ssm = torch.randn(2, 64, 3), torch.randn(2, 64, 8)
    with pytest.raises(ValueError, match=r"impl='kernel'.*CUDA.*use impl='torch'"):
        mamba_block_step(x, conv, ssm, *order(w), impl="kernel")
    with pytest.raises(ValueError, match="impl must be one of"):
        mamba_block_step(x, conv, ssm, *order(w), impl="cuda")
    # the torch path (and 'auto') still runs, and equals the float64 reference
    out = mamba_block_step(x.double(), conv.double(), ssm.double(), *order(as64(w)), impl="auto")
    ref = mamba_step_ref(x.double(), conv.double(), ssm.double(), *order(as64(w)))[0]
    assert rel_l2(out, ref) < 1e-12


def test_model_step_takes_decode_impl():
    fresh_seed()
    cfg = MambaLMConfig(d_model=32, n_layer=2, vocab_size=50, ssm_cfg={"d_state": 8})
    m = MambaLM(cfg, impl="reference").double().eval()
    assert m.decode_impl == "auto"
    ids = torch.randint(0, 50, (2, 5))
    c1, c2 = m.allocate_cache(2), m.allocate_cache(2)
    m.prefill(ids, c1)
    m.prefill(ids, c2)
    a = m.step(ids[:, 0], c1)
    b = m.step(ids[:, 0], c2, decode_impl="torch")
    with torch.no_grad():  # the sixth token's logits by the forward over all six
        full = m(torch.cat([ids, ids[:, :1]], 1))[:, -1]
    assert rel_l2(a, full) < 1e-12 and rel_l2(b, full) < 1e-12
    with pytest.raises(ValueError, match="impl must be one of"):
        m.step(ids[:, 0], c1, decode_impl="bogus")
    with pytest.raises(ValueError, match="impl='kernel'"):
        m.step(ids[:, 0], c1, decode_impl="kernel")


# ---- GPU: the kernel ----

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}

SHAPES = [  # (batch, d_model, d_inner, N, R, W, bias, conv_bias)
    (1, 128, 256, 16, 8, 4, False, True),      # one full tile, batch 1
    (3, 48, 96, 8, 3, 2, True, False),        # a partial tile only, odd rank, no conv bias
    (2, 300, 600, 64, 160, 3, False, True),   # two full tiles and a partial one, N 64, R 160
    (5, 768, 1536, 16, 48, 4, False, True),   # mamba-130m's block
    (1, 40, 1000, 32, 256, 4, True, True),    # the largest rank the kernel takes
    (2, 64, 333, 10, 5, 3, True, True),       # odd d_inner (x_proj's and dt_proj's rows read an element a
                                              # lane), N 10 (not a multiple of 4: states read one by one)
    (6, 32, 72, 4, 16, 4, False, True),       # N 4: one lane a channel; batch 6, a partial group of 4
]


def _run_steps(x_seq, w, conv, ssm, impl):
    outs = []
    for t in range(x_seq.shape[1]):
        outs.append(mamba_block_step(x_seq[:, t], conv, ssm, *order(w), impl=impl))
    return torch.stack(outs, 1)


@requires_cuda
@requires_extension
@pytest.mark.parametrize("small", ["float32", "dtype"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}_D{}_N{}_R{}_W{}".format(s[0], s[2], s[3], s[4], s[5]))
def test_kernel_steps_against_float64_and_the_torch_path(dtype, shape, small):
    """small: the conv's weight and bias, the delta bias, A_log and D in float32 (the module's), or in the
    run's dtype (a model cast as a whole: the kernel reads them as they are)."""
    batch, d_model, d_inner, N, R, W, bias, conv_bias = shape
    if small == "dtype" and dtype == torch.float32:
        pytest.skip("float32 small parameters are the first variant")
    fresh_seed()
    w = block_weights(d_model, d_inner, N, R, W, bias, conv_bias, dtype=dtype, device="cuda")
    if small == "dtype":
        for k in ("conv_weight", "conv_bias", "dt_proj_bias", "A_log", "D"):
            if w[k] is not None:
                w[k] = w[k].to(dtype)
    steps = 6
    x = torch.randn(batch, steps, d_model, device="cuda").to(dtype)
    conv0 = torch.randn(batch, d_inner, W - 1, device="cuda").to(dtype)
    ssm0 = torch.randn(batch, d_inner, N, device="cuda") * 0.5
    with matmul_precision("float32-highest"):
        ck, sk = conv0.clone(), ssm0.clone()
        out_k = _run_steps(x, w, ck, sk, "kernel")
        ct, st = conv0.clone(), ssm0.clone()
        out_t = _run_steps(x, w, ct, st, "torch")
    # float64: the same (rounded) weights and inputs
    c64, s64 = conv0.double().cpu(), ssm0.double().cpu()
    w64 = as64(w)
    ref = []
    for t in range(steps):
        o, c64, s64 = mamba_step_ref(x[:, t].double().cpu(), c64, s64, *order(w64))
        ref.append(o)
    ref = torch.stack(ref, 1)
    assert out_k.dtype == dtype and out_k.shape == (batch, steps, d_model)
    for name, got in (("out", out_k), ("conv_state", ck), ("ssm_state", sk)):
        assert torch.isfinite(got).all(), name
    e_out, e_ssm = rel_l2(out_k.cpu(), ref), rel_l2(sk.cpu(), s64)
    e_conv = rel_l2(ck.cpu(), c64)
    e_torch = rel_l2(out_k, out_t)
    print(f"{dtype} {shape}: kernel vs float64 out {e_out:.2e} ssm {e_ssm:.2e} conv {e_conv:.2e}; "
          f"vs torch path {e_torch:.2e}")
    tol = TOL[dtype]
    assert e_out < tol and e_ssm < tol
    # the conv state holds inputs (xi rounded to the dtype): exact on the rounded values up to in_proj's rounding
    assert e_conv < (1e-6 if dtype == torch.float32 else 1e-2)
    # both CUDA paths round at the same points: they differ by float32 summation order (and the roundings
    # it flips)
    assert e_torch < (1e-5 if dtype == torch.float32 else tol / 2)
    # elementwise too (a single wrong channel hides in a norm): every sequence, token and channel
    scale = ref.abs().max().item()
    assert (out_k.double().cpu() - ref).abs().max().item() < 10 * tol * scale
    assert (sk.double().cpu() - s64).abs().max().item() < 10 * tol * s64.abs().max().item()
    # and against the torch path at the first step, where both start from the same states and round at
    # the same points: a few units of the dtype's last place of the output's scale, every element
    ulp = {torch.float32: 1e-6, torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11}[dtype]
    d1 = (out_k[:, 0].double() - out_t[:, 0].double()).abs().max().item()
    assert d1 <= 8 * ulp * out_t[:, 0].double().abs().max().item(), d1


@requires_cuda
@requires_extension
def test_kernel_is_deterministic_and_writes_every_element_of_y():
    fresh_seed()
    batch, d_model, d_inner, N, R, W = 4, 256, 520, 16, 16, 4
    dtype = torch.bfloat16
    w = block_weights(d_model, d_inner, N, R, W, dtype=dtype, device="cuda")
    xz = torch.randn(batch, 2 * d_inner, device="cuda").to(dtype)
    conv0 = torch.randn(batch, d_inner, W - 1, device="cuda").to(dtype)
    ssm0 = torch.randn(batch, d_inner, N, device="cuda")
    args = (w["conv_weight"].reshape(d_inner, W).contiguous(), w["conv_bias"], w["x_proj_weight"],
            w["dt_proj_weight"], w["dt_proj_bias"], w["A_log"], w["D"])
    results = []
    for _ in range(3):
        # the allocator's cached blocks hold NaN when the op allocates y and its workspace
        torch.full((batch * 8 * d_inner,), float("nan"), device="cuda")
        c, s = conv0.clone(), ssm0.clone()
        y = torch.ops.selscan_fused.decode_mid(xz, c, s, *args)
        results.append((y, c, s))
    for y, c, s in results[1:]:
        assert torch.equal(y, results[0][0]) and torch.equal(c, results[0][1]) and torch.equal(s, results[0][2])
    y, c, s = results[0]
    assert y.shape == (batch, d_inner) and y.dtype == dtype and torch.isfinite(y).all()
    # y against float64, elementwise
    f = lambda t: t.double().cpu()  # noqa: E731
    xi, z = f(xz[:, :d_inner]), f(xz[:, d_inner:])
    win = torch.cat([f(conv0), xi[..., None]], -1)
    u = torch.nn.functional.silu((win * f(args[0])).sum(-1) + f(args[1]))
    dbc = u @ f(args[2]).T
    delta = torch.nn.functional.softplus(dbc[:, :R] @ f(args[3]).T + f(args[4]))
    A = -torch.exp(f(args[5]))
    h = f(ssm0) * torch.exp(delta[..., None] * A) + (delta * u)[..., None] * dbc[:, None, R:R + N]
    y64 = ((h * dbc[:, None, R + N:]).sum(-1) + f(args[6]) * u) * torch.nn.functional.silu(z)
    assert torch.allclose(f(y), y64, rtol=3e-2, atol=3e-2 * y64.abs().max().item())
    assert torch.allclose(f(s), h, rtol=3e-2, atol=3e-2 * h.abs().max().item())
    assert torch.equal(c, win[..., 1:].to(dtype).cuda())


@requires_cuda
@requires_extension
@pytest.mark.parametrize("d_inner,N,R", [(1536, 16, 48), (600, 64, 160), (333, 10, 5)])
def test_kernel_sequences_do_not_depend_on_the_batch(d_inner, N, R):
    """A sequence's y and states are bitwise the same stepped alone, in a batch of 3 or in one of 130
    (the kernels' launch shapes differ: x_proj's rows split over more CTAs at small batches, more
    channels a CTA at large ones; the summation orders do not)."""
    fresh_seed()
    W, dtype, big = 4, torch.bfloat16, 130
    w = block_weights(64, d_inner, N, R, W, dtype=dtype, device="cuda")
    xz = torch.randn(big, 2 * d_inner, device="cuda").to(dtype)
    conv0 = torch.randn(big, d_inner, W - 1, device="cuda").to(dtype)
    ssm0 = torch.randn(big, d_inner, N, device="cuda")
    args = (w["conv_weight"].reshape(d_inner, W).contiguous(), w["conv_bias"], w["x_proj_weight"],
            w["dt_proj_weight"], w["dt_proj_bias"], w["A_log"], w["D"])
    out = {}
    for rows in (slice(0, big), slice(5, 8), slice(6, 7)):
        c, s = conv0[rows].clone(), ssm0[rows].clone()
        y = torch.ops.selscan_fused.decode_mid(xz[rows].contiguous(), c, s, *args)
        out[(rows.start, rows.stop)] = (y, c, s)
    ya, ca, sa = out[(0, big)]
    for (lo, hi), (y, c, s) in out.items():
        assert torch.equal(y, ya[lo:hi]) and torch.equal(c, ca[lo:hi]) and torch.equal(s, sa[lo:hi]), (lo, hi)


@requires_cuda
@requires_extension
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch,d_inner,N,R", [(1, 4096, 16, 128), (130, 4096, 16, 128), (37, 1536, 16, 48),
                                               (3, 600, 64, 160), (6, 333, 10, 5), (2, 72, 4, 16), (9, 96, 32, 3)])
def test_one_launch_equals_two_launches_bitwise(dtype, batch, d_inner, N, R):
    """The middle in one cooperative launch (the default) and in two kernels: the same items, so y and
    both states bitwise equal, over several steps (each step's states carried), at the 1.4B block's
    sizes (batch 1: fewer items than CTAs; 130: more, each CTA looping over several) and odd ones; every
    element of y written (the op's buffers come from a cache poisoned with NaN)."""
    fresh_seed()
    W = 4 if N != 32 else 2
    w = block_weights(64, d_inner, N, R, W, dtype=dtype, device="cuda")
    args = (w["conv_weight"].reshape(d_inner, W).contiguous(), w["conv_bias"], w["x_proj_weight"],
            w["dt_proj_weight"], w["dt_proj_bias"], w["A_log"], w["D"])
    conv0 = torch.randn(batch, d_inner, W - 1, device="cuda").to(dtype)
    ssm0 = torch.randn(batch, d_inner, N, device="cuda")
    states = {n: (conv0.clone(), ssm0.clone()) for n in (1, 2)}
    for step in range(3):
        xz = torch.randn(batch, 2 * d_inner, device="cuda").to(dtype)
        ys = {}
        for n in (1, 2):
            torch.full((4 * batch * 8 * d_inner,), float("nan"), device="cuda")
            ys[n] = torch.ops.selscan_fused.decode_mid(xz, *states[n], *args, launches=n)
        assert torch.isfinite(ys[1]).all(), step
        assert torch.equal(ys[1], ys[2]), step
        assert torch.equal(states[1][0], states[2][0]) and torch.equal(states[1][1], states[2][1]), step
    # the states moved (the op ran); the float64 checks above run the default, the one launch
    assert not torch.equal(states[1][1], ssm0)


@requires_cuda
@requires_extension
def test_auto_takes_the_kernel_where_it_runs():
    """'auto' is the kernel on CUDA in its envelope with contiguous states (bitwise what impl='kernel'
    gives), the torch path otherwise (float64, a non-contiguous state)."""
    fresh_seed()
    batch, d_model, d_inner, N, R, W = 3, 128, 256, 16, 8, 4
    dtype = torch.bfloat16
    w = block_weights(d_model, d_inner, N, R, W, dtype=dtype, device="cuda")
    x = torch.randn(batch, d_model, device="cuda").to(dtype)
    conv = torch.randn(batch, d_inner, W - 1, device="cuda").to(dtype)
    ssm = torch.randn(batch, d_inner, N, device="cuda")
    assert resolve_step_impl("auto", x, N, R, W, (conv, ssm)) == "kernel"
    assert resolve_step_impl("auto", x.double(), N, R, W, (conv, ssm)) == "torch"
    strided = torch.randn(batch, W - 1, d_inner, device="cuda").to(dtype).transpose(1, 2)
    assert resolve_step_impl("auto", x, N, R, W, (strided, ssm)) == "torch"
    c1, s1, c2, s2 = conv.clone(), ssm.clone(), conv.clone(), ssm.clone()
    a = mamba_block_step(x, c1, s1, *order(w), impl="auto")
    b = mamba_block_step(x, c2, s2, *order(w), impl="kernel")
    assert torch.equal(a, b) and torch.equal(c1, c2) and torch.equal(s1, s2)
    # a non-contiguous state under 'auto': the torch path, which agrees with the kernel's step
    c3 = conv.clone().transpose(1, 2).contiguous().transpose(1, 2)
    s3 = ssm.clone()
    out = mamba_block_step(x, c3, s3, *order(w), impl="auto")
    assert rel_l2(out, a) < 2e-2 and rel_l2(s3, s1) < 2e-2 and torch.equal(c3, c1)


@requires_cuda
@requires_extension
def test_op_errors_name_the_argument():
    w = block_weights(64, 128, 16, 4, 4, dtype=torch.float32, device="cuda")
    xz = torch.randn(2, 256, device="cuda")
    conv, ssm = torch.randn(2, 128, 3, device="cuda"), torch.randn(2, 128, 16, device="cuda")
    args = [w["conv_weight"].reshape(128, 4).contiguous(), w["conv_bias"], w["x_proj_weight"],
            w["dt_proj_weight"], w["dt_proj_bias"], w["A_log"], w["D"]]
    op = torch.ops.selscan_fused.decode_mid
    with pytest.raises(RuntimeError, match="ssm_state"):
        op(xz, conv, ssm.double(), *args)
    with pytest.raises(RuntimeError, match="conv_state"):
        op(xz, conv[..., :2].contiguous(), ssm, *args)
    with pytest.raises(RuntimeError, match="xz"):
        op(xz[:, :200], conv, ssm, *args)
    with pytest.raises(RuntimeError, match="x_proj_weight"):
        op(xz, conv, ssm, args[0], args[1], args[2][:-1], *args[3:])
    with pytest.raises(RuntimeError, match="contiguous"):
        op(xz, conv.transpose(0, 1).contiguous().transpose(0, 1), ssm, *args)
    with pytest.raises(RuntimeError, match="conv_weight.*dtype"):  # the small parameters mixed
        op(xz, conv, ssm, args[0].half(), *args[1:])
    with pytest.raises(RuntimeError, match="small parameters"):
        op(xz, conv, ssm, *args[:5], args[5].double(), args[6])
    with pytest.raises(RuntimeError, match="launches"):
        op(xz, conv, ssm, *args, launches=3)
    # through the Python entry point: the kernel's envelope, naming the other path
    big = block_weights(64, 128, 80, 4, 4, dtype=torch.float32, device="cuda")
    with pytest.raises(ValueError, match=r"d_state = 80.*use impl='torch'"):
        mamba_block_step(torch.randn(2, 64, device="cuda"), conv, torch.randn(2, 128, 80, device="cuda"),
                         *order(big), impl="kernel")
    with pytest.raises(ValueError, match="contiguous"):
        mamba_block_step(torch.randn(2, 64, device="cuda"), conv, ssm.transpose(0, 1).contiguous().transpose(0, 1),
                         *order(w), impl="kernel")


def _small_gpu_lm(dtype, impl="unfused"):
    """A reference model on the CPU moved off its initialisation, and its copy on the GPU (impl, dtype)."""
    cfg = MambaLMConfig(d_model=96, n_layer=3, vocab_size=211, ssm_cfg={"d_state": 16, "d_conv": 4})
    fresh_seed()
    cpu = MambaLM(cfg, impl="reference")
    with torch.no_grad():
        for name, p in cpu.named_parameters():  # off the initialisation (its delta bias and A_log are too tame)
            p.add_(torch.randn_like(p) * (0.3 if p.dim() == 1 else 0.5 / math.sqrt(p.shape[-1])))
    gpu = MambaLM(cfg, impl=impl, device="cuda", dtype=dtype)
    gpu.load_state_dict(cpu.state_dict())
    return cpu.eval(), gpu.eval()


@requires_cuda
@requires_extension
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_model_kernel_steps_equal_the_float64_forward(dtype, tol):
    cpu, gpu = _small_gpu_lm(dtype)
    ref64 = MambaLM(cpu.config, impl="reference").double().eval()
    ref64.load_state_dict({k: v.double().cpu() for k, v in gpu.state_dict().items()})
    ids = torch.randint(0, 211, (3, 60))
    with torch.no_grad():
        full64 = ref64(ids)
    with matmul_precision("float32-highest"):
        cache = gpu.allocate_cache(3)
        steps = [gpu.prefill(ids[:, :20].cuda(), cache)]
        for t in range(20, 60):
            steps.append(gpu.step(ids[:, t].cuda(), cache, decode_impl="kernel").clone())
    e = rel_l2(torch.stack(steps, 1).float().cpu(), full64[:, 19:60])
    print(f"{dtype}: prefill + kernel steps against float64 rel err {e:.2e}")
    assert e < tol


@requires_cuda
@requires_hopper
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_fused_prefill_then_kernel_steps_equal_the_float64_forward(dtype, tol):
    """The whole decode pipeline on the fast paths: prefill through the blocks' fused path (d_inner 192,
    a multiple of its channel tile), then the decode kernels, against the float64 forward; the weights moved
    off their initialisation (where A_log's rows, D and the norms' weights are alike in every channel)."""
    cpu, gpu = _small_gpu_lm(dtype, impl="fused")
    ref64 = MambaLM(cpu.config, impl="reference").double().eval()
    ref64.load_state_dict({k: v.double().cpu() for k, v in gpu.state_dict().items()})
    ids = torch.randint(0, 211, (2, 300))
    with torch.no_grad():
        full64 = ref64(ids)
    with matmul_precision("float32-highest"):
        e_full = rel_l2(gpu(ids.cuda()).float().cpu(), full64)
        cache = gpu.allocate_cache(2)
        steps = [gpu.prefill(ids[:, :260].cuda(), cache)]
        for t in range(260, 300):
            steps.append(gpu.step(ids[:, t].cuda(), cache, decode_impl="kernel").clone())
    e = rel_l2(torch.stack(steps, 1).float().cpu(), full64[:, 259:300])
    print(f"{dtype}: fused forward {e_full:.2e}, fused prefill + kernel steps {e:.2e} against float64")
    assert e_full < tol and e < tol


@requires_cuda
@requires_extension
def test_cuda_graph_of_kernel_steps_equals_eager_bitwise():
    _, gpu = _small_gpu_lm(torch.bfloat16)
    gpu.decode_impl = "kernel"
    ids = torch.randint(0, 211, (4, 16), device="cuda")
    c1, c2 = gpu.allocate_cache(4), gpu.allocate_cache(4)
    gpu.prefill(ids, c1)
    gpu.prefill(ids, c2)
    stepper = CUDAGraphStep(gpu, c2)
    toks = torch.randint(0, 211, (50, 4), device="cuda")
    for i in range(50):
        eager = gpu.step(toks[i], c1)
        replay = stepper(toks[i])
        assert torch.equal(replay, eager), i
    for a, b in zip(c1.tensors(), c2.tensors()):
        assert torch.equal(a, b)


@requires_cuda
@requires_extension
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,dim", [(1, 64), (5, 768), (3, 1000), (2, 2560)])
def test_add_rmsnorm_kernel_equals_the_torch_add_norm(dtype, rows, dim):
    """Every residual case of Block.add_norm (none, float32, the dtype; residual_in_fp32 on and off): the
    residual bitwise, normed to within one rounding of the dtype (the sum of squares is added in another
    order), every element."""
    from selscan_fused.model import RMSNorm, _fused_add_norm_applies, add_norm
    fresh_seed()
    norm = RMSNorm(dim, device="cuda", dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(dim))
    hidden = (torch.randn(rows, dim, device="cuda") * 2).to(dtype)
    cases = [None, torch.randn(rows, dim, device="cuda") * 3, (torch.randn(rows, dim, device="cuda") * 3).to(dtype)]
    for residual in cases:
        assert _fused_add_norm_applies(norm, hidden, residual)  # fused=True below runs the kernel
        for fp32 in (True, False):
            want_n, want_r = add_norm(norm, hidden, residual, fp32, fused=False)
            torch.full((4 * rows * dim,), float("nan"), device="cuda")  # cached blocks poisoned
            got_n, got_r = add_norm(norm, hidden, residual, fp32, fused=True)
            assert got_r.dtype == want_r.dtype and got_n.dtype == want_n.dtype == dtype
            assert torch.equal(got_r, want_r), (residual is None, fp32)
            ulp = {torch.float32: 1e-6, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}[dtype]
            diff = (got_n.double() - want_n.double()).abs()
            assert (diff <= ulp * want_n.double().abs() + 1e-30).all(), diff.max().item()
    # errors name the argument
    with pytest.raises(RuntimeError, match="residual"):
        torch.ops.selscan_fused.add_rmsnorm(hidden, torch.randn(rows, dim + 1, device="cuda"), norm.weight, 1e-5, True)
    with pytest.raises(RuntimeError, match="weight"):
        torch.ops.selscan_fused.add_rmsnorm(hidden, None, norm.weight.float() if dtype != torch.float32 else
                                            norm.weight.half(), 1e-5, True)


@requires_extension
def test_fake_implementations_give_the_ops_shapes_and_dtypes():
    """The decode family's fake implementations (what torch.compile traces with), on meta
    tensors: shapes and dtypes as the CUDA ops return them."""
    meta = dict(device="meta")
    xz = torch.empty(3, 128, dtype=torch.bfloat16, **meta)
    y = torch.ops.selscan_fused.decode_mid(
        xz, torch.empty(3, 64, 3, dtype=torch.bfloat16, **meta), torch.empty(3, 64, 16, **meta),
        torch.empty(64, 4, **meta), None, torch.empty(40, 64, dtype=torch.bfloat16, **meta),
        torch.empty(64, 8, dtype=torch.bfloat16, **meta), torch.empty(64, **meta), torch.empty(64, 16, **meta),
        torch.empty(64, **meta))
    assert y.shape == (3, 64) and y.dtype == torch.bfloat16
    h = torch.empty(5, 96, dtype=torch.bfloat16, **meta)
    w = torch.empty(96, dtype=torch.bfloat16, **meta)
    for residual, fp32, want in ((None, True, torch.float32), (None, False, torch.bfloat16),
                                 (torch.empty(5, 96, **meta), False, torch.float32),
                                 (torch.empty(5, 96, dtype=torch.bfloat16, **meta), False, torch.bfloat16)):
        n, r = torch.ops.selscan_fused.add_rmsnorm(h, residual, w, 1e-5, fp32)
        assert n.shape == r.shape == (5, 96) and n.dtype == torch.bfloat16 and r.dtype == want
