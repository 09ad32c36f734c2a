"""benchmarks/paper_tasks.py (the Mamba paper's Selective Copying and Induction Heads) on the CPU: the data
generators, the smoke run and its CSVs, resuming from a checkpoint, chunked evaluation, the
time-invariant block; on a GPU also the unfused path against the reference."""
import math
import os
import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import requires_cuda, requires_extension, requires_hopper, requires_matplotlib

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import paper_tasks  # noqa: E402


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("batch,length,copy,vocab", [(64, 4096, 16, 16), (32, 40, 16, 16), (16, 12, 3, 5)])
def test_selective_copying_data(batch, length, copy, vocab):
    tokens, target = paper_tasks.selective_copying_batch(_gen(1), batch, length, copy, vocab)
    assert tokens.shape == (batch, length) and target.shape == (batch, copy)
    assert tokens.dtype == torch.long and target.dtype == torch.long
    region = length - copy
    # data tokens 1 .. vocab-2, noise 0, markers vocab-1 and only at the end
    assert int(target.min()) >= 1 and int(target.max()) <= vocab - 2
    assert (tokens[:, region:] == vocab - 1).all()
    head = tokens[:, :region]
    assert int(head.min()) >= 0 and int(head.max()) <= vocab - 2
    data_mask = head != 0
    assert (data_mask.sum(1) == copy).all()  # exactly `copy` data tokens among the noise
    # the targets are exactly the data tokens in the order they appear
    assert torch.equal(head[data_mask].view(batch, copy), target)
    # positions are random: not all rows alike, and not always at the start
    pos = data_mask.float().argmax(1)
    assert len(set(pos.tolist())) > 1 or batch == 1


@pytest.mark.parametrize("batch,length,vocab", [(64, 256, 16), (256, 4, 16), (8, 1000, 3)])
def test_induction_heads_data(batch, length, vocab):
    tokens, target = paper_tasks.induction_heads_batch(_gen(2), batch, length, vocab)
    assert tokens.shape == (batch, length) and target.shape == (batch, 1)
    special = vocab - 1
    assert int(tokens.min()) >= 0 and int(tokens.max()) <= special
    assert (tokens[:, -1] == special).all()
    is_special = tokens == special
    assert (is_special.sum(1) == 2).all()  # the first occurrence and the query at the end, nowhere else
    first = is_special.float().argmax(1)
    assert int(first.max()) <= length - 3
    rows = torch.arange(batch)
    assert torch.equal(tokens[rows, first + 1], target[:, 0])  # the token after the first occurrence
    assert int(target.max()) <= vocab - 2  # an ordinary token, never the special one


def test_generators_are_deterministic():
    a = paper_tasks.induction_heads_batch(_gen(5), 4, 64, 16)
    b = paper_tasks.induction_heads_batch(_gen(5), 4, 64, 16)
    c = paper_tasks.selective_copying_batch(_gen(5), 4, 64, 8, 16)
    d = paper_tasks.selective_copying_batch(_gen(5), 4, 64, 8, 16)
    assert all(torch.equal(x, y) for x, y in zip(a + c, b + d))


def _model(time_invariant=False, impl="reference", seed=0, vocab=16):
    torch.manual_seed(seed)
    return paper_tasks.TinyLM(vocab, 64, 2, impl=impl, time_invariant=time_invariant)


@pytest.mark.parametrize("time_invariant", [False, True])
@pytest.mark.parametrize("chunk,n_last", [(8, 37), (5, 1), (16, 9), (37, 37), (100, 3)])
def test_chunked_equals_one_call(time_invariant, chunk, n_last):
    model = _model(time_invariant)
    ids = torch.randint(0, 16, (3, 37), generator=_gen(3))
    with torch.no_grad():
        full = model(ids)[:, -n_last:]
        assert torch.allclose(model(ids, n_last=n_last), full, atol=1e-6, rtol=1e-6)
        chunked = model.forward_chunked(ids, chunk, n_last)
    assert chunked.shape == (3, n_last, 16)
    assert torch.allclose(chunked, full, atol=1e-5, rtol=1e-5), (chunked - full).abs().max()


def test_time_invariant_block_is_a_convolution():
    """TimeInvariantMamba's SSM is the time-invariant system: y = (K * u) + D u with the kernel
    K[c, k] = sum_n C_n B_n delta_c exp(k delta_c A_cn), the same at every position, whatever the input."""
    torch.manual_seed(4)
    blk = paper_tasks.TimeInvariantMamba(16, d_state=4, impl="reference").double()
    with torch.no_grad():
        blk.dt_low.normal_()
        blk.B_const.normal_()
        blk.C_const.normal_()
        blk.D.normal_()
    assert not hasattr(blk, "x_proj")
    x = torch.randn(2, 23, 16, dtype=torch.float64)
    out = blk(x)
    d_inner, W = blk.d_inner, blk.d_conv
    with torch.no_grad():
        xz = F.linear(x, blk.in_proj.weight)
        xi, z = xz[..., :d_inner], xz[..., d_inner:]
        pad = F.pad(xi.transpose(1, 2), (W - 1, 0))
        u = F.silu(F.conv1d(pad, blk.conv1d.weight, blk.conv1d.bias, groups=d_inner)).transpose(1, 2)
        delta = F.softplus(F.linear(blk.dt_low, blk.dt_proj.weight, blk.dt_proj.bias))  # (d_inner,)
        A = -torch.exp(blk.A_log)
        k = torch.arange(x.shape[1], dtype=torch.float64)
        K = torch.einsum("n,cnk->ck", blk.C_const * blk.B_const,
                         torch.exp(delta[:, None, None] * A[:, :, None] * k)) * delta[:, None]  # (d_inner, L)
        L = x.shape[1]
        y = torch.stack([(K[:, :t + 1].flip(1) * u[:, :t + 1].transpose(1, 2)).sum(-1) for t in range(L)], 1)
        y = (y + blk.D * u) * F.silu(z)
        expect = F.linear(y, blk.out_proj.weight)
    assert torch.allclose(out, expect, atol=1e-10, rtol=1e-9), (out - expect).abs().max()


def test_time_invariant_block_states_continue():
    torch.manual_seed(6)
    blk = paper_tasks.TimeInvariantMamba(16, d_state=4, impl="reference")
    x = torch.randn(2, 19, 16)
    with torch.no_grad():
        full = blk(x)
        a, h, c = blk(x[:, :7], return_final_state=True)
        b = blk(x[:, 7:], h0=h, conv_state=c)
    assert torch.allclose(torch.cat([a, b], 1), full, atol=1e-5, rtol=1e-5)


def _smoke_argv(task, tmp_path, *extra):
    return [task, "--smoke", "--out", str(tmp_path / task), "--no-plot", "--no-progress", *extra]


@pytest.mark.parametrize("task", paper_tasks.TASKS)
def test_smoke_run_writes_csvs(task, tmp_path):
    res = paper_tasks.main(_smoke_argv(task, tmp_path))
    steps = paper_tasks.SMOKE[task]["steps"]
    loss_rows = paper_tasks.read_rows(str(tmp_path / f"{task}_loss.csv"))
    assert [int(r["step"]) for r in loss_rows] == list(range(steps))
    assert {(r["impl"], r["variant"]) for r in loss_rows} == {("reference", "selective")}
    assert all(math.isfinite(float(r["loss"])) and 0 <= float(r["accuracy"]) <= 1 for r in loss_rows)
    acc_rows = paper_tasks.read_rows(str(tmp_path / f"{task}_accuracy.csv"))
    lengths = paper_tasks.SMOKE[task]["eval_lengths"] or [paper_tasks.SMOKE[task]["length"]]
    assert [int(r["length"]) for r in acc_rows] == lengths
    assert all(r["status"] == "ok" and 0 <= float(r["accuracy"]) <= 100 for r in acc_rows)
    # the paper's figure beside each length of its table (Selective Copying: only at its length, 4096)
    assert {r["paper_mamba"] for r in acc_rows} == ({"100.0"} if task == "induction-heads" else {""})
    assert res["status"] == {"reference": "done"}
    # a second variant goes into the same CSVs beside the first
    paper_tasks.main(_smoke_argv(task, tmp_path, "--time-invariant", "--steps", "3"))
    loss_rows = paper_tasks.read_rows(str(tmp_path / f"{task}_loss.csv"))
    assert {(r["impl"], r["variant"]) for r in loss_rows} == {("reference", "selective"),
                                                            ("reference", "time-invariant")}
    assert sum(r["variant"] == "selective" for r in loss_rows) == steps


def test_seeds_sit_side_by_side_in_the_csvs(tmp_path):
    """Runs of one path from several --seed values keep their own rows (a rerun replaces only its seed's),
    and rows written before the seed column count as seed 0."""
    task = "induction-heads"
    base = ["--steps", "3", "--eval-lengths", "16"]
    paper_tasks.main(_smoke_argv(task, tmp_path, *base))
    seed1 = paper_tasks.main(_smoke_argv(task, tmp_path, *base, "--seed", "1"))["logs"]["reference"]
    loss_rows = paper_tasks.read_rows(str(tmp_path / f"{task}_loss.csv"))
    assert sorted({paper_tasks.run_of(r) for r in loss_rows}) == [("reference", "selective", "0"),
                                                                   ("reference", "selective", "1")]
    assert [float(r["loss"]) for r in loss_rows if r["seed"] == "1"] == pytest.approx([x[1] for x in seed1], abs=1e-6)
    acc = paper_tasks.read_rows(str(tmp_path / f"{task}_accuracy.csv"))
    assert sorted(r["seed"] for r in acc) == ["0", "1"]
    # a rerun of seed 0 replaces seed 0's rows only
    paper_tasks.main(_smoke_argv(task, tmp_path, *base))
    loss_rows = paper_tasks.read_rows(str(tmp_path / f"{task}_loss.csv"))
    assert [r["seed"] for r in loss_rows].count("0") == 3 and [r["seed"] for r in loss_rows].count("1") == 3
    # a CSV of the earlier layout (no seed column): its rows are seed 0's
    old = tmp_path / "old_loss.csv"
    old.write_text("task,impl,variant,step,loss,accuracy,lr\ninduction-heads,fused,selective,0,1.0,0.5,1e-3\n")
    paper_tasks.merge_write(str(old), paper_tasks.LOSS_FIELDS, [], {("fused", "selective", "0")})
    assert paper_tasks.read_rows(str(old)) == []


def test_resume_gives_the_losses_of_an_uninterrupted_run(tmp_path, capsys):
    task = "induction-heads"
    base = ["--steps", "8", "--eval-lengths", "16", "--log-every", "3"]
    whole = paper_tasks.main(_smoke_argv(task, tmp_path / "a", *base))["logs"]["reference"]
    ckpt = str(tmp_path / "run.pt")
    first = paper_tasks.main(_smoke_argv(task, tmp_path / "b", *base, "--ckpt", ckpt, "--stop-after", "3"))
    assert first["status"] == {"reference": "stopped"} and len(first["logs"]["reference"]) == 3
    assert not (tmp_path / "b" / f"{task}_loss.csv").exists()  # nothing written for an unfinished run
    assert "rerun the same command" in capsys.readouterr().out
    resumed = paper_tasks.main(_smoke_argv(task, tmp_path / "b", *base, "--ckpt", ckpt))
    assert "resuming at step 3" in capsys.readouterr().out
    log = resumed["logs"]["reference"]
    assert [r[0] for r in log] == list(range(8))
    assert [(r[0], r[1], r[2]) for r in log] == [(r[0], r[1], r[2]) for r in whole]  # bit for bit
    # other settings refuse the checkpoint
    with pytest.raises(SystemExit, match="lr"):
        paper_tasks.main(_smoke_argv(task, tmp_path / "b", *base, "--ckpt", ckpt, "--lr", "0.01"))


def test_impls_share_weights_and_batches(tmp_path):
    """Two runs of one impl from the same seed give the same losses (what --impls relies on: the same
    initial weights and batches for every impl)."""
    argv = _smoke_argv("induction-heads", tmp_path, "--steps", "3", "--eval-lengths", "16")
    a = paper_tasks.main(argv)["logs"]["reference"]
    b = paper_tasks.main(argv)["logs"]["reference"]
    assert a == b


def test_unavailable_impl_stops_cleanly(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        paper_tasks.main(_smoke_argv("induction-heads", tmp_path, "--impl", "fused"))
    assert e.value.code == 2
    out = capsys.readouterr().out
    assert "impl 'fused' cannot run the block here" in out and "nothing trained" in out
    assert not (tmp_path / "induction-heads_loss.csv").exists()


def test_options():
    a = paper_tasks.parse_args(["induction-heads"])
    assert a.impls == ["unfused"] and a.length == 256 and a.vocab == 16 and a.d_model == 64 and a.n_layer == 2
    assert a.eval_lengths == [2 ** k for k in range(6, 21)]
    a = paper_tasks.parse_args(["selective-copying", "--impls", "unfused,reference"])
    assert a.impls == ["unfused", "reference"] and a.length == 4096 and a.copy == 16 and a.eval_lengths == [4096]
    a = paper_tasks.parse_args(["selective-copying", "--smoke", "--steps", "5"])
    assert a.impls == ["reference"] and a.device == "cpu" and a.steps == 5
    with pytest.raises(SystemExit):
        paper_tasks.parse_args(["induction-heads", "--impl", "unfused", "--impls", "reference"])


def test_learning_rate_schedule():
    a = paper_tasks.parse_args(["induction-heads", "--steps", "100", "--lr", "1e-3"])
    lrs = [paper_tasks.lr_at(s, a) for s in range(100)]
    assert lrs[0] == pytest.approx(1e-3 / a.warmup) and max(lrs) == pytest.approx(1e-3)
    assert lrs[-1] == pytest.approx(1e-4)
    a = paper_tasks.parse_args(["induction-heads", "--steps", "100", "--schedule", "constant", "--warmup", "1"])
    assert {paper_tasks.lr_at(s, a) for s in range(100)} == {a.lr}


@requires_matplotlib
@pytest.mark.parametrize("task", paper_tasks.TASKS)
def test_plots(task, tmp_path):
    paper_tasks.main([task, "--smoke", "--out", str(tmp_path / task), "--no-progress", "--steps", "3"])
    for kind in ("loss", "accuracy"):
        assert os.path.getsize(tmp_path / f"{task}_{kind}.png") > 5_000


@requires_cuda
@requires_extension
@pytest.mark.parametrize("impl", ["unfused", pytest.param("fused", marks=requires_hopper)])
@pytest.mark.parametrize("time_invariant", [False, True])
def test_cuda_matches_reference(time_invariant, impl):
    ref = _model(time_invariant).cuda()
    unf = _model(time_invariant, impl=impl).cuda()
    unf.load_state_dict(ref.state_dict())
    ids = torch.randint(0, 16, (4, 300), generator=_gen(7)).cuda()
    with torch.no_grad():
        a, b = ref(ids), unf(ids)
        assert (a - b).norm() / a.norm() < 1e-3
        c = unf.forward_chunked(ids, 64, 300)
        assert (c - b).norm() / b.norm() < 1e-4
    # one bf16 training step on each: finite losses, close to each other
    losses = []
    for m in (ref, unf):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = m(ids, n_last=1).float()
        loss = F.cross_entropy(logits[:, 0], ids[:, 0])
        loss.backward()
        assert all(p.grad is None or torch.isfinite(p.grad).all() for p in m.parameters())
        losses.append(loss.item())
    assert abs(losses[0] - losses[1]) < 2e-2 * abs(losses[0])


@requires_cuda
@requires_extension
def test_gpu_runs_both_impls(tmp_path):
    res = paper_tasks.main(["induction-heads", "--smoke", "--device", "cuda", "--impls", "unfused,reference",
                            "--out", str(tmp_path / "ih"), "--no-plot", "--no-progress"])
    a, b = res["logs"]["unfused"], res["logs"]["reference"]
    assert len(a) == len(b) and abs(a[0][1] - b[0][1]) < 2e-2 * a[0][1]


def test_memory_diagnostic_reads_a_checkpoint(tmp_path, monkeypatch, capsys):
    """scripts/diag_ih_memory.py on a smoke run's checkpoint: its delta is the one the block's reference
    computes, and it prints a half-life line per block."""
    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(__file__), "..", "scripts"))
    import diag_ih_memory
    import selscan_fused.block_reference as block_reference

    ckpt = str(tmp_path / "ih.pt")
    paper_tasks.main(_smoke_argv("induction-heads", tmp_path, "--steps", "3", "--eval-lengths", "16", "--ckpt", ckpt))
    store = torch.load(ckpt, map_location="cpu", weights_only=False)
    cfg = store["config"]
    model = paper_tasks.TinyLM(cfg["vocab"], d_model=cfg["d_model"], n_layer=cfg["n_layer"], d_state=cfg["d_state"],
                               d_conv=cfg["d_conv"], expand=cfg["expand"], impl="reference", norm=cfg["norm"])
    model.load_state_dict(store["runs"]["reference/selective"]["model"])
    ids, _ = paper_tasks.induction_heads_batch(torch.Generator().manual_seed(3), 2, 40, cfg["vocab"])
    seen = []
    scan_ref = block_reference.scan_ref
    monkeypatch.setattr(block_reference, "scan_ref",
                        lambda u, delta, *rest: (seen.append(delta), scan_ref(u, delta, *rest))[1])
    with torch.no_grad():
        h = model.norms[0](model.embedding(ids).float())
        model.mixers[0](h)
        torch.testing.assert_close(diag_ih_memory.block_delta(model.mixers[0], h), seen[0].float())
    monkeypatch.setattr(sys, "argv", ["diag_ih_memory.py", ckpt, "--length", "64", "--n", "2"])
    diag_ih_memory.main()
    out = capsys.readouterr().out
    assert "reference/selective" in out
    for i in range(cfg["n_layer"]):
        assert f"block {i}: longest half-lives" in out
