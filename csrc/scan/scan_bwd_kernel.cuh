// The backward scan kernel (both paths' backward; the math is docs/math.md, "The backward pass").
//
// Reads delta_pre and [B | C] (the layer's proj, or the block's dt_proj and x_proj outputs), x, dy,
// the per-channel parameters, the gradient of the final state and the forward's checkpoints (the state entering every kT-th token); writes dz (the gradient
// of delta_pre) into dP, the scan's own part of dx, per-tile partial sums of dB and dC, and per-item
// partial sums of dA, dD and db_delta. Everything that is summed over channels, tokens or sequences
// leaves the kernel as partials summed afterwards in a fixed order: no atomics, bitwise deterministic.
//
// Work decomposition
//   CTA = kDc channels x kP threads per channel (128 or 256); thread (c, g) owns channel c and the
//   kNS states g*kNS ..; lanes of a warp: channel lanes adjacent (the kP threads of a channel), the
//   kR = 32 / kP lanes of one state group kP apart. Work item = (L-segment, sequence, channel tile),
//   walked from its last chunk of kT tokens to its first; the adjoint g stays in registers.
//   Per chunk:
//     (prep)  dt = softplus(z), sigmoid(z) (the derivative of softplus), x, dy, B, C in float32
//             shared memory, each element once; the next (earlier) chunk is then fetched by cp.async.
//     (F)     from the chunk's checkpoint, the forward recurrence over the chunk, keeping the state
//             at the start of every sub-chunk of kS tokens (shared memory, per thread).
//     (R)     sub-chunks last first: the forward states of the sub-chunk again, from its start state,
//             into registers (with the decays a[t] when they fit: N <= 32), then token by token in
//             reverse:
//               g       = a[t+1] * g + C[t] * dy[t]
//               ddelta += sum_n g * A * a[t] * h[t-1]  +  x[t] * sum_n g * B[t]
//               dA     += g * dt * a[t] * h[t-1]
//               dB[t]   = sum_d g * dt * x,   dC[t] = sum_d dy * h[t]     (over the tile's channels)
//             ddelta and sum_n g * B are reduce-scattered over the kP threads of a channel (groups of
//             kP / 2 tokens: one value per lane), dB and dC over the kR lanes of a state group, then
//             over the 4 warps through shared memory (one barrier per sub-chunk).
//     (store) dz = ddelta * sigmoid(z) into dP, dx_scan = dt * sum_n g * B + D * dy, coalesced.
//   Two rounds of exponentials for N <= 32 (F and R), three for N = 64 (the decays of a sub-chunk
//   do not fit in registers next to its states, so R computes them twice).
//
// The block's gate (kGate, the forward's output policy): dy is the gradient of the gated output
// y * silu(z). prep turns it into the gradient of y, dy * silu(z), and keeps q = dy * silu'(z); (R)
// forms y = sum_n C h + D x from the states it recomputes anyway (reduced over the kP threads of a
// channel), and the store phase writes the gate's gradient q * y. So the forward keeps no y before the
// gate, and no separate kernel reads it back.
//
// Parallelism along L (n_segments > 1, cooperative launch): the adjoint recurrence is linear, so a
// segment's adjoint is its own part (from a zero adjoint at its end) plus the decayed adjoint entering
// from its successor. Phase 1: every segment but the first runs the adjoint alone (no states needed)
// and publishes a[t0] * g[t0] and its sum of dt. grid.sync(). Phase 2: each segment folds its
// successors, last first, E = pub[s] + exp2(A2 * sum_dt[s]) * E, starting from dhT, and runs the full
// backward from E. The forward states come from the checkpoints, which hold the true states.
#pragma once
#include <cooperative_groups.h>
#include <cuda_runtime.h>
#include <cstdint>

#include "../common/cp_async.cuh"
#include "../common/cuda_check.h"
#include "../common/device_math.cuh"
#include "../common/launch.cuh"
#include "../common/l_split.h"
#include "../common/seq_map.h"
#include "scan_bwd_params.h"

namespace selscan {
namespace scan_bwd {

template <class T_, int kN_, bool kGate_ = false>
struct Traits {
  using T = T_;
  static constexpr bool kGate = kGate_;              // dy is the gradient of y * silu(z) (the block)
  static constexpr int kN = kN_;                     // states per channel
  // Threads per channel: 8 (4 for N = 8), so that each thread keeps few states (kNS = 2, 2, 4, 8 for
  // N = 8, 16, 32, 64) and a CTA of 32 channels has 8 warps: the shared memory per channel and token
  // limits an SM to 2 CTAs, and with 4 threads per channel (4 warps per CTA) the scheduler had 2 warps
  // to pick from: 43% of its cycles issued nothing (docs/perf/training.md, backward v1).
  static constexpr int kP = kN == 8 ? 4 : 8;
  static constexpr int kNS = kN / kP;
  static constexpr int kDc = kN == 64 ? 16 : 32;     // channels per CTA
  static constexpr int kThreads = kDc * kP;          // 128 or 256
  static constexpr int kWarps = kThreads / 32;
  // CTAs per SM the registers are capped for: 2, except N = 32, whose shared memory fits one only
  // (and whose kernel spills under the 128-register cap of two).
  static constexpr int kMinBlocks = kN == 32 ? 1 : 2;
  static constexpr int kR = 32 / kP;                 // lanes of a warp sharing a state group
  static constexpr int kT = int(kCkptEvery);         // tokens per chunk = checkpoint interval
  static constexpr int kS = 8;                       // tokens per sub-chunk (states in registers)
  static constexpr int kG = kP / 2;                  // tokens per reduction group (one value per lane)
  static constexpr bool kKeepA = kNS * kS <= 32;     // the sub-chunk's decays kept in registers
  static constexpr int kVec = 16 / int(sizeof(T));   // elements per 16-byte copy
  static constexpr int kRowsPerCol = kThreads / kDc; // store-phase threads per column
  static_assert(kN % kP == 0 && kS % kG == 0 && kT % kS == 0, "tiling");
  static_assert((kDc * int(sizeof(T))) % 16 == 0 && (2 * kN * int(sizeof(T))) % 16 == 0, "rows must be 16B");
  static_assert((kS * 2 * kN) % kThreads == 0, "dB/dC sums of a sub-chunk: whole rounds of threads");
};

// The gate's rows (the block): z as loaded, and q = dy * silu'(z), overwritten by the gate's gradient in
// (R). Empty for the layer, whose shared memory (occupancy, L-split plan) stays as it was.
template <class T, int kT, int kDc, bool kGate>
struct GateRaw {
  alignas(16) T z[kT][kDc];
};
template <class T, int kT, int kDc>
struct GateRaw<T, kT, kDc, false> {};
template <int kT, int kDc, bool kGate>
struct GateRows {
  alignas(16) float gq[kT][kDc];
};
template <int kT, int kDc>
struct GateRows<kT, kDc, false> {};

template <class Tr>
struct SharedStorage : GateRows<Tr::kT, Tr::kDc, Tr::kGate> {
  using T = typename Tr::T;
  // one chunk as loaded (a single buffer: the next chunk is fetched once prep has read it)
  struct Raw : GateRaw<T, Tr::kT, Tr::kDc, Tr::kGate> {
    alignas(16) T delta[Tr::kT][Tr::kDc];
    alignas(16) T x[Tr::kT][Tr::kDc];
    alignas(16) T dy[Tr::kT][Tr::kDc];
    alignas(16) T bc[Tr::kT][2 * Tr::kN];
  };
  Raw raw;
  alignas(16) float dt[Tr::kT][Tr::kDc];   // softplus(delta_pre + bias); 0 for padding tokens/channels
  alignas(16) float x[Tr::kT][Tr::kDc];
  alignas(16) float dy[Tr::kT][Tr::kDc];  // the gradient of y (under the gate: dy * silu(z))
  alignas(16) float sig[Tr::kT][Tr::kDc];  // sigmoid(delta_pre + bias), overwritten by dz in (R)
  alignas(16) float dx[Tr::kT][Tr::kDc];   // dt * sum_n g * B + D * dy
  alignas(16) float B[Tr::kT][Tr::kN];
  alignas(16) float C[Tr::kT][Tr::kN];
  alignas(16) float sub[Tr::kT / Tr::kS][Tr::kNS][Tr::kThreads];  // sub-chunk start states, per thread
  alignas(16) float red[2][Tr::kWarps][Tr::kS][2 * Tr::kN];       // dB | dC per warp (double-buffered)
  float bias[Tr::kDc];
  float Dskip[Tr::kDc];
};

// Reduce-scatter of V values over R lanes kStride apart (r: this lane's index among them): afterwards
// v[0 .. V/R) hold the sums over the R lanes of the original v[r * V/R ..].
template <int V, int R, int kStride>
__device__ __forceinline__ void reduce_scatter(float* v, int r) {
  if constexpr (R > 1) {
    constexpr int kLen = V / 2;
    const bool hi = (r & (R / 2)) != 0;
#pragma unroll
    for (int i = 0; i < kLen; ++i) {
      const float keep = hi ? v[i + kLen] : v[i], send = hi ? v[i] : v[i + kLen];
      v[i] = keep + __shfl_xor_sync(0xffffffffu, send, (R / 2) * kStride);
    }
    reduce_scatter<kLen, R / 2, kStride>(v, r);
  }
}

struct Item {
  int64_t seg, b, tile;
  int64_t t_begin, t_end;  // token range inside the sequence
  int64_t d0;              // first channel of the tile
  int64_t row0;            // the sequence's first row (b * seqlen, or its start when packed)
  int64_t ckpt0;           // the sequence's first checkpoint slot
};

// kPacked: the item's sequence from cu_seqlens (compile-time: the batch kernels keep their registers).
template <class Tr, bool kPacked>
__device__ __forceinline__ Item decode_item(const ScanBwdParams& p, int64_t item) {
  const int64_t n_tiles = (p.dim + Tr::kDc - 1) / Tr::kDc;
  Item it;
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

// cp.async of one chunk: rows row0 .. row0+nvalid-1 of delta_pre, x, dy, the gate's z (the tile's
// channels) and B|C. kFull = false (the adjoint alone): no x.
template <class Tr, bool kFull>
__device__ __forceinline__ void load_chunk(typename SharedStorage<Tr>::Raw& r, const ScanBwdParams& p,
                                           int64_t row0, int nvalid, int64_t d0) {
  using T = typename Tr::T;
  constexpr int kDcV = Tr::kDc / Tr::kVec, kBcV = 2 * Tr::kN / Tr::kVec;
  static_assert(Tr::kThreads % kDcV == 0 && Tr::kThreads % kBcV == 0, "tiling");
  const int tid = threadIdx.x;
  const T* delta = static_cast<const T*>(p.delta) + row0 * p.delta_stride;
  const T* bc = static_cast<const T*>(p.bc) + row0 * p.bc_stride;
  const T* x = static_cast<const T*>(p.x) + row0 * p.dim;
  const T* dy = static_cast<const T*>(p.dy) + row0 * p.dim;
  const int vec = tid % kDcV;
  const int64_t dcol = d0 + int64_t(vec) * Tr::kVec;
  if (dcol < p.dim) {
#pragma unroll
    for (int t = tid / kDcV; t < Tr::kT; t += Tr::kThreads / kDcV) {
      if (t < nvalid) {
        cp_async_16(&r.delta[t][vec * Tr::kVec], delta + int64_t(t) * p.delta_stride + dcol);
        cp_async_16(&r.dy[t][vec * Tr::kVec], dy + int64_t(t) * p.dim + dcol);
        if (kFull) cp_async_16(&r.x[t][vec * Tr::kVec], x + int64_t(t) * p.dim + dcol);
        if constexpr (Tr::kGate)
          cp_async_16(&r.z[t][vec * Tr::kVec], static_cast<const T*>(p.gate_z) + (row0 + t) * p.gate_z_stride + dcol);
      }
    }
  }
  const int bvec = tid % kBcV;
#pragma unroll
  for (int t = tid / kBcV; t < Tr::kT; t += Tr::kThreads / kBcV)
    if (t < nvalid) cp_async_16(&r.bc[t][bvec * Tr::kVec], bc + int64_t(t) * p.bc_stride + bvec * Tr::kVec);
}

// (prep) of one chunk from the raw buffer; padding tokens and channels get dt = 0, dy = x = 0 and
// B = C = 0, so that they leave the state and the adjoint unchanged and contribute nothing.
template <class Tr, bool kFull>
__device__ __forceinline__ void prep_chunk(SharedStorage<Tr>& s, const ScanBwdParams& p, int nvalid, int64_t d0) {
  const int tid = threadIdx.x;
  const int col = tid % Tr::kDc;
  const bool col_valid = d0 + col < p.dim;
  const float bias = s.bias[col];
  const auto& r = s.raw;
#pragma unroll 4
  for (int t = tid / Tr::kDc; t < Tr::kT; t += Tr::kThreads / Tr::kDc) {
    // Branch-free: stale values of padding rows are computed on, then replaced by 0.
    const bool valid = t < nvalid && col_valid;
    const float z = to_float(r.delta[t][col]) + bias;
    s.dt[t][col] = valid ? softplus(z) : 0.f;
    const float dyv = to_float(r.dy[t][col]);
    if constexpr (Tr::kGate) {
      // y_out = y * silu(zg): dy = dy_out * silu(zg), q = dy_out * silu'(zg), silu' = s (1 + zg (1 - s))
      const float zg = to_float(r.z[t][col]);
      const float sg = 1.f / (1.f + __expf(-zg));
      s.dy[t][col] = valid ? dyv * zg * sg : 0.f;
      if (kFull) s.gq[t][col] = valid ? dyv * sg * (1.f + zg * (1.f - sg)) : 0.f;
    } else {
      s.dy[t][col] = valid ? dyv : 0.f;
    }
    if (kFull) {
      const float e = ex2_approx(z * kLog2e);
      // torch's softplus backward: 1 above its threshold (20), else e^z / (1 + e^z)
      s.sig[t][col] = valid ? (z > 20.f ? 1.f : __fdividef(e, 1.f + e)) : 0.f;
      s.x[t][col] = valid ? to_float(r.x[t][col]) : 0.f;
    }
  }
  const int scol = tid % Tr::kN;
#pragma unroll 4
  for (int t = tid / Tr::kN; t < Tr::kT; t += Tr::kThreads / Tr::kN) {
    const bool valid = t < nvalid;
    if (kFull) s.B[t][scol] = valid ? to_float(r.bc[t][scol]) : 0.f;
    s.C[t][scol] = valid ? to_float(r.bc[t][Tr::kN + scol]) : 0.f;
  }
}

template <class Tr>
__device__ __forceinline__ void load_vec(const float* src, float (&v)[Tr::kNS]) {
#pragma unroll
  for (int n = 0; n < Tr::kNS; n += 2) {
    const float2 f = *reinterpret_cast<const float2*>(src + n);
    v[n] = f.x; v[n + 1] = f.y;
  }
}

// One token of the forward recurrence for this thread's states: h = a[t] * h + dt * x * B[t]; returns
// the decays a[t] through `a` (the same arithmetic as the forward scan, so recomputed states match it).
template <class Tr>
__device__ __forceinline__ void forward_token(const SharedStorage<Tr>& s, int t, int c, int n0,
                                              const float (&A2)[Tr::kNS], float (&h)[Tr::kNS],
                                              float (&a)[Tr::kNS]) {
  const float dt = s.dt[t][c], dtx = dt * s.x[t][c];
  float Bv[Tr::kNS];
  load_vec<Tr>(&s.B[t][n0], Bv);
#pragma unroll
  for (int n = 0; n < Tr::kNS; ++n) {
    a[n] = ex2_approx(dt * A2[n]);
    h[n] = fmaf(a[n], h[n], dtx * Bv[n]);
  }
}

// Per-thread state of one work item, carried across its chunks.
template <class Tr>
struct ItemState {
  float A2[Tr::kNS];  // A * log2(e)
  float A[Tr::kNS];   // A = -exp(A_log)
  float g[Tr::kNS];   // the adjoint entering the current token from the later ones: a[t+1] * g[t+1]
                      // is formed as an[n] * g[n]
  float an[Tr::kNS];  // a[t+1], the decay of the token after the current one (1 past the end)
  float dA[Tr::kNS];  // sum of g * dt * a * h_prev
  float sum_dt;       // phase 1: sum of dt over the segment
  float db, dD;       // store phase: sums of dz and dy * x over this thread's (rows, column)
};

// Phase 1 of the L split: the adjoint alone over one segment's chunk (tokens in reverse).
template <class Tr>
__device__ __forceinline__ void adjoint_chunk(SharedStorage<Tr>& s, ItemState<Tr>& st) {
  const int tid = threadIdx.x;
  const int c = tid / Tr::kP, n0 = (tid % Tr::kP) * Tr::kNS;
#pragma unroll 4
  for (int t = Tr::kT - 1; t >= 0; --t) {
    const float dt = s.dt[t][c], dy = s.dy[t][c];
    float Cv[Tr::kNS];
    load_vec<Tr>(&s.C[t][n0], Cv);
#pragma unroll
    for (int n = 0; n < Tr::kNS; ++n) {
      st.g[n] = fmaf(st.an[n], st.g[n], Cv[n] * dy);
      st.an[n] = ex2_approx(dt * st.A2[n]);
    }
    st.sum_dt += dt;
  }
}

// (F) and (R) of one chunk: see the header. row0: the chunk's first row; q: its checkpoint.
template <class Tr>
__device__ __forceinline__ void backward_chunk(SharedStorage<Tr>& s, const ScanBwdParams& p, const Item& it,
                                               int64_t row0, int64_t q, int nvalid, ItemState<Tr>& st) {
  constexpr int kNS = Tr::kNS, kS = Tr::kS, kG = Tr::kG, kN = Tr::kN;
  const int tid = threadIdx.x;
  const int lane = tid % 32, warp = tid / 32;
  const int c = tid / Tr::kP, g = tid % Tr::kP, n0 = g * kNS;
  const int c_local = lane / Tr::kP;
  const int64_t d = it.d0 + c;
  const bool valid_d = d < p.dim;
  const int n_sub = (nvalid + kS - 1) / kS;  // sub-chunks holding tokens (uniform over the CTA)

  // (F) the forward states from the checkpoint; the start state of every sub-chunk to shared memory.
  {
    float h[kNS];
#pragma unroll
    for (int n = 0; n < kNS; ++n)
      h[n] = valid_d ? p.ckpt[((it.ckpt0 + q) * p.dim + d) * kN + n0 + n] : 0.f;
    for (int sc = 0; sc < n_sub; ++sc) {
#pragma unroll
      for (int n = 0; n < kNS; ++n) s.sub[sc][n][tid] = h[n];
#pragma unroll
      for (int j = 0; j < kS; ++j) {
        float a[kNS];
        forward_token<Tr>(s, sc * kS + j, c, n0, st.A2, h, a);
      }
    }
  }

  // (R) sub-chunks last first.
  for (int sc = n_sub - 1; sc >= 0; --sc) {
    const int buf = sc & 1;
    float hp[kS][kNS];                       // h[t-1] for the sub-chunk's tokens
    [[maybe_unused]] float a[kS][kNS];       // a[t] (kKeepA)
    float hend[kNS];                         // h at the sub-chunk's last token
#pragma unroll
    for (int n = 0; n < kNS; ++n) hend[n] = s.sub[sc][n][tid];
#pragma unroll
    for (int j = 0; j < kS; ++j) {
      float aj[kNS];
#pragma unroll
      for (int n = 0; n < kNS; ++n) hp[j][n] = hend[n];
      forward_token<Tr>(s, sc * kS + j, c, n0, st.A2, hend, aj);
      if constexpr (Tr::kKeepA) {
#pragma unroll
        for (int n = 0; n < kNS; ++n) a[j][n] = aj[n];
      }
    }
    if constexpr (Tr::kGate) {
      // y = sum_n C h[t] + D x of the sub-chunk's tokens (h[t]: the next token's h[t-1], or hend),
      // reduce-scattered over the channel's kP threads: lane g ends with tokens g * kYL .. of it;
      // the gate's gradient q * y replaces q.
      constexpr int kYL = kS / Tr::kP;
      static_assert(kS % Tr::kP == 0, "y reduce-scatter");
      float yv[kS];
#pragma unroll
      for (int j = 0; j < kS; ++j) {
        float Cv[kNS];
        load_vec<Tr>(&s.C[sc * kS + j][n0], Cv);
        float acc = 0.f;
#pragma unroll
        for (int n = 0; n < kNS; ++n) acc = fmaf(Cv[n], j + 1 < kS ? hp[j + 1 < kS ? j + 1 : j][n] : hend[n], acc);
        yv[j] = acc;
      }
      reduce_scatter<kS, Tr::kP, 1>(yv, g);
#pragma unroll
      for (int i = 0; i < kYL; ++i) {
        const int t = sc * kS + g * kYL + i;
        s.gq[t][c] *= fmaf(s.Dskip[c], s.x[t][c], yv[i]);
      }
    }
    // Reverse, kG tokens per reduction group.
#pragma unroll
    for (int jg = kS - kG; jg >= 0; jg -= kG) {
      float v1[2 * kG];        // per token: ddelta's partial, then sum_n g * B
      float v2[2 * kG * kNS];  // per token: dB (g * dt * x) then dC (dy * h[t]), kNS states each
#pragma unroll
      for (int jj = kG - 1; jj >= 0; --jj) {
        const int j = jg + jj, t = sc * kS + j;
        const float dt = s.dt[t][c], dy = s.dy[t][c], xv = s.x[t][c];
        const float dtx = dt * xv;
        float Bv[kNS], Cv[kNS];
        load_vec<Tr>(&s.B[t][n0], Bv);
        load_vec<Tr>(&s.C[t][n0], Cv);
        float acc_a = 0.f, acc_b = 0.f;
#pragma unroll
        for (int n = 0; n < kNS; ++n) {
          float aj;
          if constexpr (Tr::kKeepA) aj = a[j][n]; else aj = ex2_approx(dt * st.A2[n]);
          const float gn = fmaf(st.an[n], st.g[n], Cv[n] * dy);
          st.g[n] = gn;
          st.an[n] = aj;
          const float gah = gn * (aj * hp[j][n]);
          acc_a = fmaf(st.A[n], gah, acc_a);
          acc_b = fmaf(gn, Bv[n], acc_b);
          st.dA[n] = fmaf(gah, dt, st.dA[n]);
          v2[(jj * 2 + 0) * kNS + n] = gn * dtx;
          // h[t] is the next token's h[t-1], or the sub-chunk's end state
          v2[(jj * 2 + 1) * kNS + n] = dy * (j + 1 < kS ? hp[j + 1 < kS ? j + 1 : j][n] : hend[n]);
        }
        v1[jj * 2 + 0] = fmaf(xv, acc_b, acc_a);
        v1[jj * 2 + 1] = acc_b;
      }
      // ddelta and sum_n g * B over the channel's kP threads: lane g ends with value g of v1.
      reduce_scatter<2 * kG, Tr::kP, 1>(v1, g);
      {
        const int t = sc * kS + jg + g / 2;
        if (g % 2 == 0) {
          s.sig[t][c] = v1[0] * s.sig[t][c];                      // dz
        } else {
          s.dx[t][c] = fmaf(s.dt[t][c], v1[0], s.Dskip[c] * s.dy[t][c]);  // the scan's part of dx
        }
      }
      // dB and dC over the warp's kR channels: lane c_local ends with values c_local * kV2 ...
      constexpr int kV2 = 2 * kG * kNS / Tr::kR;
      static_assert(kV2 >= 1 && (2 * kG * kNS) % Tr::kR == 0, "dB/dC reduce-scatter");
      reduce_scatter<2 * kG * kNS, Tr::kR, Tr::kP>(v2, c_local);
#pragma unroll
      for (int i = 0; i < kV2; ++i) {
        const int v = c_local * kV2 + i;
        const int jj = v / (2 * kNS), kind = (v / kNS) % 2, n = v % kNS;
        s.red[buf][warp][jg + jj][kind * kN + n0 + n] = v2[i];
      }
    }
    __syncthreads();  // the sub-chunk's dB | dC of every warp are in red[buf]
    // Sum over the warps in order; write the tile's partial for the sub-chunk's tokens.
    const int64_t n_tiles = (p.dim + Tr::kDc - 1) / Tr::kDc;
#pragma unroll
    for (int e = tid; e < kS * 2 * kN; e += Tr::kThreads) {
      const int j = e / (2 * kN), col = e % (2 * kN);
      float sum = 0.f;
#pragma unroll
      for (int w = 0; w < Tr::kWarps; ++w) sum += s.red[buf][w][j][col];
      const int t = sc * kS + j;
      if (t < nvalid) p.bc_partial[((row0 + t) * n_tiles + it.tile) * (2 * kN) + col] = sum;
    }
    // red[buf] is written again two sub-chunks later, after the next barrier: no second barrier.
  }
}

// (store) dz, the scan's part of dx and the gate's gradient, coalesced; the sums of dz and dy * x.
template <class Tr>
__device__ __forceinline__ void store_chunk(SharedStorage<Tr>& s, const ScanBwdParams& p, const Item& it,
                                            int64_t row0, int nvalid, ItemState<Tr>& st) {
  using T = typename Tr::T;
  const int tid = threadIdx.x;
  const int col = tid % Tr::kDc;
  if (it.d0 + col >= p.dim) return;
  const int64_t stride = p.dim + 2 * p.dstate;
  T* dP = static_cast<T*>(p.dP) + row0 * stride + it.d0 + col;
  T* dx = static_cast<T*>(p.dx) + row0 * p.dim + it.d0 + col;
  [[maybe_unused]] T* dgz = nullptr;
  if constexpr (Tr::kGate) dgz = static_cast<T*>(p.dgate_z) + row0 * p.dim + it.d0 + col;
#pragma unroll 4
  for (int t = tid / Tr::kDc; t < Tr::kT; t += Tr::kRowsPerCol) {
    if (t < nvalid) {
      const float dz = s.sig[t][col];
      dP[int64_t(t) * stride] = from_float<T>(dz);
      dx[int64_t(t) * p.dim] = from_float<T>(s.dx[t][col]);
      if constexpr (Tr::kGate) dgz[int64_t(t) * p.dim] = from_float<T>(s.gq[t][col]);
      st.db += dz;
      st.dD = fmaf(s.dy[t][col], s.x[t][col], st.dD);
    }
  }
}

template <class Tr>
__device__ __forceinline__ void load_item_params(SharedStorage<Tr>& s, const ScanBwdParams& p, const Item& it,
                                                 ItemState<Tr>& st) {
  const int tid = threadIdx.x;
  const int c = tid / Tr::kP, n0 = (tid % Tr::kP) * Tr::kNS;
  const int64_t d = it.d0 + c;
  __syncthreads();  // the previous item no longer reads bias / Dskip / the raw buffer
  for (int i = tid; i < Tr::kDc; i += Tr::kThreads) {
    const bool valid = it.d0 + i < p.dim;
    s.bias[i] = valid ? p.b_delta[it.d0 + i] : 0.f;
    s.Dskip[i] = valid ? p.D[it.d0 + i] : 0.f;
  }
#pragma unroll
  for (int n = 0; n < Tr::kNS; ++n) {
    const float A_log = d < p.dim ? p.A_log[d * Tr::kN + n0 + n] : -INFINITY;  // A = 0 past D
    st.A[n] = decay_rate(A_log, 1.f);
    st.A2[n] = decay_rate(A_log, kLog2e);
    st.g[n] = 0.f;
    st.an[n] = 1.f;
    st.dA[n] = 0.f;
  }
  st.sum_dt = 0.f;
  st.db = 0.f;
  st.dD = 0.f;
  __syncthreads();  // bias / Dskip visible to prep
}

// One work item, its chunks last first. kFull = false: phase 1 (the adjoint alone).
template <class Tr, bool kFull>
__device__ __forceinline__ void run_item(SharedStorage<Tr>& s, const ScanBwdParams& p, const Item& it,
                                         ItemState<Tr>& st) {
  const int64_t row_base = it.row0;
  const int64_t n_chunks = (it.t_end - it.t_begin + Tr::kT - 1) / Tr::kT;
  if (n_chunks == 0) return;  // an empty packed sequence: the adjoint passes through (dh0 = dhT)
  auto chunk_t0 = [&](int64_t k) { return it.t_begin + k * Tr::kT; };
  auto chunk_n = [&](int64_t k) { return int(min_i64(Tr::kT, it.t_end - chunk_t0(k))); };
  load_chunk<Tr, kFull>(s.raw, p, row_base + chunk_t0(n_chunks - 1), chunk_n(n_chunks - 1), it.d0);
  cp_async_commit();
  for (int64_t k = n_chunks - 1; k >= 0; --k) {
    const int64_t t0 = chunk_t0(k);
    const int nvalid = chunk_n(k);
    cp_async_wait_all();
    __syncthreads();  // (A) chunk k in the raw buffer; chunk k+1's shared arrays fully consumed
    prep_chunk<Tr, kFull>(s, p, nvalid, it.d0);
    __syncthreads();  // (B) prep visible; the raw buffer is free
    if (k > 0) {
      load_chunk<Tr, kFull>(s.raw, p, row_base + chunk_t0(k - 1), chunk_n(k - 1), it.d0);
      cp_async_commit();
    }
    if constexpr (kFull) {
      backward_chunk<Tr>(s, p, it, row_base + t0, t0 / Tr::kT, nvalid, st);
      __syncthreads();  // (C) dz and dx of the chunk are in shared memory
      store_chunk<Tr>(s, p, it, row_base + t0, nvalid, st);
    } else {
      adjoint_chunk<Tr>(s, st);
    }
  }
}

template <class Tr, bool kSplit, bool kPacked = false>
__global__ void __launch_bounds__(Tr::kThreads, Tr::kMinBlocks) scan_bwd_kernel(const ScanBwdParams p) {
  static_assert(!(kSplit && kPacked), "packed sequences are never split along L");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  auto& s = *reinterpret_cast<SharedStorage<Tr>*>(smem_raw);
  constexpr int kNS = Tr::kNS, kN = Tr::kN;
  const int tid = threadIdx.x;
  const int c = tid / Tr::kP, g = tid % Tr::kP, n0 = g * kNS;
  const int64_t n_tiles = (p.dim + Tr::kDc - 1) / Tr::kDc;
  const int64_t items_per_seg = p.batch * n_tiles;
  const int64_t n_items = items_per_seg * p.n_segments;
  const SplitWorkspace ws(p.workspace, p.n_segments, p.batch, p.dim, kN);
  ItemState<Tr> st;

  if constexpr (kSplit) {
    // Phase 1: every segment but the first, the adjoint alone from a zero adjoint at its end.
    for (int64_t item = blockIdx.x; item < items_per_seg * (p.n_segments - 1); item += gridDim.x) {
      const Item it = decode_item<Tr, kPacked>(p, item + items_per_seg);
      load_item_params<Tr>(s, p, it, st);
      run_item<Tr, false>(s, p, it, st);
      const int64_t d = it.d0 + c;
      float pub[kNS];
#pragma unroll
      for (int n = 0; n < kNS; ++n) pub[n] = st.an[n] * st.g[n];  // a[t0] * g[t0]
      if (d < p.dim) ws.publish<kNS>(it.seg - 1, it.b, d, n0, pub, st.sum_dt, g == 0);
    }
    __threadfence();
    cooperative_groups::this_grid().sync();
  }

  // Phase 2: the adjoint entering each segment's end, then the full backward.
  for (int64_t item = blockIdx.x; item < n_items; item += gridDim.x) {
    const Item it = decode_item<Tr, kPacked>(p, item);
    load_item_params<Tr>(s, p, it, st);
    const int64_t d = it.d0 + c;
    const bool valid_d = d < p.dim;
#pragma unroll
    for (int n = 0; n < kNS; ++n)
      st.g[n] = (p.dhT != nullptr && valid_d) ? p.dhT[(it.b * p.dim + d) * kN + n0 + n] : 0.f;
    if (kSplit && valid_d) ws.fold_reverse<kNS>(it.seg, p.n_segments, it.b, d, n0, st.A2, st.g);
    run_item<Tr, true>(s, p, it, st);
    if (valid_d) {
      const int64_t row = it.seg * p.batch + it.b;
#pragma unroll
      for (int n = 0; n < kNS; ++n) p.dA_partial[(row * p.dim + d) * kN + n0 + n] = st.dA[n];
      if (it.seg == 0) {
#pragma unroll
        for (int n = 0; n < kNS; ++n) p.dh0[(it.b * p.dim + d) * kN + n0 + n] = st.an[n] * st.g[n];
      }
    }
    const int col = tid % Tr::kDc;
    if (it.d0 + col < p.dim) {
      const int64_t prow = (it.seg * p.batch + it.b) * Tr::kRowsPerCol + tid / Tr::kDc;
      p.db_partial[prow * p.dim + it.d0 + col] = st.db;
      p.dD_partial[prow * p.dim + it.d0 + col] = st.dD;
    }
  }
}

// Host side.
template <class Tr, bool kSplit, bool kPacked = false>
cudaError_t prepare_kernel(int device, int* blocks_per_sm) {
  return selscan::prepare_kernel<scan_bwd_kernel<Tr, kSplit, kPacked>>(Tr::kThreads, int(sizeof(SharedStorage<Tr>)),
                                                                     device, blocks_per_sm);
}

template <class Tr>
cudaError_t launch(const ScanBwdParams& p, cudaStream_t stream) {
  int device = 0, blocks = 0;
  SELSCAN_RETURN_IF_ERROR(cudaGetDevice(&device));
  const int64_t n_items = p.batch * ((p.dim + Tr::kDc - 1) / Tr::kDc) * p.n_segments;
  if (p.n_segments == 1) {
    if (n_items > 0x7fffffffLL) return cudaErrorInvalidConfiguration;
    if (p.cu_seqlens != nullptr) {
      SELSCAN_RETURN_IF_ERROR(prepare_kernel<Tr, false, true>(device, &blocks));
      scan_bwd_kernel<Tr, false, true><<<unsigned(n_items), Tr::kThreads, sizeof(SharedStorage<Tr>), stream>>>(p);
    } else {
      SELSCAN_RETURN_IF_ERROR(prepare_kernel<Tr, false>(device, &blocks));
      scan_bwd_kernel<Tr, false><<<unsigned(n_items), Tr::kThreads, sizeof(SharedStorage<Tr>), stream>>>(p);
    }
    return cudaGetLastError();
  }
  if (p.cu_seqlens != nullptr) return cudaErrorInvalidValue;  // packed sequences are never split
  SELSCAN_RETURN_IF_ERROR(prepare_kernel<Tr, true>(device, &blocks));
  return launch_cooperative(scan_bwd_kernel<Tr, true>, p, n_items, blocks, Tr::kThreads,
                            int(sizeof(SharedStorage<Tr>)), stream);
}

// One entry per dtype, explicitly instantiated in scan_bwd_<dtype>.cu.
template <class T>
struct Dispatch {
  static cudaError_t launch(const ScanBwdParams& p, cudaStream_t stream);
  // Blocks per SM of the split kernel, channels per CTA and store rows per column, for the plan.
  static cudaError_t occupancy(int64_t dstate, bool gate, int device, int* blocks_per_sm, int* channels_per_cta,
                               int* rows_per_col);
};

#define SELSCAN_BWD_SWITCH_N(N, ...)                         \
  [&]() -> cudaError_t {                                     \
    switch (N) {                                             \
      case 8:  { constexpr int kN = 8;  return __VA_ARGS__(); }  \
      case 16: { constexpr int kN = 16; return __VA_ARGS__(); }  \
      case 32: { constexpr int kN = 32; return __VA_ARGS__(); }  \
      case 64: { constexpr int kN = 64; return __VA_ARGS__(); }  \
      default: return cudaErrorInvalidValue;                 \
    }                                                        \
  }()

template <class T>
cudaError_t Dispatch<T>::launch(const ScanBwdParams& p, cudaStream_t stream) {
  if ((p.gate_z == nullptr) != (p.dgate_z == nullptr)) return cudaErrorInvalidValue;
  if (p.gate_z != nullptr)
    return SELSCAN_BWD_SWITCH_N(p.dstate, [&] { return scan_bwd::launch<Traits<T, kN, true>>(p, stream); });
  return SELSCAN_BWD_SWITCH_N(p.dstate, [&] { return scan_bwd::launch<Traits<T, kN>>(p, stream); });
}

template <class T>
cudaError_t Dispatch<T>::occupancy(int64_t dstate, bool gate, int device, int* blocks_per_sm, int* channels_per_cta,
                                   int* rows_per_col) {
  return SELSCAN_BWD_SWITCH_N(dstate, [&] {
    *channels_per_cta = Traits<T, kN>::kDc;
    *rows_per_col = Traits<T, kN>::kRowsPerCol;
    return gate ? prepare_kernel<Traits<T, kN, true>, true>(device, blocks_per_sm)
                : prepare_kernel<Traits<T, kN>, true>(device, blocks_per_sm);
  });
}

}  // namespace scan_bwd
}  // namespace selscan
