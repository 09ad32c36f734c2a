"""Shared helpers: fresh random inputs, the float64 evaluation, poisoned allocations, tolerances."""
import importlib.util
import os
import sys
from contextlib import contextmanager

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

import selscan_fused  # noqa: E402
from selscan_fused.reference import selective_scan_ref  # noqa: E402

HAS_CUDA = torch.cuda.is_available()

# What a GPU test needs, as marks: pytest_runtest_setup below skips the test with the first missing
# piece, raising every skip of one cause from one line, so that `pytest -rs` (pyproject.toml) prints
# one line per cause with its count.
requires_cuda = pytest.mark.needs("cuda")
requires_extension = pytest.mark.needs("extension")
requires_hopper = pytest.mark.needs("hopper")  # an sm_90 GPU and the fused extension
requires_matplotlib = pytest.mark.needs("matplotlib")  # the optional plotting extra


def requires_gpu_memory(gib: int):
    return pytest.mark.needs(f"gpu_memory:{gib}")


def _no_gpu_reason() -> str:
    if torch.version.cuda is None:
        return (f"no GPU tests: torch {torch.__version__} is a CPU-only build (a CUDA build of torch and an "
                "NVIDIA GPU are needed)")
    return (f"no GPU tests: no CUDA GPU is visible (torch.cuda.is_available() is False; torch "
            f"{torch.__version__}, CUDA {torch.version.cuda})")


def _missing(needs: set):
    """(cause, reason) of the first piece these needs lack, or None when everything is there."""
    if "matplotlib" in needs and importlib.util.find_spec("matplotlib") is None:
        return "matplotlib", "no plot tests: matplotlib is an optional extra (pip install .[bench])"
    if needs & {"cuda", "hopper"} or any(n.startswith("gpu_memory") for n in needs):
        if not HAS_CUDA:
            return "gpu", _no_gpu_reason()
    if needs & {"extension", "hopper"} and not selscan_fused.extension_available():
        msg = selscan_fused._extension.extension_error_message("unfused").split(". Rebuild")[0]
        return "extension", f"no CUDA-path tests: {msg.removeprefix('selscan_fused: ')}"
    if "hopper" in needs:
        cap = torch.cuda.get_device_capability()
        if cap != (9, 0):
            return "sm90", (f"no impl='fused' tests: the GPU ({torch.cuda.get_device_name()}) is "
                            f"sm_{cap[0]}{cap[1]}; the fused kernel needs sm_90 (H100/H200)")
        if not selscan_fused._extension.fused_extension_available():
            msg = selscan_fused._extension.extension_error_message("fused").split(". Rebuild")[0]
            return "fused_extension", f"no impl='fused' tests: {msg.removeprefix('selscan_fused: ')}"
    for n in needs:
        if n.startswith("gpus:") and torch.cuda.device_count() < int(n.split(":")[1]):
            return "gpus", (f"no multi-GPU tests: they need {n.split(':')[1]} CUDA GPUs, "
                            f"{torch.cuda.device_count()} visible (scripts/two_gpus.py)")
        if n.startswith("gpu_memory:"):
            gib = int(n.split(":")[1])
            have = torch.cuda.get_device_properties(0).total_memory / 2**30
            if have < gib:
                return "memory", f"needs a GPU with at least {gib} GiB of memory ({have:.0f} GiB here)"
    return None


def threads_per_worker(cpus: int, workers: int) -> int:
    """torch's CPU threads for one of `workers` pytest-xdist workers on `cpus` cores: an equal share, at
    least one. (Each worker's torch would otherwise take every core: 14 workers on 16 cores ran 224
    threads, and the CPU-bound tests, the paper tasks' training runs first, slowed past a suite's limit.)"""
    return max(1, cpus // max(1, workers))


def pytest_configure(config):
    config.addinivalue_line("markers", "needs(what): skip unless the machine has it (tests/conftest.py)")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers > 1 and os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(threads_per_worker(os.cpu_count() or 1, workers))


# Test files whose GPU tests take the longest (training runs, whole models, long packed batches,
# torch.compile), collected first: pytest-xdist hands tests out in collection order, so a parallel run
# ends on short tests instead of starting its longest ones last.
SLOW_FIRST = ("test_paper_tasks.py", "test_model.py", "test_varlen.py", "test_compile.py")


def slow_first_rank(file_name: str) -> int:
    """Where a test file goes in the collection: SLOW_FIRST's files by their place there, then the rest."""
    return SLOW_FIRST.index(file_name) if file_name in SLOW_FIRST else len(SLOW_FIRST)


def pytest_collection_modifyitems(config, items):
    """The files in SLOW_FIRST go first (each file's tests in their own order). Then
    SELSCAN_TEST_SHARD=K/M keeps the collected tests whose index modulo M is K (the collection order
    is fixed, so the M shards of one tree make the whole suite once): the GPU suite in parts, each within
    a machine's per-command time limit."""
    items.sort(key=lambda item: slow_first_rank(item.path.name))  # stable
    shard = os.environ.get("SELSCAN_TEST_SHARD")
    if not shard:
        return
    try:
        k, m = (int(v) for v in shard.split("/"))
        if not 0 <= k < m:
            raise ValueError
    except ValueError:
        raise pytest.UsageError(f"SELSCAN_TEST_SHARD={shard!r}: expected K/M with 0 <= K < M") from None
    keep = [it for i, it in enumerate(items) if i % m == k]
    config.hook.pytest_deselected(items=[it for i, it in enumerate(items) if i % m != k])
    items[:] = keep


def pytest_runtest_setup(item):
    needs = {m.args[0] for m in item.iter_markers(name="needs")}
    if not needs:
        return
    missing = _missing(needs)
    if missing is None:
        return
    cause, reason = missing
    # One pytest.skip per cause, each on its own line: pytest folds the skips by where they were raised.
    if cause == "gpu":
        pytest.skip(reason)
    elif cause == "extension":
        pytest.skip(reason)
    elif cause == "sm90":
        pytest.skip(reason)
    elif cause == "fused_extension":
        pytest.skip(reason)
    elif cause == "gpus":
        pytest.skip(reason)
    elif cause == "matplotlib":
        pytest.skip(reason)
    else:
        pytest.skip(reason)


# The bounds on the relative L2 error against the float64 evaluation (docs/math.md, "Accuracy").
TOLERANCE = {
    "float32-highest": 1e-5,
    "float32-high": 1e-3,
    "bfloat16": 1e-2,
    "float16": 3e-3,
}
# Gradients that are sums over every token of the batch and whose terms cancel (A_log's, and the
# delta projection's weight and bias: the delta pre-activation's gradient has both signs) reach the
# relative L2 error of a short sum amplified: at a few tokens one seed in tens lands above the bound
# although both CUDA paths give the same error to three digits (docs/math.md, "Accuracy": gradients
# summed over few tokens). Below SHORT_SUM_TOKENS tokens those gradients get twice the bound.
SHORT_SUM_TOKENS = 64


def short_sum_bound(tol: float, tokens: int) -> float:
    return 2 * tol if tokens < SHORT_SUM_TOKENS else tol


DTYPES = {
    "float32-highest": torch.float32,
    "float32-high": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@contextmanager
def matmul_precision(mode: str):
    """'float32-high' runs under torch.set_float32_matmul_precision('high'), the rest under 'highest'."""
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if mode == "float32-high" else "highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(old)


def fresh_seed() -> int:
    """A new seed for every call (fresh inputs every run), printed so that a failure can be replayed:
    SELSCAN_TEST_SEED=<seed> pytest ... -k <test> gives that test the printed seed again."""
    seed = int(os.environ.get("SELSCAN_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
    torch.manual_seed(seed)
    print(f"seed={seed}")
    return seed


def make_inputs(batch, L, Dm, N, dtype=torch.float32, device="cpu", with_h0=False):
    """Random layer inputs with the original model's initialisation scales (never zeros)."""
    bound = Dm ** -0.5
    u = lambda *s: (torch.rand(*s, device=device) * 2 - 1) * bound  # nn.Linear default init
    inp = dict(
        x=torch.randn(batch, L, Dm, device=device).to(dtype),
        A_log=torch.randn(Dm, N, device=device),
        W_delta=u(Dm, Dm).to(dtype),
        b_delta=u(Dm),
        W_B=u(N, Dm).to(dtype),
        W_C=u(N, Dm).to(dtype),
        D=torch.randn(Dm, device=device),
    )
    inp["h0"] = torch.randn(batch, Dm, N, device=device) if with_h0 else None
    return inp


def float64_eval(inp):
    """The float64 evaluation (docs/math.md): the same (already rounded) values, everything in float64."""
    f = {k: (v.double() if v is not None else None) for k, v in inp.items()}
    return selective_scan_ref(f["x"], f["A_log"], f["W_delta"], f["b_delta"], f["W_B"], f["W_C"], f["D"], f["h0"])


def check_against_float64(inp, y, h, mode):
    """y and the final state against the float64 evaluation, within docs/math.md's bound for `mode`, and
    every element written (the outputs were NaN-poisoned before the kernel ran)."""
    y64, h64 = float64_eval(inp)
    assert y.dtype == inp["x"].dtype and y.shape == inp["x"].shape
    assert h.dtype == torch.float32 and h.shape == h64.shape
    assert torch.isfinite(y).all(), "unwritten (NaN-poisoned) or non-finite elements in y"
    assert torch.isfinite(h).all(), "unwritten (NaN-poisoned) or non-finite elements in the final state"
    ey, eh = rel_l2(y, y64), rel_l2(h, h64)
    print(f"{mode}: rel err y={ey:.2e} final state={eh:.2e} (bound {TOLERANCE[mode]:.0e})")
    assert ey < TOLERANCE[mode] and eh < TOLERANCE[mode]


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def call(inp, impl, **kw):
    return selscan_fused.selective_scan(
        inp["x"], inp["A_log"], inp["W_delta"], inp["b_delta"], inp["W_B"], inp["W_C"], inp["D"],
        h0=inp["h0"], impl=impl, **kw)


@pytest.fixture
def poisoned_outputs():
    """The CUDA ops fill their outputs with NaN before launching while this fixture is active, so an
    element the kernel never writes stays NaN (the inputs never produce NaN)."""
    ops = [torch.ops.selscan_fused.set_poison_outputs]
    if selscan_fused._extension.fused_extension_available():
        ops.append(torch.ops.selscan_fused.fused_set_poison_outputs)
    for op in ops:
        op(True)
    yield
    for op in ops:
        op(False)


def pytest_runtest_logreport(report):
    """SELSCAN_FAILURE_LOG=FILE: every failure's report appended to FILE as it happens; SELSCAN_DONE_LOG=
    FILE: the node id of every test that has finished (its teardown reported), one a line. Both written
    once, by the controlling process under pytest-xdist, so that a run stopped at a time limit, whose
    summary never prints, still says what failed and why, and which tests it had not finished
    (scripts/gpu_check.sh)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    path = os.environ.get("SELSCAN_FAILURE_LOG")
    if path and report.failed:
        with open(path, "a") as f:
            f.write(f"==== {report.nodeid} ({report.when}, {report.duration:.1f} s)\n{report.longreprtext}\n")
    done = os.environ.get("SELSCAN_DONE_LOG")
    if done and report.when == "teardown":
        with open(done, "a") as f:
            f.write(report.nodeid + "\n")


def run_generate_cli(*args):
    """`python -m selscan_fused.generate ARGS` in a fresh process on the CPU (no GPU visible), from this
    checkout: its CompletedProcess (returncode, stdout, stderr)."""
    import subprocess
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""), CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, "-m", "selscan_fused.generate", *args], capture_output=True, text=True,
                          cwd=repo, env=env, timeout=300)
