// Argument checks shared by the op bindings (csrc/torch_ops.cpp, csrc/fused/fused_ops.cpp): each error
// names the offending argument, and all of them run before anything is allocated or launched.
#pragma once
#include <ATen/ATen.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

#include "common/checkpoints.h"
#include "common/dtype.h"

namespace selscan {
namespace {

#define SELSCAN_CUDA_OK(expr, what)                                                       \
  do {                                                                                    \
    const cudaError_t err__ = (expr);                                                     \
    TORCH_CHECK(err__ == cudaSuccess, "selscan_fused: ", what, " failed: ",              \
                cudaGetErrorName(err__), ": ", cudaGetErrorString(err__));                \
  } while (0)

inline DType to_dtype(at::ScalarType t, const char* name) {
  switch (t) {
    case at::kFloat: return DType::kFloat32;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kHalf: return DType::kFloat16;
    default: break;
  }
  TORCH_CHECK(false, "selscan_fused: ", name, " has dtype ", t,
              "; the CUDA paths take float32, bfloat16 or float16 (impl='reference' also takes float64)");
}

inline void check_tensor(const at::Tensor& t, const char* name, const at::Tensor& x, at::IntArrayRef shape,
                  c10::optional<at::ScalarType> dtype, const char* where = "") {
  TORCH_CHECK(t.device() == x.device(), "selscan_fused: ", name, " is on ", t.device(), " but x is on ",
              x.device(), "; all tensors must be on the same device");
  TORCH_CHECK(t.sizes() == shape, "selscan_fused: ", name, " has shape ", t.sizes(), ", expected ", shape, where);
  if (dtype) {
    TORCH_CHECK(t.scalar_type() == *dtype, "selscan_fused: ", name, " has dtype ", t.scalar_type(),
                ", expected ", *dtype);
  }
}

// cu_seqlens' metadata (its values are the caller's: checked on the host by selscan_fused.varlen unless
// validate=False, clamped on the device either way). Returns num_seqs.
inline int64_t check_cu_seqlens_arg(const at::Tensor& cu, const at::Tensor& x, int64_t total) {
  TORCH_CHECK(cu.device() == x.device(), "selscan_fused: cu_seqlens is on ", cu.device(), " but x is on ",
              x.device(), "; all tensors must be on the same device");
  TORCH_CHECK(cu.scalar_type() == at::kInt, "selscan_fused: cu_seqlens must be int32, got ", cu.scalar_type());
  TORCH_CHECK(cu.dim() == 1 && cu.size(0) >= 2, "selscan_fused: cu_seqlens must have shape (num_seqs + 1,) with "
              "num_seqs >= 1, got ", cu.sizes());
  TORCH_CHECK(total <= std::numeric_limits<int32_t>::max(), "selscan_fused: the packed length ", total,
              " does not fit cu_seqlens' int32 values");
  return cu.size(0) - 1;
}

// x's width against the parameters': when every parameter agrees on a d_model other than x's last
// dimension, the mistake is x's, and the message says so (rather than blaming the first parameter).
inline void check_x_width(const at::Tensor& x, const at::Tensor& A_log, const at::Tensor& b_delta, const at::Tensor& D,
                          const at::Tensor* W_delta, const at::Tensor* W_B, const at::Tensor* W_C) {
  const int64_t Dm = x.size(2), P = A_log.size(0);
  if (P == Dm) return;
  bool agree = b_delta.dim() == 1 && b_delta.size(0) == P && D.dim() == 1 && D.size(0) == P;
  if (W_delta) agree = agree && W_delta->dim() == 2 && W_delta->size(0) == P && W_delta->size(1) == P;
  if (W_B) agree = agree && W_B->dim() == 2 && W_B->size(1) == P;
  if (W_C) agree = agree && W_C->dim() == 2 && W_C->size(1) == P;
  TORCH_CHECK(!agree, "selscan_fused: x has D = ", Dm, " channels (its last dimension; x has shape ", x.sizes(),
              ") but the parameters are for D = ", P, " (A_log ", A_log.sizes(), ", b_delta ", b_delta.sizes(),
              ", D ", D.sizes(), W_delta ? ", W_delta and W_B, W_C of the same width" : "",
              "): x's last dimension must be the parameters' d_model");
}

// Shapes shared by every op. Returns (batch, L, D, N).
inline std::tuple<int64_t, int64_t, int64_t, int64_t> check_common(const at::Tensor& x, const at::Tensor& A_log,
                                                            const at::Tensor& b_delta, const at::Tensor& D,
                                                            const c10::optional<at::Tensor>& h0,
                                                            const at::Tensor* W_delta = nullptr,
                                                            const at::Tensor* W_B = nullptr,
                                                            const at::Tensor* W_C = nullptr) {
  TORCH_CHECK(x.is_cuda(), "selscan_fused: x is on ", x.device(),
              "; the CUDA paths need CUDA tensors (impl='reference' runs on the CPU)");
  TORCH_CHECK(x.dim() == 3, "selscan_fused: x must have shape (batch, L, D), got ", x.sizes());
  to_dtype(x.scalar_type(), "x");
  TORCH_CHECK(A_log.dim() == 2, "selscan_fused: A_log must have shape (D, N), got ", A_log.sizes());
  check_x_width(x, A_log, b_delta, D, W_delta, W_B, W_C);
  const int64_t batch = x.size(0), L = x.size(1), Dm = x.size(2), N = A_log.size(1);
  check_tensor(A_log, "A_log", x, {Dm, N}, at::kFloat, " (D from x's last dimension)");
  check_tensor(b_delta, "b_delta", x, {Dm}, at::kFloat, " (D from x's last dimension)");
  check_tensor(D, "D", x, {Dm}, at::kFloat, " (D from x's last dimension)");
  if (h0) check_tensor(*h0, "h0", x, {batch, Dm, N}, at::kFloat, " (batch from x, D from x's last dimension, N from A_log)");
  return {batch, L, Dm, N};
}

// check_common and the three projection weights (in x's dtype) of the layer ops. Returns (batch, L, D, N).
inline std::tuple<int64_t, int64_t, int64_t, int64_t> check_layer(
    const at::Tensor& x, const at::Tensor& A_log, const at::Tensor& W_delta, const at::Tensor& b_delta,
    const at::Tensor& W_B, const at::Tensor& W_C, const at::Tensor& D, const c10::optional<at::Tensor>& h0) {
  auto dims = check_common(x, A_log, b_delta, D, h0, &W_delta, &W_B, &W_C);
  const int64_t Dm = std::get<2>(dims), N = std::get<3>(dims);
  const char* dn = " (D from x's last dimension, N from A_log's second)";
  check_tensor(W_delta, "W_delta", x, {Dm, Dm}, x.scalar_type(), " (D from x's last dimension)");
  check_tensor(W_B, "W_B", x, {N, Dm}, x.scalar_type(), dn);
  check_tensor(W_C, "W_C", x, {N, Dm}, x.scalar_type(), dn);
  return dims;
}

// 16-byte aligned and contiguous, as the kernels' vector loads need.
inline at::Tensor aligned_contiguous(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  if (reinterpret_cast<uintptr_t>(c.data_ptr()) % 16 != 0) c = c.clone();
  return c;
}

// A (batch, L, K) operand whose rows the scan kernels address as row (b * L + t) * stride: the tensor
// itself when its last dimension is contiguous, its pointer and row stride 16-byte aligned and its
// batch stride L rows (a column slice of a contiguous tensor, such as [B | C] inside x_proj's output);
// otherwise a contiguous aligned copy. Returns (tensor, row stride in elements).
inline std::pair<at::Tensor, int64_t> row_operand(const at::Tensor& t) {
  const int64_t es = t.element_size();
  if (t.dim() == 3 && t.stride(2) == 1 && (t.size(0) <= 1 || t.stride(0) == t.size(1) * t.stride(1)) &&
      (t.stride(1) * es) % 16 == 0 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 && t.stride(1) >= t.size(2))
    return {t, t.stride(1)};
  at::Tensor c = aligned_contiguous(t);
  return {c, c.size(-1)};
}

inline std::tuple<at::Tensor, at::Tensor> empty_result(const at::Tensor& x, int64_t batch, int64_t Dm, int64_t N,
                                                const c10::optional<at::Tensor>& h0, bool return_final_state) {
  at::Tensor y = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor hT = at::empty({0}, x.options().dtype(at::kFloat));
  if (return_final_state) hT = h0 ? h0->clone(at::MemoryFormat::Contiguous) : at::zeros({batch, Dm, N}, hT.options());
  return {y, hT};
}

// The backward ops' own arguments: the upstream gradients (any floating dtype, any strides) and the
// forward's checkpoints.
inline void check_backward_args(const at::Tensor& x, const at::Tensor& dy, const c10::optional<at::Tensor>& dhT,
                                const at::Tensor& ckpt, int64_t batch, int64_t L, int64_t Dm, int64_t N) {
  check_tensor(dy, "dy (the gradient of y)", x, x.sizes(), c10::nullopt);
  TORCH_CHECK(dy.is_floating_point(), "selscan_fused: dy (the gradient of y) must be floating-point, got ",
              dy.scalar_type());
  if (dhT) {
    check_tensor(*dhT, "dhT (the gradient of the final state)", x, {batch, Dm, N}, c10::nullopt);
    TORCH_CHECK(dhT->is_floating_point(), "selscan_fused: dhT must be floating-point, got ", dhT->scalar_type());
  }
  check_tensor(ckpt, "ckpt (the forward's checkpoints)", x, {batch, ckpt_count(L), Dm, N}, at::kFloat);
}

// The end of both paths' backward, after the kernel: the sums of its partials over channel tiles,
// (segment, sequence) items and store rows, each a fixed-order reduction (bitwise deterministic), then
// the library products dx += dP . [W_delta; W_B; W_C] and dW = dP^T . x (one product per weight, so
// that every output is a product's own result). dP (batch, L, D + 2N): columns [0, D) hold dz, the
// last 2N are filled here from bc_part (batch * L, tiles, 2N); dA_part (rows, D, N); dDdb_part
// (2, rows', D): the sums of dy * x and of dz. Returns (dx, dA_log, dW_delta, db_delta, dW_B, dW_C, dD,
// dh0).
// The sums of the backward scan kernel's partials (the first half of finish_backward; the block's
// backward stops here, its products being its own): fills dP's last 2N columns and returns
// (dA_log, dD, db_delta).
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> sum_partials(const at::Tensor& A_log, at::Tensor& dP,
                                                                   const at::Tensor& bc_part, const at::Tensor& dA_part,
                                                                   const at::Tensor& dDdb_part, int64_t batch,
                                                                   int64_t L, int64_t Dm, int64_t N) {
  dP.narrow(2, Dm, 2 * N).copy_(bc_part.sum(1).view({batch, L, 2 * N}));
  // dA_log = dA * A, A = -exp(A_log), clamped to -FLT_MAX as in the kernels (decay_rate): past
  // A_log ~ 88.7 the decay is 0, dA is 0, and 0 * -inf would be NaN.
  at::Tensor dA_log = dA_part.sum(0).mul_(A_log.exp().neg_().clamp_min_(-std::numeric_limits<float>::max()));
  return {dA_log, dDdb_part[0].sum(0), dDdb_part[1].sum(0)};
}

// dW = G^T . X over the K = batch * L rows of G (K, M) and X (K, D): the backward's weight gradients.
// cuBLAS 13.0's split-K kernels on the H100 (nvjet ..._splitK, picked for a small M or D and a long K)
// drop part of a last partial K tile of 64: with K = 4097 (one row past a multiple of 64) dW_B was
// 1.8% off, the missing row's share, and a float32 output or
// torch.backends.cuda.matmul.allow_{bf16,fp16}_reduced_precision_reduction = False did not change it
// (docs/reliability.md, "cuBLAS split-K and a partial K tile"). So the product runs over the rows up to
// a multiple of 64 and over the rest (fewer than 64) apart; 16-bit products have float32 outputs,
// summed, then rounded once to the dtype.
inline at::Tensor weight_grad(const at::Tensor& G, const at::Tensor& X) {
  constexpr int64_t kTile = 64;
  const int64_t K = G.size(0), K0 = K / kTile * kTile;
  const bool half = G.scalar_type() != at::kFloat;
  auto prod = [&](int64_t k0, int64_t n) {
    const at::Tensor g = G.narrow(0, k0, n).t(), x = X.narrow(0, k0, n);
    return half ? at::mm(g, x, at::kFloat) : at::mm(g, x);
  };
  if (K0 == K) return half ? prod(0, K).to(G.scalar_type()) : prod(0, K);
  at::Tensor out = prod(K0, K - K0);
  if (K0 > 0) out.add_(prod(0, K0));
  return half ? out.to(G.scalar_type()) : out;
}

inline std::vector<at::Tensor> finish_backward(const at::Tensor& x, const at::Tensor& W, const at::Tensor& A_log,
                                               at::Tensor& dP, at::Tensor& dx, const at::Tensor& bc_part,
                                               const at::Tensor& dA_part, const at::Tensor& dDdb_part,
                                               const at::Tensor& dh0, int64_t batch, int64_t L, int64_t Dm,
                                               int64_t N) {
  const int64_t BL = batch * L, P = Dm + 2 * N;
  auto [dA_log, dD, db] = sum_partials(A_log, dP, bc_part, dA_part, dDdb_part, batch, L, Dm, N);
  const at::Tensor dP2 = dP.view({BL, P});
  dx.view({BL, Dm}).addmm_(dP2, W);  // dx = dx_scan + dP . W
  const at::Tensor x2 = x.view({BL, Dm});
  at::Tensor dW_delta = weight_grad(dP2.narrow(1, 0, Dm), x2);   // dz^T . x
  at::Tensor dW_B = weight_grad(dP2.narrow(1, Dm, N), x2);       // dB^T . x
  at::Tensor dW_C = weight_grad(dP2.narrow(1, Dm + N, N), x2);   // dC^T . x
  return {dx, dA_log, dW_delta, db, dW_B, dW_C, dD, dh0};
}

}  // namespace
}  // namespace selscan
