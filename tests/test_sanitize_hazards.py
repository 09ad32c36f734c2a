"""scripts/sanitize_hazards.py: racecheck's hazards attributed to this project's kernels or to others'
(scripts/sanitize.sh fails on the first kind only). CPU only: a log in racecheck's format."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import sanitize_hazards  # noqa: E402


def _hazard(kind, read_kernel, write_kernel):
    return [f"========= Error: Potential {kind} hazard detected at __shared__ 0x34488 in block (0,0,0) :",
            f"=========     Read Thread (63,0,0) at {read_kernel}+0xb00",
            f"=========     Write Thread (256,0,0) at {write_kernel}+0x29f0",
            "=========     Current Value : 1, Incoming Value : 1",
            "=========     Saved host backtrace up to driver entry point at kernel launch time",
            "=========         Host Frame: cublasLtHSHMatmul [0xf9cd67] in libcublasLt.so.13", "========="]


OURS = "void selscan::fused::fused_kernel<selscan::fused::Config<cutlass::bfloat16_t, 16>>(selscan::fused::FusedParams)"
NVJET = "nvjet_sm90_hsh_64x32_64x16_2x4_h_bz_NTT"


def test_hazards_are_attributed_to_their_kernel(tmp_path):
    lines = (["========= COMPUTE-SANITIZER"] + _hazard("WAR", NVJET, NVJET) + _hazard("RAW", NVJET, OURS)
             + _hazard("WAR", NVJET, NVJET) + ["========= RACECHECK SUMMARY: 3 hazards displayed (3 errors, 0 warnings)"])
    ours, others, unseen = sanitize_hazards.attribute(lines)
    assert (ours, dict(others), unseen) == (1, {NVJET: 2}, 0)
    log = tmp_path / "racecheck.log"
    log.write_text("\n".join(lines) + "\n")
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "sanitize_hazards.py"), str(log)],
                         capture_output=True, text=True, check=True).stdout
    assert out.startswith("1 in this project's kernels, 2 in others"), out


def test_only_other_kernels_and_unprinted_hazards():
    lines = _hazard("WAR", NVJET, NVJET) + ["========= RACECHECK SUMMARY: 4 hazards displayed (9 errors, 0 warnings)"]
    ours, others, unseen = sanitize_hazards.attribute(lines)
    assert (ours, sum(others.values()), unseen) == (0, 1, 3)
    assert sanitize_hazards.attribute(["========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)"])[0] == 0
