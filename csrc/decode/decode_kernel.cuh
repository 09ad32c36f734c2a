// The block's decode step, from in_proj's output to the gated y, for one token per sequence
// (selscan_fused/decode.py gives the math; selscan_fused.block_reference.mamba_step_ref is its
// reference). Two kernels, each on a grid of (channel tile of kDecodeChannels, group of kSeqs
// sequences), one thread per channel:
//   conv_xproj  the conv update (the window [conv_state | xi], the state shifted in place), the SiLU,
//               u rounded to the dtype (as the unfused path's conv kernel writes it) into the workspace,
//               then x_proj's partial sums over the tile's channels: warp w takes outputs w, w + 8, ...;
//               its lanes read a weight row's channels side by side (coalesced) and reduce by shuffles.
//   scan_gate   x_proj's outputs: the tiles' partial sums added in tile order (deterministic: no
//               atomics) and rounded to the dtype (as a library product writes them); dt_proj for the
//               thread's channel (rounded likewise), softplus with the bias, the state update of its N
//               states in float32 (in place), y = C h + D u, the gate y * silu(z), y stored.
// At batch 1 the step reads every weight once; at larger batches each group of kSeqs sequences reads
// x_proj's and dt_proj's weights once more (from L2 after the first).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "../common/device_math.cuh"
#include "decode_params.h"

namespace selscan {
namespace decode {

constexpr int kThreads = kDecodeChannels;
static_assert(kThreads % 32 == 0, "whole warps");
// Sequences per CTA: every weight element a CTA reads serves kSeqs sequences (at batch 128 the weights'
// reads from L2 would otherwise be 128 per element and step); each sequence's sums are taken in the
// same order whatever the batch (bitwise the same result).
constexpr int kSeqs = 4;

template <class T>
__device__ __forceinline__ float round_to(float v) {
  return to_float<T>(from_float<T>(v));
}

// softplus as torch computes it (threshold 20), accurate (no approximate exponentials: a decode step
// is not bound by them).
__device__ __forceinline__ float softplus_exact(float v) { return v > 20.f ? v : log1pf(expf(v)); }

__device__ __forceinline__ float silu_exact(float v) { return v / (1.f + expf(-v)); }

// Element i of a small parameter, float32 or T (DecodeParams::small_fp32; the branch is uniform).
template <class T>
__device__ __forceinline__ float small(const void* ptr, int64_t i, bool fp32) {
  return fp32 ? static_cast<const float*>(ptr)[i] : to_float<T>(static_cast<const T*>(ptr)[i]);
}

template <class T, int kW>
__global__ void __launch_bounds__(kThreads) conv_xproj_kernel(DecodeParams p) {
  __shared__ float s_u[kSeqs][kThreads];
  const int tid = threadIdx.x;
  const int64_t b0 = int64_t(blockIdx.y) * kSeqs;
  const int64_t Dn = p.d_inner;
  const int64_t c0 = int64_t(blockIdx.x) * kThreads;
  const int64_t c = c0 + tid;
  const bool f32 = p.small_fp32;
  float w[kW], bias = 0.f;
  if (c < Dn) {
#pragma unroll
    for (int k = 0; k < kW; ++k) w[k] = small<T>(p.conv_weight, c * kW + k, f32);
    if (p.conv_bias != nullptr) bias = small<T>(p.conv_bias, c, f32);
  }
#pragma unroll
  for (int q = 0; q < kSeqs; ++q) {
    const int64_t b = b0 + q;
    float u = 0.f;
    if (b < p.batch && c < Dn) {
      T* cs = static_cast<T*>(p.conv_state) + (b * Dn + c) * (kW - 1);
      const T* xi = static_cast<const T*>(p.xz) + b * p.xz_stride;
      float win[kW];
#pragma unroll
      for (int k = 0; k < kW - 1; ++k) win[k] = to_float<T>(cs[k]);
      win[kW - 1] = to_float<T>(xi[c]);
      float acc = bias;
#pragma unroll
      for (int k = 0; k < kW; ++k) acc = fmaf(w[k], win[k], acc);
#pragma unroll
      for (int k = 0; k < kW - 1; ++k) cs[k] = from_float<T>(win[k + 1]);
      u = round_to<T>(silu_exact(acc));
      p.workspace[b * Dn + c] = u;
    }
    s_u[q][tid] = u;
  }
  __syncthreads();

  // x_proj's partial sums: each weight element read once for the CTA's kSeqs sequences.
  const int n_out = p.dt_rank + 2 * p.dstate;
  const int warp = tid / 32, lane = tid % 32;
  const int64_t cmax = Dn - c0 < kThreads ? Dn - c0 : kThreads;
  const T* wx = static_cast<const T*>(p.x_proj_weight);
  for (int j = warp; j < n_out; j += kThreads / 32) {
    const T* row = wx + int64_t(j) * Dn + c0;
    float sq[kSeqs];
#pragma unroll
    for (int q = 0; q < kSeqs; ++q) sq[q] = 0.f;
    for (int k = lane; k < cmax; k += 32) {
      const float wv = to_float<T>(row[k]);
#pragma unroll
      for (int q = 0; q < kSeqs; ++q) sq[q] = fmaf(wv, s_u[q][k], sq[q]);
    }
#pragma unroll
    for (int q = 0; q < kSeqs; ++q) {
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) sq[q] += __shfl_xor_sync(0xffffffffu, sq[q], off);
    }
    if (lane == 0) {
#pragma unroll
      for (int q = 0; q < kSeqs; ++q) {
        const int64_t b = b0 + q;
        if (b < p.batch) p.workspace[p.batch * Dn + (b * int64_t(gridDim.x) + blockIdx.x) * n_out + j] = sq[q];
      }
    }
  }
}

template <class T>
__global__ void __launch_bounds__(kThreads) scan_gate_kernel(DecodeParams p) {
  __shared__ float s_dbc[kSeqs][kDecodeMaxRank + 2 * kDecodeMaxState];
  const int tid = threadIdx.x;
  const int64_t b0 = int64_t(blockIdx.y) * kSeqs;
  const int64_t Dn = p.d_inner;
  const int R = p.dt_rank, N = p.dstate, n_out = R + 2 * N;
  const int64_t n_tiles = gridDim.x;
#pragma unroll
  for (int q = 0; q < kSeqs; ++q) {
    const int64_t b = b0 + q;
    if (b >= p.batch) break;
    const float* partial = p.workspace + p.batch * Dn + b * n_tiles * n_out;
    for (int j = tid; j < n_out; j += kThreads) {
      float s = 0.f;
      for (int64_t t = 0; t < n_tiles; ++t) s += partial[t * n_out + j];
      s_dbc[q][j] = round_to<T>(s);
    }
  }
  __syncthreads();
  const int64_t c = int64_t(blockIdx.x) * kThreads + tid;
  if (c >= Dn) return;

  // dt_proj for the thread's channel: its weight row read once for the CTA's kSeqs sequences.
  const T* wdt = static_cast<const T*>(p.dt_proj_weight) + c * R;
  float dt[kSeqs];
#pragma unroll
  for (int q = 0; q < kSeqs; ++q) dt[q] = 0.f;
  for (int r = 0; r < R; ++r) {
    const float wv = to_float<T>(wdt[r]);
#pragma unroll
    for (int q = 0; q < kSeqs; ++q) dt[q] = fmaf(wv, s_dbc[q][r], dt[q]);
  }
  const bool f32 = p.small_fp32;
  const float dt_bias = small<T>(p.dt_bias, c, f32), dskip = small<T>(p.D, c, f32);
#pragma unroll
  for (int q = 0; q < kSeqs; ++q) {
    const int64_t b = b0 + q;
    if (b >= p.batch) break;
    const float delta = softplus_exact(round_to<T>(dt[q]) + dt_bias);
    const float u = p.workspace[b * Dn + c];
    const float du = delta * u;
    const float* Bv = s_dbc[q] + R;
    const float* Cv = s_dbc[q] + R + N;
    float* h = p.ssm_state + (b * Dn + c) * N;
    float y = 0.f;
#pragma unroll 4
    for (int n = 0; n < N; ++n) {
      const float decay = expf(-delta * expf(small<T>(p.A_log, c * N + n, f32)));  // exp(delta A), A = -exp(A_log)
      const float hn = h[n] * decay + du * Bv[n];
      h[n] = hn;
      y = fmaf(hn, Cv[n], y);
    }
    y = fmaf(dskip, u, y);
    const float z = to_float<T>(static_cast<const T*>(p.xz)[b * p.xz_stride + Dn + c]);
    static_cast<T*>(p.y)[b * Dn + c] = from_float<T>(y * silu_exact(z));
  }
}

}  // namespace decode
}  // namespace selscan
