// torch.library registration of the block's decode step kernels (csrc/decode/). Same conventions as
// csrc/torch_ops.cpp: every argument is checked, naming it, before anything is allocated or launched;
// the work runs on the current CUDA stream under a device guard; nothing synchronises the host.
// selscan_fused/decode.py adds the fake implementation and the Python entry point.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <tuple>

#include "../op_checks.h"
#include "decode_api.h"
#include "norm_api.h"

namespace selscan {
namespace {

void check_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_contiguous(), "selscan_fused: decode_mid: ", name, " must be contiguous (it is read or "
              "written in place with its natural strides)");
}

// y (batch, d_inner) in xz's dtype; conv_state and ssm_state advanced by one token in place.
at::Tensor decode_mid(const at::Tensor& xz, at::Tensor conv_state, at::Tensor ssm_state, const at::Tensor& conv_weight,
                      const c10::optional<at::Tensor>& conv_bias, const at::Tensor& x_proj_weight,
                      const at::Tensor& dt_proj_weight, const at::Tensor& dt_bias, const at::Tensor& A_log,
                      const at::Tensor& D, int64_t launches) {
  TORCH_CHECK(xz.is_cuda(), "selscan_fused: decode_mid: xz is on ", xz.device(),
              "; the op needs CUDA tensors (selscan_fused.mamba_block_step(impl='torch') runs anywhere)");
  TORCH_CHECK(xz.dim() == 2, "selscan_fused: decode_mid: xz (in_proj's output) must have shape (batch, 2 d_inner), "
              "got ", xz.sizes());
  const DType dt = to_dtype(xz.scalar_type(), "xz (decode_mid)");
  TORCH_CHECK(A_log.dim() == 2, "selscan_fused: decode_mid: A_log must have shape (d_inner, d_state), got ",
              A_log.sizes());
  TORCH_CHECK(conv_weight.dim() == 2, "selscan_fused: decode_mid: conv_weight must have shape (d_inner, d_conv), "
              "got ", conv_weight.sizes());
  TORCH_CHECK(dt_proj_weight.dim() == 2, "selscan_fused: decode_mid: dt_proj_weight must have shape (d_inner, "
              "dt_rank), got ", dt_proj_weight.sizes());
  const int64_t batch = xz.size(0), Dn = A_log.size(0), N = A_log.size(1), W = conv_weight.size(1),
                R = dt_proj_weight.size(1);
  TORCH_CHECK(xz.size(1) == 2 * Dn, "selscan_fused: decode_mid: xz has ", xz.size(1), " columns, expected 2 d_inner = ",
              2 * Dn, " (d_inner from A_log)");
  TORCH_CHECK(xz.stride(1) == 1, "selscan_fused: decode_mid: xz must have unit column stride, got strides ",
              xz.strides());
  TORCH_CHECK(batch >= 1 && batch <= 65535, "selscan_fused: decode_mid: batch (xz's first dimension) must be in "
              "1 .. 65535, got ", batch);
  TORCH_CHECK(N >= 1 && N <= kDecodeMaxState, "selscan_fused: decode_mid: d_state (A_log's second dimension) = ", N,
              "; the decode kernel takes 1 .. ", kDecodeMaxState, " (impl='torch' takes any)");
  TORCH_CHECK(R >= 1 && R <= kDecodeMaxRank, "selscan_fused: decode_mid: dt_rank (dt_proj_weight's second "
              "dimension) = ", R, "; the decode kernel takes 1 .. ", kDecodeMaxRank, " (impl='torch' takes any)");
  TORCH_CHECK(W >= 2 && W <= 4, "selscan_fused: decode_mid: d_conv (conv_weight's second dimension) = ", W,
              "; the decode kernel takes 2, 3, 4 (impl='torch' takes any)");
  const char* sizes = " (batch from xz; d_inner, d_state from A_log; d_conv from conv_weight; dt_rank from "
                      "dt_proj_weight)";
  check_tensor(conv_state, "conv_state (decode_mid)", xz, {batch, Dn, W - 1}, xz.scalar_type(), sizes);
  check_tensor(ssm_state, "ssm_state (decode_mid)", xz, {batch, Dn, N}, at::kFloat, sizes);
  // The small parameters: all float32, or all in xz's dtype (A_log's decides which).
  const at::ScalarType small = A_log.scalar_type();
  TORCH_CHECK(small == at::kFloat || small == xz.scalar_type(), "selscan_fused: decode_mid: A_log has dtype ", small,
              "; the small parameters (conv_weight, conv_bias, dt_bias, A_log, D) must all be float32 or all ",
              xz.scalar_type(), " (xz's dtype)");
  check_tensor(conv_weight, "conv_weight (decode_mid)", xz, {Dn, W}, small, sizes);
  if (conv_bias) check_tensor(*conv_bias, "conv_bias (decode_mid)", xz, {Dn}, small, sizes);
  check_tensor(x_proj_weight, "x_proj_weight (decode_mid)", xz, {R + 2 * N, Dn}, xz.scalar_type(), sizes);
  check_tensor(dt_proj_weight, "dt_proj_weight (decode_mid)", xz, {Dn, R}, xz.scalar_type(), sizes);
  check_tensor(dt_bias, "dt_bias (decode_mid)", xz, {Dn}, small, sizes);
  check_tensor(A_log, "A_log (decode_mid)", xz, {Dn, N}, small, sizes);
  check_tensor(D, "D (decode_mid)", xz, {Dn}, small, sizes);
  check_contiguous(conv_state, "conv_state");
  check_contiguous(ssm_state, "ssm_state");
  check_contiguous(conv_weight, "conv_weight");
  if (conv_bias) check_contiguous(*conv_bias, "conv_bias");
  check_contiguous(x_proj_weight, "x_proj_weight");
  check_contiguous(dt_proj_weight, "dt_proj_weight");
  check_contiguous(dt_bias, "dt_bias");
  check_contiguous(A_log, "A_log");
  check_contiguous(D, "D");
  TORCH_CHECK(launches == 1 || launches == 2, "selscan_fused: decode_mid: launches must be 1 (both phases in one "
              "cooperative launch) or 2 (two kernels), got ", launches);

  const c10::cuda::CUDAGuard guard(xz.device());
  at::Tensor y = at::empty({batch, Dn}, xz.options());
  at::Tensor ws = at::empty({decode_workspace_floats(batch, Dn, int(N), int(R))}, xz.options().dtype(at::kFloat));
  DecodeParams p;
  p.batch = batch;
  p.d_inner = Dn;
  p.dstate = int(N);
  p.dt_rank = int(R);
  p.width = int(W);
  p.dtype = dt;
  p.xz = xz.data_ptr();
  p.xz_stride = xz.stride(0);
  p.small_fp32 = small == at::kFloat;
  p.conv_weight = conv_weight.data_ptr();
  p.conv_bias = conv_bias ? conv_bias->data_ptr() : nullptr;
  p.x_proj_weight = x_proj_weight.data_ptr();
  p.dt_proj_weight = dt_proj_weight.data_ptr();
  p.dt_bias = dt_bias.data_ptr();
  p.A_log = A_log.data_ptr();
  p.D = D.data_ptr();
  p.conv_state = conv_state.data_ptr();
  p.ssm_state = ssm_state.data_ptr<float>();
  p.workspace = ws.data_ptr<float>();
  p.y = y.data_ptr();
  p.launches = int(launches);
  SELSCAN_CUDA_OK(decode_mid_launch(p, c10::cuda::getCurrentCUDAStream().stream()), "the decode step launch");
  return y;
}

// (normed, residual_out): selscan_fused.model.Block.add_norm for RMSNorm in one kernel. hidden (rows, dim)
// with unit column stride; residual null or (rows, dim) contiguous, float32 or hidden's dtype; weight
// (dim,) in hidden's dtype. residual_out is float32 when the residual is, or when residual_fp32 and the
// dtype is bfloat16 / float16; hidden's dtype otherwise.
std::tuple<at::Tensor, at::Tensor> add_rmsnorm(const at::Tensor& hidden, const c10::optional<at::Tensor>& residual,
                                               const at::Tensor& weight, double eps, bool residual_fp32) {
  TORCH_CHECK(hidden.is_cuda(), "selscan_fused: add_rmsnorm: hidden is on ", hidden.device(),
              "; the op needs CUDA tensors");
  TORCH_CHECK(hidden.dim() == 2, "selscan_fused: add_rmsnorm: hidden must have shape (rows, d_model), got ",
              hidden.sizes());
  const DType dt = to_dtype(hidden.scalar_type(), "hidden (add_rmsnorm)");
  TORCH_CHECK(hidden.size(1) == 1 || hidden.stride(1) == 1, "selscan_fused: add_rmsnorm: hidden must have unit "
              "column stride, got strides ", hidden.strides());
  const int64_t rows = hidden.size(0), dim = hidden.size(1);
  TORCH_CHECK(rows >= 1 && rows <= 2147483647 && dim >= 1, "selscan_fused: add_rmsnorm: hidden has shape ",
              hidden.sizes(), "; rows 1 .. 2^31 - 1 and d_model >= 1");
  check_tensor(weight, "weight (add_rmsnorm)", hidden, {dim}, hidden.scalar_type(), " (d_model from hidden)");
  TORCH_CHECK(weight.is_contiguous(), "selscan_fused: add_rmsnorm: weight must be contiguous");
  bool res_f32 = false;
  if (residual) {
    TORCH_CHECK(residual->scalar_type() == at::kFloat || residual->scalar_type() == hidden.scalar_type(),
                "selscan_fused: add_rmsnorm: residual has dtype ", residual->scalar_type(), "; expected float32 or ",
                hidden.scalar_type(), " (hidden's dtype)");
    check_tensor(*residual, "residual (add_rmsnorm)", hidden, {rows, dim}, c10::nullopt, " (hidden's shape)");
    TORCH_CHECK(residual->is_contiguous(), "selscan_fused: add_rmsnorm: residual must be contiguous");
    res_f32 = residual->scalar_type() == at::kFloat;
  }
  const bool out_f32 = res_f32 || (residual_fp32 && dt != DType::kFloat32);
  const c10::cuda::CUDAGuard guard(hidden.device());
  at::Tensor normed = at::empty({rows, dim}, hidden.options());
  at::Tensor res_out = at::empty({rows, dim}, hidden.options().dtype(out_f32 ? at::kFloat : hidden.scalar_type()));
  AddNormParams p;
  p.rows = rows;
  p.dim = dim;
  p.dtype = dt;
  p.eps = float(eps);
  p.hidden = hidden.data_ptr();
  p.hidden_stride = hidden.stride(0);
  p.residual = residual ? residual->data_ptr() : nullptr;
  p.residual_fp32 = res_f32;
  p.weight = weight.data_ptr();
  p.normed = normed.data_ptr();
  p.residual_out = res_out.data_ptr();
  p.residual_out_fp32 = out_f32;
  SELSCAN_CUDA_OK(add_rmsnorm_launch(p, c10::cuda::getCurrentCUDAStream().stream()), "the add_rmsnorm launch");
  return {normed, res_out};
}

}  // namespace
}  // namespace selscan

TORCH_LIBRARY_FRAGMENT(selscan_fused, m) {
  // The block's decode step from in_proj's output xz = [xi | z] (batch, 2 d_inner) to the gated y
  // (batch, d_inner) in xz's dtype: the conv update, x_proj, dt_proj, the state update, D and the gate;
  // conv_state (xz's dtype) and ssm_state (float32) advance by one token in place. conv_weight (d_inner,
  // d_conv), conv_bias, dt_bias, A_log and D all in float32 or all in xz's dtype; the two weights in xz's
  // dtype. launches: 1, both phases of csrc/decode/decode_kernel.cuh in one cooperative launch; 2, two
  // kernels (bitwise the same results).
  m.def("decode_mid(Tensor xz, Tensor(a!) conv_state, Tensor(b!) ssm_state, Tensor conv_weight, Tensor? conv_bias, "
        "Tensor x_proj_weight, Tensor dt_proj_weight, Tensor dt_bias, Tensor A_log, Tensor D, int launches=1) -> Tensor");
  // The model's residual add + RMSNorm for the decode step: (normed (hidden's dtype), residual_out).
  m.def("add_rmsnorm(Tensor hidden, Tensor? residual, Tensor weight, float eps, bool residual_fp32) -> "
        "(Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(selscan_fused, CUDA, m) {
  m.impl("decode_mid", &selscan::decode_mid);
  m.impl("add_rmsnorm", &selscan::add_rmsnorm);
}

// CPU tensors reach the same function so that the error says what to do instead of "no CPU kernel".
TORCH_LIBRARY_IMPL(selscan_fused, CPU, m) {
  m.impl("decode_mid", &selscan::decode_mid);
  m.impl("add_rmsnorm", &selscan::add_rmsnorm);
}
