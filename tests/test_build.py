"""The package and its extension: what was built, and what a failed load says."""
import os

import pytest
import torch

import selscan_fused
from selscan_fused import _extension


def test_extension_loads_where_required():
    # CI and scripts/gpu_check.sh set SELSCAN_EXPECT_EXTENSION=1: there the extension must have been
    # built and must load with the installed torch.
    if os.environ.get("SELSCAN_EXPECT_EXTENSION") != "1":
        pytest.skip("SELSCAN_EXPECT_EXTENSION is not set")
    assert selscan_fused.extension_available(), _extension.extension_error_message("unfused")
    info = selscan_fused.build_info()
    assert info["TORCH_VERSION"] == torch.__version__
    for op in ("unfused_fwd", "scan_fwd", "scan_plan", "set_poison_outputs", "unfused_fwd_res", "unfused_bwd"):
        assert hasattr(torch.ops.selscan_fused, op)


def test_load_error_message_gives_the_rebuild_command():
    msg = _extension.extension_error_message("unfused")
    assert "pip install --no-build-isolation" in msg and "impl='unfused'" in msg


def test_extension_errors_are_catchable():
    """A bad call into the extension raises a Python error instead of crashing the process (a host
    compiler with a mismatched C++ runtime once made every error a segfault). Run in a subprocess so
    that a crash fails this test instead of the whole session."""
    if not selscan_fused.extension_available():
        pytest.skip("the extension is not built here")
    import subprocess
    import sys
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
    import subprocess
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    if shutil.which("git") is None or not (root / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(["git", "apply", "--check", f"benchmarks/ablation/{patch}"], cwd=root,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_ci_runs_the_readme_commands_as_written():
    """.ci/run must run the README's two commands exactly as the README writes them, in a fresh venv with
    its stock pip: no pip upgrade and nothing installed by hand before them."""
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    readme = (root / "README.md").read_text()
    block = readme.split("## Two commands", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    commands = [line.split("#", 1)[0].strip() for line in block.strip().splitlines()]
    assert len(commands) == 2 and all(commands)
    ci = [line.strip() for line in (root / ".ci" / "run").read_text().splitlines()]
    body = [line for line in ci if line and not line.startswith("#")]
    assert body[-2:] == commands, (body[-2:], commands)
    assert not any("pip install" in line for line in body), "the README's first command installs everything"
    assert (root / "pyproject.toml").is_file(), "pip 23 needs the PEP 517 build declaration (README)"
