"""The benchmark scripts' logic, on the CPU (their timings are measured on the GPU, never in tests):
the paper figure's PyTorch-scan baseline computes the layer, its sweep resumes from its CSV, and the
plot is drawn from that CSV."""
import os
import sys

import pytest
import torch

from conftest import float64_eval, make_inputs, rel_l2, requires_matplotlib

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import paper_figure  # noqa: E402


@pytest.mark.parametrize("L", [1, 7, 300])
def test_pytorch_scan_baseline_computes_the_layer(L):
    """The standard-scan baseline must be the same function (a straw man would flatter the kernels)."""
    torch.manual_seed(L)
    inp = make_inputs(2, L, 32, 8)
    y = paper_figure._pytorch_scan(inp["x"], inp["A_log"], inp["W_delta"], inp["b_delta"], inp["W_B"], inp["W_C"],
                                   inp["D"])
    y64, _ = float64_eval(inp)
    assert rel_l2(y, y64) < 1e-5


def test_paper_figure_sweep_writes_and_resumes(tmp_path, capsys):
    out = tmp_path / "fig.csv"
    argv = ["--device", "cpu", "--min-L", "64", "--max-L", "128", "--D", "32", "--reps", "1", "--csv", str(out),
            "--paths", "attention,pytorch-scan,fft-conv,fused"]
    paper_figure.main(argv)
    rows = paper_figure.read_rows(str(out))
    assert len(rows) == 4 * 2 * 2  # paths x modes x lengths
    by = {(r["path"], r["mode"], r["L"]): r for r in rows}
    assert by[("fused", "fwd", "64")]["status"] == "unavailable: needs CUDA"
    for p in ("attention", "pytorch-scan", "fft-conv"):
        for m in ("fwd", "fwd+bwd"):
            assert by[(p, m, "128")]["status"].startswith("ok") and float(by[(p, m, "128")]["gpu_ms"]) > 0
    mtime = out.stat().st_mtime_ns
    paper_figure.main(argv)  # everything is there: nothing re-measured, nothing rewritten
    assert out.stat().st_mtime_ns == mtime and len(paper_figure.read_rows(str(out))) == 16
    assert "The paper's claims" in capsys.readouterr().out


@requires_matplotlib
def test_plot_from_the_csv(tmp_path):
    import plot_results
    out = tmp_path / "fig.csv"
    paper_figure.main(["--device", "cpu", "--min-L", "64", "--max-L", "128", "--D", "32", "--reps", "1",
                       "--csv", str(out), "--paths", "fft-conv", "--modes", "fwd"])
    png = plot_results.plot_figure(str(out), str(tmp_path / "fig.png"))
    assert os.path.getsize(png) > 10_000


@requires_matplotlib
def test_plot_of_the_ablation_table(tmp_path):
    import csv

    import ablation_table
    import plot_results
    out = tmp_path / "table.csv"
    with open(out, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=ablation_table.FIELDS)
        w.writeheader()
        for shape, dtype, path, x in [("S1", "bf16", "fused", 2.3), ("S1", "bf16", "unfused", 1.8),
                                      ("S2", "bf16", "fused", 3.1), ("S1", "fp32", "scan", 4.0)]:
            w.writerow({**{k: "" for k in ablation_table.FIELDS}, "shape": shape, "dtype": dtype, "path": path,
                        "x_mamba_user": x, "status": "ok"})
    png = plot_results.plot_table(str(out), str(tmp_path / "table.png"))
    assert os.path.getsize(png) > 10_000
    with open(out, "w", newline="") as fh:  # no row with mamba-ssm beside it: says so
        csv.DictWriter(fh, fieldnames=ablation_table.FIELDS).writeheader()
    with pytest.raises(SystemExit, match="no rows"):
        plot_results.plot_table(str(out), str(tmp_path / "t2.png"))


def _write_csv(path, fields, rows):
    import csv
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)


def test_compare_results_finds_what_did_not_reproduce(tmp_path, capsys):
    import compare_results
    fields = ["shape", "dtype", "path", "gpu_ms", "eager_ms", "status"]
    row = lambda shape, path, ms, status="ok": dict(shape=shape, dtype="bf16", path=path, gpu_ms=ms,  # noqa: E731
                                                     eager_ms=ms, status=status)
    old = [row("S1", "fused", 0.0657), row("S2", "fused", 0.344), row("S3", "fused", 0.865),
           row("S4", "fused", 0.266), row("S4", "mamba-user", 1.08), row("S5-1", "fused", 0.0134),
           row("S1", "reference", 250.0)]
    new = [row("S1", "fused", 0.0690), row("S2", "fused", 0.420), row("S3", "fused", 0.850),
           row("S4", "fused", 0.270), row("S4", "mamba-user", "", "unavailable: no selective_scan_cuda"),
           row("R", "fused", 0.1), row("S1", "reference", 100.0)]
    _write_csv(tmp_path / "old.csv", fields, old)
    _write_csv(tmp_path / "new.csv", fields, new)
    assert compare_results.main([str(tmp_path / "old.csv"), str(tmp_path / "new.csv")]) == 1
    out = capsys.readouterr().out
    assert "4 rows measured in both runs, 3 within 10%, 1 outside; 1 changed status; 1 host-timed;" in out
    assert "host-timed rows (reference; not held to the tolerance): new / committed 0.400 .. 0.400" in out
    assert "outside: shape=S2 dtype=bf16 path=fused: 0.344 -> 0.42 ms (1.221x)" in out
    assert "status: shape=S4 dtype=bf16 path=mamba-user" in out
    assert f"only in {tmp_path / 'old.csv'}: shape=S5-1 dtype=bf16 path=fused" in out
    assert f"only in {tmp_path / 'new.csv'}: shape=R dtype=bf16 path=fused" in out
    # within 5%, the reference's host-timed row 2.5x slower: still a reproduction
    same = [dict(r, gpu_ms=float(r["gpu_ms"]) * (2.5 if r["path"] == "reference" else 1.05)) for r in old]
    _write_csv(tmp_path / "same.csv", fields, same)
    assert compare_results.main([str(tmp_path / "old.csv"), str(tmp_path / "same.csv")]) == 0


@pytest.mark.parametrize("name", ["paper_figure", "ablation_table"])
def test_compare_results_reads_the_committed_tables(name, capsys):
    import compare_results
    path = os.path.join(os.path.dirname(__file__), "..", "docs", f"{name}.csv")
    assert compare_results.main([path, path]) == 0
    _, rows = compare_results.read(path)
    measured = sum(r["status"].startswith("ok") and r.get("path") not in compare_results.HOST_TIMED_PATHS
                   for r in rows)
    assert f"{name}: {measured} rows measured in both runs, {measured} within 10%, 0 outside" in capsys.readouterr().out


def test_plan_model_reads_the_committed_sweep(capsys):
    """benchmarks/plan_model.py on docs/fwd_split_sweep.csv: the plan before 2026-12-03 as the op
    measured it, and the library's splits (docs/perf/batch1.md, the batch-1 section, quotes both means)."""
    import plan_model
    assert plan_model.split_lengths(1000, 3) == (3, 384)
    assert plan_model.main([]) == 0
    out = capsys.readouterr().out
    assert "mean x fastest: before 1.068; library 1.004 over 17 shapes" in out
    # the plan before: P at 2K splits the wide layout in 4 (the 512-token floor); the library's in 8
    assert plan_model.plan_before(1, 2048, 1024, 16)[:2] == (64, 4)
    assert plan_model.plan_library(1, 2048, 1024, 16) == (64, 8, 256)
    # at 512 tokens one phase of the narrow layout: a split's second phase costs more than it saves
    assert plan_model.plan_library(1, 512, 1024, 16) == (16, 1, 512)


def test_decode_bench_smoke_on_the_cpu(tmp_path):
    """The decode benchmark's rows on the CPU (tiny model): the torch path measured, the kernel (both
    launch forms) and mamba-ssm's step each saying why they did not run, the floor from the model's bytes."""
    import csv
    import decode_bench
    out = tmp_path / "decode.csv"
    rows = decode_bench.main(["--device", "cpu", "--sizes", "tiny", "--batches", "1,3", "--reps", "2", "--dtype",
                              "fp32", "--csv", str(out)])
    assert [(r["batch"], r["path"]) for r in rows] == [(b, p) for b in (1, 3) for p in ("torch", "kernel", "kernel-2",
                                                                                   "mamba-ssm")]
    by = {(r["batch"], r["path"]): r for r in rows}
    assert by[(1, "torch")]["status"].startswith("ok") and float(by[(1, "torch")]["ms_per_token"]) > 0
    for path in ("kernel", "kernel-2"):
        assert by[(1, path)]["status"].startswith("unavailable") and "CUDA" in by[(1, path)]["status"]
    assert by[(1, "mamba-ssm")]["status"].startswith("unavailable")
    # the floor: every parameter's bytes once, plus the states read and written
    model = decode_bench.build("tiny", torch.float32, torch.device("cpu"))
    weights = sum(p.numel() * 4 for p in model.parameters())
    assert float(by[(1, "torch")]["floor_ms"]) > weights / decode_bench.BANDWIDTH * 1e3
    assert float(by[(3, "torch")]["floor_ms"]) > float(by[(1, "torch")]["floor_ms"])
    assert len(list(csv.DictReader(open(out)))) == 8


def test_inference_throughput_smoke_on_the_cpu(tmp_path):
    """Figure 8 (right)'s script on the CPU with tiny models: every model generates all its tokens (the
    status would say otherwise), throughput = batch x gen / time; mamba-ssm says why it did not run."""
    import inference_throughput
    rows = inference_throughput.main(["--device", "cpu", "--tiny", "--batches", "1,2", "--prompt", "12", "--gen",
                                      "3", "--reps", "1", "--csv", str(tmp_path / "t.csv")])
    by = {(r["model"], r["batch"]): r for r in rows}
    for name in ("ours", "ours-torch", "transformer"):
        for b in (1, 2):
            r = by[(name, b)]
            assert r["status"] == "ok", r
            assert abs(float(r["tokens_per_s"]) - b * 3 / float(r["total_ms"]) * 1e3) < 0.1 + 0.01 * float(r["tokens_per_s"])
    assert by[("mamba-ssm", 1)]["status"].startswith("unavailable")
    assert by[("ours-fused", 1)]["status"].startswith("unavailable")


def test_varlen_bench_smoke_on_the_cpu():
    """The packed-sequence benchmark's rows on the CPU: the mix drawn as documented (log-normal, median
    1024, clipped to [16, 16384], reproducible), each layout saying why it did not run."""
    import varlen_bench
    lengths = varlen_bench.draw_lengths(200, 3)
    assert lengths == varlen_bench.draw_lengths(200, 3) and min(lengths) >= 16 and max(lengths) <= 16384
    assert 700 < sorted(lengths)[100] < 1500  # the median
    rows = varlen_bench.main(["--device", "cpu", "--d-model", "16", "--lengths", "5,9,1", "--reps", "1",
                              "--impls", "unfused,fused"])
    assert [(r["impl"], r["layout"]) for r in rows] == [(i, lay) for i in ("unfused", "fused")
                                                        for lay in ("packed", "one", "padded")]
    assert all(r["status"].startswith("unavailable") for r in rows)
    assert all("CUDA" in r["status"] for r in rows if r["impl"] == "unfused")
    assert [r["tokens"] for r in rows] == [15, 15, 27] * 2
    with pytest.raises(SystemExit):
        varlen_bench.main(["--device", "cpu", "--impls", "unfused,bogus"])
