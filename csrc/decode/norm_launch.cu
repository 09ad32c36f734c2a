// The residual add and RMSNorm of the model's decode step (selscan_fused.model.Block.add_norm's math, one
// kernel instead of about ten elementwise ones): per row, s = hidden + residual (in float32 when the
// residual is float32, else rounded to the dtype, as PyTorch's promotion computes it), the residual
// stored (float32 or the dtype), then normed = (x * rsqrt(mean(x^2) + eps)) * weight with x = s rounded to
// the dtype, in float32, rounded to the dtype. One CTA a row; the sum of squares is reduced in a fixed
// order (deterministic).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "../common/cuda_check.h"
#include "../common/device_math.cuh"
#include "norm_api.h"

namespace selscan {
namespace {

constexpr int kNormThreads = 256;

template <class T>
__global__ void __launch_bounds__(kNormThreads) add_rmsnorm_kernel(AddNormParams p) {
  __shared__ float s_warp[kNormThreads / 32];
  const int64_t row = blockIdx.x;
  const T* h = static_cast<const T*>(p.hidden) + row * p.hidden_stride;
  const float* rf = p.residual_fp32 ? static_cast<const float*>(p.residual) + row * p.dim : nullptr;
  const T* rt = (p.residual != nullptr && !p.residual_fp32) ? static_cast<const T*>(p.residual) + row * p.dim : nullptr;
  float* of = p.residual_out_fp32 ? static_cast<float*>(p.residual_out) + row * p.dim : nullptr;
  T* ot = p.residual_out_fp32 ? nullptr : static_cast<T*>(p.residual_out) + row * p.dim;
  float ss = 0.f;
  for (int64_t i = threadIdx.x; i < p.dim; i += kNormThreads) {
    float s = to_float<T>(h[i]);
    if (rf != nullptr) s += rf[i];                                  // float32 residual: one float32 add
    else if (rt != nullptr) s = to_float<T>(from_float<T>(s + to_float<T>(rt[i])));  // dtype + dtype
    if (of != nullptr) of[i] = s;
    else ot[i] = from_float<T>(s);
    const float x = to_float<T>(from_float<T>(s));                  // residual.to(norm weight's dtype)
    ss = fmaf(x, x, ss);
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
  if (threadIdx.x % 32 == 0) s_warp[threadIdx.x / 32] = ss;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < kNormThreads / 32; ++w) total += s_warp[w];
  const float r = rsqrtf(total / float(p.dim) + p.eps);
  const T* w = static_cast<const T*>(p.weight);
  T* out = static_cast<T*>(p.normed) + row * p.dim;
  // The residual this thread stored is read back by the same thread (same indices): no barrier needed.
  for (int64_t i = threadIdx.x; i < p.dim; i += kNormThreads) {
    const float s = of != nullptr ? of[i] : to_float<T>(ot[i]);
    const float x = to_float<T>(from_float<T>(s));
    out[i] = from_float<T>((x * r) * to_float<T>(w[i]));
  }
}

template <class T>
cudaError_t launch_typed(const AddNormParams& p, cudaStream_t stream) {
  add_rmsnorm_kernel<T><<<unsigned(p.rows), kNormThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t add_rmsnorm_launch(const AddNormParams& p, cudaStream_t stream) {
  if (p.rows <= 0 || p.rows > 2147483647 || p.dim <= 0 || p.hidden == nullptr || p.weight == nullptr ||
      p.normed == nullptr || p.residual_out == nullptr)
    return cudaErrorInvalidValue;
  switch (p.dtype) {
    case DType::kFloat32: return launch_typed<float>(p, stream);
    case DType::kBFloat16: return launch_typed<__nv_bfloat16>(p, stream);
    case DType::kFloat16: return launch_typed<__half>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace selscan
