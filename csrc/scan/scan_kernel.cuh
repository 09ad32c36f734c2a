// The standalone scan kernel of the unfused path.
//
// Reads delta_pre and [B | C] (one row per token, written by library matrix products: the layer's
// proj = [delta_pre | B | C], or the block's dt_proj and x_proj outputs), x and the per-channel
// parameters; writes y (gated by silu(z) for the block) and the final state. float32 state and
// arithmetic for every dtype.
//
// Work decomposition
//   CTA = 128 threads = kDc channels x kP threads per channel; thread (c, g) owns channel c and the kNS
//   states g*kNS .. g*kNS+kNS-1, with A2 = -exp(A_log) * log2(e) in registers, so each state update is
//       h = ex2(dt * A2) * h + (dt * x) * B[t, n]        (one MUFU.EX2)
//       y_partial += C[t, n] * h
//   Work item = (L-segment, sequence, channel tile). The CTA walks the segment's tokens in chunks of
//   kT tokens: cp.async loads chunk k+1 while chunk k is processed in three phases separated by
//   __syncthreads: (prep) softplus(delta_pre + bias) -> dt, dt*x, B, C in float32 shared memory, each
//   element computed once; (scan) the recurrence, partial sums of y per (token, channel, g) into shared
//   memory; (store) y = D*x + sum of the partials, converted and written.
//
// Parallelism along L (n_segments > 1, cooperative launch)
//   Phase 1: every segment but the last scans from a zero state and stores its end state and sum of dt.
//   grid.sync(). Phase 2: every segment folds its predecessors, in order, into its true start state
//       h = exp2(A2 * sum_dt[s]) * h + h_end[s]
//   and scans again writing y. This costs a second pass of exponentials over all but the last segment;
//   the plan only splits L when batch x channel tiles cannot fill the GPU.
#pragma once
#include <cooperative_groups.h>
#include <cuda_runtime.h>
#include <cstdint>

#include "../common/cp_async.cuh"
#include "../common/cuda_check.h"
#include "../common/device_math.cuh"
#include "../common/launch.cuh"
#include "../common/seq_map.h"
#include "scan_params.h"

namespace selscan {
namespace scan {

template <class T_, int kN_, int kNS_ = (kN_ <= 16 ? 4 : 8), int kT_ = 32, bool kGate_ = false>
struct Traits {
  using T = T_;
  static constexpr bool kGate = kGate_;              // the output policy: y gated by silu(z) (the block)
  static constexpr int kN = kN_;                     // states per channel
  static constexpr int kNS = kNS_;                   // states per thread
  static constexpr int kP = kN / kNS;                // threads per channel
  static constexpr int kThreads = 128;
  static constexpr int kDc = kThreads / kP;          // channels per CTA
  static constexpr int kT = kT_;                     // tokens per chunk
  static constexpr int kVec = 16 / int(sizeof(T));   // elements per 16-byte copy
  static_assert(kN % kNS == 0 && kThreads % kP == 0, "bad tiling");
  static_assert((kDc * int(sizeof(T))) % 16 == 0 && (2 * kN * int(sizeof(T))) % 16 == 0, "rows must be 16B");
};

// The gate's rows of one chunk (the block's output policy); empty for the layer, whose shared memory
// (and so its occupancy and L-split plan) stays as it was.
template <class T, int kT, int kDc, bool kGate>
struct GateRows {
  alignas(16) T z[kT][kDc];
};
template <class T, int kT, int kDc>
struct GateRows<T, kT, kDc, false> {};

template <class Tr>
struct SharedStorage {
  using T = typename Tr::T;
  struct Raw : GateRows<T, Tr::kT, Tr::kDc, Tr::kGate> {  // one chunk as loaded
    alignas(16) T delta[Tr::kT][Tr::kDc];
    alignas(16) T x[Tr::kT][Tr::kDc];
    alignas(16) T bc[Tr::kT][2 * Tr::kN];
  };
  Raw raw[2];
  alignas(16) float dt[Tr::kT][Tr::kDc];    // softplus(delta_pre + bias); 0 for padding tokens/channels
  alignas(16) float dtx[Tr::kT][Tr::kDc];   // dt * x
  alignas(16) float B[Tr::kT][Tr::kN];
  alignas(16) float C[Tr::kT][Tr::kN];
  alignas(16) float yp[Tr::kT][Tr::kDc][Tr::kP];  // per-thread partial sums of y
  float bias[Tr::kDc];
  float Dskip[Tr::kDc];
};

template <class Tr>
struct Item {
  int64_t seg, b, tile;
  int64_t t_begin, t_end;  // token range inside the sequence
  int64_t d0;              // first channel of the tile
  int64_t row0;            // the sequence's first row (b * seqlen, or its start when packed)
  int64_t ckpt0;           // the sequence's first checkpoint slot
};

// kPacked: the item's sequence from cu_seqlens (a compile-time policy, so that the batch kernels keep
// their registers and occupancy, which the L-split plan reads).
template <class Tr, bool kPacked>
__device__ __forceinline__ Item<Tr> decode_item(const ScanParams& p, int64_t item) {
  const int64_t n_tiles = (p.dim + Tr::kDc - 1) / Tr::kDc;
  Item<Tr> it;
  it.tile = item % n_tiles;
  it.b = (item / n_tiles) % p.batch;
  it.seg = item / (n_tiles * p.batch);
  it.d0 = it.tile * Tr::kDc;
  const ItemRows r = item_rows<kPacked>(p.cu_seqlens, it.b, it.seg, p.seg_len, p.seqlen);
  it.t_begin = r.t_begin;
  it.t_end = r.t_end;
  it.row0 = r.row0;
  it.ckpt0 = r.ckpt0;
  return it;
}

// Per-thread fixed roles inside a chunk. Every loop below walks elements i = tid + k * kThreads; since
// kThreads is a multiple of each row width, a thread's column is the same for every k: the column and
// its bounds check are computed once per item, the row is tid / width + k * (kThreads / width).
template <class Tr>
struct Roles {
  static constexpr int kDcV = Tr::kDc / Tr::kVec;       // 16-byte vectors per row of delta / x
  static constexpr int kBcV = 2 * Tr::kN / Tr::kVec;    // 16-byte vectors per row of B|C
  static_assert(Tr::kThreads % kDcV == 0 && Tr::kThreads % kBcV == 0, "tiling");
  static_assert(Tr::kThreads % Tr::kDc == 0 && Tr::kThreads % Tr::kN == 0, "tiling");
  // cp.async rounds per chunk (rows past kT in a last partial round fail the t < nvalid test)
  static constexpr int kLdIters = (Tr::kT * kDcV + Tr::kThreads - 1) / Tr::kThreads;
  static constexpr int kBcIters = (Tr::kT * kBcV + Tr::kThreads - 1) / Tr::kThreads;
  static_assert((Tr::kT * Tr::kDc) % Tr::kThreads == 0 && (Tr::kT * Tr::kN) % Tr::kThreads == 0, "tiling");

  // loads: this thread's 16-byte vector of delta/x rows and of B|C rows
  int ld_row, ld_vec, bc_row, bc_vec;
  bool ld_valid;         // the vector's channels are < dim
  // prep/store: this thread's channel and B/C state
  int el_row, el_col, st_row, st_col;
  bool col_valid;        // el_col's channel is < dim

  __device__ __forceinline__ Roles(const ScanParams& p, int64_t d0) {
    const int tid = threadIdx.x;
    ld_row = tid / kDcV;  ld_vec = tid % kDcV;
    bc_row = tid / kBcV;  bc_vec = tid % kBcV;
    ld_valid = d0 + int64_t(ld_vec) * Tr::kVec < p.dim;
    el_row = tid / Tr::kDc;  el_col = tid % Tr::kDc;
    st_row = tid / Tr::kN;   st_col = tid % Tr::kN;
    col_valid = d0 + el_col < p.dim;
  }
};

// cp.async of one chunk: rows row0 .. row0+nvalid-1 of delta_pre, x (the tile's channels) and B|C.
template <class Tr>
__device__ __forceinline__ void load_chunk(typename SharedStorage<Tr>::Raw& r, const ScanParams& p,
                                           const Roles<Tr>& ro, int64_t row0, int nvalid, int64_t d0) {
  using T = typename Tr::T;
  using R = Roles<Tr>;
  const T* delta = static_cast<const T*>(p.delta) + row0 * p.delta_stride;
  const T* bc = static_cast<const T*>(p.bc) + row0 * p.bc_stride;
  const T* x = static_cast<const T*>(p.x) + row0 * p.dim;
  const int64_t dcol = d0 + int64_t(ro.ld_vec) * Tr::kVec;
  if (ro.ld_valid) {
#pragma unroll
    for (int k = 0; k < R::kLdIters; ++k) {
      const int t = ro.ld_row + k * (Tr::kThreads / R::kDcV);
      if (t < nvalid) {
        cp_async_16(&r.delta[t][ro.ld_vec * Tr::kVec], delta + int64_t(t) * p.delta_stride + dcol);
        cp_async_16(&r.x[t][ro.ld_vec * Tr::kVec], x + int64_t(t) * p.dim + dcol);
        if constexpr (Tr::kGate)
          cp_async_16(&r.z[t][ro.ld_vec * Tr::kVec], static_cast<const T*>(p.z) + (row0 + t) * p.z_stride + dcol);
      }
    }
  }
  const int64_t bcol = int64_t(ro.bc_vec) * Tr::kVec;
#pragma unroll
  for (int k = 0; k < R::kBcIters; ++k) {
    const int t = ro.bc_row + k * (Tr::kThreads / R::kBcV);
    if (t < nvalid) cp_async_16(&r.bc[t][ro.bc_vec * Tr::kVec], bc + int64_t(t) * p.bc_stride + bcol);
  }
}

// Scans the tokens [it.t_begin, it.t_end) of one (sequence, channel tile) starting from h.
// kFull: compute y and write it (phase 2); otherwise only advance h and sum dt (phase 1).
template <class Tr, bool kFull>
__device__ __forceinline__ void scan_segment(SharedStorage<Tr>& s, const ScanParams& p, const Item<Tr>& it,
                                             const float (&A2)[Tr::kNS], float (&h)[Tr::kNS], float& sum_dt) {
  using T = typename Tr::T;
  constexpr int kG = 4;  // tokens whose loads and exponentials are issued together
  static_assert(Tr::kT % kG == 0 && Tr::kNS % 4 == 0, "tiling");
  const int tid = threadIdx.x;
  const int c = tid / Tr::kP;
  const int g = tid % Tr::kP;
  const Roles<Tr> ro(p, it.d0);
  const int64_t row_base = it.row0;
  const int64_t n_tok = it.t_end - it.t_begin;
  const int64_t n_chunks = (n_tok + Tr::kT - 1) / Tr::kT;

  __syncthreads();  // the previous item is done with the raw buffers
  load_chunk<Tr>(s.raw[0], p, ro, row_base + it.t_begin, int(min_i64(Tr::kT, n_tok)), it.d0);
  cp_async_commit();

  for (int64_t k = 0; k < n_chunks; ++k) {
    const int64_t t0 = it.t_begin + k * Tr::kT;
    const int nvalid = int(min_i64(Tr::kT, it.t_end - t0));
    auto& r = s.raw[k & 1];
    if (kFull && p.ckpt != nullptr && t0 % kCkptEvery == 0) {  // the state entering token t0, for the backward
      const int64_t d = it.d0 + c;
      if (d < p.dim) {
        float* ck = p.ckpt + ((it.ckpt0 + t0 / kCkptEvery) * p.dim + d) * Tr::kN + g * Tr::kNS;
#pragma unroll
        for (int n = 0; n < Tr::kNS; ++n) ck[n] = h[n];
      }
    }
    cp_async_wait_all();
    __syncthreads();  // (A) chunk k visible; chunk k-1 fully consumed
    if (k + 1 < n_chunks) {
      const int64_t t1 = t0 + Tr::kT;
      load_chunk<Tr>(s.raw[(k + 1) & 1], p, ro, row_base + t1, int(min_i64(Tr::kT, it.t_end - t1)), it.d0);
      cp_async_commit();
    }

    // (prep) each element once: dt, dt*x, B, C in float32; padding tokens/channels get dt = 0, B = C = 0
    // so that they leave h unchanged.
    {
      const float bias = s.bias[ro.el_col];
#pragma unroll
      for (int kk = 0; kk < Tr::kT * Tr::kDc / Tr::kThreads; ++kk) {
        const int t = ro.el_row + kk * (Tr::kThreads / Tr::kDc);
        // Branch-free: stale values of padding rows are computed on, then replaced by 0.
        const bool valid = t < nvalid && ro.col_valid;
        const float dt = softplus(to_float(r.delta[t][ro.el_col]) + bias);
        const float dtx = dt * to_float(r.x[t][ro.el_col]);
        s.dt[t][ro.el_col] = valid ? dt : 0.f;
        s.dtx[t][ro.el_col] = valid ? dtx : 0.f;
      }
#pragma unroll
      for (int kk = 0; kk < Tr::kT * Tr::kN / Tr::kThreads; ++kk) {
        const int t = ro.st_row + kk * (Tr::kThreads / Tr::kN);
        const bool valid = t < nvalid;
        s.B[t][ro.st_col] = valid ? to_float(r.bc[t][ro.st_col]) : 0.f;
        if (kFull) s.C[t][ro.st_col] = valid ? to_float(r.bc[t][Tr::kN + ro.st_col]) : 0.f;
      }
    }
    __syncthreads();  // (B)

    // (scan) the recurrence, kG tokens at a time: all loads, then all kG x kNS exponentials (independent),
    // then the kNS dependency chains through h; h stays in registers.
#pragma unroll 1
    for (int tg = 0; tg < Tr::kT; tg += kG) {
      float dt[kG], dtx[kG], Bv[kG][Tr::kNS], Cv[kG][Tr::kNS];
#pragma unroll
      for (int j = 0; j < kG; ++j) {
        dt[j] = s.dt[tg + j][c];
        dtx[j] = s.dtx[tg + j][c];
#pragma unroll
        for (int v = 0; v < Tr::kNS; v += 4) {
          const float4 b4 = *reinterpret_cast<const float4*>(&s.B[tg + j][g * Tr::kNS + v]);
          Bv[j][v] = b4.x; Bv[j][v + 1] = b4.y; Bv[j][v + 2] = b4.z; Bv[j][v + 3] = b4.w;
          if (kFull) {
            const float4 c4 = *reinterpret_cast<const float4*>(&s.C[tg + j][g * Tr::kNS + v]);
            Cv[j][v] = c4.x; Cv[j][v + 1] = c4.y; Cv[j][v + 2] = c4.z; Cv[j][v + 3] = c4.w;
          }
        }
      }
      float dA[kG][Tr::kNS];
#pragma unroll
      for (int j = 0; j < kG; ++j)
#pragma unroll
        for (int n = 0; n < Tr::kNS; ++n) dA[j][n] = ex2_approx(dt[j] * A2[n]);
#pragma unroll
      for (int j = 0; j < kG; ++j) {
        float yj[Tr::kNS];
#pragma unroll
        for (int n = 0; n < Tr::kNS; ++n) {
          h[n] = fmaf(dA[j][n], h[n], dtx[j] * Bv[j][n]);
          if (kFull) yj[n] = Cv[j][n] * h[n];
        }
        if (kFull) {
#pragma unroll
          for (int w = 1; w < Tr::kNS; w *= 2)  // pairwise sum: short dependency chains
#pragma unroll
            for (int n = 0; n < Tr::kNS; n += 2 * w) yj[n] += yj[n + w];
          s.yp[tg + j][c][g] = yj[0];
        } else {
          sum_dt += dt[j];
        }
      }
    }

    if (kFull) {
      __syncthreads();  // (C)
      // (store) y = D*x + sum of the partials, times silu(z) under the block's gate; consecutive threads
      // take consecutive channels.
      T* y = static_cast<T*>(p.y) + (row_base + t0) * p.dim + it.d0;
      if (ro.col_valid) {
        const float dsk = s.Dskip[ro.el_col];
#pragma unroll
        for (int kk = 0; kk < Tr::kT * Tr::kDc / Tr::kThreads; ++kk) {
          const int t = ro.el_row + kk * (Tr::kThreads / Tr::kDc);
          if (t < nvalid) {
            float acc = dsk * to_float(r.x[t][ro.el_col]);
#pragma unroll
            for (int gg = 0; gg < Tr::kP; ++gg) acc += s.yp[t][ro.el_col][gg];
            if constexpr (Tr::kGate) acc *= silu(to_float(r.z[t][ro.el_col]));
            y[int64_t(t) * p.dim + ro.el_col] = from_float<T>(acc);
          }
        }
      }
    }
  }
}

template <class Tr>
__device__ __forceinline__ void load_channel_params(SharedStorage<Tr>& s, const ScanParams& p,
                                                    const Item<Tr>& it, float (&A2)[Tr::kNS]) {
  const int tid = threadIdx.x;
  const int c = tid / Tr::kP;
  const int g = tid % Tr::kP;
  const int64_t d = it.d0 + c;
  __syncthreads();  // the previous item no longer reads bias/Dskip
  for (int i = tid; i < Tr::kDc; i += Tr::kThreads) {
    const bool valid = it.d0 + i < p.dim;
    s.bias[i] = valid ? p.b_delta[it.d0 + i] : 0.f;
    s.Dskip[i] = valid ? p.D[it.d0 + i] : 0.f;
  }
#pragma unroll
  for (int n = 0; n < Tr::kNS; ++n)
    A2[n] = d < p.dim ? decay_rate(p.A_log[d * Tr::kN + g * Tr::kNS + n], kLog2e) : 0.f;
  // bias/Dskip are read after the (A) barrier of the first chunk.
}

template <class Tr, bool kSplit, bool kPacked = false>
__global__ void __launch_bounds__(Tr::kThreads) scan_fwd_kernel(const ScanParams p) {
  static_assert(!(kSplit && kPacked), "packed sequences are never split along L");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  auto& s = *reinterpret_cast<SharedStorage<Tr>*>(smem_raw);
  const int tid = threadIdx.x;
  const int c = tid / Tr::kP;
  const int g = tid % Tr::kP;
  const int64_t n_tiles = (p.dim + Tr::kDc - 1) / Tr::kDc;
  const int64_t items_per_seg = p.batch * n_tiles;
  const int64_t n_items = items_per_seg * p.n_segments;
  const SplitWorkspace ws(p.workspace, p.n_segments, p.batch, p.dim, Tr::kN);
  float A2[Tr::kNS];
  float h[Tr::kNS];

  if constexpr (kSplit) {
    // Phase 1: end state and sum of dt of every segment but the last, from a zero state.
    for (int64_t item = blockIdx.x; item < items_per_seg * (p.n_segments - 1); item += gridDim.x) {
      const Item<Tr> it = decode_item<Tr, kPacked>(p, item);
      load_channel_params<Tr>(s, p, it, A2);
#pragma unroll
      for (int n = 0; n < Tr::kNS; ++n) h[n] = 0.f;
      float sum_dt = 0.f;
      scan_segment<Tr, false>(s, p, it, A2, h, sum_dt);
      const int64_t d = it.d0 + c;
      if (d < p.dim) ws.publish<Tr::kNS>(it.seg, it.b, d, g * Tr::kNS, h, sum_dt, g == 0);
    }
    __threadfence();
    cooperative_groups::this_grid().sync();
  }

  // Phase 2: true start state, then the scan that writes y.
  for (int64_t item = blockIdx.x; item < n_items; item += gridDim.x) {
    const Item<Tr> it = decode_item<Tr, kPacked>(p, item);
    load_channel_params<Tr>(s, p, it, A2);
    const int64_t d = it.d0 + c;
    const bool valid_d = d < p.dim;
#pragma unroll
    for (int n = 0; n < Tr::kNS; ++n)
      h[n] = (p.h0 != nullptr && valid_d) ? p.h0[(it.b * p.dim + d) * Tr::kN + g * Tr::kNS + n] : 0.f;
    if (kSplit && valid_d) ws.fold<Tr::kNS>(it.seg, it.b, d, g * Tr::kNS, A2, h);
    float unused = 0.f;
    scan_segment<Tr, true>(s, p, it, A2, h, unused);
    if (p.final_state != nullptr && valid_d && it.seg == p.n_segments - 1) {
#pragma unroll
      for (int n = 0; n < Tr::kNS; ++n) p.final_state[(it.b * p.dim + d) * Tr::kN + g * Tr::kNS + n] = h[n];
    }
  }
}

// Host side.
template <class Tr, bool kSplit, bool kPacked = false>
cudaError_t prepare_kernel(int device, int* blocks_per_sm) {
  return selscan::prepare_kernel<scan_fwd_kernel<Tr, kSplit, kPacked>>(Tr::kThreads, int(sizeof(SharedStorage<Tr>)),
                                                                     device, blocks_per_sm);
}

template <class Tr>
cudaError_t launch_whole(const ScanParams& p, cudaStream_t stream) {
  int device = 0, blocks = 0;
  SELSCAN_RETURN_IF_ERROR(cudaGetDevice(&device));
  const int64_t n_items = p.batch * ((p.dim + Tr::kDc - 1) / Tr::kDc);
  if (n_items > 0x7fffffffLL) return cudaErrorInvalidConfiguration;
  if (p.cu_seqlens != nullptr) {
    SELSCAN_RETURN_IF_ERROR(prepare_kernel<Tr, false, true>(device, &blocks));
    scan_fwd_kernel<Tr, false, true><<<unsigned(n_items), Tr::kThreads, sizeof(SharedStorage<Tr>), stream>>>(p);
  } else {
    SELSCAN_RETURN_IF_ERROR(prepare_kernel<Tr, false>(device, &blocks));
    scan_fwd_kernel<Tr, false><<<unsigned(n_items), Tr::kThreads, sizeof(SharedStorage<Tr>), stream>>>(p);
  }
  return cudaGetLastError();
}

template <class Tr>
cudaError_t launch_split(const ScanParams& p, cudaStream_t stream) {
  if (p.cu_seqlens != nullptr) return cudaErrorInvalidValue;  // packed sequences are never split
  int device = 0, blocks = 0;
  SELSCAN_RETURN_IF_ERROR(cudaGetDevice(&device));
  SELSCAN_RETURN_IF_ERROR(prepare_kernel<Tr, true>(device, &blocks));
  const int64_t n_items = p.batch * ((p.dim + Tr::kDc - 1) / Tr::kDc) * p.n_segments;
  return launch_cooperative(scan_fwd_kernel<Tr, true>, p, n_items, blocks, Tr::kThreads,
                            int(sizeof(SharedStorage<Tr>)), stream);
}

template <class Tr>
cudaError_t occupancy(int device, int* blocks_per_sm, int* channels_per_cta) {
  *channels_per_cta = Tr::kDc;
  return prepare_kernel<Tr, true>(device, blocks_per_sm);
}

// One entry per dtype, explicitly instantiated in scan_<dtype>.cu.
template <class T>
struct Dispatch {
  static cudaError_t launch(const ScanParams& p, cudaStream_t stream);
  static cudaError_t occupancy(int64_t dstate, bool gate, int device, int* blocks_per_sm, int* channels_per_cta);
};

#define SELSCAN_SCAN_SWITCH_N(N, ...)                        \
  [&]() -> cudaError_t {                                     \
    switch (N) {                                             \
      case 8:  { constexpr int kN = 8;  return __VA_ARGS__(); }  \
      case 16: { constexpr int kN = 16; return __VA_ARGS__(); }  \
      case 32: { constexpr int kN = 32; return __VA_ARGS__(); }  \
      case 64: { constexpr int kN = 64; return __VA_ARGS__(); }  \
      default: return cudaErrorInvalidValue;                 \
    }                                                        \
  }()

// Tiling per regime, chosen by measurement on the H200 (docs/perf/layer-forward.md, scan v2): 4 states per
// thread (8 for N >= 32); chunks of 64 tokens when L is not split (fewer barriers per token), 32 when
// it is (more CTAs fit an SM, and the split plan wants them resident).
template <class T, int kN, bool kGate = false> using TraitsWhole = Traits<T, kN, (kN <= 16 ? 4 : 8), 64, kGate>;
template <class T, int kN, bool kGate = false> using TraitsSplit = Traits<T, kN, (kN <= 16 ? 4 : 8), 32, kGate>;

template <class T>
cudaError_t Dispatch<T>::launch(const ScanParams& p, cudaStream_t stream) {
  // The output policy: the layer's y, or the block's y gated by silu(z) (p.z given).
  return SELSCAN_SCAN_SWITCH_N(p.dstate, [&] {
    if (p.z != nullptr)
      return p.n_segments == 1 ? scan::launch_whole<TraitsWhole<T, kN, true>>(p, stream)
                               : scan::launch_split<TraitsSplit<T, kN, true>>(p, stream);
    return p.n_segments == 1 ? scan::launch_whole<TraitsWhole<T, kN>>(p, stream)
                             : scan::launch_split<TraitsSplit<T, kN>>(p, stream);
  });
}

template <class T>
cudaError_t Dispatch<T>::occupancy(int64_t dstate, bool gate, int device, int* blocks_per_sm, int* channels_per_cta) {
  return SELSCAN_SCAN_SWITCH_N(dstate, [&] {
    return gate ? scan::occupancy<TraitsSplit<T, kN, true>>(device, blocks_per_sm, channels_per_cta)
                : scan::occupancy<TraitsSplit<T, kN>>(device, blocks_per_sm, channels_per_cta);
  });
}

}  // namespace scan
}  // namespace selscan
