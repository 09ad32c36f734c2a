// Device helpers shared by the unfused scan and the fused kernel: the exponential and softplus used by
// every path, and conversions between the storage types and float.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

namespace selscan {

// log2(e): A is pre-scaled by it so that exp(delta * A) costs one MUFU.EX2.
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// 2^x on the special-function unit (ex2.approx.ftz: about 2 ulp; flushes denormal results to zero).
__device__ __forceinline__ float ex2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float lg2_approx(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// softplus as torch.nn.functional.softplus (beta 1, threshold 20): v for v > 20, else log(1 + e^v).
// Two MUFU operations; below v = -15 log1p(e) = e to within e^2/2 < 1e-13, which avoids 1 + e rounding.
// NaN propagates (every comparison with NaN is false and the last branch computes with it). The unfused
// scan uses this form (its timings were measured with it).
__device__ __forceinline__ float softplus(float v) {
  const float e = ex2_approx(v * kLog2e);
  const float l = lg2_approx(1.f + e) * kLn2;
  return v > 20.f ? v : (v < -15.f ? e : l);
}

// The same function as max(v, 0) + log(1 + e^-|v|), without selects: 6 instructions instead of 9, the
// same two MUFU operations; measured 0.5-1.5% faster in the fused kernel's epilogue, which uses it
// (docs/perf-notes.md, v3.5). Beyond float32 rounding it differs from softplus() only for v < -15,
// where the rounding of 1 + e^v costs at most ~6e-8 absolute (below v = -16.6 it returns 0 where
// softplus() returns e^v < 6e-8): negligible in delta * x * B and in exp(delta * A). Above v = 20 the
// log term is below half an ulp of v.
// e^-|v| <= 1 cannot overflow; NaN propagates through the log term (fmaxf drops it, the FFMA adds it
// back); +Inf gives Inf, -Inf gives 0.
__device__ __forceinline__ float softplus_noselect(float v) {
  const float e = ex2_approx(-fabsf(v) * kLog2e);
  const float l = lg2_approx(1.f + e);
  return fmaf(l, kLn2, fmaxf(v, 0.f));
}

// scale * A with A = -exp(A_log) (scale 1, or log2(e) for ex2_approx), clamped to -FLT_MAX where it
// would be -inf (A_log above ~88.7, or +inf). The kernels pad a tile past L with dt = 0, whose step
// exp(0 * A) = 1 must stay the identity: -inf * 0 is NaN, -FLT_MAX * 0 is 0 (it would otherwise turn a
// finite final state into NaN). For every dt > 2^-100 the decay is still exactly 0. NaN stays NaN.
__device__ __forceinline__ float decay_rate(float A_log, float scale) {
  const float a = -__expf(A_log) * scale;
  return a < -3.402823466e38f ? -3.402823466e38f : a;
}

template <class T> __device__ __forceinline__ float to_float(T v);
template <> __device__ __forceinline__ float to_float<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <> __device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }

template <class T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }

}  // namespace selscan
