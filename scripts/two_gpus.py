#!/usr/bin/env python3
"""Two GPUs: the op on the second device, and data-parallel training (docs/reliability.md, "Two GPUs").

    python scripts/two_gpus.py devices            # every op on cuda:1 while cuda:0 is current, and back
    torchrun --standalone --nproc_per_node 2 scripts/two_gpus.py ddp [--impl unfused] [--steps 20] [--fsdp]
    python scripts/two_gpus.py all                # both (it launches torchrun itself), every path

devices: for each CUDA path (unfused; fused on H100/H200), forward and backward, with and without h0
and the final state, the call on tensors of cuda:1 while cuda:0 is the current device (and the other
way round) must give bitwise the results of the same call made with the tensors' device current
(both paths are deterministic), leave the current device as it was, and allocate nothing on the
device that is not the tensors'.

ddp: a small model of SelectiveScan layers (benchmarks/selective_copying.py's: embedding, blocks of
RMSNorm -> SelectiveScan and RMSNorm -> MLP with residuals, head) is
trained for --steps SGD steps with DistributedDataParallel, one process per GPU (NCCL), each on its
half of every batch; rank 0 trains the same model from the same seed on the whole batch on its own
GPU, and the parameters must agree within float32 tolerance. --fsdp does the same with FSDP2
(torch.distributed.fsdp.fully_shard) where it exists. --device cpu runs the same on the CPU (gloo,
impl="reference"): a smoke test of the script itself.

Exit status 0 when every check passed; each check prints one line.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import selscan_fused  # noqa: E402
from selective_copying import Model  # noqa: E402  (the training run's model: embedding, blocks, head)
from selscan_fused.demo import make_inputs  # noqa: E402


# --- devices -------------------------------------------------------------------------------------------

def _inputs(dev, dtype, batch=2, L=777, Dm=128, N=16, seed=0):
    """The layer's inputs drawn on the CPU from one seed (the same values for every device), with h0."""
    torch.manual_seed(seed)
    inp = make_inputs(batch, L, Dm, N, dtype, "cpu")
    inp["h0"] = torch.randn(batch, Dm, N)
    return {k: v.to(dev) for k, v in inp.items()}


def _call(inp, impl, with_h0, seed=1):
    """y, final state and every gradient, as one tuple of tensors."""
    leaves = {k: v.clone().requires_grad_(True) for k, v in inp.items() if with_h0 or k != "h0"}
    y, h = selscan_fused.selective_scan(leaves["x"], leaves["A_log"], leaves["W_delta"], leaves["b_delta"],
                                        leaves["W_B"], leaves["W_C"], leaves["D"], h0=leaves.get("h0"),
                                        return_final_state=True, impl=impl)
    g = torch.Generator().manual_seed(seed)
    dy = torch.randn(y.shape, generator=g).to(y.device, y.dtype)
    dh = torch.randn(h.shape, generator=g).to(h.device)
    grads = torch.autograd.grad([y, h], list(leaves.values()), [dy, dh])
    return (y, h) + tuple(grads)


def check_devices() -> bool:
    if torch.cuda.device_count() < 2:
        print(f"devices: needs 2 CUDA GPUs, {torch.cuda.device_count()} visible")
        return False
    impls = ["unfused"]
    if selscan_fused._extension.fused_extension_available() and all(
            torch.cuda.get_device_capability(i) == (9, 0) for i in (0, 1)):
        impls.append("fused")
    ok = True
    for impl in impls:
        for dtype in (torch.bfloat16, torch.float32):
            for with_h0 in (False, True):
                for data, current in ((1, 0), (0, 1)):
                    inp = _inputs(f"cuda:{data}", dtype)
                    with torch.cuda.device(data):  # the tensors' device current: the expected results
                        want = _call(inp, impl, with_h0)
                        torch.cuda.synchronize(data)
                    with torch.cuda.device(current):
                        before = torch.cuda.memory_allocated(current)
                        got = _call(inp, impl, with_h0)
                        torch.cuda.synchronize(data)
                        torch.cuda.synchronize(current)
                        stays = torch.cuda.current_device() == current
                        leak = torch.cuda.memory_allocated(current) - before
                    same = all(a.device == b.device and torch.equal(a, b) for a, b in zip(got, want))
                    good = same and stays and leak == 0
                    ok &= good
                    print(f"devices: {impl:8s} {str(dtype):14s} h0={with_h0!s:5s} tensors on cuda:{data}, cuda:{current} "
                          f"current: {'ok' if good else 'FAILED'} (bitwise equal: {same}; current device kept: {stays}; "
                          f"bytes allocated on cuda:{current}: {leak})", flush=True)
    return ok


# --- ddp / fsdp -----------------------------------------------------------------------------------------

def _batches(steps, batch, L, vocab):
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(0, vocab, (batch, L + 1), generator=g) for _ in range(steps)]


def _train(model, batches, device, lr, rows=None):
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses = []
    for tok in batches:
        tok = tok.to(device)
        if rows is not None:
            tok = tok[rows]
        logits = model(tok[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tok[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _full_params(model, fsdp):
    out = {}
    for k, v in model.state_dict().items():
        if fsdp and hasattr(v, "full_tensor"):
            v = v.full_tensor()
        out[k.replace("module.", "")] = v.detach().float().cpu()
    return out


def run_ddp(args) -> bool:
    import torch.distributed as dist
    cpu = args.device == "cpu"
    dist.init_process_group("gloo" if cpu else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu") if cpu else torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    if not cpu:
        torch.cuda.set_device(device)
    impl = "reference" if cpu else args.impl
    batch = args.batch
    assert batch % world == 0, "--batch must be a multiple of the number of processes"
    per = batch // world
    batches = _batches(args.steps, batch, args.L, args.vocab)
    torch.manual_seed(0)
    model = Model(args.vocab, args.width, args.states, args.layers, impl).to(device)
    single = None
    if rank == 0:  # the same model, trained on the whole batch in one process
        single = Model(args.vocab, args.width, args.states, args.layers, impl).to(device)
        single.load_state_dict(model.state_dict())
    ok = True
    modes = ["ddp"] + (["fsdp"] if args.fsdp else [])
    for mode in modes:
        m = Model(args.vocab, args.width, args.states, args.layers, impl).to(device)
        m.load_state_dict(model.state_dict())  # the same initial weights in every mode and process
        if mode == "ddp":
            from torch.nn.parallel import DistributedDataParallel
            wrapped = DistributedDataParallel(m, device_ids=None if cpu else [device.index])
        else:
            try:
                from torch.distributed.fsdp import fully_shard
            except ImportError as e:
                if rank == 0:
                    print(f"fsdp: not run: {e}")
                continue
            from torch.distributed.device_mesh import init_device_mesh
            # The mesh named by the run's device: left to itself, fully_shard takes CUDA whenever it is
            # present, and a CPU run on a one-GPU machine then asks rank 1 for cuda:1.
            mesh = init_device_mesh("cpu" if cpu else "cuda", (world,))
            for b in m.blocks:
                fully_shard(b, mesh=mesh)
            wrapped = fully_shard(m, mesh=mesh)
        rows = slice(rank * per, (rank + 1) * per)
        if args.wrong and rank == world - 1:  # the harness's own check: the last rank trains on wrong rows
            rows = slice(0, per)
        losses = _train(wrapped, batches, device, args.lr, rows)
        params = _full_params(wrapped, mode == "fsdp")
        if rank == 0:
            if mode == modes[0]:
                single_losses = _train(single, batches, device, args.lr)
                ref = _full_params(single, False)
            worst = max(((params[k] - ref[k]).norm() / ref[k].norm().clamp_min(1e-30)).item() for k in ref)
            good = worst < args.tol
            ok &= good
            print(f"{mode}: {world} processes x {per} sequences against 1 x {batch}, {args.steps} steps, impl={impl}: "
                  f"{'ok' if good else 'FAILED'} (largest relative difference of a parameter {worst:.2e}, "
                  f"tolerance {args.tol:g}; loss {losses[0]:.4f} -> {losses[-1]:.4f} on rank 0's half, "
                  f"{single_losses[0]:.4f} -> {single_losses[-1]:.4f} on the whole batch)", flush=True)
    flag = torch.tensor([1.0 if ok else 0.0], device=device)
    dist.broadcast(flag, 0)
    dist.barrier()  # every rank past its last collective before any tears the group down
    dist.destroy_process_group()
    return bool(flag.item())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["devices", "ddp", "all"])
    ap.add_argument("--impl", default="auto", help="the CUDA path of the ddp model (auto, unfused, fused)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--L", type=int, default=256)
    ap.add_argument("--width", type=int, default=128, help="d_model")
    ap.add_argument("--states", type=int, default=16, help="d_state")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--tol", type=float, default=1e-4)
    ap.add_argument("--fsdp", action="store_true")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--wrong", action="store_true", help=argparse.SUPPRESS)  # tests: the check must fail
    a = ap.parse_args(argv)
    if a.what == "devices":
        return 0 if check_devices() else 1
    if a.what == "ddp":
        code = 0 if run_ddp(a) else 1
        # Leave without the interpreter's teardown: with torch 2.14.1 a CPU (gloo) run with FSDP aborts at
        # exit about one time in ten ("terminate called without an active exception", a thread still
        # joinable in a static destructor), after every check has passed and the process group has been
        # destroyed (a barrier before the destruction did not prevent it). The result is printed by then.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    ok = check_devices()
    for impl in ("unfused", "fused", "auto"):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__, "ddp",
               "--impl", impl, "--steps", str(a.steps), "--fsdp"]
        ok &= subprocess.run(cmd).returncode == 0
    print("two GPUs: all checks passed" if ok else "two GPUs: SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
