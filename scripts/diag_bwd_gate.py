"""The backward scan kernel with and without the block's gate, at the same scan sizes, for a profiler:
the block (selscan_fused.Mamba, impl='unfused', d_model 768 -> d_inner 1536, N 16) and the layer
(selective_scan, impl='unfused', D 1536, N 16), one training step each after a warm-up, bf16.

    ncu --clock-control none --kernel-name regex:scan_bwd_kernel --launch-skip 4 --launch-count 2 \\
        python scripts/diag_bwd_gate.py --batch 8 --L 2048

The warm-up runs two steps of each (--launch-skip 4 skips their four launches; the profiled ones are the
third block step, then the third layer step). Needs a GPU and the built extension.
"""
import argparse

import torch

import selscan_fused


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--L", type=int, default=2048)
    ap.add_argument("--d-model", type=int, default=768)
    a = ap.parse_args()
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    blk = selscan_fused.Mamba(a.d_model, impl="unfused").to(dev, dt)
    D, N = blk.d_inner, blk.d_state
    u = torch.randn(a.batch, a.L, a.d_model, device=dev, dtype=dt, requires_grad=True)
    x = torch.randn(a.batch, a.L, D, device=dev, dtype=dt, requires_grad=True)
    w = dict(A_log=torch.log(torch.rand(D, N, device=dev) * 15 + 1).requires_grad_(),
             W_delta=(torch.randn(D, D, device=dev) / D ** 0.5).to(dt).requires_grad_(),
             b_delta=torch.full((D,), -4.0, device=dev).requires_grad_(),
             W_B=(torch.randn(N, D, device=dev) / D ** 0.5).to(dt).requires_grad_(),
             W_C=(torch.randn(N, D, device=dev) / D ** 0.5).to(dt).requires_grad_(),
             D=torch.ones(D, device=dev).requires_grad_())

    def block_step():
        blk(u).float().square().mean().backward()

    def layer_step():
        selscan_fused.selective_scan(x, impl="unfused", **w).float().square().mean().backward()

    # two warm-up steps of each, then one profiled step of each, block first
    for f in (block_step, block_step, layer_step, layer_step, block_step, layer_step):
        f()
    torch.cuda.synchronize()
    print(f"block: batch {a.batch}, L {a.L}, d_inner {D}, N {N}; layer: D {D}, N {N}; done")


if __name__ == "__main__":
    main()
