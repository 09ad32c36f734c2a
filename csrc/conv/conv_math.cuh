// The causal conv's loads, stores and arithmetic, shared by the conv kernels (conv_kernel.cuh) and the
// fused block's conv (csrc/fused/block_xproj.cu, and fused_kernel.cuh's conv_in_tile), so that every
// path computes u = silu(pre) with the same operations in the same order: the fused block's u is
// bitwise the unfused one's.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

#include "../common/device_math.cuh"

namespace selscan {

template <int kBytes> struct RawVec;
template <> struct RawVec<2> { using type = unsigned short; };
template <> struct RawVec<4> { using type = unsigned int; };
template <> struct RawVec<8> { using type = uint2; };
template <> struct RawVec<16> { using type = uint4; };

// kV consecutive elements at ptr (aligned to kV * sizeof(T)) as float.
template <class T, int kV>
__device__ __forceinline__ void load_vec(const T* ptr, float (&out)[kV]) {
  using R = typename RawVec<int(sizeof(T)) * kV>::type;
  const R raw = *reinterpret_cast<const R*>(ptr);
  T vals[kV];
  memcpy(vals, &raw, sizeof(raw));
#pragma unroll
  for (int v = 0; v < kV; ++v) out[v] = to_float<T>(vals[v]);
}

template <class T, int kV>
__device__ __forceinline__ void store_vec(T* ptr, const float (&in)[kV]) {
  using R = typename RawVec<int(sizeof(T)) * kV>::type;
  T vals[kV];
#pragma unroll
  for (int v = 0; v < kV; ++v) vals[v] = from_float<T>(in[v]);
  R raw;
  memcpy(&raw, vals, sizeof(raw));
  *reinterpret_cast<R*>(ptr) = raw;
}

// The per-thread constants: weight[c0 + v, k] (the kV rows are kV * kW consecutive floats) and bias.
template <int kW, int kV>
__device__ __forceinline__ void load_weights(const float* __restrict__ weight, const float* __restrict__ bias,
                                             int64_t c0, float (&w)[kW][kV], float (&bs)[kV]) {
#pragma unroll
  for (int v = 0; v < kV; ++v) {
#pragma unroll
    for (int k = 0; k < kW; ++k) w[k][v] = weight[(c0 + v) * kW + k];
    bs[v] = bias != nullptr ? bias[c0 + v] : 0.f;
  }
}

// win <- win shifted by one token, `in` the newest.
template <int kN, int kV>
__device__ __forceinline__ void shift_in(float (&win)[kN][kV], const float (&in)[kV]) {
#pragma unroll
  for (int j = 0; j + 1 < kN; ++j) {
#pragma unroll
    for (int v = 0; v < kV; ++v) win[j][v] = win[j + 1][v];
  }
#pragma unroll
  for (int v = 0; v < kV; ++v) win[kN - 1][v] = in[v];
}

// x * sigmoid(x). __expf(-x) is +inf below x ~ -88.7, where the quotient is -0 (the limit); NaN stays NaN.
__device__ __forceinline__ float silu_f(float a) { return __fdividef(a, 1.f + __expf(-a)); }

// d silu / d a = s * (1 + a * (1 - s)), s = sigmoid(a).
__device__ __forceinline__ float dsilu_f(float a) {
  const float s = __fdividef(1.f, 1.f + __expf(-a));
  return s * fmaf(a, 1.f - s, 1.f);
}

// pre for one token: bias + sum_{k < kW-1} w[k] * win[k] + w[kW-1] * xt.
template <int kW, int kV>
__device__ __forceinline__ void conv_pre(const float (&w)[kW][kV], const float (&bs)[kV], const float (&win)[kW - 1][kV],
                                         const float (&xt)[kV], float (&pre)[kV]) {
#pragma unroll
  for (int v = 0; v < kV; ++v) {
    float a = bs[v];
#pragma unroll
    for (int k = 0; k < kW - 1; ++k) a = fmaf(w[k][v], win[k][v], a);
    pre[v] = fmaf(w[kW - 1][v], xt[v], a);
  }
}

}  // namespace selscan
