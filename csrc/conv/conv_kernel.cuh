// The depthwise causal conv1d of the Mamba-1 block, with SiLU fused (csrc/conv/conv_params.h has the
// math). Memory-bound: each kernel reads its inputs once and writes its outputs once.
//
// Work decomposition (both kernels)
//   Thread = `kV` consecutive channels (one vector load per token: 16 bytes in the forward, 4 channels
//   in the backward) x one run of consecutive tokens of one sequence. Consecutive threads of a warp own
//   consecutive channels, so every token's load and store is one coalesced row segment. A thread walks
//   its run in token order, keeping the last W-1 inputs (the causal window's halo) in registers; only
//   the W-1 inputs before the run are read a second time (from x, or initial_state at s < 0). Tokens
//   are loaded `kGroup` at a time before any is used, for memory-level parallelism.
//   CTA = block_c (channels) x block_t (runs) threads; blockIdx.x = (sequence, token tile), blockIdx.y
//   = channel tile (ConvLaunchShape).
//
// Backward
//   The thread of run [t0, t1) recomputes pre and dpre for t in [t0, t1 + W - 1) (the last W - 1 of
//   them belong to the next run and are recomputed there), keeps the last W - 1 dpre in registers, and
//   emits dx at the positions [t0, t1): dx[pos] = sum_k weight[k] * dpre[pos + W - 1 - k]. The run at
//   t0 = 0 also emits the positions -(W-1) .. -1, which are dinitial_state's. dfinal_state is added at
//   the positions >= L - (W - 1). dweight and dbias: per-thread sums over the run (token order), per-CTA
//   sums over the runs (run order) through shared memory, one row of ConvBwdParams::partial per CTA;
//   the caller sums the rows in a fixed order. No atomics: bitwise deterministic.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

#include "../common/device_math.cuh"
#include "../common/seq_map.h"
#include "conv_math.cuh"
#include "conv_params.h"

namespace selscan {
namespace conv {

constexpr int kThreads = 128;  // threads per CTA (block_c * block_t)
constexpr int kGroup = 4;      // tokens loaded together
constexpr int kBwdVec = 4;     // channels per thread in the backward (aligned case)

__host__ __device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// The halo of a run starting at t0: win[j] = xx[t0 - (kW-1) + j]. x points at the sequence's channel
// c0; init at initial_state[b, c0, 0] (or null for zeros).
template <class T, int kW, int kV>
__device__ __forceinline__ void load_halo(const T* x, int64_t token_stride, const float* init, int64_t t0,
                                          float (&win)[kW - 1][kV]) {
#pragma unroll
  for (int j = 0; j < kW - 1; ++j) {
    const int64_t s = t0 - (kW - 1) + j;
    if (s >= 0) {
      load_vec<T, kV>(x + s * token_stride, win[j]);
    } else {
#pragma unroll
      for (int v = 0; v < kV; ++v) win[j][v] = init != nullptr ? init[v * (kW - 1) + (kW - 1) + s] : 0.f;
    }
  }
}

// This thread's run: sequence b, its first token t0 (in the sequence), the sequence's length L and first
// row (b * L for a batch; packed: its start in the row, common/seq_map.h), live when the run holds tokens.
struct Run {
  int64_t b, t0, L, row0;
  bool live;
};

template <bool kPacked, class P>
__device__ __forceinline__ Run locate_run(const P& p) {
  const ConvLaunchShape& sh = p.shape;
  Run r;
  if constexpr (kPacked) {
    const int64_t j = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;  // run slot
    SeqRange range;
    int64_t index = 0;
    r.b = seq_of_slot(p.cu_seqlens, p.num_seqs, p.seqlen, sh.tokens_per_thread, j, &range, &index);
    r.t0 = index * sh.tokens_per_thread;
    r.L = range.len;
    r.row0 = range.start;
    r.live = index >= 0 && r.t0 < r.L;  // else a slot between sequences' runs
  } else {
    r.b = int64_t(blockIdx.x) / sh.token_tiles;
    r.t0 = (int64_t(blockIdx.x) % sh.token_tiles * blockDim.y + threadIdx.y) * sh.tokens_per_thread;
    r.L = p.seqlen;
    r.row0 = r.b * p.seqlen;
    r.live = r.t0 < r.L;
  }
  return r;
}

template <class T, int kW, int kV, bool kPacked>
__global__ void __launch_bounds__(kThreads) conv_fwd_kernel(const ConvParams p) {
  const ConvLaunchShape& sh = p.shape;
  const int64_t c0 = (int64_t(blockIdx.y) * blockDim.x + threadIdx.x) * kV;
  if (c0 >= p.dim) return;  // dim % kV == 0 when kV > 1 (conv_fwd_plan): the whole vector is in range
  const Run run = locate_run<kPacked>(p);
  if (!run.live) return;
  const int64_t b = run.b, t0 = run.t0, L = run.L;
  const int64_t t1 = min64(t0 + sh.tokens_per_thread, L);

  const T* x = static_cast<const T*>(p.x) + (kPacked ? run.row0 * p.x_token_stride : b * p.x_batch_stride) + c0;
  T* out = static_cast<T*>(p.out) + run.row0 * p.dim + c0;
  const float* init = p.initial_state != nullptr ? p.initial_state + (b * p.dim + c0) * (kW - 1) : nullptr;

  float w[kW][kV], bs[kV], win[kW - 1][kV];
  load_weights<kW, kV>(p.weight, p.bias, c0, w, bs);
  load_halo<T, kW, kV>(x, p.x_token_stride, init, t0, win);

  // Offsets within the run in int (a run is at most tokens_per_thread <= 64 tokens); pointers step
  // by a group.
  const int n = int(t1 - t0);
  const int64_t xs = p.x_token_stride, os = p.dim;
  const T* xp = x + t0 * xs;
  T* op = out + t0 * os;
  for (int i = 0; i < n; i += kGroup, xp += kGroup * xs, op += kGroup * os) {
    float xv[kGroup][kV];
#pragma unroll
    for (int g = 0; g < kGroup; ++g) {
      if (i + g < n) load_vec<T, kV>(xp + g * xs, xv[g]);
    }
#pragma unroll
    for (int g = 0; g < kGroup; ++g) {
      if (i + g < n) {
        float o[kV];
        conv_pre<kW, kV>(w, bs, win, xv[g], o);
        if (p.silu) {
#pragma unroll
          for (int v = 0; v < kV; ++v) o[v] = silu_f(o[v]);
        }
        store_vec<T, kV>(op + g * os, o);
        shift_in<kW - 1, kV>(win, xv[g]);
      }
    }
  }

  // The run holding the last token: win = xx[L - (W-1) .. L-1] (reaching into initial_state when the
  // run is shorter than W - 1, through its halo).
  if (p.final_state != nullptr && t1 == L) {
    T* fs = static_cast<T*>(p.final_state) + (b * p.dim + c0) * (kW - 1);
#pragma unroll
    for (int v = 0; v < kV; ++v) {
#pragma unroll
      for (int j = 0; j < kW - 1; ++j) fs[v * (kW - 1) + j] = from_float<T>(win[j][v]);
    }
  }
}

template <class T, int kW, int kV, bool kPacked>
__global__ void __launch_bounds__(kThreads) conv_bwd_kernel(const ConvBwdParams p) {
  constexpr int kCols = kW + 1;  // dweight's kW sums and dbias's
  __shared__ float red[kThreads * kCols * kV];

  const ConvLaunchShape& sh = p.shape;
  const int64_t c0 = (int64_t(blockIdx.y) * blockDim.x + threadIdx.x) * kV;
  const Run run = locate_run<kPacked>(p);
  const int64_t b = run.b, t0 = run.t0, L = run.L;

  float dw[kCols][kV];  // [k < kW]: sum of dpre * xx[t-W+1+k]; [kW]: sum of dpre
#pragma unroll
  for (int k = 0; k < kCols; ++k) {
#pragma unroll
    for (int v = 0; v < kV; ++v) dw[k][v] = 0.f;
  }

  if (c0 < p.dim && run.live) {
    const int64_t t1 = min64(t0 + sh.tokens_per_thread, L);
    const T* x = static_cast<const T*>(p.x) + (kPacked ? run.row0 * p.x_token_stride : b * p.x_batch_stride) + c0;
    const T* dout =
        static_cast<const T*>(p.dout) + (kPacked ? run.row0 * p.dout_token_stride : b * p.dout_batch_stride) + c0;
    T* dx = static_cast<T*>(p.dx) + run.row0 * p.dim + c0;
    const int64_t sc = (b * p.dim + c0) * (kW - 1);  // offset of [b, c0, 0] in the (batch, dim, W-1) tensors
    const float* init = p.initial_state != nullptr ? p.initial_state + sc : nullptr;
    const float* dfs = p.dfinal_state != nullptr ? p.dfinal_state + sc : nullptr;
    float* dinit = p.dinitial_state != nullptr ? p.dinitial_state + sc : nullptr;

    float w[kW][kV], bs[kV], win[kW - 1][kV];
    load_weights<kW, kV>(p.weight, p.bias, c0, w, bs);
    load_halo<T, kW, kV>(x, p.x_token_stride, init, t0, win);
    float dq[kW - 1][kV];  // dq[j] = dpre[t - (kW-1) + j]: the last kW-1 values, oldest first
#pragma unroll
    for (int j = 0; j < kW - 1; ++j) {
#pragma unroll
      for (int v = 0; v < kV; ++v) dq[j][v] = 0.f;
    }

    // The walk, in offsets i = t - t0 (int: a run is at most 64 tokens): tokens [t0, t1 + kW-1), of
    // which [t0, min(t1 + kW-1, L)) are read (dpre = 0 past L); position pos = t - (kW-1) is emitted
    // from i_first on (the run at t0 = 0 emits dinitial_state's positions -(kW-1) .. -1 first), and
    // gets dfinal_state[pos - (L - (kW-1))] from i_final on.
    const int n_own = int(t1 - t0);
    const int n_walk = n_own + (kW - 1);
    const int n_load = int(min64(t1 + (kW - 1), L) - t0);
    const int i_first = t0 == 0 ? 0 : kW - 1;
    const int i_final = int(min64(L - t0, int64_t(n_walk)));  // pos >= L - (kW-1) <=> ii >= L - t0
    const int64_t xs = p.x_token_stride, gs = p.dout_token_stride;
    const T* xp = x + t0 * xs;
    const T* gp = dout + t0 * gs;

    for (int i = 0; i < n_walk; i += kGroup, xp += kGroup * xs, gp += kGroup * gs) {
      float xv[kGroup][kV], gv[kGroup][kV];
#pragma unroll
      for (int g = 0; g < kGroup; ++g) {
        if (i + g < n_load) {
          load_vec<T, kV>(xp + g * xs, xv[g]);
          load_vec<T, kV>(gp + g * gs, gv[g]);
        }
      }
#pragma unroll
      for (int g = 0; g < kGroup; ++g) {
        const int ii = i + g;
        if (ii < n_walk) {
          float dp[kV];
          if (ii < n_load) {
            if (p.silu) {
              float pre[kV];
              conv_pre<kW, kV>(w, bs, win, xv[g], pre);
#pragma unroll
              for (int v = 0; v < kV; ++v) dp[v] = gv[g][v] * dsilu_f(pre[v]);
            } else {
#pragma unroll
              for (int v = 0; v < kV; ++v) dp[v] = gv[g][v];
            }
            if (ii < n_own) {  // this run's token: into dweight, dbias
#pragma unroll
              for (int v = 0; v < kV; ++v) {
#pragma unroll
                for (int k = 0; k < kW - 1; ++k) dw[k][v] = fmaf(dp[v], win[k][v], dw[k][v]);
                dw[kW - 1][v] = fmaf(dp[v], xv[g][v], dw[kW - 1][v]);
                dw[kW][v] += dp[v];
              }
            }
            shift_in<kW - 1, kV>(win, xv[g]);
          } else {
#pragma unroll
            for (int v = 0; v < kV; ++v) dp[v] = 0.f;
          }
          // Position pos = t0 + ii - (kW-1): sum_k w[k] * dpre[pos + kW-1 - k] = w[0] * dpre[t] +
          // sum_{k >= 1} w[k] * dq[kW-1-k].
          if (ii >= i_first) {
            float gx[kV];
#pragma unroll
            for (int v = 0; v < kV; ++v) {
              float a = w[0][v] * dp[v];
#pragma unroll
              for (int k = 1; k < kW; ++k) a = fmaf(w[k][v], dq[kW - 1 - k][v], a);
              gx[v] = a;
            }
            if (dfs != nullptr && ii >= i_final) {
#pragma unroll
              for (int v = 0; v < kV; ++v) gx[v] += dfs[v * (kW - 1) + (ii - i_final)];
            }
            if (ii >= kW - 1) {  // pos >= 0
              store_vec<T, kV>(dx + (t0 + ii - (kW - 1)) * p.dim, gx);
            } else if (dinit != nullptr) {  // t0 = 0, pos = ii - (kW-1) < 0
#pragma unroll
              for (int v = 0; v < kV; ++v) dinit[v * (kW - 1) + ii] = gx[v];
            }
          }
          shift_in<kW - 1, kV>(dq, dp);
        }
      }
    }
  }

  // The CTA's sums over its runs, in run order, then one row of partial: column i of the CTA is
  // (k, channel) = (i / (block_c * kV), i % (block_c * kV)), so consecutive threads store consecutive
  // channels.
  const int nc = int(blockDim.x) * kV;  // channels of the CTA
  const int ncols = kCols * nc;
  float* mine = red + threadIdx.y * ncols + threadIdx.x * kV;
#pragma unroll
  for (int k = 0; k < kCols; ++k) {
#pragma unroll
    for (int v = 0; v < kV; ++v) mine[k * nc + v] = dw[k][v];
  }
  __syncthreads();
  const int tid = int(threadIdx.y * blockDim.x + threadIdx.x);
  const int64_t cbase = int64_t(blockIdx.y) * nc;
  float* row = p.partial + int64_t(blockIdx.x) * kCols * p.dim;
  for (int i = tid; i < ncols; i += kThreads) {
    const int k = i / nc;
    const int64_t c = cbase + i % nc;
    if (c < p.dim) {
      float acc = 0.f;
      for (int r = 0; r < int(blockDim.y); ++r) acc += red[r * ncols + i];
      row[k * p.dim + c] = acc;
    }
  }
}

// One instantiation per dtype (csrc/conv/conv_<dtype>.cu); conv_launch.cu plans and dispatches.
template <class T>
struct Dispatch {
  static cudaError_t fwd(const ConvParams& p, cudaStream_t stream);
  static cudaError_t bwd(const ConvBwdParams& p, cudaStream_t stream);
};

// The run policy (a batch of equal-length sequences, or packed sequences) is a compile-time choice, so
// that the batch kernels are the ones they were.
template <class T, int kV, bool kPacked>
cudaError_t launch_fwd_policy(const ConvParams& p, const dim3 grid, const dim3 block, cudaStream_t stream) {
  switch (p.width) {
    case 2: conv_fwd_kernel<T, 2, kV, kPacked><<<grid, block, 0, stream>>>(p); break;
    case 3: conv_fwd_kernel<T, 3, kV, kPacked><<<grid, block, 0, stream>>>(p); break;
    case 4: conv_fwd_kernel<T, 4, kV, kPacked><<<grid, block, 0, stream>>>(p); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

template <class T, int kV>
cudaError_t launch_fwd(const ConvParams& p, cudaStream_t stream) {
  const dim3 grid(unsigned(p.batch * p.shape.token_tiles), unsigned(p.shape.channel_tiles));
  const dim3 block(unsigned(p.shape.block_c), unsigned(p.shape.block_t));
  return p.cu_seqlens != nullptr ? launch_fwd_policy<T, kV, true>(p, grid, block, stream)
                                 : launch_fwd_policy<T, kV, false>(p, grid, block, stream);
}

template <class T, int kV, bool kPacked>
cudaError_t launch_bwd_policy(const ConvBwdParams& p, const dim3 grid, const dim3 block, cudaStream_t stream) {
  switch (p.width) {
    case 2: conv_bwd_kernel<T, 2, kV, kPacked><<<grid, block, 0, stream>>>(p); break;
    case 3: conv_bwd_kernel<T, 3, kV, kPacked><<<grid, block, 0, stream>>>(p); break;
    case 4: conv_bwd_kernel<T, 4, kV, kPacked><<<grid, block, 0, stream>>>(p); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

template <class T, int kV>
cudaError_t launch_bwd(const ConvBwdParams& p, cudaStream_t stream) {
  const dim3 grid(unsigned(p.batch * p.shape.token_tiles), unsigned(p.shape.channel_tiles));
  const dim3 block(unsigned(p.shape.block_c), unsigned(p.shape.block_t));
  return p.cu_seqlens != nullptr ? launch_bwd_policy<T, kV, true>(p, grid, block, stream)
                                 : launch_bwd_policy<T, kV, false>(p, grid, block, stream);
}

template <class T>
cudaError_t Dispatch<T>::fwd(const ConvParams& p, cudaStream_t stream) {
  constexpr int kVmax = 16 / int(sizeof(T));
  if (p.shape.vec == kVmax) return launch_fwd<T, kVmax>(p, stream);
  if (p.shape.vec == 1) return launch_fwd<T, 1>(p, stream);
  return cudaErrorInvalidValue;
}

template <class T>
cudaError_t Dispatch<T>::bwd(const ConvBwdParams& p, cudaStream_t stream) {
  if (p.shape.vec == kBwdVec) return launch_bwd<T, kBwdVec>(p, stream);
  if (p.shape.vec == 1) return launch_bwd<T, 1>(p, stream);
  return cudaErrorInvalidValue;
}

}  // namespace conv
}  // namespace selscan
