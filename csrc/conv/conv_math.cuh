// The causal conv's arithmetic, shared by the conv kernels (conv_kernel.cuh) and the fused block's
// in-kernel conv (csrc/fused/fused_kernel.cuh, block_xproj.cu), so that every path computes u =
// silu(pre) with the same operations in the same order: the fused block's u is bitwise the unfused one's.
#pragma once

namespace selscan {

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
