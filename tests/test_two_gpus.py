"""Two GPUs (scripts/two_gpus.py): the op on the second device while the first is current, and
data-parallel training against one process on the combined batch. The GPU tests need 2 CUDA GPUs; the
script's own comparison is checked on the CPU (gloo, the reference path)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import requires_cuda, requires_extension

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "scripts" / "two_gpus.py")
two_gpus = pytest.mark.needs("gpus:2")


def _torchrun(*args, timeout=600):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", SCRIPT, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


SMALL = ["--device", "cpu", "--L", "24", "--steps", "4", "--width", "16", "--states", "8", "--batch", "4"]


def test_data_parallel_matches_one_process_on_the_cpu():
    r = _torchrun("ddp", *SMALL, "--fsdp")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "ddp: 2 processes" in r.stdout and ": ok" in r.stdout


def test_the_comparison_catches_a_wrong_run():
    r = _torchrun("ddp", *SMALL, "--wrong")
    assert r.returncode != 0 and "FAILED" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]


@requires_cuda
@two_gpus
@requires_extension
def test_every_op_on_the_other_device():
    r = subprocess.run([sys.executable, SCRIPT, "devices"], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


@requires_cuda
@two_gpus
@requires_extension
@pytest.mark.parametrize("impl", ["unfused", "fused"])
def test_ddp_and_fsdp_match_one_gpu(impl):
    if impl == "fused" and torch.cuda.get_device_capability(0) != (9, 0):
        pytest.skip("the fused path needs an H100/H200 (sm_90)")
    r = _torchrun("ddp", "--impl", impl, "--fsdp")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
