// The block's decode step, from in_proj's output to the gated y, for one token per sequence
// (selscan_fused/decode.py gives the math; selscan_fused.block_reference.mamba_step_ref is its
// reference). Two phases (docs/perf/decode.md, "The decode kernels"), each a function of one work item
// called by its own kernel (two launches) or by decode_step_kernel, which runs both in one cooperative
// launch with a grid-wide barrier between them (one launch; the same items: bitwise the same results):
//   conv_xproj  items (x tile of kDecodeXTile channels x slice of x_proj's rows, group of kSeqs
//               sequences): the conv window and its SiLU for the tile's channels (u rounded to the
//               dtype, into shared memory; conv_state only read here), then x_proj's partial sums over
//               the tile for the slice's rows: a warp takes 4 rows at a time, its lanes 16 B of a row
//               each (coalesced), the 4 x kSeqs sums reduced across the warp by a reduce-scatter of
//               shuffles, into a (batch, x tiles, R + 2N) float32 workspace.
//   scan_gate   items (scan tile of channels, group of kSeqs sequences): the x tiles' partial sums added
//               in tile order (deterministic: no atomics) and rounded to the dtype (as a library
//               product writes them); then per channel a group of state_lanes lanes (4 states a lane):
//               the dt_proj row read 16 B a lane (consecutive lanes, consecutive pieces of the row),
//               reduced by shuffles and rounded, softplus with the bias, the conv recomputed (bitwise
//               as the first kernel computes u) and conv_state shifted in place, the N states updated
//               in place in float32 (16 B a lane, a warp's states contiguous), y = C h + D u by
//               shuffles, the gate y * silu(z), y stored.
// Every summation order depends only on d_inner, N, R and the pointers' alignment, never on the batch
// or on the launch's shape: a sequence's results are bitwise the same whatever the batch.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "../common/device_math.cuh"
#include "decode_params.h"

namespace selscan {
namespace decode {

// Sequences per CTA: every weight element a CTA reads serves kSeqs sequences.
constexpr int kSeqs = 4;
constexpr int kXThreads = 256;               // the first kernel's CTA
constexpr int kXWarps = kXThreads / 32;
constexpr int kRowBlock = 4;                 // x_proj rows a warp reduces together
static_assert(kRowBlock * kSeqs == 16, "the reduce-scatter below takes 16 sums a lane");
constexpr int kScanThreads = 128;            // the second kernel's CTA
constexpr int kStepThreads = 256;            // the one-launch kernel's CTA (both phases)
static_assert(kStepThreads == kXThreads, "the one-launch kernel runs the first phase's items as they are");
static_assert(kDecodeXTile % (32 * 8) == 0, "whole 16 B vectors a lane");
constexpr unsigned kFull = 0xffffffffu;

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

__device__ __forceinline__ bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; }

// The V = 16 / sizeof(T) elements of a 16 B vector as float.
template <class T>
__device__ __forceinline__ void unpack(const uint4& raw, float (&out)[16 / sizeof(T)]) {
  const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < int(16 / sizeof(T)); ++i) out[i] = to_float<T>(e[i]);
}

// The conv of channel c for sequence b: its taps and bias (loaded once per channel), the window
// [conv_state | xi] (kept raw for the shift) and u = silu(bias + sum_k w[k] window[k]) rounded to T, the
// taps added oldest first. Both kernels call it on the same values: the same u bitwise.
template <class T>
struct ConvTaps {
  float w[kDecodeMaxWidth - 1] = {};  // the state's taps (oldest first)
  float wx = 0.f;                     // the new input's tap
  float bias = 0.f;
  __device__ __forceinline__ void load(const DecodeParams& p, int64_t c) {
    const int W = p.width;
    const bool f32 = p.small_fp32;
#pragma unroll
    for (int k = 0; k < kDecodeMaxWidth - 1; ++k)
      if (k < W - 1) w[k] = small<T>(p.conv_weight, c * W + k, f32);
    wx = small<T>(p.conv_weight, c * W + W - 1, f32);
    if (p.conv_bias != nullptr) bias = small<T>(p.conv_bias, c, f32);
  }
};

template <class T>
struct ConvWindow {
  T s[kDecodeMaxWidth - 1];  // conv_state's entries (oldest first), the first width - 1 valid
  T x;                       // the new input xi
  __device__ __forceinline__ void load(const DecodeParams& p, int64_t b, int64_t c) {
    const int W = p.width;
    const T* cs = static_cast<const T*>(p.conv_state) + (b * p.d_inner + c) * (W - 1);
#pragma unroll
    for (int k = 0; k < kDecodeMaxWidth - 1; ++k) s[k] = k < W - 1 ? cs[k] : from_float<T>(0.f);
    x = static_cast<const T*>(p.xz)[b * p.xz_stride + c];
  }
  __device__ __forceinline__ float u(const ConvTaps<T>& t, int W) const {
    float acc = t.bias;
#pragma unroll
    for (int k = 0; k < kDecodeMaxWidth - 1; ++k)
      if (k < W - 1) acc = fmaf(t.w[k], to_float<T>(s[k]), acc);
    acc = fmaf(t.wx, to_float<T>(x), acc);
    return round_to<T>(silu_exact(acc));
  }
  // conv_state <- window[1:] (the raw values: exact).
  __device__ __forceinline__ void store_shifted(const DecodeParams& p, int64_t b, int64_t c) const {
    const int W = p.width;
    T* cs = static_cast<T*>(p.conv_state) + (b * p.d_inner + c) * (W - 1);
#pragma unroll
    for (int k = 0; k < kDecodeMaxWidth - 2; ++k)
      if (k < W - 2) cs[k] = s[k + 1];
    cs[W - 2] = x;
  }
};

// ---- conv_xproj ----

// The weights of a warp's kRowBlock rows starting at j, its lane's kVecs vectors of each (vector k =
// lane + 32 v of the tile's channels); rows at or past j_end and vectors past the tile read as zeros.
template <class T, int kVecs>
__device__ __forceinline__ void load_rows(const T* tile_w, int64_t Dn, int j, int j_end, int lane, int nvec,
                                          uint4 (&w)[kRowBlock][kVecs]) {
#pragma unroll
  for (int r = 0; r < kRowBlock; ++r) {
#pragma unroll
    for (int v = 0; v < kVecs; ++v) {
      const int k = lane + 32 * v;
      if (j + r < j_end && k < nvec) {
        w[r][v] = __ldg(reinterpret_cast<const uint4*>(tile_w + int64_t(j + r) * Dn) + k);
      } else {
        w[r][v] = make_uint4(0u, 0u, 0u, 0u);
      }
    }
  }
}

// acc[r * kSeqs + q] summed over the warp's 32 lanes: a reduce-scatter (16 sums -> 8 -> 4 -> 2 -> 1 a
// lane, then the lane pair's last add), 16 shuffles. Lane l ends with sum m = l >> 1 (both lanes of a
// pair hold it). A fixed tree: deterministic.
template <int kHalf>
__device__ __forceinline__ void reduce_scatter_level(float (&a)[16], int lane) {
  const bool upper = (lane & (2 * kHalf)) != 0;
#pragma unroll
  for (int i = 0; i < kHalf; ++i) {
    const float send = upper ? a[i] : a[i + kHalf];
    const float keep = upper ? a[i + kHalf] : a[i];
    a[i] = keep + __shfl_xor_sync(kFull, send, 2 * kHalf);
  }
}

__device__ __forceinline__ float warp_reduce_scatter16(float (&a)[16], int lane) {
  reduce_scatter_level<8>(a, lane);
  reduce_scatter_level<4>(a, lane);
  reduce_scatter_level<2>(a, lane);
  reduce_scatter_level<1>(a, lane);
  return a[0] + __shfl_xor_sync(kFull, a[0], 1);
}

// The shared memory of one CTA: the first phase's u, or the second's x_proj outputs.
struct __align__(16) ScanShared {
  float dt[kSeqs][kDecodeMaxRank];
  float B[kSeqs][kDecodeMaxState];
  float C[kSeqs][kDecodeMaxState];
};
union __align__(16) StepShared {
  float u[kSeqs][kDecodeXTile];
  ScanShared scan;
};

// One item of the first phase: x item `xitem` (x tile xitem % x tiles, row slice xitem / x tiles) for the
// sequences of group `group`, by kXThreads threads. Ends with a barrier of the CTA (its shared memory
// free for the next item).
template <class T>
__device__ __forceinline__ void conv_xproj_item(const DecodeParams& p, int64_t xitem, int64_t group,
                                                float (&s_u)[kSeqs][kDecodeXTile]) {
  constexpr int V = 16 / int(sizeof(T));          // elements of a 16 B vector
  constexpr int kVecs = kDecodeXTile / V / 32;     // vectors of a row a lane reads (2; 4 for float)
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int64_t Dn = p.d_inner;
  const int64_t xtiles = decode_xproj_tiles(Dn);
  const int64_t tile = xitem % xtiles, slice = xitem / xtiles;
  const int64_t c0 = tile * kDecodeXTile;
  const int cmax = int(Dn - c0 < kDecodeXTile ? Dn - c0 : kDecodeXTile);
  const int64_t b0 = group * kSeqs;
  const int nseq = int(p.batch - b0 < kSeqs ? p.batch - b0 : kSeqs);
  const int n_out = p.dt_rank + 2 * p.dstate;
  const int j_begin = int(slice) * p.xproj_rows;
  const int j_end = j_begin + p.xproj_rows < n_out ? j_begin + p.xproj_rows : n_out;
  const T* tile_w = static_cast<const T*>(p.x_proj_weight) + c0;
  // 16 B vectors when every row's tile starts 16 B aligned; else one element a lane at a time.
  const bool vec = Dn % V == 0 && aligned16(p.x_proj_weight);
  const int nvec = cmax / V;

  // The warp's first rows requested before the conv, so that their latency overlaps it.
  int j = j_begin + warp * kRowBlock;
  uint4 w[kRowBlock][kVecs];
  if (vec) load_rows<T, kVecs>(tile_w, Dn, j, j_end, lane, nvec, w);

  // u for the tile's channels and the group's sequences (zeros past d_inner and the batch).
  for (int i = tid; i < kDecodeXTile; i += kXThreads) {
    const int64_t c = c0 + i;
    ConvTaps<T> taps;
    if (c < Dn) taps.load(p, c);
#pragma unroll
    for (int q = 0; q < kSeqs; ++q) {
      float u = 0.f;
      if (q < nseq && c < Dn) {
        ConvWindow<T> win;
        win.load(p, b0 + q, c);
        u = win.u(taps, p.width);
      }
      s_u[q][i] = u;
    }
  }
  __syncthreads();

  float* partial = p.workspace;
  for (; j < j_end; j += kXWarps * kRowBlock) {
    float acc[kRowBlock * kSeqs];
#pragma unroll
    for (int m = 0; m < kRowBlock * kSeqs; ++m) acc[m] = 0.f;
    if (vec) {
#pragma unroll
      for (int v = 0; v < kVecs; ++v) {
        const int k = lane + 32 * v;  // zeros past the tile (weights and u both)
#pragma unroll
        for (int h = 0; h < V / 4; ++h) {
          float uq[kSeqs][4];
#pragma unroll
          for (int q = 0; q < kSeqs; ++q) {
            const float4 t = *reinterpret_cast<const float4*>(&s_u[q][k * V + 4 * h]);
            uq[q][0] = t.x; uq[q][1] = t.y; uq[q][2] = t.z; uq[q][3] = t.w;
          }
#pragma unroll
          for (int r = 0; r < kRowBlock; ++r) {
            float wf[V];
            unpack<T>(w[r][v], wf);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
#pragma unroll
              for (int q = 0; q < kSeqs; ++q) acc[r * kSeqs + q] = fmaf(wf[4 * h + e], uq[q][e], acc[r * kSeqs + q]);
            }
          }
        }
      }
    } else {
      for (int k = lane; k < cmax; k += 32) {
        float uq[kSeqs];
#pragma unroll
        for (int q = 0; q < kSeqs; ++q) uq[q] = s_u[q][k];
#pragma unroll
        for (int r = 0; r < kRowBlock; ++r) {
          const float wv = j + r < j_end ? to_float<T>(tile_w[int64_t(j + r) * Dn + k]) : 0.f;
#pragma unroll
          for (int q = 0; q < kSeqs; ++q) acc[r * kSeqs + q] = fmaf(wv, uq[q], acc[r * kSeqs + q]);
        }
      }
    }
    const float sum = warp_reduce_scatter16(acc, lane);
    const int m = lane >> 1, r = m / kSeqs, q = m % kSeqs;
    if ((lane & 1) == 0 && j + r < j_end && q < nseq)
      partial[((b0 + q) * xtiles + tile) * n_out + j + r] = sum;
    // the next rows (the loads issued together: one round trip a row block)
    if (vec && j + kXWarps * kRowBlock < j_end) load_rows<T, kVecs>(tile_w, Dn, j + kXWarps * kRowBlock, j_end, lane, nvec, w);
  }
  __syncthreads();
}

template <class T>
__global__ void __launch_bounds__(kXThreads, 2) conv_xproj_kernel(DecodeParams p) {
  __shared__ __align__(16) float s_u[kSeqs][kDecodeXTile];
  conv_xproj_item<T>(p, blockIdx.x, blockIdx.y, s_u);
}

// ---- scan_gate ----

// One item of the second phase: scan tile `stile` (scan_passes x kThreads / kL channels) for the
// sequences of group `group`, by kThreads threads. kL lanes a channel (a power of two, 4 * kL >= N: lane
// `sub` of the group holds states 4 sub .. 4 sub + 3); the conv and the gate of sequence q by the group's
// lane q % kL (its slot q / kL). Ends with a barrier of the CTA.
template <class T, int kL, int kThreads>
__device__ __forceinline__ void scan_gate_item(const DecodeParams& p, int64_t stile, int64_t group, ScanShared& sh) {
  constexpr int V = 16 / int(sizeof(T));
  constexpr int kSlots = (kSeqs + kL - 1) / kL;  // sequences whose conv and gate a lane takes
  constexpr int kPerPass = kThreads / kL;        // channels a pass
  float (&s_dt)[kSeqs][kDecodeMaxRank] = sh.dt;
  float (&s_B)[kSeqs][kDecodeMaxState] = sh.B;
  float (&s_C)[kSeqs][kDecodeMaxState] = sh.C;
  const int tid = threadIdx.x, lane = tid & 31;
  const int64_t Dn = p.d_inner;
  const int R = p.dt_rank, N = p.dstate, n_out = R + 2 * N;
  const int64_t b0 = group * kSeqs;
  const int nseq = int(p.batch - b0 < kSeqs ? p.batch - b0 : kSeqs);
  const int64_t xtiles = decode_xproj_tiles(Dn);

  // x_proj's outputs for the group's sequences: the x tiles' partial sums in tile order, rounded to T
  // (read past L1: in the one-launch kernel other CTAs wrote them in this launch).
  for (int i = tid; i < nseq * n_out; i += kThreads) {
    const int q = i / n_out, jj = i - q * n_out;
    const float* part = p.workspace + (b0 + q) * xtiles * n_out + jj;
    float s = 0.f;
    for (int64_t t = 0; t < xtiles; ++t) s += __ldcg(part + t * n_out);
    s = round_to<T>(s);
    if (jj < R) s_dt[q][jj] = s;
    else if (jj < R + N) s_B[q][jj - R] = s;
    else s_C[q][jj - R - N] = s;
  }
  __syncthreads();

  const int sub = tid % kL;               // this lane's place in its channel's group
  const int group_lane0 = lane - sub;
  const int n0 = 4 * sub;                 // this lane's first state
  const bool f32 = p.small_fp32;
  const bool vec_dt = R % V == 0 && aligned16(p.dt_proj_weight);
  const bool vec_h = N % 4 == 0 && aligned16(p.ssm_state);
  const int64_t tile_c0 = stile * p.scan_passes * kPerPass;
  const int64_t seq_h = Dn * N;           // ssm_state's stride between sequences

  for (int pass = 0; pass < p.scan_passes; ++pass) {
    const int64_t pc0 = tile_c0 + int64_t(pass) * kPerPass;
    if (pc0 >= Dn) break;  // uniform across the CTA
    const int64_t c = pc0 + tid / kL;
    const bool valid = c < Dn;  // lanes past d_inner still take part in the shuffles
    float* const h0 = p.ssm_state + (b0 * Dn + c) * N + n0;

    // The loads that need nothing of the sums first: the states, the conv windows, z.
    float h[kSeqs][4];
#pragma unroll
    for (int q = 0; q < kSeqs; ++q) {
#pragma unroll
      for (int i = 0; i < 4; ++i) h[q][i] = 0.f;
      if (q < nseq && valid) {
        const float* hp = h0 + q * seq_h;
        if (vec_h) {
          if (n0 < N) {
            const float4 t = __ldcs(reinterpret_cast<const float4*>(hp));
            h[q][0] = t.x; h[q][1] = t.y; h[q][2] = t.z; h[q][3] = t.w;
          }
        } else {
#pragma unroll
          for (int i = 0; i < 4; ++i)
            if (n0 + i < N) h[q][i] = hp[i];
        }
      }
    }
    ConvWindow<T> win[kSlots];
    float z[kSlots];
#pragma unroll
    for (int k = 0; k < kSlots; ++k) {
      const int q = sub + kL * k;
      z[k] = 0.f;
      if (q < nseq && valid) {
        win[k].load(p, b0 + q, c);
        z[k] = to_float<T>(static_cast<const T*>(p.xz)[(b0 + q) * p.xz_stride + Dn + c]);
      }
    }

    // dt_proj: the channel's row split over its kL lanes (16 B pieces, consecutive lanes consecutive
    // pieces), each lane's products added in row order, then the kL lanes' sums by a butterfly (every
    // lane ends with the same value).
    float dt[kSeqs];
#pragma unroll
    for (int q = 0; q < kSeqs; ++q) dt[q] = 0.f;
    if (valid) {
      const T* row = static_cast<const T*>(p.dt_proj_weight) + c * R;
      if (vec_dt) {
        const int nv = R / V;
#pragma unroll 2
        for (int k = sub; k < nv; k += kL) {
          float wf[V];
          unpack<T>(__ldg(reinterpret_cast<const uint4*>(row) + k), wf);
#pragma unroll
          for (int q = 0; q < kSeqs; ++q) {
#pragma unroll
            for (int h4 = 0; h4 < V / 4; ++h4) {
              const float4 d = *reinterpret_cast<const float4*>(&s_dt[q][k * V + 4 * h4]);
              dt[q] = fmaf(wf[4 * h4 + 0], d.x, dt[q]);
              dt[q] = fmaf(wf[4 * h4 + 1], d.y, dt[q]);
              dt[q] = fmaf(wf[4 * h4 + 2], d.z, dt[q]);
              dt[q] = fmaf(wf[4 * h4 + 3], d.w, dt[q]);
            }
          }
        }
      } else {
#pragma unroll 4
        for (int r = sub; r < R; r += kL) {
          const float wv = to_float<T>(row[r]);
#pragma unroll
          for (int q = 0; q < kSeqs; ++q) dt[q] = fmaf(wv, s_dt[q][r], dt[q]);
        }
      }
    }
#pragma unroll
    for (int off = 1; off < kL; off <<= 1) {
#pragma unroll
      for (int q = 0; q < kSeqs; ++q) dt[q] += __shfl_xor_sync(kFull, dt[q], off);
    }

    // The channel's parameters; u of the lane's sequences (conv_state shifted in place).
    float dt_bias = 0.f, dskip = 0.f, expA[4] = {0.f, 0.f, 0.f, 0.f}, u_own[kSlots];
    if (valid) {
      dt_bias = small<T>(p.dt_bias, c, f32);
      dskip = small<T>(p.D, c, f32);
#pragma unroll
      for (int i = 0; i < 4; ++i)
        if (n0 + i < N) expA[i] = expf(small<T>(p.A_log, c * N + n0 + i, f32));  // A = -exp(A_log)
    }
    {
      ConvTaps<T> taps;
      if (valid && sub < nseq) taps.load(p, c);
#pragma unroll
      for (int k = 0; k < kSlots; ++k) {
        const int q = sub + kL * k;
        u_own[k] = 0.f;
        if (q < nseq && valid) {
          u_own[k] = win[k].u(taps, p.width);
          win[k].store_shifted(p, b0 + q, c);
        }
      }
    }

#pragma unroll
    for (int q = 0; q < kSeqs; ++q) {
      if (q >= nseq) break;  // uniform
      const float u = __shfl_sync(kFull, u_own[q / kL], group_lane0 + q % kL);
      const float delta = softplus_exact(round_to<T>(dt[q]) + dt_bias);
      const float du = delta * u;
      float y = 0.f;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        if (valid && n0 + i < N) {
          const float decay = expf(-delta * expA[i]);  // exp(delta A)
          const float hn = h[q][i] * decay + du * s_B[q][n0 + i];
          h[q][i] = hn;
          y = fmaf(hn, s_C[q][n0 + i], y);
        }
      }
      if (valid) {
        float* hp = h0 + q * seq_h;
        if (vec_h) {
          if (n0 < N) __stcs(reinterpret_cast<float4*>(hp), make_float4(h[q][0], h[q][1], h[q][2], h[q][3]));
        } else {
#pragma unroll
          for (int i = 0; i < 4; ++i)
            if (n0 + i < N) hp[i] = h[q][i];
        }
      }
#pragma unroll
      for (int off = 1; off < kL; off <<= 1) y += __shfl_xor_sync(kFull, y, off);
      if (valid && sub == q % kL) {  // the lane that holds sequence q's z
        y = fmaf(dskip, u, y);
        static_cast<T*>(p.y)[(b0 + q) * Dn + c] = from_float<T>(y * silu_exact(z[q / kL]));
      }
    }
  }
  __syncthreads();
}

template <class T, int kL>
__global__ void __launch_bounds__(kScanThreads, 4) scan_gate_kernel(DecodeParams p) {
  __shared__ __align__(16) ScanShared sm;
  scan_gate_item<T, kL, kScanThreads>(p, blockIdx.x, blockIdx.y, sm);
}

// ---- both phases in one launch ----

// A cooperative launch of at most as many CTAs as fit on the GPU at once (decode_mid_launch): each CTA
// takes the first phase's items blockIdx.x, blockIdx.x + gridDim.x, ... (x item fastest, then the
// group), then, after a grid-wide barrier (every partial sum written and visible), the second's the same
// way. The items are those of the two-launch path with its kScanThreads replaced by kStepThreads in the
// scan tile's width: every result bitwise the same.
template <class T, int kL>
__global__ void __launch_bounds__(kStepThreads, 2) decode_step_kernel(DecodeParams p, int64_t x_items, int64_t groups,
                                                                      int64_t scan_tiles) {
  __shared__ StepShared sm;
  for (int64_t i = blockIdx.x; i < x_items * groups; i += gridDim.x) conv_xproj_item<T>(p, i % x_items, i / x_items, sm.u);
  cooperative_groups::this_grid().sync();
  for (int64_t i = blockIdx.x; i < scan_tiles * groups; i += gridDim.x)
    scan_gate_item<T, kL, kStepThreads>(p, i % scan_tiles, i / scan_tiles, sm.scan);
}

}  // namespace decode
}  // namespace selscan
