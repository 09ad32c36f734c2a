"""The package and its extension: what was built, and what a failed load says."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import selscan_fused
from conftest import requires_extension
from selscan_fused import _extension

ROOT = Path(__file__).resolve().parent.parent


def extension_expected() -> bool:
    """Whether this install must have a working extension. SELSCAN_EXPECT_EXTENSION=1 or =0 decides
    (CI and scripts/gpu_check.sh set 1). Unset, the extension is expected wherever a CUDA build was
    made: setup.py writes selscan_fused/_build_info.py when it builds the extension and removes it
    when it installs without (SELSCAN_SKIP_CUDA=1, which scripts/install_and_run.sh sets where there
    is no CUDA toolkit or torch is a CPU-only build). So after a CUDA build a failed or stale extension
    fails this test, where the CUDA-path tests would only skip."""
    setting = os.environ.get("SELSCAN_EXPECT_EXTENSION", "")
    if setting in ("0", "1"):
        return setting == "1"
    return bool(selscan_fused.build_info())


def test_extension_loads_where_expected():
    if not extension_expected():
        pytest.skip("no extension expected: the package was installed without it (no CUDA build recorded "
                    "in selscan_fused/_build_info.py) or SELSCAN_EXPECT_EXTENSION=0")
    hint = ("\n(a CUDA build of this package was made or SELSCAN_EXPECT_EXTENSION=1 is set, so the extension "
            "must load; SELSCAN_EXPECT_EXTENSION=0 turns this check off)")
    assert selscan_fused.extension_available(), _extension.extension_error_message("unfused") + hint
    info = selscan_fused.build_info()
    assert info.get("TORCH_VERSION") == torch.__version__, (
        f"the extension was built against torch {info.get('TORCH_VERSION')}, torch {torch.__version__} is "
        f"installed: rebuild with {_extension.REBUILD_COMMAND}" + hint)
    for op in ("unfused_fwd", "scan_fwd", "scan_plan", "set_poison_outputs", "unfused_fwd_res", "unfused_bwd"):
        assert hasattr(torch.ops.selscan_fused, op)
    assert selscan_fused._extension.fused_extension_available(), (
        _extension.extension_error_message("fused") + hint)


def test_load_error_message_gives_the_rebuild_command():
    msg = _extension.extension_error_message("unfused")
    assert "pip install --no-build-isolation" in msg and "impl='unfused'" in msg


@requires_extension
def test_extension_errors_are_catchable():
    """A bad call into the extension raises a Python error instead of crashing the process (a host
    compiler with a mismatched C++ runtime once made every error a segfault). Run in a subprocess so
    that a crash fails this test instead of the whole session."""
    code = (
        "import torch, selscan_fused\n"
        "x = torch.randn(1, 2, 8)\n"
        "try:\n"
        "    torch.ops.selscan_fused.unfused_fwd(x, torch.randn(8, 8), x[0, :, :8].repeat(4, 1), torch.randn(8),\n"
        "        torch.randn(8, 8), torch.randn(8, 8), torch.randn(8), None, False, 0)\n"
        "except RuntimeError as e:\n"
        "    print('raised:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "raised:" in out.stdout and "x is on cpu" in out.stdout, out.stderr[-2000:]


@pytest.mark.parametrize("patch", ["roles.patch", "narrow_rs.patch"])
def test_ablation_patch_applies(patch):
    """benchmarks/ablation/*.patch (timing-only role switches and trial layouts, docs/perf/layer-forward.md)
    must keep applying to the kernel as it changes, or the measurements they back cannot be repeated."""
    import shutil
    root = ROOT
    if shutil.which("git") is None or not (root / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(["git", "apply", "--check", f"benchmarks/ablation/{patch}"], cwd=root,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_ci_runs_the_readme_commands_as_written():
    """.ci/run must run the README's two commands exactly as the README writes them, in a fresh venv with
    its stock pip (the README's block opens with the venv it assumes): no pip upgrade and nothing
    installed by hand before them."""
    root = ROOT
    readme = (root / "README.md").read_text()
    block = readme.split("## Two commands", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    lines = [line.split("#", 1)[0].strip() for line in block.strip().splitlines()]
    assert len(lines) == 3 and all(lines), lines
    venv, commands = lines[0], lines[1:]
    assert venv.startswith("python3 -m venv ") and "/bin/activate" in venv, venv
    ci = [line.strip() for line in (root / ".ci" / "run").read_text().splitlines()]
    body = [line for line in ci if line and not line.startswith("#")]
    assert any(line.startswith("python3 -m venv ") for line in body), "CI makes a fresh venv as the README does"
    assert body[-2:] == commands, (body[-2:], commands)
    assert not any("pip install" in line for line in body), "the README's first command installs everything"
    assert (root / "pyproject.toml").is_file(), "pip 23 needs the PEP 517 build declaration (README)"


def test_readme_skip_line_is_the_suites():
    """The README's example of the skip summary is the line this suite prints without a GPU: the
    location of the no-GPU skip in tests/conftest.py and its reason as conftest words it (the count
    grows with the suite)."""
    import conftest
    readme = (ROOT / "README.md").read_text()
    m = re.search(r"`SKIPPED \[\d+\] tests/conftest\.py:(\d+): (no GPU tests: [^`]*)`", readme.replace("\n", " "))
    assert m, "the README shows no skip line of the form `SKIPPED [N] tests/conftest.py:LINE: no GPU tests: ...`"
    source = (ROOT / "tests" / "conftest.py").read_text().splitlines()
    line = int(m.group(1))
    assert source[line - 1].strip() == "pytest.skip(reason)" and 'cause == "gpu"' in source[line - 2], (
        f"tests/conftest.py:{line} is not where the no-GPU skip is raised")
    shown = re.sub(r"torch \S+, CUDA \S+\)$", "", m.group(2))
    assert shown.startswith("no GPU tests: no CUDA GPU is visible (torch.cuda.is_available() is False;")
    if torch.version.cuda is not None:
        assert conftest._no_gpu_reason().startswith(shown), (conftest._no_gpu_reason(), shown)


def test_build_progress_prints_one_line_per_translation_unit():
    """scripts/build_progress.py on the form of `pip install -v` output that torch's ninja build gives
    (captured from a real build): one line per compiled file, per extension and per link; errors pass."""
    sample = (
        "  Running command Building editable for selscan_fused (pyproject.toml)\n"
        "  running build_ext\n"
        "  building 'selscan_fused._C' extension\n"
        f"  [1/2] /usr/local/cuda/bin/nvcc -MD -MF {ROOT}/build/t/csrc/scan/scan_bf16.o.d -I{ROOT}/csrc -c -c "
        f"{ROOT}/csrc/scan/scan_bf16.cu -o {ROOT}/build/t/csrc/scan/scan_bf16.o -O3 -std=c++20\n"
        "  /usr/local/cuda/include/some.h(12): warning #177-D: variable declared but never referenced\n"
        f"  [2/2] c++ -MMD -MF {ROOT}/build/t/csrc/torch_ops.o.d -Wall -fPIC -c {ROOT}/csrc/torch_ops.cpp "
        f"-o {ROOT}/build/t/csrc/torch_ops.o -O3\n"
        f"  g++ -O3 -shared {ROOT}/build/t/csrc/torch_ops.o -L/x -o build/lib/selscan_fused/_C.cpython-311-x86_64-linux-gnu.so\n"
        "  FAILED: build/t/csrc/fused/fused_bf16.o\n"
        f"  {ROOT}/csrc/fused/fused_bf16.cu(3): error: identifier \"x\" is undefined\n"
        "Successfully installed selscan_fused-0.1.0\n")
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "build_progress.py")], input=sample,
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = [re.sub(r"  \(\d+:\d\d\)$", "", line) for line in out.stdout.splitlines()]
    assert lines == [
        "selscan_fused: compiling selscan_fused._C",
        "  [1/2] csrc/scan/scan_bf16.cu",
        "  [2/2] csrc/torch_ops.cpp",
        "  linked _C.cpython-311-x86_64-linux-gnu.so",
        "  FAILED: build/t/csrc/fused/fused_bf16.o",
        f"  {ROOT}/csrc/fused/fused_bf16.cu(3): error: identifier \"x\" is undefined",
        "Successfully installed selscan_fused-0.1.0",
    ], out.stdout


def _collect(args, shard=None):
    """`pytest --collect-only` of ARGS in a fresh process (SELSCAN_TEST_SHARD=SHARD where given):
    its return code, the collected test ids in order, and its output."""
    env = dict(os.environ)
    env.pop("SELSCAN_TEST_SHARD", None)
    env.pop("PYTEST_ADDOPTS", None)  # the caller's options (-v changes --collect-only's output)
    if shard is not None:
        env["SELSCAN_TEST_SHARD"] = shard
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                        "-p", "no:xdist", *args], cwd=ROOT, env=env, capture_output=True, text=True)
    return r.returncode, [ln for ln in r.stdout.splitlines() if "::" in ln], r.stdout + r.stderr


def test_test_shards_make_the_suite_once():
    """SELSCAN_TEST_SHARD=K/M (tests/conftest.py): the M shards of a test file are disjoint and together
    the whole file; a malformed value is a usage error that names the variable."""
    def collect(shard):
        return _collect(["tests/test_api_errors.py"], shard)

    rc, whole, _ = collect(None)
    assert rc == 0 and len(whole) > 3
    parts = [collect(f"{k}/3")[1] for k in range(3)]
    assert all(parts) and sum(len(p) for p in parts) == len(whole)
    assert sorted(t for p in parts for t in p) == sorted(whole)
    rc, _, out = collect("3/3")
    assert rc != 0 and "SELSCAN_TEST_SHARD='3/3'" in out


def test_fused_block_limit_is_the_kernels():
    """block.py's limit on x_proj's outputs for impl='fused' (checked in Python, before any launch) is
    the one the fused block's first kernel is built for (kBlockXprojMaxOut in csrc/fused/fused_api.h)."""
    from selscan_fused import block
    header = (ROOT / "csrc" / "fused" / "fused_api.h").read_text()
    m = re.search(r"constexpr\s+int64_t\s+kBlockXprojMaxOut\s*=\s*(\d+)\s*;", header)
    assert m, "csrc/fused/fused_api.h no longer defines kBlockXprojMaxOut"
    assert block.FUSED_BLOCK_MAX_XPROJ == int(m.group(1)), (block.FUSED_BLOCK_MAX_XPROJ, m.group(1))


def test_slowest_test_files_are_collected_first():
    """tests/conftest.py's SLOW_FIRST files come first in the collection, whatever order the command
    line names them in, each file's tests in their own order (pytest-xdist hands tests out in that order)."""
    import conftest
    files = ["tests/test_api_errors.py", "tests/test_varlen.py", "tests/test_paper_tasks.py"]
    def collect(args):
        rc, tests, out = _collect(args)
        assert rc == 0, out
        return tests
    order = collect(files)
    alone = {f: collect([f]) for f in files}
    assert all(alone.values())
    expected = sorted(files, key=lambda f: conftest.slow_first_rank(Path(f).name))
    assert expected[0] == "tests/test_paper_tasks.py"
    assert order == [t for f in expected for t in alone[f]]


def test_xdist_workers_share_the_cpu_threads():
    """Under pytest-xdist each worker's torch takes an equal share of the cores (tests/conftest.py), not
    all of them; outside xdist torch keeps its own count."""
    import conftest
    assert conftest.threads_per_worker(16, 14) == 1 and conftest.threads_per_worker(16, 4) == 4
    assert conftest.threads_per_worker(2, 8) == 1 and conftest.threads_per_worker(8, 0) == 8
    probe = ("import sys, torch; sys.path.insert(0, 'tests'); import conftest\n"
             "class C:\n    def addinivalue_line(self, *a): pass\n"
             "torch.set_num_threads(7); conftest.pytest_configure(C()); print(torch.get_num_threads())")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    def threads(**extra):
        out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=dict(env, **extra), capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        return int(out.stdout.split()[-1])
    assert threads() == 7
    assert threads(PYTEST_XDIST_WORKER="gw0", PYTEST_XDIST_WORKER_COUNT="4") == max(1, (os.cpu_count() or 1) // 4)


def test_done_log_names_every_finished_test(tmp_path):
    """SELSCAN_DONE_LOG=FILE (tests/conftest.py): every test that ran, passed or skipped, is named in FILE
    once, with the node id `--collect-only` gives it, so that scripts/gpu_check.sh can name the tests a
    run stopped at its time limit had not finished (the collected ids less these)."""
    args = ["tests/test_api_errors.py"]
    rc, collected, out = _collect(args)
    assert rc == 0 and len(collected) > 3, out
    done = tmp_path / "done.txt"
    env = dict(os.environ, SELSCAN_DONE_LOG=str(done))
    # this test's own run's settings (under pytest-xdist, PYTEST_XDIST_WORKER would make the inner run's
    # hook take itself for a worker and write nothing)
    for name in ("SELSCAN_TEST_SHARD", "PYTEST_ADDOPTS", "PYTEST_XDIST_WORKER", "SELSCAN_FAILURE_LOG"):
        env.pop(name, None)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", *args],
                       cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    names = done.read_text().splitlines()
    assert sorted(names) == sorted(collected)
