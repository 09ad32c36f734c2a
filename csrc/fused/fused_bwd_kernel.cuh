// The fused backward kernel (sm_90a): one launch from x, dy and the forward's checkpoints to the
// gradient of the projection outputs; the math is docs/math.md, "The backward pass".
//
// The projections [delta_pre | B | C] are recomputed on the tensor cores inside the launch, as the
// forward computes them (fused_projection.cuh: the same operand ring, products and softplus epilogue),
// and handed to the reverse scan through shared memory: nothing of shape (batch, L, D) is read but x
// and dy, and nothing of shape (batch, L, D, N) exists anywhere.
//
// Work: a stream = (L-segment, sequence b, channel tile of 64), as the forward's, with its token tiles
// (64 tokens = one checkpoint interval) walked last first; one persistent CTA per SM.
// Roles (256 + 64 kP threads):
//   warpgroup 0  warp 0's elected lane: the operand ring (x and the stacked weight tile, TMA), tiles in
//                reverse; warp 1's elected lane: the scan's x and dy tiles (64 x 64 each, TMA, one
//                barrier for both), in the scan's order.
//   warpgroup 1  tensor cores: x . [W_delta slice; W_B; W_C]^T for the tile's 64 tokens, then
//                dt = softplus(z) (0 past L), B and C into a hand-off tile (two stages: the next
//                tile's products run under this tile's scan).
//   warpgroups 2, 3 (and 4, 5)  the reverse scan: thread (channel c, group g) owns states g*kNS .. of
//                channel c (kP = 4 threads per channel, two warpgroups; or 8, four warpgroups; 64
//                channels). Per tile:
//     (F)  from the tile's checkpoint, the forward recurrence over the tile, keeping the state at the
//          start of every sub-chunk of kS tokens (shared memory, per thread);
//     (R)  sub-chunks last first: their forward states again, from the sub-chunk's start state, into
//          registers with the decays, then token by token in reverse (the standalone backward's
//          recurrence, csrc/scan/scan_bwd_kernel.cuh):
//            g = a[t+1] g + C[t] dy[t];  ddelta += sum_n g A a[t] h[t-1] + x[t] sum_n g B[t]
//            dA += g dt a[t] h[t-1];     dB[t] = sum_d g dt x,  dC[t] = sum_d dy h[t]
//          ddelta and sum_n g B reduce-scattered over a channel's 4 threads, then stored at once:
//          dz = ddelta * sigmoid(z) (sigmoid(z) = -expm1(-dt), the same value: 1 - e^-softplus(z))
//          into dP's first D columns, and the scan's part of dx, dt sum_n g B + D dy; dB and dC
//          reduce-scattered over the 32 / kP channels of a warp, then summed over the warps in a fixed
//          order (one barrier per sub-chunk) into a per-tile partial.
// What leaves: dz, the scan's dx, per-tile partials of [dB | dC] ((batch x L, D / 64, 2N) float32),
// per-stream partials of dA, dD and db_delta, dh0. The host sums the partials in a fixed order and
// finishes with two library products (dx += dP W, dW = dP^T x): bitwise deterministic.
//
// L split (few streams: one long sequence, S4): the standalone backward's scheme inside the launch.
// Phase 1: every segment but the first runs the adjoint alone from a zero adjoint at its end (the
// projections computed for it as in phase 2) and publishes a[t0] g[t0] and its sum of dt; grid-wide
// barrier (cooperative launch); phase 2: each segment folds its successors, last first, into the
// adjoint entering its end, and runs the full backward. The forward states come from the checkpoints,
// which hold the true states.
#pragma once
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <atomic>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cutlass.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "../common/checkpoints.h"
#include "../common/cuda_check.h"
#include "../common/device_math.cuh"
#include "../common/l_split.h"
#include "../scan/scan_bwd_kernel.cuh"  // scan_bwd::reduce_scatter
#include "../scan/scan_bwd_params.h"
#include "fused_api.h"
#include "fused_config.h"
#include "fused_params.h"
#include "fused_projection.cuh"

namespace selscan {
namespace fused {

constexpr int kBarScanBwd = 6;  // the two scan warpgroups alone (the cross-warp dB/dC sums)

// The backward's Config: the forward's (64 channels, 64-token tensor-core tiles, the shared memory the
// backward keeps for itself taken from the ring) with kScanThreads scan threads (two or four
// warpgroups) and the registers per role to match (setmaxnreg; 65536 per SM, one CTA).
template <class E, int kN, int kScanThreads_, int kReserve>
struct BwdConfig : Config<E, kN, false, 1, 64, 64, kReserve> {
  static constexpr int kScanThreads = kScanThreads_;
  static constexpr int kThreads = 256 + kScanThreads;
  static_assert(kThreads == 512 || kThreads == 768, "two or four scan warpgroups");
  static constexpr int kRegProducer = kThreads == 512 ? 40 : 24;
  static constexpr int kRegMma = kThreads == 512 ? 184 : 104;
  static constexpr int kRegScan = kThreads == 512 ? 144 : 88;
  static_assert(kRegProducer + kRegMma + kRegScan * (kScanThreads / 128) ==
                    (65536 / kThreads) / 8 * 8 * (kThreads / 128),
                "register budget of one CTA per SM");
};

// One backward instance: element type E (bf16 / fp16), N states, kP scan threads per channel (4: N/4
// states each, two scan warpgroups; 8: N/8 states each, four scan warpgroups).
template <class E, int kN_, int kP_>
struct BwdTraits {
  static constexpr int kN = kN_;
  static constexpr int kT = 64;                  // tokens per tile = checkpoint interval
  static constexpr int kDc = 64;                 // channels per stream
  static constexpr int kP = kP_;                 // scan threads per channel
  static_assert(kP == 4 || kP == 8, "4 or 8 scan threads per channel");
  static constexpr int kNS = kN / kP;            // states per thread
  static constexpr int kScanThreads = kDc * kP;  // 256 or 512
  static constexpr int kScanWarps = kScanThreads / 32;
  static constexpr int kS = 8;                   // tokens per sub-chunk
  static constexpr int kG = kP / 2;              // tokens per reduction group (one value per lane)
  static constexpr int kR = 32 / kP;             // lanes of a warp sharing a state group (its channels)
  static constexpr int kRowsPerCol = kP / 2;     // dD / db partial rows per (segment, sequence)
  static constexpr int kXStages = 2;
  // What the kernel keeps beside the forward's members: the dy tiles, the sub-chunk start states and
  // the cross-warp dB/dC sums (double-buffered), plus alignment slack.
  static constexpr int kReserve = kXStages * kT * kDc * int(sizeof(E)) + (kT / kS) * kNS * kScanThreads * 4 +
                                  2 * kScanWarps * kS * 2 * kN * 4 + 2048;
  using Cfg = BwdConfig<E, kN, kScanThreads, kReserve>;
  static_assert(Cfg::kTM == kT && Cfg::kHalves == 1 && !Cfg::kNarrow && Cfg::kXtWarp && !Cfg::kTF32,
                "one scan tile per tensor-core tile, bf16/fp16");
  static_assert(kT == int(kCkptEvery), "a checkpoint at every tile");
  static_assert(kNS * kS <= 32, "the sub-chunk's states and decays fit in registers");
  static constexpr uint32_t kXdyBytes = 2u * uint32_t(kT * kDc * sizeof(E));  // one x/dy stage
};

template <class Tr>
struct BwdSharedStorage {
  using Cfg = typename Tr::Cfg;
  using E = typename Cfg::Element;
  alignas(1024) cute::ArrayEngine<E, cosize_v<typename Cfg::SmemLayoutX>> x;
  alignas(1024) cute::ArrayEngine<E, cosize_v<typename Cfg::SmemLayoutW>> w;
  alignas(16) cute::ArrayEngine<E, 8> xs;  // the 3xTF32 remainder rings: unused (bf16/fp16)
  alignas(16) cute::ArrayEngine<E, 8> ws;
  alignas(128) cute::ArrayEngine<E, cosize_v<typename Cfg::SmemLayoutXt>> xt;   // x tiles (64 x 64)
  alignas(128) cute::ArrayEngine<E, cosize_v<typename Cfg::SmemLayoutXt>> dyt;  // dy tiles, same stage
  alignas(16) float dt[Cfg::kPStages][Cfg::kT][Cfg::kLdDt];
  alignas(16) float B[Cfg::kPStages][Cfg::kT][Cfg::kLdN];
  alignas(16) float C[Cfg::kPStages][Cfg::kT][Cfg::kLdN];
  alignas(16) float sub[Tr::kT / Tr::kS][Tr::kNS][Tr::kScanThreads];  // sub-chunk start states
  alignas(16) float red[2][Tr::kScanWarps][Tr::kS][2 * Tr::kN];       // dB | dC per warp
  alignas(16) typename Cfg::Ring::SharedStorage ring;
  alignas(16) typename Cfg::XPipe::SharedStorage xpipe;
  alignas(8) cutlass::arch::ClusterBarrier rounded[1];  // unused (float32 only)
#if SELSCAN_HANDOFF_MBARRIER
  alignas(8) HandOffBarriers<Cfg::kPStages> handoff;
#endif
};

template <class Cfg, class TmaX, class TmaXt, class TmaWd, class TmaWn>
struct BwdArgs {
  TmaX tma_x;     // x: operand tiles (64 x kBK), swizzled
  TmaXt tma_xt;   // x: scan tiles (64 x 64), plain
  TmaWd tma_wd;
  TmaWn tma_wb;
  TmaWn tma_wc;
  TmaXt tma_dyt;  // dy: scan tiles, as x's
  FusedParams p;  // sizes, x, weights, per-channel parameters, the L split
  ScanBwdParams q;  // dy, dhT, checkpoints and the outputs (q's sizes and split equal p's)
};

// Warp 1's elected lane: the x and dy tiles of every tile, in the scan's order (last first).
template <class Tr, class Args, class SS>
__device__ __forceinline__ void xdy_phase(const Args& a, typename Tr::Cfg::XPipe& xpipe, SS& ss,
                                          cutlass::PipelineState<Tr::Cfg::kXStages>& st, int64_t first,
                                          int64_t count) {
  using Cfg = typename Tr::Cfg;
  using TE = typename Cfg::TmaElement;
  const FusedParams& p = a.p;
  const int L = int(p.seqlen), Dm = int(p.dim), Bt = int(p.batch);
  Tensor sX = make_tensor(make_smem_ptr(reinterpret_cast<TE*>(ss.xt.begin())), typename Cfg::SmemLayoutXt{});
  Tensor sD = make_tensor(make_smem_ptr(reinterpret_cast<TE*>(ss.dyt.begin())), typename Cfg::SmemLayoutXt{});
  Tensor mX = a.tma_xt.get_tma_tensor(make_shape(L, Dm, Bt));
  Tensor mD = a.tma_dyt.get_tma_tensor(make_shape(L, Dm, Bt));
  for (int64_t idx = first; idx < count; idx += gridDim.x) {
    const Stream s = decode_stream<Cfg, false>(p, idx);  // never packed
    for (int64_t tile = 0; tile < s.n_tiles; ++tile) {
      const int t_sub = int(s.t_begin / Cfg::kT + (s.n_tiles - 1 - tile));
      Tensor gX = local_tile(mX(_, _, int(s.b)), make_shape(typename Cfg::BlkT{}, typename Cfg::BlkDt{}),
                             make_coord(t_sub, int(s.j)));
      Tensor gD = local_tile(mD(_, _, int(s.b)), make_shape(typename Cfg::BlkT{}, typename Cfg::BlkDt{}),
                             make_coord(t_sub, int(s.j)));
      auto [tXg, tXs] = tma_partition(a.tma_xt, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sX), group_modes<0, 2>(gX));
      auto [tDg, tDs] = tma_partition(a.tma_dyt, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sD), group_modes<0, 2>(gD));
      xpipe.producer_acquire(st);
      auto* bar = xpipe.producer_get_barrier(st);
      copy(a.tma_xt.with(*bar), tXg, tXs(_, st.index()));
      copy(a.tma_dyt.with(*bar), tDg, tDs(_, st.index()));
      ++st;
    }
  }
}

template <int kNS>
__device__ __forceinline__ void load_states(const float* src, float (&v)[kNS]) {
  static_assert(kNS % 4 == 0 || kNS == 2, "16- or 8-byte loads");
  if constexpr (kNS == 2) {
    const float2 f = *reinterpret_cast<const float2*>(src);
    v[0] = f.x; v[1] = f.y;
  } else {
#pragma unroll
    for (int n = 0; n < kNS; n += 4) {
      const float4 f = *reinterpret_cast<const float4*>(src + n);
      v[n] = f.x; v[n + 1] = f.y; v[n + 2] = f.z; v[n + 3] = f.w;
    }
  }
}

// Per-thread state of one stream.
template <class Tr>
struct BwdStreamState {
  float A2[Tr::kNS];  // A * log2(e)
  float A[Tr::kNS];   // A = -exp(A_log)
  float g[Tr::kNS];   // the adjoint entering the current token from the later ones (a[t+1] g[t+1] is
                      // formed as an * g)
  float an[Tr::kNS];  // a[t+1]: the decay of the token after the current one (1 past the end)
  float dA[Tr::kNS];  // sum of g dt a h_prev
  float sum_dt;       // phase 1: the segment's sum of dt
  float db, dD;       // sums of dz and dy x over this thread's tokens of its channel
};

// The scan role. kFull = false: phase 1 (the adjoint alone); true: the full backward.
template <class Tr, bool kFull, class Args, class SS>
__device__ __forceinline__ void bwd_scan_phase(const Args& a, typename Tr::Cfg::XPipe& xpipe, SS& ss,
                                               RoleState<typename Tr::Cfg>& st, uint32_t& red_turn,
                                               int64_t first, int64_t count) {
  using Cfg = typename Tr::Cfg;
  using TE = typename Cfg::TmaElement;
  constexpr int kN = Tr::kN, kNS = Tr::kNS, kS = Tr::kS, kG = Tr::kG, kP = Tr::kP, kT = Tr::kT, kDc = Tr::kDc;
  constexpr int kLdDt = Cfg::kLdDt, kLdN = Cfg::kLdN;
  const FusedParams& p = a.p;
  const ScanBwdParams& q = a.q;
  const int tid = threadIdx.x - 256;  // 0 .. kScanThreads-1
  const int lane = tid % 32, warp = tid / 32;
  const int c = tid / kP, gi = tid % kP, n0 = gi * kNS;
  const int c_local = lane / kP;
  const SplitWorkspace ws(q.workspace, p.n_segments, p.batch, p.dim, kN);
  const int64_t n_ctiles = p.dim / kDc;
  const int64_t n_ck = ckpt_count(p.seqlen);
  const int64_t stride_p = p.dim + 2 * p.dstate;  // dP's row
  TE* const dP = static_cast<TE*>(q.dP);
  TE* const dxo = static_cast<TE*>(q.dx);

  for (int64_t idx = first; idx < count; idx += gridDim.x) {
    const Stream s = decode_stream<Cfg, false>(p, idx);  // never packed
    const int64_t d = s.j * kDc + c;
    BwdStreamState<Tr> it;
#pragma unroll
    for (int n = 0; n < kNS; ++n) {
      const float A_log = p.A_log[d * kN + n0 + n];
      it.A[n] = decay_rate(A_log, 1.f);
      it.A2[n] = decay_rate(A_log, kLog2e);
      it.g[n] = 0.f;
      it.an[n] = 1.f;
      it.dA[n] = 0.f;
    }
    it.sum_dt = 0.f;
    it.db = 0.f;
    it.dD = 0.f;
    if constexpr (kFull) {
      if (q.dhT != nullptr) {
#pragma unroll
        for (int n = 0; n < kNS; ++n) it.g[n] = q.dhT[(s.b * p.dim + d) * kN + n0 + n];
      }
      if (p.n_segments > 1) ws.fold_reverse<kNS>(s.seg, p.n_segments, s.b, d, n0, it.A2, it.g);
    }
    const float dskip = p.D[d];
    const int64_t row_base = s.b * p.seqlen;

    for (int64_t tile = 0; tile < s.n_tiles; ++tile) {
      const int64_t k = s.n_tiles - 1 - tile;  // tile of the stream, last first
      const int64_t t0 = s.t_begin + k * kT;
      const int nvalid = int(min_i64(kT, p.seqlen - t0));
      const int ps = st.hand.stage;
      handoff_wait<Cfg, HandOff::kFull>(ss, st.hand);                              // dt, B, C of the tile
      xpipe.consumer_wait(st.xt);                                          // its x and dy
      const float* dts = &ss.dt[ps][0][0] + c;
      const float* Bs = &ss.B[ps][0][0] + n0;
      const float* Cs = &ss.C[ps][0][0] + n0;
      const TE* xs = reinterpret_cast<const TE*>(ss.xt.begin()) + st.xt.index() * (kT * kDc) + c;
      const TE* dys = reinterpret_cast<const TE*>(ss.dyt.begin()) + st.xt.index() * (kT * kDc) + c;

      if constexpr (!kFull) {
#pragma unroll 4
        for (int t = kT - 1; t >= 0; --t) {
          const float dt = dts[t * kLdDt], dy = float(dys[t * kDc]);
          float Cv[kNS];
          load_states<kNS>(Cs + t * kLdN, Cv);
#pragma unroll
          for (int n = 0; n < kNS; ++n) {
            it.g[n] = fmaf(it.an[n], it.g[n], Cv[n] * dy);
            it.an[n] = ex2_approx(dt * it.A2[n]);
          }
          it.sum_dt += dt;
        }
      } else {
        // One token of the forward recurrence: h = a h + dt x B; the decays through `av`.
        auto forward_token = [&](int t, float (&h)[kNS], float (&av)[kNS]) {
          const float dt = dts[t * kLdDt], dtx = dt * float(xs[t * kDc]);
          float Bv[kNS];
          load_states<kNS>(Bs + t * kLdN, Bv);
#pragma unroll
          for (int n = 0; n < kNS; ++n) {
            av[n] = ex2_approx(dt * it.A2[n]);
            h[n] = fmaf(av[n], h[n], dtx * Bv[n]);
          }
        };
        const int n_sub = (nvalid + kS - 1) / kS;  // sub-chunks holding tokens (uniform over the CTA)
        // (F) from the checkpoint: the start state of every sub-chunk.
        {
          float h[kNS], av[kNS];
          load_states<kNS>(q.ckpt + ((s.b * n_ck + t0 / kT) * p.dim + d) * kN + n0, h);
          for (int sc = 0; sc < n_sub; ++sc) {
#pragma unroll
            for (int n = 0; n < kNS; ++n) ss.sub[sc][n][tid] = h[n];
#pragma unroll
            for (int j = 0; j < kS; ++j) forward_token(sc * kS + j, h, av);
          }
        }
        // (R) sub-chunks last first.
        for (int sc = n_sub - 1; sc >= 0; --sc) {
          const int buf = int(red_turn & 1u);
          ++red_turn;
          float hp[kS][kNS];  // h[t-1] of the sub-chunk's tokens
          float av[kS][kNS];  // a[t]
          float hend[kNS];    // h after the sub-chunk's last token
#pragma unroll
          for (int n = 0; n < kNS; ++n) hend[n] = ss.sub[sc][n][tid];
#pragma unroll
          for (int j = 0; j < kS; ++j) {
#pragma unroll
            for (int n = 0; n < kNS; ++n) hp[j][n] = hend[n];
            forward_token(sc * kS + j, hend, av[j]);
          }
#pragma unroll
          for (int jg = kS - kG; jg >= 0; jg -= kG) {
            float v1[2 * kG];        // per token: ddelta's partial, then sum_n g B
            float v2[2 * kG * kNS];  // per token: dB's terms (g dt x), then dC's (dy h[t])
#pragma unroll
            for (int jj = kG - 1; jj >= 0; --jj) {
              const int j = jg + jj, t = sc * kS + j;
              const float dt = dts[t * kLdDt], dy = float(dys[t * kDc]), xv = float(xs[t * kDc]);
              const float dtx = dt * xv;
              float Bv[kNS], Cv[kNS];
              load_states<kNS>(Bs + t * kLdN, Bv);
              load_states<kNS>(Cs + t * kLdN, Cv);
              float acc_a = 0.f, acc_b = 0.f;
#pragma unroll
              for (int n = 0; n < kNS; ++n) {
                const float aj = av[j][n];
                const float gn = fmaf(it.an[n], it.g[n], Cv[n] * dy);
                it.g[n] = gn;
                it.an[n] = aj;
                const float gah = gn * (aj * hp[j][n]);
                acc_a = fmaf(it.A[n], gah, acc_a);
                acc_b = fmaf(gn, Bv[n], acc_b);
                it.dA[n] = fmaf(gah, dt, it.dA[n]);
                v2[(jj * 2 + 0) * kNS + n] = gn * dtx;
                v2[(jj * 2 + 1) * kNS + n] = dy * (j + 1 < kS ? hp[j + 1 < kS ? j + 1 : j][n] : hend[n]);
              }
              v1[jj * 2 + 0] = fmaf(xv, acc_b, acc_a);
              v1[jj * 2 + 1] = acc_b;
            }
            // ddelta and sum_n g B over the channel's kP threads: lane gi ends with value gi of v1
            // (token jg + gi / 2; even gi: ddelta, odd: sum_n g B).
            scan_bwd::reduce_scatter<2 * kG, kP, 1>(v1, gi);
            {
              const int t = sc * kS + jg + gi / 2;
              if (t < nvalid) {
                const int64_t row = row_base + t0 + t;
                const float dt = dts[t * kLdDt], dy = float(dys[t * kDc]);
                if (gi % 2 == 0) {
                  const float dz = v1[0] * -expm1f(-dt);  // ddelta * sigmoid(z)
                  dP[row * stride_p + d] = TE(dz);
                  it.db += dz;
                  it.dD = fmaf(dy, float(xs[t * kDc]), it.dD);
                } else {
                  dxo[row * p.dim + d] = TE(fmaf(dt, v1[0], dskip * dy));
                }
              }
            }
            // dB and dC over the warp's kR channels: lane c_local ends with values c_local * kV2 ...
            constexpr int kV2 = 2 * kG * kNS / Tr::kR;
            static_assert(kV2 >= 1 && (2 * kG * kNS) % Tr::kR == 0, "dB/dC reduce-scatter");
            scan_bwd::reduce_scatter<2 * kG * kNS, Tr::kR, kP>(v2, c_local);
#pragma unroll
            for (int i = 0; i < kV2; ++i) {
              const int v = c_local * kV2 + i;
              const int jj = v / (2 * kNS), kind = (v / kNS) % 2, n = v % kNS;
              ss.red[buf][warp][jg + jj][kind * kN + n0 + n] = v2[i];
            }
          }
          named_sync(kBarScanBwd, Tr::kScanThreads);  // the sub-chunk's dB | dC of every warp
          // Summed over the warps in order: the tile's partial for the sub-chunk's tokens. red[buf] is
          // written again two sub-chunks later, after the next barrier (red_turn runs on across tiles
          // and streams, so the buffers alternate strictly).
#pragma unroll
          for (int e = tid; e < kS * 2 * kN; e += Tr::kScanThreads) {
            const int j = e / (2 * kN), col = e % (2 * kN);
            float sum = 0.f;
#pragma unroll
            for (int w = 0; w < Tr::kScanWarps; ++w) sum += ss.red[buf][w][j][col];
            const int t = sc * kS + j;
            if (t < nvalid) q.bc_partial[((row_base + t0 + t) * n_ctiles + s.j) * (2 * kN) + col] = sum;
          }
        }
      }
      xpipe.consumer_release(st.xt);
      ++st.xt;
      handoff_arrive<Cfg, HandOff::kEmpty>(ss, st.hand);
      st.hand.advance(Cfg::kPStages);
    }

    if constexpr (!kFull) {
      float pub[kNS];
#pragma unroll
      for (int n = 0; n < kNS; ++n) pub[n] = it.an[n] * it.g[n];  // a[t0] g[t0]
      ws.publish<kNS>(s.seg - 1, s.b, d, n0, pub, it.sum_dt, gi == 0);
    } else {
      const int64_t row = s.seg * p.batch + s.b;
#pragma unroll
      for (int n = 0; n < kNS; ++n) q.dA_partial[(row * p.dim + d) * kN + n0 + n] = it.dA[n];
      if (s.seg == 0) {
#pragma unroll
        for (int n = 0; n < kNS; ++n) q.dh0[(s.b * p.dim + d) * kN + n0 + n] = it.an[n] * it.g[n];
      }
      if (gi % 2 == 0) {  // the even threads of a channel hold its sums over their tokens
        const int64_t prow = row * Tr::kRowsPerCol + gi / 2;
        q.db_partial[prow * p.dim + d] = it.db;
        q.dD_partial[prow * p.dim + d] = it.dD;
      }
    }
  }
}

template <class Tr, class Args>
__global__ void __launch_bounds__(Tr::Cfg::kThreads, 1) fused_bwd_kernel(const __grid_constant__ Args a) {
#if defined(__CUDA_ARCH__) && defined(CUTE_ARCH_MMA_SM90A_ENABLED)
  using Cfg = typename Tr::Cfg;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  auto& ss = *reinterpret_cast<BwdSharedStorage<Tr>*>(smem_raw);
  const FusedParams& p = a.p;
  const int warp = cutlass::canonical_warp_idx_sync();
  const int wg = cutlass::canonical_warp_group_idx();
  const int lane_elected = cute::elect_one_sync();
  const bool producer_lane = (warp == 0) && lane_elected;
  const bool xdy_lane = (warp == 1) && lane_elected;
  if (producer_lane) {
    cute::prefetch_tma_descriptor(a.tma_x.get_tma_descriptor());
    cute::prefetch_tma_descriptor(a.tma_xt.get_tma_descriptor());
    cute::prefetch_tma_descriptor(a.tma_wd.get_tma_descriptor());
    cute::prefetch_tma_descriptor(a.tma_wb.get_tma_descriptor());
    cute::prefetch_tma_descriptor(a.tma_wc.get_tma_descriptor());
    cute::prefetch_tma_descriptor(a.tma_dyt.get_tma_descriptor());
  }
  using Ring = typename Cfg::Ring;
  using XPipe = typename Cfg::XPipe;
  typename Ring::Params rp;
  rp.transaction_bytes = Cfg::kRingBytes;
  rp.role = wg == 0 ? (warp == 0 ? Ring::ThreadCategory::Producer : Ring::ThreadCategory::NonParticipant)
                    : (wg == 1 ? Ring::ThreadCategory::Consumer : Ring::ThreadCategory::NonParticipant);
  rp.is_leader = producer_lane;
  rp.num_consumers = Cfg::kMmaThreads;
  Ring ring(ss.ring, rp, Shape<_1, _1, _1>{});
  typename XPipe::Params xp;
  xp.transaction_bytes = Tr::kXdyBytes;
  xp.role = wg == 0 ? (warp == 1 ? XPipe::ThreadCategory::Producer : XPipe::ThreadCategory::NonParticipant)
                    : (wg >= 2 ? XPipe::ThreadCategory::Consumer : XPipe::ThreadCategory::NonParticipant);
  xp.is_leader = xdy_lane;
  xp.num_consumers = Cfg::kScanThreads;
  XPipe xpipe(ss.xpipe, xp, Shape<_1, _1, _1>{});
  handoff_init<Cfg>(ss);
  __syncthreads();  // barrier initialisation visible to everyone

  RoleState<Cfg> st;
  st.ring.n_stages = Cfg::kStages;
  if (wg == 0) {
    st.ring.phase_ = 1;  // the producer's start state: every stage free
    st.xt = cutlass::make_producer_start_state<XPipe>();
  }
  const int64_t streams_per_seg = p.batch * (p.dim / Cfg::kDt);
  const int64_t n_all = streams_per_seg * p.n_segments;
  const bool split = p.n_segments > 1;
  // Phase 1 (L split only): the streams of segments 1 .. n_segments-1, the adjoint alone.
  const int64_t first1 = streams_per_seg + blockIdx.x;
  auto grid_barrier = [&] {
    __threadfence();
    cooperative_groups::this_grid().sync();
  };
  if (wg == 0) {
    cutlass::arch::warpgroup_reg_dealloc<Cfg::kRegProducer>();
    if (producer_lane) {
      if (split) producer_phase<Cfg, true>(a, ring, ss, st, first1, n_all);
    } else if (xdy_lane) {
      if (split) xdy_phase<Tr>(a, xpipe, ss, st.xt, first1, n_all);
    }
    if (split) grid_barrier();
    if (producer_lane) {
      producer_phase<Cfg, true>(a, ring, ss, st, blockIdx.x, n_all);
    } else if (xdy_lane) {
      xdy_phase<Tr>(a, xpipe, ss, st.xt, blockIdx.x, n_all);
    }
  } else if (wg == 1) {
    cutlass::arch::warpgroup_reg_alloc<Cfg::kRegMma>();
    if (split) {
      mma_phase<Cfg, true>(a, ring, xpipe, ss, st, first1, n_all, false);
      grid_barrier();
    }
    mma_phase<Cfg, true>(a, ring, xpipe, ss, st, blockIdx.x, n_all, false);
  } else {
    cutlass::arch::warpgroup_reg_alloc<Cfg::kRegScan>();
    handoff_start_empty<Cfg>();  // every hand-off tile starts empty
    uint32_t red_turn = 0;
    if (split) {
      bwd_scan_phase<Tr, false>(a, xpipe, ss, st, red_turn, first1, n_all);
      grid_barrier();
    }
    bwd_scan_phase<Tr, true>(a, xpipe, ss, st, red_turn, blockIdx.x, n_all);
  }
#else
  __trap();  // built for another architecture: the host never launches this
#endif
}

// ---------------------------------------------------------------------------------------------------
// Host side.

template <class Tr>
auto make_bwd_args(const FusedParams& p, const ScanBwdParams& q) {
  using Cfg = typename Tr::Cfg;
  auto xt = make_x_tmas<Cfg>(p);
  auto wt = make_w_tmas<Cfg>(p);
  FusedParams pd = p;
  pd.x = q.dy;
  auto dyt = make_x_tmas<Cfg>(pd);
  using A = BwdArgs<Cfg, cute::remove_cvref_t<decltype(get<0>(xt))>, cute::remove_cvref_t<decltype(get<1>(xt))>,
                    cute::remove_cvref_t<decltype(get<0>(wt))>, cute::remove_cvref_t<decltype(get<1>(wt))>>;
  return A{get<0>(xt), get<1>(xt), get<0>(wt), get<1>(wt), get<2>(wt), get<1>(dyt), p, q};
}

template <class Tr>
struct BwdLauncher {
  using Cfg = typename Tr::Cfg;
  using Args = decltype(make_bwd_args<Tr>(FusedParams{}, ScanBwdParams{}));
  static constexpr int kSmem = int(sizeof(BwdSharedStorage<Tr>));
  static_assert(kSmem <= 227 * 1024, "shared memory budget exceeded");
  static_assert(Cfg::kStages >= 2, "a 2-deep operand ring at least");

  static cudaError_t launch(const FusedParams& p, const ScanBwdParams& q, cudaStream_t stream) {
    int device = 0, sms = 0;
    SELSCAN_RETURN_IF_ERROR(cudaGetDevice(&device));
    SELSCAN_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    static std::atomic<bool> done[64] = {};
    if (!(device >= 0 && device < 64 && done[device].load(std::memory_order_acquire))) {
      SELSCAN_RETURN_IF_ERROR(
          cudaFuncSetAttribute(fused_bwd_kernel<Tr, Args>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
      if (device >= 0 && device < 64) done[device].store(true, std::memory_order_release);
    }
    FusedParams pp = p;
    pp.ring_stages = Cfg::kStages;
    pp.channel_tile = Cfg::kDt;
    const Args args = make_bwd_args<Tr>(pp, q);
    const int64_t n_streams = p.batch * (p.dim / Cfg::kDt) * p.n_segments;
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute attr[1];
    cfg.gridDim = dim3(unsigned(min_i64(n_streams, sms)));
    cfg.blockDim = dim3(Cfg::kThreads);
    cfg.dynamicSmemBytes = kSmem;
    cfg.stream = stream;
    if (p.n_segments > 1) {  // the grid-wide barrier needs every CTA resident
      attr[0].id = cudaLaunchAttributeCooperative;
      attr[0].val.cooperative = 1;
      cfg.attrs = attr;
      cfg.numAttrs = 1;
    }
    return cudaLaunchKernelEx(&cfg, fused_bwd_kernel<Tr, Args>, args);
  }
};

}  // namespace fused
}  // namespace selscan
