// torch.library registration of the depthwise causal conv1d with fused SiLU (the Mamba-1 block's
// conv; kernels in csrc/conv/conv_kernel.cuh). Same conventions as csrc/torch_ops.cpp: every argument
// is checked, naming it, before anything is allocated or launched; the work runs on the current CUDA
// stream under a device guard; nothing synchronises the host. selscan_fused/conv.py adds the fake
// implementations and the autograd formula.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

#include "../op_checks.h"
#include "conv_api.h"

namespace selscan {
namespace {

// Test hook (conv_set_poison_outputs), as set_poison_outputs in torch_ops.cpp: fill every output and
// the partial sums with NaN before the kernel runs, so that a test can check every element is written.
std::atomic<bool> g_poison_outputs{false};

void poison(at::Tensor& t) {
  if (g_poison_outputs.load(std::memory_order_relaxed) && t.numel() > 0) t.fill_(NAN);
}

DType conv_dtype(const at::Tensor& x) {
  switch (x.scalar_type()) {
    case at::kFloat: return DType::kFloat32;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kHalf: return DType::kFloat16;
    default: break;
  }
  TORCH_CHECK(false, "selscan_fused: causal_conv1d: x has dtype ", x.scalar_type(),
              "; the CUDA op takes float32, bfloat16 or float16 (selscan_fused.conv.causal_conv1d_ref also "
              "takes float64)");
}

struct ConvDims {
  int64_t batch, L, C, W;
};

// The arguments both ops share. Returns (batch, L, C, W).
ConvDims check_conv_args(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                         const c10::optional<at::Tensor>& initial_state) {
  TORCH_CHECK(x.is_cuda(), "selscan_fused: causal_conv1d: x is on ", x.device(),
              "; the op needs CUDA tensors (selscan_fused.conv.causal_conv1d_ref runs on the CPU)");
  TORCH_CHECK(x.dim() == 3, "selscan_fused: causal_conv1d: x must have shape (batch, L, C), got ", x.sizes());
  conv_dtype(x);
  const int64_t batch = x.size(0), L = x.size(1), C = x.size(2);
  TORCH_CHECK(weight.dim() == 2, "selscan_fused: causal_conv1d: weight must have shape (C, W) (nn.Conv1d's "
              "(C, 1, W) reshaped), got ", weight.sizes());
  const int64_t W = weight.size(1);
  TORCH_CHECK(conv_supports_width(W), "selscan_fused: causal_conv1d: weight has width W = ", W,
              " (its last dimension); the CUDA op supports W (d_conv) = 2, 3, 4");
  check_tensor(weight, "weight (causal_conv1d)", x, {C, W}, at::kFloat, " (C from x's last dimension)");
  if (bias) check_tensor(*bias, "bias (causal_conv1d)", x, {C}, at::kFloat, " (C from x's last dimension)");
  if (initial_state) {
    check_tensor(*initial_state, "initial_state (causal_conv1d)", x, {batch, C, W - 1}, at::kFloat,
                 " (batch from x, C from x's last dimension, W - 1 from weight)");
  }
  return {batch, L, C, W};
}

// x with channel stride 1 (the kernels' layout; the batch and token strides stay as they are).
at::Tensor channels_unit_stride(const at::Tensor& t) {
  return (t.size(2) <= 1 || t.stride(2) == 1) ? t : t.contiguous();
}

// Packed sequences (common/seq_map.h): x (1, total, C); cu_seqlens' metadata and the per-sequence
// initial state (num_seqs, C, W-1) float32. Returns num_seqs.
int64_t check_packed_conv(const at::Tensor& x, const ConvDims& d, const at::Tensor& cu,
                          const c10::optional<at::Tensor>& initial_state) {
  TORCH_CHECK(d.batch == 1, "selscan_fused: causal_conv1d: packed sequences take x of shape (1, total_tokens, C), "
              "got ", x.sizes());
  const int64_t S = check_cu_seqlens_arg(cu, x, d.L);
  if (initial_state) {
    check_tensor(*initial_state, "initial_state (causal_conv1d)", x, {S, d.C, d.W - 1}, at::kFloat,
                 " (one per sequence: num_seqs from cu_seqlens, C from x's last dimension, W - 1 from weight)");
  }
  return S;
}

// The forward of both ops: a batch of equal-length sequences (cu null), or packed sequences.
std::tuple<at::Tensor, at::Tensor> conv_fwd_impl(const at::Tensor& x_in, const at::Tensor& weight,
                                                 const c10::optional<at::Tensor>& bias,
                                                 const c10::optional<at::Tensor>& initial_state, bool silu,
                                                 bool return_final_state, const at::Tensor* cu) {
  const ConvDims d = check_conv_args(x_in, weight, bias, cu != nullptr ? c10::nullopt : initial_state);
  const int64_t S = cu != nullptr ? check_packed_conv(x_in, d, *cu, initial_state) : d.batch;  // states' rows
  const c10::cuda::CUDAGuard guard(x_in.device());
  at::Tensor out = at::empty({d.batch, d.L, d.C}, x_in.options());
  at::Tensor fs = return_final_state ? at::empty({S, d.C, d.W - 1}, x_in.options())
                                     : at::empty({0}, x_in.options());
  if (x_in.numel() == 0) {  // nothing to launch; with L = 0 the final state is the initial state
    if (fs.numel() > 0) {
      if (initial_state) fs.copy_(*initial_state);
      else fs.zero_();
    }
    return {out, fs};
  }
  const at::Tensor x = channels_unit_stride(x_in);
  const at::Tensor w = weight.contiguous();
  at::Tensor b, init;
  if (bias) b = bias->contiguous();
  if (initial_state) init = initial_state->contiguous();
  poison(out);
  if (cu != nullptr && fs.numel() > 0) {  // an empty sequence's final state is its initial state (no run)
    if (initial_state) fs.copy_(*initial_state);
    else fs.zero_();
  } else {
    poison(fs);
  }

  ConvParams p;
  p.batch = d.batch; p.seqlen = d.L; p.dim = d.C; p.width = int(d.W);
  p.dtype = conv_dtype(x); p.silu = silu;
  if (cu != nullptr) { p.cu_seqlens = cu->data_ptr<int32_t>(); p.num_seqs = S; }
  p.x = x.data_ptr(); p.x_batch_stride = x.stride(0); p.x_token_stride = x.stride(1);
  p.weight = w.data_ptr<float>();
  p.bias = bias ? b.data_ptr<float>() : nullptr;
  p.initial_state = initial_state ? init.data_ptr<float>() : nullptr;
  p.out = out.data_ptr();
  p.final_state = return_final_state ? fs.data_ptr() : nullptr;
  SELSCAN_CUDA_OK(conv_fwd_plan(&p), "planning causal_conv1d");
  SELSCAN_CUDA_OK(conv_fwd_launch(p, c10::cuda::getCurrentCUDAStream().stream()), "the causal_conv1d forward launch");
  return {out, fs};
}

std::tuple<at::Tensor, at::Tensor> causal_conv1d_fwd(const at::Tensor& x_in, const at::Tensor& weight,
                                                     const c10::optional<at::Tensor>& bias,
                                                     const c10::optional<at::Tensor>& initial_state, bool silu,
                                                     bool return_final_state) {
  return conv_fwd_impl(x_in, weight, bias, initial_state, silu, return_final_state, nullptr);
}

std::tuple<at::Tensor, at::Tensor> causal_conv1d_packed_fwd(const at::Tensor& x_in, const at::Tensor& weight,
                                                            const c10::optional<at::Tensor>& bias,
                                                            const c10::optional<at::Tensor>& initial_state,
                                                            const at::Tensor& cu_seqlens, bool silu,
                                                            bool return_final_state) {
  const at::Tensor cu = cu_seqlens.contiguous();
  return conv_fwd_impl(x_in, weight, bias, initial_state, silu, return_final_state, &cu);
}

// Returns (dx, dweight, dbias or (0,), dinitial_state or (0,)): dx in x's dtype, the rest float32.
std::vector<at::Tensor> conv_bwd_impl(const at::Tensor& x_in, const at::Tensor& weight,
                                      const c10::optional<at::Tensor>& bias,
                                      const c10::optional<at::Tensor>& initial_state, const at::Tensor& dout_in,
                                      const c10::optional<at::Tensor>& dfinal_state, bool silu, const at::Tensor* cu) {
  const ConvDims d = check_conv_args(x_in, weight, bias, cu != nullptr ? c10::nullopt : initial_state);
  const int64_t S = cu != nullptr ? check_packed_conv(x_in, d, *cu, initial_state) : d.batch;  // states' rows
  check_tensor(dout_in, "dout (the gradient of causal_conv1d's out)", x_in, x_in.sizes(), c10::nullopt);
  TORCH_CHECK(dout_in.is_floating_point(), "selscan_fused: causal_conv1d: dout must be floating-point, got ",
              dout_in.scalar_type());
  if (dfinal_state) {
    check_tensor(*dfinal_state, "dfinal_state (the gradient of causal_conv1d's final_state)", x_in,
                 {S, d.C, d.W - 1}, c10::nullopt,
                 " (batch (num_seqs when packed) from x, C from x's last dimension, W - 1 from weight)");
    TORCH_CHECK(dfinal_state->is_floating_point(),
                "selscan_fused: causal_conv1d: dfinal_state must be floating-point, got ", dfinal_state->scalar_type());
  }
  const c10::cuda::CUDAGuard guard(x_in.device());
  const auto fopt = x_in.options().dtype(at::kFloat);
  at::Tensor dx = at::empty({d.batch, d.L, d.C}, x_in.options());
  at::Tensor dinit = initial_state ? at::empty({S, d.C, d.W - 1}, fopt) : at::empty({0}, fopt);
  if (x_in.numel() == 0) {  // no token (or no channel, or no sequence): only dfinal_state can reach dinit
    at::Tensor dbias = bias ? at::zeros({d.C}, fopt) : at::empty({0}, fopt);
    if (dinit.numel() > 0) {
      if (dfinal_state) dinit.copy_(*dfinal_state);  // L = 0: final_state is initial_state
      else dinit.zero_();
    }
    return {dx, at::zeros({d.C, d.W}, fopt), dbias, dinit};
  }
  const at::Tensor x = channels_unit_stride(x_in);
  const at::Tensor dout = channels_unit_stride(dout_in.to(x.scalar_type()));
  const at::Tensor w = weight.contiguous();
  at::Tensor b, init, dfs;
  if (bias) b = bias->contiguous();
  if (initial_state) init = initial_state->contiguous();
  if (dfinal_state) dfs = dfinal_state->to(at::kFloat).contiguous();

  ConvBwdParams p;
  p.batch = d.batch; p.seqlen = d.L; p.dim = d.C; p.width = int(d.W);
  p.dtype = conv_dtype(x); p.silu = silu;
  p.x = x.data_ptr(); p.x_batch_stride = x.stride(0); p.x_token_stride = x.stride(1);
  p.weight = w.data_ptr<float>();
  p.bias = bias ? b.data_ptr<float>() : nullptr;
  p.initial_state = initial_state ? init.data_ptr<float>() : nullptr;
  p.dout = dout.data_ptr(); p.dout_batch_stride = dout.stride(0); p.dout_token_stride = dout.stride(1);
  p.dfinal_state = dfinal_state ? dfs.data_ptr<float>() : nullptr;
  p.dx = dx.data_ptr();
  p.dinitial_state = initial_state ? dinit.data_ptr<float>() : nullptr;
  if (cu != nullptr) { p.cu_seqlens = cu->data_ptr<int32_t>(); p.num_seqs = S; }
  SELSCAN_CUDA_OK(conv_bwd_plan(&p), "planning the causal_conv1d backward");
  at::Tensor partial = at::empty({conv_bwd_partial_rows(p), d.W + 1, d.C}, fopt);
  poison(dx);
  if (cu != nullptr && dinit.numel() > 0) {  // an empty sequence's: its dfinal_state (no run writes it)
    if (dfinal_state) dinit.copy_(*dfinal_state);
    else dinit.zero_();
  } else {
    poison(dinit);
  }
  poison(partial);
  p.partial = partial.data_ptr<float>();
  SELSCAN_CUDA_OK(conv_bwd_launch(p, c10::cuda::getCurrentCUDAStream().stream()),
                  "the causal_conv1d backward launch");
  // The CTAs' partial sums over the rows (one per (sequence, token tile)), by a fixed-order reduction:
  // bitwise deterministic.
  at::Tensor dweight = partial.narrow(1, 0, d.W).sum(0).t().contiguous();  // (C, W)
  at::Tensor dbias = bias ? partial.select(1, d.W).sum(0) : at::empty({0}, fopt);
  return {dx, dweight, dbias, dinit};
}

std::vector<at::Tensor> causal_conv1d_bwd(const at::Tensor& x_in, const at::Tensor& weight,
                                          const c10::optional<at::Tensor>& bias,
                                          const c10::optional<at::Tensor>& initial_state, const at::Tensor& dout_in,
                                          const c10::optional<at::Tensor>& dfinal_state, bool silu) {
  return conv_bwd_impl(x_in, weight, bias, initial_state, dout_in, dfinal_state, silu, nullptr);
}

std::vector<at::Tensor> causal_conv1d_packed_bwd(const at::Tensor& x_in, const at::Tensor& weight,
                                                 const c10::optional<at::Tensor>& bias,
                                                 const c10::optional<at::Tensor>& initial_state,
                                                 const at::Tensor& dout_in, const c10::optional<at::Tensor>& dfinal_state,
                                                 const at::Tensor& cu_seqlens, bool silu) {
  const at::Tensor cu = cu_seqlens.contiguous();
  return conv_bwd_impl(x_in, weight, bias, initial_state, dout_in, dfinal_state, silu, &cu);
}

void conv_set_poison_outputs(bool enable) { g_poison_outputs.store(enable); }

}  // namespace
}  // namespace selscan

TORCH_LIBRARY_FRAGMENT(selscan_fused, m) {
  // out = silu(depthwise causal conv1d of x (batch, L, C) with weight (C, W) + bias), (batch, L, C) in
  // x's dtype; final_state (batch, C, W-1) in x's dtype when return_final_state, else empty (0,).
  m.def("causal_conv1d_fwd(Tensor x, Tensor weight, Tensor? bias, Tensor? initial_state, bool silu, "
        "bool return_final_state) -> (Tensor, Tensor)");
  // [dx (x's dtype), dweight (C, W), dbias (C,) or empty, dinitial_state (batch, C, W-1) or empty], float32
  // but dx.
  m.def("causal_conv1d_bwd(Tensor x, Tensor weight, Tensor? bias, Tensor? initial_state, Tensor dout, "
        "Tensor? dfinal_state, bool silu) -> Tensor[]");
  // Packed sequences (cu_seqlens int32 (num_seqs + 1,), x (1, total, C)): the window restarts at every
  // sequence start; initial_state, final_state and their gradients are (num_seqs, C, W-1).
  m.def("causal_conv1d_packed_fwd(Tensor x, Tensor weight, Tensor? bias, Tensor? initial_state, Tensor cu_seqlens, "
        "bool silu, bool return_final_state) -> (Tensor, Tensor)");
  m.def("causal_conv1d_packed_bwd(Tensor x, Tensor weight, Tensor? bias, Tensor? initial_state, Tensor dout, "
        "Tensor? dfinal_state, Tensor cu_seqlens, bool silu) -> Tensor[]");
  // Test hook: NaN-fill the conv ops' outputs before every launch (off by default).
  m.def("conv_set_poison_outputs(bool enable) -> ()", &selscan::conv_set_poison_outputs);
}

TORCH_LIBRARY_IMPL(selscan_fused, CUDA, m) {
  m.impl("causal_conv1d_fwd", &selscan::causal_conv1d_fwd);
  m.impl("causal_conv1d_bwd", &selscan::causal_conv1d_bwd);
  m.impl("causal_conv1d_packed_fwd", &selscan::causal_conv1d_packed_fwd);
  m.impl("causal_conv1d_packed_bwd", &selscan::causal_conv1d_packed_bwd);
}

// CPU tensors reach the same functions so that the error says what to do instead of "no CPU kernel".
TORCH_LIBRARY_IMPL(selscan_fused, CPU, m) {
  m.impl("causal_conv1d_fwd", &selscan::causal_conv1d_fwd);
  m.impl("causal_conv1d_bwd", &selscan::causal_conv1d_bwd);
  m.impl("causal_conv1d_packed_fwd", &selscan::causal_conv1d_packed_fwd);
  m.impl("causal_conv1d_packed_bwd", &selscan::causal_conv1d_packed_bwd);
}
