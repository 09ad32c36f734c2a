"""csrc/common/seq_map.h (the packed-sequence maps the scan and conv kernels share) compiled for the host
and run over random length mixes: every token of every sequence in exactly one conv run, no run across a
sequence start, every checkpoint slot in bounds and owned by one sequence; with invalid cu_seqlens
values (what validate=False lets through), the clamped ranges stay in bounds."""
import os
import random
import shutil
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def checker(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler (g++) on this machine")
    exe = tmp_path_factory.mktemp("seq_map") / "seq_map_check"
    out = subprocess.run([cxx, "-std=c++17", "-O1", "-Wall", "-I", os.path.join(REPO, "csrc"),
                          os.path.join(REPO, "tests", "seq_map_check.cpp"), "-o", str(exe)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return str(exe)


def run(checker, cases):
    text = "".join(f"{total} {len(cu) - 1} {tile} {' '.join(map(str, cu))}\n" for total, cu, tile in cases)
    out = subprocess.run([checker], input=text, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.split("\n")[:len(cases)]


def test_valid_mixes(checker):
    rng = random.Random(7)
    cases = []
    for _ in range(3000):
        S = rng.randint(1, 40)
        lengths = [rng.choice([0, 1, 2, 3, rng.randint(1, 70), rng.randint(1, 700)]) for _ in range(S)]
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        cases.append((cu[-1], cu, rng.choice([4, 8, 16, 32, 64])))
    cases += [(0, [0, 0], 32), (1, [0, 1], 64), (64, [0, 64], 64), (65, [0, 1, 65], 64), (7, [0, 0, 0, 7], 4)]
    res = run(checker, cases)
    bad = [(c, r) for c, r in zip(cases, res) if r != "ok"]
    assert not bad, bad[:3]


def test_invalid_values_stay_in_bounds(checker):
    rng = random.Random(11)
    cases = []
    for _ in range(2000):
        S = rng.randint(1, 20)
        total = rng.randint(0, 3000)
        cu = [rng.randint(-100, total + 100) for _ in range(S + 1)]
        cases.append((total, cu, rng.choice([4, 16, 64])))
    res = run(checker, cases)
    bad = [(c, r) for c, r in zip(cases, res) if r != "ok"]
    assert not bad, bad[:3]


def test_the_checker_catches_a_wrong_map(checker, tmp_path):
    """The check itself can fail: a map whose sequences' first slots overlap (one slot per sequence too
    few) leaves tokens uncovered."""
    src = open(os.path.join(REPO, "csrc", "common", "seq_map.h")).read()
    wrong = src.replace("return start / tile + s;", "return start / tile;")
    assert wrong != src
    (tmp_path / "common").mkdir()
    (tmp_path / "common" / "seq_map.h").write_text(wrong)
    shutil.copy(os.path.join(REPO, "csrc", "common", "checkpoints.h"), tmp_path / "common")  # its include
    exe = tmp_path / "wrong_check"
    cxx = shutil.which("g++") or shutil.which("c++")
    out = subprocess.run([cxx, "-std=c++17", "-O1", "-I", str(tmp_path),
                          os.path.join(REPO, "tests", "seq_map_check.cpp"), "-o", str(exe)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    res = run(str(exe), [(130, [0, 30, 30, 100, 130], 32), (10, [0, 3, 5, 10], 4)])
    assert any(r != "ok" for r in res), res
