// The fused kernels' projection side, shared by the forward (fused_kernel.cuh) and the backward
// (fused_bwd_kernel.cuh): the stream scheduler (a stream = (L-segment, sequence, channel tile), walked
// by one persistent CTA per SM), the operand ring (TMA loads of x and the stacked weight tile
// [W_delta slice; W_B; W_C], producer_phase), and the tensor-core warpgroup (wgmma products of a
// token tile, softplus epilogue, hand-off of dt, B and C to the scan through shared memory,
// mma_phase). The backward walks every stream's tiles last first (kReverse); the shared-memory
// storage is the caller's (SS: any struct with the members these functions name).
#pragma once
#include <cuda_runtime.h>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/cutlass.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "../common/device_math.cuh"
#include "../common/l_split.h"
#include "../common/seq_map.h"
#include "fused_config.h"
#include "fused_params.h"

namespace selscan {
namespace fused {

using namespace cute;

// Named barriers (0 is __syncthreads): dt/B/C hand-off tile s full / empty (ids 1..4); the tensor-core
// warpgroup alone (id 5).
constexpr int kBarFull = 1;     // + stage (2 stages max)
constexpr int kBarEmpty = 3;    // + stage
constexpr int kBarMmaRound = 5; // the tensor-core warpgroup's own x rounding (float32 "high")
constexpr int kBarConvIn = 7;   // the scan threads alone: the block's conv inside the kernel (fused_kernel.cuh)

__device__ __forceinline__ void named_sync(int id, int n) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int n) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}

// The dt/B/C hand-off (tensor-core warpgroup -> scan warpgroups, Cfg::kPStages tiles): by default
// through the named barriers above (the writer waits on "empty", writes, bar.arrives on "full"; the
// reader bar.syncs on "full", reads, arrives on "empty"; the reader arrives on every "empty" once
// first). Built with -DSELSCAN_HANDOFF_MBARRIER=1 (SELSCAN_FUSED_NVCC_FLAGS), the same ring goes
// through mbarriers in shared memory, waited on by phase parity: the form compute-sanitizer's
// racecheck follows (it reports named-barrier hand-offs of this kind whether or not they race:
// docs/reliability.md, scripts/probes/racecheck_named_barrier.cu). The default build is unchanged.
// (SELSCAN_HANDOFF_MBARRIER and HandOffBarriers: fused_config.h, beside the shared storage.)

// Where each role stands in the hand-off ring (one copy per thread, carried from phase 1 into 2).
struct HandOffState {
  int stage = 0;
  uint32_t phase = 0;  // flips each time the stage index wraps (the mbarrier form only uses it)
  __device__ __forceinline__ void advance(int n_stages) {
#if SELSCAN_HANDOFF_MBARRIER
    if (++stage == n_stages) {
      stage = 0;
      phase ^= 1;
    }
#else
    stage = (stage + 1) % n_stages;  // the default build's code as before the mbarrier form existed
#endif
  }
};

// Once per CTA, by one thread, before the __syncthreads that makes barrier initialisation visible.
template <class Cfg, class SS>
__device__ __forceinline__ void handoff_init(SS& ss) {
#if SELSCAN_HANDOFF_MBARRIER
  if (threadIdx.x == 0) {
    for (int i = 0; i < Cfg::kPStages; ++i) {
      ss.handoff.full[i].init(Cfg::kMmaThreads);
      ss.handoff.empty[i].init(Cfg::kScanThreads);
    }
    cutlass::arch::fence_barrier_init();
  }
#else
  (void)ss;
#endif
}

// The scan warpgroups, once before their first tile: every hand-off tile starts empty.
template <class Cfg>
__device__ __forceinline__ void handoff_start_empty() {
#if !SELSCAN_HANDOFF_MBARRIER
  for (int s = 0; s < Cfg::kPStages; ++s) named_arrive(kBarEmpty + s, Cfg::kMmaThreads + Cfg::kScanThreads);
#endif
}

// The two sides of a hand-off stage: "full" (the tile is written; the reader waits, the writer
// arrives) and "empty" (the tile is read; the writer waits, the reader arrives).
enum class HandOff { kFull, kEmpty };

// Wait on one side of the current stage: the reader on kFull before it reads, the writer on kEmpty
// before it writes (on the mbarriers, its first round waits on the phase before, already complete).
template <class Cfg, HandOff kSide, class SS>
__device__ __forceinline__ void handoff_wait(SS& ss, const HandOffState& h) {
#if SELSCAN_HANDOFF_MBARRIER
  if constexpr (kSide == HandOff::kFull) ss.handoff.full[h.stage].wait(h.phase);
  else ss.handoff.empty[h.stage].wait(h.phase ^ 1);
#else
  (void)ss;
  named_sync((kSide == HandOff::kFull ? kBarFull : kBarEmpty) + h.stage, Cfg::kMmaThreads + Cfg::kScanThreads);
#endif
}
// Arrive on one side of the current stage: the writer on kFull once the tile is written, the reader
// on kEmpty once it has read it.
template <class Cfg, HandOff kSide, class SS>
__device__ __forceinline__ void handoff_arrive(SS& ss, const HandOffState& h) {
#if SELSCAN_HANDOFF_MBARRIER
  if constexpr (kSide == HandOff::kFull) ss.handoff.full[h.stage].arrive();
  else ss.handoff.empty[h.stage].arrive();
#else
  (void)ss;
  named_arrive((kSide == HandOff::kFull ? kBarFull : kBarEmpty) + h.stage, Cfg::kMmaThreads + Cfg::kScanThreads);
#endif
}

// kCh (1 or 2) adjacent values of the x tile / of y as float (one 2- to 8-byte access).
template <int kCh, class T>
__device__ __forceinline__ void load_vals(const T* p, float (&v)[kCh]) {
  if constexpr (kCh == 1) {
    v[0] = float(p[0]);
  } else if constexpr (cute::is_same_v<T, float>) {
    const float2 f = *reinterpret_cast<const float2*>(p);
    v[0] = f.x; v[1] = f.y;
  } else if constexpr (cute::is_same_v<T, cutlass::bfloat16_t>) {
    const uint32_t u = *reinterpret_cast<const uint32_t*>(p);  // bf16 -> float: the high half of a float
    v[0] = __uint_as_float(u << 16); v[1] = __uint_as_float(u & 0xffff0000u);
  } else {
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(p));
    v[0] = f.x; v[1] = f.y;
  }
}
template <int kCh, class T>
__device__ __forceinline__ void store_vals(T* p, const float (&v)[kCh]) {
  if constexpr (kCh == 1) {
    p[0] = T(v[0]);
  } else if constexpr (cute::is_same_v<T, float>) {
    *reinterpret_cast<float2*>(p) = make_float2(v[0], v[1]);
  } else if constexpr (cute::is_same_v<T, cutlass::bfloat16_t>) {
    *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(v[0], v[1]);
  } else {
    *reinterpret_cast<__half2*>(p) = __floats2half2_rn(v[0], v[1]);
  }
}

// Whether this build takes packed sequences (FusedParams::cu_seqlens): yes, unless built with
// -DSELSCAN_FUSED_NO_PACKED. With that switch every packed branch below folds away and the kernel is the
// batch layout's alone (the switch measures what the packed branches cost the batch layout).
#ifndef SELSCAN_FUSED_NO_PACKED
constexpr bool kPackedBuild = true;
#else
constexpr bool kPackedBuild = false;
#endif

// Streams: (segment, sequence, channel tile), segment-major; packed, (sequence, channel tile).
struct Stream {
  int64_t seg, b, j;      // segment, sequence (its row of x: 0 when packed), channel tile
  int64_t seq;            // the sequence: h0's and the final state's index (b, or the packed sequence)
  int64_t t_begin;        // first token (in x's row)
  int64_t t_end;          // one past the stream's last token
  int64_t n_tiles;        // token tiles
  int64_t ckpt0, t_origin;  // the checkpoint of token t is ckpt0 + (t - t_origin) / kCkptEvery
};

// kPacked false: the batch layout only (the fused backward kernel, which never runs packed streams,
// keeps its registers).
template <class Cfg, bool kPacked = kPackedBuild>
__device__ __forceinline__ Stream decode_stream(const FusedParams& p, int64_t idx) {
  const int64_t n_ctiles = p.dim / Cfg::kDt;
  Stream s;
  s.j = idx % n_ctiles;
  if (kPacked && p.cu_seqlens != nullptr) {
    s.seq = idx / n_ctiles;
    s.b = 0;
    s.seg = 0;
    // clamped to [0, L] as the scan kernels clamp them (common/seq_map.h): invalid values (validate=False)
    // give wrong sequences, never an access out of bounds
    const SeqRange r = seq_range(p.cu_seqlens, s.seq, p.seqlen);
    s.t_begin = r.start;
    s.t_end = r.start + r.len;
    s.ckpt0 = seq_first_slot(r.start, s.seq, kCkptEvery);
    s.t_origin = r.start;
  } else {
    s.b = (idx / n_ctiles) % p.batch;
    s.seq = s.b;
    s.seg = idx / (n_ctiles * p.batch);
    s.t_begin = s.seg * p.seg_len;
    s.t_end = min_i64(p.seqlen, s.t_begin + p.seg_len);
    s.ckpt0 = s.b * ckpt_count(p.seqlen);
    s.t_origin = 0;
  }
  s.n_tiles = (s.t_end - s.t_begin + Cfg::kTM - 1) / Cfg::kTM;  // tensor-core tiles (segments are whole ones)
  return s;
}

// One past the last token that stream s may read or write: L in the batch layout (segments are whole
// tiles, so within a segment's tiles this is the same as its end), the sequence's end when packed.
__device__ __forceinline__ int64_t stream_end(const FusedParams& p, const Stream& s) {
  return kPackedBuild ? s.t_end : p.seqlen;
}

// K chunks of the products: K / kBK for the layer (D is a multiple of 64); the block's K = R + 2N is
// rounded up (the last chunk's boxes are zero-filled past K).
template <class Cfg>
__device__ __forceinline__ int k_chunks(const FusedParams& p) {
  return int((p.kdim() + Cfg::kBK - 1) / Cfg::kBK);
}

// Whether the scan tile starting at token t0 of stream s holds tokens (the first of every tile does).
template <class Cfg>
__device__ __forceinline__ bool sub_tile_live(const FusedParams& p, const Stream& s, int64_t t0) {
  return Cfg::kHalves == 1 || t0 < stream_end(p, s);
}

template <class Cfg, class TmaX, class TmaXt, class TmaWd, class TmaWn>
struct KernelArgs {
  TmaX tma_x;     // the product's operand (x, or the block's xk) as (L, K, batch): tiles (64 x kBK), swizzled
  TmaXt tma_xt;   // x (the block's u) as (L, D, batch): scan tiles (64 x kDt), plain
  TmaWd tma_wd;   // W_delta (D, K)
  TmaWn tma_wb;   // W_B (N, K)
  TmaWn tma_wc;   // W_C (N, K)
  FusedParams p;
};

// A position in the operand ring when `n_stages` of its kStages stages are in use (the ablation
// switch FusedParams::ring_stages; the shared memory always holds kStages). CUTLASS's pipeline calls
// read only the index and phase.
template <uint32_t kMax>
struct RingState : cutlass::PipelineState<kMax> {
  int n_stages = int(kMax);
  __device__ __forceinline__ void operator++() {
    ++this->index_;
    ++this->count_;
    if (this->index_ == n_stages) {
      this->index_ = 0;
      this->phase_ ^= 1;
    }
  }
};

// Per-role state carried from phase 1 into phase 2.
template <class Cfg>
struct RoleState {
  RingState<Cfg::kStages> ring;
  cutlass::PipelineState<Cfg::kXStages> xt;
  HandOffState hand;
};

// ---------------------------------------------------------------------------------------------------
// Producer: TMA loads.

// One scan x tile (kT tokens x kDt channels): the scan tile starting at token t0 of stream s (t0 - t_begin
// a multiple of kT; in the batch layout t0 itself is).
template <class Cfg, class Args, class SS>
__device__ __forceinline__ void load_xt(const Args& a, typename Cfg::XPipe& xpipe, SS& ss,
                                        cutlass::PipelineState<Cfg::kXStages>& st, const Stream& s, int64_t t0) {
  const FusedParams& p = a.p;
  using TE = typename Cfg::TmaElement;
  Tensor sXt = make_tensor(make_smem_ptr(reinterpret_cast<TE*>(ss.xt.begin())), typename Cfg::SmemLayoutXt{});
  Tensor mXt = a.tma_xt.get_tma_tensor(make_shape(int(p.seqlen), int(p.dim), int(p.batch)));
  // Packed: the box starts at the sequence's first token, rarely a multiple of kT (FlashAttention-3's
  // varlen way: the TMA tensor's coordinates offset); rows past the sequence are masked by the scan.
  auto gXt = [&] {
    if constexpr (kPackedBuild) {
      return local_tile(domain_offset(make_coord(int(s.t_begin), 0), mXt(_, _, int(s.b))),
                        make_shape(typename Cfg::BlkT{}, typename Cfg::BlkDt{}),
                        make_coord(int((t0 - s.t_begin) / Cfg::kT), int(s.j)));
    } else {
      return local_tile(mXt(_, _, int(s.b)), make_shape(typename Cfg::BlkT{}, typename Cfg::BlkDt{}),
                        make_coord(int(t0 / Cfg::kT), int(s.j)));
    }
  }();
  auto [tXtg, tXts] = tma_partition(a.tma_xt, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sXt), group_modes<0, 2>(gXt));
  xpipe.producer_acquire(st);
  copy(a.tma_xt.with(*xpipe.producer_get_barrier(st)), tXtg, tXts(_, st.index()));
  ++st;
}

// Warp 1's elected lane (Cfg::kXtWarp): the scan's x tiles, in the scan's order, each as soon as the
// scan has freed a stage.
template <class Cfg, class Args, class SS>
__device__ __forceinline__ void xt_phase(const Args& a, typename Cfg::XPipe& xpipe, SS& ss,
                                         cutlass::PipelineState<Cfg::kXStages>& st, int64_t first, int64_t count) {
  for (int64_t idx = first; idx < count; idx += gridDim.x) {
    const Stream s = decode_stream<Cfg>(a.p, idx);
    for (int64_t t = 0; t < s.n_tiles * Cfg::kHalves; ++t) {
      const int64_t t0 = s.t_begin + t * Cfg::kT;
      if (sub_tile_live<Cfg>(a.p, s, t0)) load_xt<Cfg>(a, xpipe, ss, st, s, t0);
    }
  }
}
template <class Cfg, bool kReverse = false, class Args, class SS>
__device__ __forceinline__ void producer_phase(const Args& a, typename Cfg::Ring& ring,
                                               SS& ss, RoleState<Cfg>& st, int64_t first,
                                               int64_t count) {
  const FusedParams& p = a.p;
  const int L = int(p.seqlen), Dm = int(p.dim), Bt = int(p.batch), N = int(p.dstate), K = int(p.kdim());
  using TE = typename Cfg::TmaElement;
  Tensor sX = make_tensor(make_smem_ptr(reinterpret_cast<TE*>(ss.x.begin())), typename Cfg::SmemLayoutXTma{});
  TE* const w_base = reinterpret_cast<TE*>(ss.w.begin());
  Tensor mX = a.tma_x.get_tma_tensor(make_shape(L, K, Bt));
  Tensor mWd = a.tma_wd.get_tma_tensor(make_shape(Dm, K));
  Tensor mWb = a.tma_wb.get_tma_tensor(make_shape(N, K));
  Tensor mWc = a.tma_wc.get_tma_tensor(make_shape(N, K));
  const int k_tiles = k_chunks<Cfg>(p);
  // One stage's three weight boxes inside the stacked tile (rows [0,kDt), [kDt,kDt+kN), [kDt+kN,kNW)).
  auto w_box = [&](int stage, int row0, auto layout) {
    return make_tensor(make_smem_ptr(w_base + stage * Cfg::kWStageElems + row0 * Cfg::kBK), layout);
  };

  for (int64_t idx = first; idx < count; idx += gridDim.x) {
    const Stream s = decode_stream<Cfg, kPackedBuild && !kReverse>(p, idx);
    Tensor gWd = local_tile(mWd, make_shape(typename Cfg::BlkDt{}, typename Cfg::BlkK{}), make_coord(int(s.j), _));
    Tensor gWb = local_tile(mWb, make_shape(typename Cfg::BlkN{}, typename Cfg::BlkK{}), make_coord(0, _));
    Tensor gWc = local_tile(mWc, make_shape(typename Cfg::BlkN{}, typename Cfg::BlkK{}), make_coord(0, _));
    for (int64_t tile = 0; tile < s.n_tiles; ++tile) {
      const int t_rel = int(kReverse ? s.n_tiles - 1 - tile : tile);  // tensor-core tile of the stream
      // The operand tiles of every K chunk (packed: offset to the sequence's first token, as load_xt;
      // the backward (kReverse) never runs packed streams and keeps the batch form).
      auto gX = [&] {
        if constexpr (kPackedBuild && !kReverse) {
          return local_tile(domain_offset(make_coord(int(s.t_begin), 0), mX(_, _, int(s.b))),
                            make_shape(typename Cfg::BlkTM{}, typename Cfg::BlkK{}), make_coord(t_rel, _));
        } else {
          return local_tile(mX(_, _, int(s.b)), make_shape(typename Cfg::BlkTM{}, typename Cfg::BlkK{}),
                            make_coord(int(s.t_begin / Cfg::kTM) + t_rel, _));
        }
      }();
      auto [tXg, tXs] = tma_partition(a.tma_x, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sX), group_modes<0, 2>(gX));
      for (int k = 0; k < k_tiles; ++k) {
        ring.producer_acquire(st.ring);
        auto* bar = ring.producer_get_barrier(st.ring);
        const int stage = st.ring.index();
        copy(a.tma_x.with(*bar), tXg(_, k), tXs(_, stage));
        {
          auto [g, sm] = tma_partition(a.tma_wd, Int<0>{}, Layout<_1>{},
                                       group_modes<0, 2>(w_box(stage, 0, typename Cfg::SmemLayoutWdTma1{})),
                                       group_modes<0, 2>(gWd));
          copy(a.tma_wd.with(*bar), g(_, k), sm);
        }
        {
          auto [g, sm] = tma_partition(a.tma_wb, Int<0>{}, Layout<_1>{},
                                       group_modes<0, 2>(w_box(stage, Cfg::kDt, typename Cfg::SmemLayoutWnTma1{})),
                                       group_modes<0, 2>(gWb));
          copy(a.tma_wb.with(*bar), g(_, k), sm);
        }
        {
          auto [g, sm] = tma_partition(a.tma_wc, Int<0>{}, Layout<_1>{},
                                       group_modes<0, 2>(w_box(stage, Cfg::kDt + Cfg::kN, typename Cfg::SmemLayoutWnTma1{})),
                                       group_modes<0, 2>(gWc));
          copy(a.tma_wc.with(*bar), g(_, k), sm);
        }
        ++st.ring;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// Tensor cores: products, softplus epilogue, hand-off.

// 3xTF32 ("highest"): the remainders v - tf32(v) of the stage (the tensor cores truncate v to tf32).
// An infinite v is its own TF32 value: its remainder is 0, not inf - inf = NaN (which would turn a
// product with an infinite weight into NaN where float32 gives +-inf); a NaN's remainder stays NaN.
__device__ __forceinline__ float tf32_remainder(float f) {
  const float hi = __uint_as_float(__float_as_uint(f) & 0xffffe000u);
  return f == hi ? 0.f : f - hi;
}

// 1xTF32 ("high"): round to nearest in place (truncation by the tensor cores is a bias that costs ~2x the
// error). The tensor cores read the top 19 bits only, so adding half a TF32 unit (bit 12) is the whole
// rounding: to nearest, ties away from zero, as cvt.rna.tf32 (which also clears the low bits: one more
// instruction per value, measured 3-10% of the float32 "high" kernel, docs/perf/layer-forward.md v3.3). Inf and
// NaN are left as they are (an add could turn a NaN into a finite value).
__device__ __forceinline__ float tf32_round(float f) {
  return fabsf(f) < __int_as_float(0x7f800000) ? __uint_as_float(__float_as_uint(f) + 0x1000u) : f;
}

// float32: warps 1-3 of warpgroup 0 (96 threads) follow the ring in the tensor cores' order; for
// every stage they either round its weights to TF32 in place ("high": the tensor-core warpgroup
// rounds the x tile, mma_round_x) or write the stage's TF32 remainders to the remainder ring
// ("highest"), then arrive on rounded[stage]; the tensor-core warpgroup waits on that
// instead of the TMA barrier. The stage is released by the tensor cores as before, so a stage is
// prepared once per fill.
template <class Cfg, class SS>
__device__ __forceinline__ void round_phase(const FusedParams& p, typename Cfg::Ring& ring, SS& ss,
                                            RingState<Cfg::kStages>& st, int64_t first, int64_t count) {
  const int tid = threadIdx.x - 32;  // 0..95
  const int k_tiles = k_chunks<Cfg>(p);
  for (int64_t idx = first; idx < count; idx += gridDim.x) {
    const Stream s = decode_stream<Cfg>(p, idx);
    for (int64_t t = 0; t < s.n_tiles * k_tiles; ++t) {
      ring.consumer_wait(st);
      const int stage = st.index();
      auto apply = [&](float* base, float* rem, int elems) {
        const float4* src = reinterpret_cast<const float4*>(base + stage * elems);
        float4* dst = reinterpret_cast<float4*>((Cfg::k3x ? rem : base) + stage * elems);
#pragma unroll 4
        for (int i = tid; i < elems / 4; i += Cfg::kRoundThreads) {
          const float4 v = src[i];
          if constexpr (Cfg::k3x) {
            dst[i] = make_float4(tf32_remainder(v.x), tf32_remainder(v.y), tf32_remainder(v.z), tf32_remainder(v.w));
          } else {
            dst[i] = make_float4(tf32_round(v.x), tf32_round(v.y), tf32_round(v.z), tf32_round(v.w));
          }
        }
      };
      if constexpr (!Cfg::kMmaRoundsX)
        apply(reinterpret_cast<float*>(ss.x.begin()), reinterpret_cast<float*>(ss.xs.begin()), Cfg::kTM * Cfg::kBK);
      apply(reinterpret_cast<float*>(ss.w.begin()), reinterpret_cast<float*>(ss.ws.begin()), Cfg::kWStageElems);
      cutlass::arch::fence_view_async_shared();  // generic-proxy writes -> wgmma (async proxy) reads
      ss.rounded[stage].arrive();
      ++st;
    }
  }
}

// float32 "high" (Config::kMmaRoundsX): the tensor-core warpgroup rounds the stage's x tile in place
// (the weights are rounded by warps 1-3), then makes the writes visible to its wgmma: a generic-proxy
// fence per thread and a barrier over the warpgroup.
template <class Cfg, class SS>
__device__ __forceinline__ void mma_round_x(SS& ss, int stage, int tid) {
  constexpr int kElems = Cfg::kTM * Cfg::kBK;
  float4* x = reinterpret_cast<float4*>(reinterpret_cast<float*>(ss.x.begin()) + stage * kElems);
  CUTE_UNROLL
  for (int i = tid; i < kElems / 4; i += Cfg::kMmaThreads) {
    const float4 v = x[i];
    x[i] = make_float4(tf32_round(v.x), tf32_round(v.y), tf32_round(v.z), tf32_round(v.w));
  }
  cutlass::arch::fence_view_async_shared();
  named_sync(kBarMmaRound, Cfg::kMmaThreads);
}

// The tensor cores' wait for a ring stage: the TMA barrier, or for float32 the barrier warps 1-3
// arrive on once the stage is rounded / its remainders written. Returns the stage, broadcast from
// lane 0: ptxas then knows it is warp-uniform and builds the wgmma descriptors in uniform registers
// (v3.6: 91 -> 67 instructions per K chunk, bf16 N = 16).
template <class Cfg, class SS>
__device__ __forceinline__ int wait_operands(typename Cfg::Ring& ring, SS& ss,
                                             const cutlass::PipelineState<Cfg::kStages>& st) {
  if constexpr (Cfg::kRoundWarps) {
    ss.rounded[st.index()].wait(st.phase());
  } else {
    ring.consumer_wait(st);
  }
  return __shfl_sync(0xffffffffu, st.index(), 0);
}

template <class Cfg, bool kReverse = false, class Args, class SS>
__device__ __forceinline__ void mma_phase(const Args& a, typename Cfg::Ring& ring, typename Cfg::XPipe& xpipe,
                                          SS& ss, RoleState<Cfg>& st, int64_t first, int64_t count,
                                          bool xt_leader) {
  const FusedParams& p = a.p;
  const int tid = threadIdx.x - 128;  // 0..127 in the warpgroup
  using E = typename Cfg::Element;
  Tensor sX = make_tensor(make_smem_ptr(ss.x.begin()), typename Cfg::SmemLayoutX{});
  Tensor sW = make_tensor(make_smem_ptr(ss.w.begin()), typename Cfg::SmemLayoutW{});
  Tensor sXs = make_tensor(make_smem_ptr(ss.xs.begin()), typename Cfg::SmemLayoutX{});
  Tensor sWs = make_tensor(make_smem_ptr(ss.ws.begin()), typename Cfg::SmemLayoutW{});

  typename Cfg::Mma mma;
  auto thr = mma.get_thread_slice(tid);
  Tensor tAx = thr.make_fragment_A(thr.partition_A(sX));     // (MMA, M, K, PIPE) descriptors
  Tensor tBw = thr.make_fragment_B(thr.partition_B(sW));
  Tensor tAxs = thr.make_fragment_A(thr.partition_A(sXs));
  Tensor tBws = thr.make_fragment_B(thr.partition_B(sWs));

  using TileShape = Shape<typename Cfg::BlkTM, typename Cfg::BlkNW>;
  Tensor acc = partition_fragment_C(mma, TileShape{});
  // (row, col) of every accumulator register. The wgmma accumulator layout puts register i at column
  // 2 * (lane % 4) + (i % 2) + 8 * (i / 4): the region (delta / B / C) of a register pair is known at
  // compile time from i alone, since the region boundaries are multiples of 8.
  Tensor cAcc = thr.partition_C(make_identity_tensor(TileShape{}));
  using CLayout = typename Cfg::Mma::AtomLayoutC_TV;
  static_assert(decltype(size<1, 0>(CLayout{}))::value == 2 && decltype(stride<1, 0>(CLayout{}))::value == Cfg::kT,
                "accumulator register pairs must be adjacent columns");
  static_assert(decltype(size<0, 0>(CLayout{}))::value == 4 && decltype(stride<0, 0>(CLayout{}))::value == 2 * Cfg::kT,
                "lane % 4 must step 2 columns");
  static_assert(decltype(size<1, 2>(CLayout{}))::value == Cfg::kNW / 8 &&
                    decltype(stride<1, 2>(CLayout{}))::value == 8 * Cfg::kT,
                "register groups of 4 must step 8 columns");
  const int k_tiles = k_chunks<Cfg>(p);

  for (int64_t idx = first; idx < count; idx += gridDim.x) {
    const Stream s = decode_stream<Cfg>(p, idx);
    const int64_t d0 = s.j * Cfg::kDt;
    // The bias of this thread's delta columns 2 * (lane % 4) + 8 * v2 (+0, +1), held for the stream.
    float2 bias2[Cfg::kDt / 8];
    CUTE_UNROLL
    for (int v2 = 0; v2 < Cfg::kDt / 8; ++v2)
      bias2[v2] = __ldg(reinterpret_cast<const float2*>(p.b_delta + d0 + 2 * (tid % 4) + 8 * v2));

    for (int64_t tile = 0; tile < s.n_tiles; ++tile) {
      const int64_t t0 = s.t_begin + (kReverse ? s.n_tiles - 1 - tile : tile) * Cfg::kTM;
      // Scan tiles that start past L (only the last tile of a sequence can have one) are skipped by
      // every role: no products, no hand-off, no x tile (sub_tile_live).
      const bool live_rows1 = sub_tile_live<Cfg>(p, s, t0 + Cfg::kT);
      // ---- products over K
      if constexpr (Cfg::k3x) {
        // 3xTF32: each K chunk's three products go to fresh accumulators, added into the running sum
        // with float32 (round-to-nearest) adds: the tensor cores' own accumulation truncates, and
        // over K = 2048 that bias alone exceeded the 1e-5 bound (measured; docs/perf/layer-forward.md).
        clear(acc);
        for (int k = 0; k < k_tiles; ++k) {
          const int stage = wait_operands<Cfg>(ring, ss, st.ring);
          Tensor tmp = partition_fragment_C(mma, TileShape{});
          mma.accumulate_ = GMMA::ScaleOut::Zero;
          warpgroup_fence_operand(tmp);
          warpgroup_arrive();
          CUTE_UNROLL
          for (int kb = 0; kb < size<2>(tAx); ++kb) {
            cute::gemm(mma, tAx(_, _, kb, stage), tBw(_, _, kb, stage), tmp);
            mma.accumulate_ = GMMA::ScaleOut::One;
            cute::gemm(mma, tAx(_, _, kb, stage), tBws(_, _, kb, stage), tmp);
            cute::gemm(mma, tAxs(_, _, kb, stage), tBw(_, _, kb, stage), tmp);
          }
          warpgroup_commit_batch();
          warpgroup_wait<0>();  // this chunk's products are in tmp; the stage and its remainders are free
          warpgroup_fence_operand(tmp);
          ring.consumer_release(st.ring);
          ++st.ring;
          CUTE_UNROLL
          for (int i = 0; i < size(acc); ++i) acc(i) += tmp(i);
        }
      } else {
        // One K loop per number of live row blocks, chosen once per tile: a branch between the
        // wgmma of one batch makes ptxas serialise every wgmma of the kernel (C7520).
        auto k_loop = [&](auto all_blocks) {
          auto release = st.ring;
          mma.accumulate_ = GMMA::ScaleOut::Zero;
          warpgroup_fence_operand(acc);
          for (int k = 0; k < k_tiles; ++k) {
            const int stage = wait_operands<Cfg>(ring, ss, st.ring);
            if constexpr (Cfg::kMmaRoundsX) mma_round_x<Cfg>(ss, stage, tid);
            warpgroup_fence_operand(acc);
            warpgroup_arrive();
            CUTE_UNROLL
            for (int kb = 0; kb < size<2>(tAx); ++kb) {
              if constexpr (decltype(all_blocks)::value) {
                cute::gemm(mma, tAx(_, _, kb, stage), tBw(_, _, kb, stage), acc);
              } else {  // the second row block is past L (short sequences): its products are skipped
                cute::gemm(mma, tAx(_, 0, kb, stage), tBw(_, 0, kb, stage), acc(_, 0, 0));
              }
              mma.accumulate_ = GMMA::ScaleOut::One;
            }
            warpgroup_commit_batch();
            warpgroup_wait<1>();  // batch k-1 retired: its ring stage can be reused
            warpgroup_fence_operand(acc);
            if (k > 0) {
              ring.consumer_release(release);
              ++release;
            }
            ++st.ring;
          }
          warpgroup_wait<0>();
          warpgroup_fence_operand(acc);
          ring.consumer_release(release);
        };
        if (Cfg::kHalves == 1 || live_rows1) k_loop(cute::true_type{}); else k_loop(cute::false_type{});
      }

      // ---- epilogue: dt = softplus(acc + bias) (0 past L), B, C -> one hand-off tile per 64 rows
      // (the accumulator holds kHalves wgmma row blocks; flat register index = v + kV * half).
      constexpr int kV = decltype(size<0>(acc))::value;
      static_assert(decltype(size(acc))::value == kV * Cfg::kHalves, "one accumulator row block per scan tile");
      CUTE_UNROLL
      for (int half = 0; half < Cfg::kHalves; ++half) {
        const int64_t th = t0 + half * Cfg::kT;
        if (half > 0 && !sub_tile_live<Cfg>(p, s, th)) break;
        const int ps = st.hand.stage;
        handoff_wait<Cfg, HandOff::kEmpty>(ss, st.hand);  // the scan is done with it
        if constexpr (!Cfg::kXtWarp) {
          // float32: this scan tile's x tile. The scan releases its x stage before it frees the
          // hand-off tile, so the acquire does not wait.
          if (xt_leader) load_xt<Cfg>(a, xpipe, ss, st.xt, s, th);
        }
        // Narrow layout: dt * x is formed here, from this scan tile's x tile (loaded by warp 1 for
        // the scan, which releases it only after it has read this hand-off tile).
        using TE = typename Cfg::TmaElement;
        const TE* xs = nullptr;
        if constexpr (Cfg::kNarrow) {
          xpipe.consumer_wait(st.xt);
          xs = reinterpret_cast<const TE*>(ss.xt.begin()) + st.xt.index() * (Cfg::kT * Cfg::kDt);
        }
        CUTE_UNROLL
        for (int v = 0; v < kV; v += 2) {
          const int i = v + kV * half;
          const int r = get<0>(cAcc(i)) - half * Cfg::kT, c = get<1>(cAcc(i));
          constexpr int kDt = Cfg::kDt, kN = Cfg::kN;
          if ((v / 4) * 8 < kDt) {  // delta columns
            const bool valid = th + r < stream_end(p, s);
            const float2 bc = bias2[v / 4];
            const float v0 = softplus_noselect(acc(i) + bc.x);
            const float v1 = softplus_noselect(acc(i + 1) + bc.y);
            if constexpr (Cfg::kNarrow) {
              const float d0 = valid ? v0 : 0.f, d1 = valid ? v1 : 0.f;
              float xv[2];
              load_vals<2>(xs + r * kDt + c, xv);
              *reinterpret_cast<float4*>(&ss.dt[ps][r][2 * c]) = make_float4(d0, d0 * xv[0], d1, d1 * xv[1]);
            } else {
              *reinterpret_cast<float2*>(&ss.dt[ps][r][c]) = make_float2(valid ? v0 : 0.f, valid ? v1 : 0.f);
            }
          } else if constexpr (Cfg::kNarrow) {  // B or C by token pairs (Config::kLdBP)
            const int n = (v / 4) * 8 < kDt + kN ? c - kDt : c - kDt - kN;
            float* bc = (v / 4) * 8 < kDt + kN ? &ss.B[ps][0][0] : &ss.C[ps][0][0];
            *reinterpret_cast<float2*>(bc + (r / 2) * Cfg::kLdBP + (n / 2) * 4 + (r % 2) * 2) =
                make_float2(acc(i), acc(i + 1));
          } else {
            float b0 = acc(i), b1 = acc(i + 1);
            if constexpr (kPackedBuild) {  // packed: rows past the sequence (the next one's) as zeros
              if (th + r >= stream_end(p, s)) b0 = b1 = 0.f;
            }
            if ((v / 4) * 8 < kDt + kN) {
              *reinterpret_cast<float2*>(&ss.B[ps][r][c - kDt]) = make_float2(b0, b1);
            } else {
              *reinterpret_cast<float2*>(&ss.C[ps][r][c - kDt - kN]) = make_float2(b0, b1);
            }
          }
        }
        handoff_arrive<Cfg, HandOff::kFull>(ss, st.hand);
        if constexpr (Cfg::kNarrow) ++st.xt;
        st.hand.advance(Cfg::kPStages);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// Host side: the TMA descriptors of the operands.

// The TMA descriptors: x's two (operand tiles, scan tiles) and the three weights'. Encoding one is
// host work in every call; fused_args() below reuses those whose tensor is the same.
// The operand tiles read p.operand() (x, or the block's xk) over K = p.kdim() columns; the scan tiles
// read x (the block's u) over its D channels. Boxes past K (K not a multiple of kBK) are zero-filled by
// the TMA unit, and the weights' boxes there too: they add nothing to the products.
template <class Cfg>
auto make_x_tmas(const FusedParams& p) {
  using TE = typename Cfg::TmaElement;
  const int L = int(p.seqlen), Dm = int(p.dim), Bt = int(p.batch), K = int(p.kdim());
  const int64_t ld = p.xt_stride(), ldb = p.xb_stride(), ldk = p.kdim();
  auto gk = make_tensor(make_gmem_ptr(static_cast<const TE*>(p.operand())),
                        make_layout(make_shape(L, K, Bt), make_stride(ldk, _1{}, int64_t(L) * ldk)));
  auto gx = make_tensor(make_gmem_ptr(static_cast<const TE*>(p.x)),
                        make_layout(make_shape(L, Dm, Bt), make_stride(ld, _1{}, ldb)));
  auto tma_x = make_tma_copy(SM90_TMA_LOAD{}, gk, typename Cfg::SmemLayoutXTma{}(_, _, 0));
  auto tma_xt = make_tma_copy(SM90_TMA_LOAD{}, gx, typename Cfg::SmemLayoutXt{}(_, _, 0));
  return cute::make_tuple(tma_x, tma_xt);
}

template <class Cfg>
auto make_w_tmas(const FusedParams& p) {
  using TE = typename Cfg::TmaElement;
  const int Dm = int(p.dim), N = int(p.dstate), K = int(p.kdim());
  const int64_t ld = p.kdim();
  auto gwd = make_tensor(make_gmem_ptr(static_cast<const TE*>(p.W_delta)),
                         make_layout(make_shape(Dm, K), make_stride(ld, _1{})));
  auto gwb = make_tensor(make_gmem_ptr(static_cast<const TE*>(p.W_B)),
                         make_layout(make_shape(N, K), make_stride(ld, _1{})));
  auto gwc = make_tensor(make_gmem_ptr(static_cast<const TE*>(p.W_C)),
                         make_layout(make_shape(N, K), make_stride(ld, _1{})));
  auto tma_wd = make_tma_copy(SM90_TMA_LOAD{}, gwd, typename Cfg::SmemLayoutWdTma1{});
  auto tma_wb = make_tma_copy(SM90_TMA_LOAD{}, gwb, typename Cfg::SmemLayoutWnTma1{});
  auto tma_wc = make_tma_copy(SM90_TMA_LOAD{}, gwc, typename Cfg::SmemLayoutWnTma1{});
  return cute::make_tuple(tma_wd, tma_wb, tma_wc);
}

}  // namespace fused
}  // namespace selscan
