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
    for op in ("unfused_fwd", "scan_fwd", "scan_plan", "set_poison_outputs"):
        assert hasattr(torch.ops.selscan_fused, op)


def test_load_error_message_gives_the_rebuild_command():
    msg = _extension.extension_error_message("unfused")
    assert "pip install --no-build-isolation" in msg and "impl='unfused'" in msg
