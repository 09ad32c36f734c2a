// torch.library registration of the gate's derivative (csrc/scan/gate_bwd.cu), used by the Mamba block's
// backward (selscan_fused/_ops.py, _gated_scan_backward). Conventions as csrc/torch_ops.cpp: arguments
// checked by name first, the current stream under a device guard, no host synchronisation.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <tuple>

#include "../op_checks.h"
#include "gate_bwd.h"

namespace selscan {
namespace {

// (dyu, dz), contiguous, in dy's dtype: the gate y = yu * silu(z)'s derivative for dy.
std::tuple<at::Tensor, at::Tensor> gate_bwd(const at::Tensor& dy, const at::Tensor& z, const at::Tensor& yu) {
  TORCH_CHECK(dy.is_cuda(), "selscan_fused: gate_bwd: dy is on ", dy.device(), "; the op needs CUDA tensors");
  TORCH_CHECK(dy.dim() == 3, "selscan_fused: gate_bwd: dy must have shape (batch, L, d_inner), got ", dy.sizes());
  const DType dt = to_dtype(dy.scalar_type(), "dy (gate_bwd)");
  check_tensor(z, "z (gate_bwd)", dy, dy.sizes(), dy.scalar_type(), " (dy's shape and dtype)");
  check_tensor(yu, "yu (gate_bwd)", dy, dy.sizes(), dy.scalar_type(), " (dy's shape and dtype)");
  const int64_t batch = dy.size(0), L = dy.size(1), Dn = dy.size(2);
  TORCH_CHECK(Dn <= 1 || (dy.stride(2) == 1 && z.stride(2) == 1), "selscan_fused: gate_bwd: dy and z need unit "
              "channel stride, got ", dy.strides(), " and ", z.strides());
  TORCH_CHECK(yu.is_contiguous(), "selscan_fused: gate_bwd: yu must be contiguous");
  const c10::cuda::CUDAGuard guard(dy.device());
  at::Tensor dyu = at::empty({batch, L, Dn}, dy.options());
  at::Tensor dz = at::empty({batch, L, Dn}, dy.options());
  if (dy.numel() == 0) return {dyu, dz};
  GateBwdParams p;
  p.batch = batch;
  p.seqlen = L;
  p.dim = Dn;
  p.dtype = dt;
  p.dy = dy.data_ptr();
  p.dy_batch_stride = dy.stride(0);
  p.dy_token_stride = dy.stride(1);
  p.z = z.data_ptr();
  p.z_batch_stride = z.stride(0);
  p.z_token_stride = z.stride(1);
  p.yu = yu.data_ptr();
  p.dyu = dyu.data_ptr();
  p.dz = dz.data_ptr();
  SELSCAN_CUDA_OK(gate_bwd_launch(p, c10::cuda::getCurrentCUDAStream().stream()), "the gate_bwd launch");
  return {dyu, dz};
}

}  // namespace
}  // namespace selscan

TORCH_LIBRARY_FRAGMENT(selscan_fused, m) {
  // The Mamba block's gate y = yu * silu(z), backward: (dyu, dz) for dy, in float32, stored in dy's dtype.
  m.def("gate_bwd(Tensor dy, Tensor z, Tensor yu) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(selscan_fused, CUDA, m) { m.impl("gate_bwd", &selscan::gate_bwd); }

TORCH_LIBRARY_IMPL(selscan_fused, CPU, m) { m.impl("gate_bwd", &selscan::gate_bwd); }
