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

// log(1 + e) for 0 <= e <= e^-4 (about 0.0183) by log1p's series to the e^4 term: relative error below
// e^4 / 5 < 2.3e-8 there, from four FMA-pipe instructions. Forming 1 + e in float32 instead keeps only
// e's bits above 2^-24: delta's relative error would be 5.5e-5 at a softplus argument of -7 and 2e-3
// at -13 (docs/reliability.md, "Found, and fixed").
__device__ __forceinline__ float log1p_small(float e) {
  return e * fmaf(e, fmaf(e, fmaf(e, -0.25f, 0.33333334f), -0.5f), 1.f);
}

// softplus as torch.nn.functional.softplus (beta 1, threshold 20): v for v > 20, log1p's series of e^v
// below -4, else ln 2 * lg2(1 + e^v). Two MUFU operations. Relative error against float64 below 1e-6
// for v < -4 (ex2.approx's 2 ulp), below 3.3e-6 on [-4, 0] (the rounding of 1 + e^v and lg2.approx's
// absolute error against a value of at least 0.018). ex2.approx flushes e^v to 0 below v = -87.3,
// where float64's softplus is itself below float32's normal range. NaN propagates (every comparison
// with NaN is false and the last branch computes with it). The unfused scan and the backward use it.
__device__ __forceinline__ float softplus(float v) {
  const float e = ex2_approx(v * kLog2e);
  const float l = lg2_approx(1.f + e) * kLn2;
  return v > 20.f ? v : (v < -4.f ? log1p_small(e) : l);
}

// The same function as max(v, 0) + log(1 + e^-|v|), with fewer selects (docs/perf/layer-forward.md, v3.5: the
// select-free form was 0.5-1.5% faster in the fused kernel's epilogue, which uses this one): log1p's
// series for |v| > 4, where 1 + e^-|v| would round away e^-|v|'s low bits. Above v = 20 the log term is
// below half an ulp of v. e^-|v| <= 1 cannot overflow; NaN propagates (fabsf(NaN) > 4 is false, the
// lg2 term is NaN and is added to fmaxf's 0); +Inf gives Inf, -Inf gives 0.
__device__ __forceinline__ float softplus_noselect(float v) {
  const float e = ex2_approx(-fabsf(v) * kLog2e);
  const float l = fabsf(v) > 4.f ? log1p_small(e) : lg2_approx(1.f + e) * kLn2;
  return l + fmaxf(v, 0.f);
}

// scale * A with A = -exp(A_log) (scale 1, or log2(e) for ex2_approx), clamped to -FLT_MAX where it
// would be -inf (A_log above ~88.7, or +inf). The kernels pad a tile past L with dt = 0, whose step
// exp(0 * A) = 1 must stay the identity: -inf * 0 is NaN, -FLT_MAX * 0 is 0 (it would otherwise turn a
// finite final state into NaN). For every dt > 2^-100 the decay is still exactly 0. NaN stays NaN.
__device__ __forceinline__ float decay_rate(float A_log, float scale) {
  const float a = -__expf(A_log) * scale;
  return a < -3.402823466e38f ? -3.402823466e38f : a;
}

// silu(v) = v * sigmoid(v), the Mamba-1 block's gate (and its conv's activation). __expf: MUFU.EX2 and a
// multiply; e^-v overflows to inf for v < -88.7, where 1 / inf = 0 gives silu = -0.0, as the exact value
// rounds to in float32. NaN propagates.
__device__ __forceinline__ float silu(float v) { return v / (1.f + __expf(-v)); }

template <class T> __device__ __forceinline__ float to_float(T v);
template <> __device__ __forceinline__ float to_float<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <> __device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }

template <class T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }

}  // namespace selscan
