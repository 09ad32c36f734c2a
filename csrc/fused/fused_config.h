// Compile-time configuration of the fused kernel: tile sizes, shared-memory layouts, the tensor-core
// atoms and the pipelines, for one (element type, N, TF32 mode).
#pragma once
#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/numeric_types.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

namespace selscan {
namespace fused {

using namespace cute;

// kTM_: tokens per tensor-core tile, 0 for the forward's rule below (the backward takes 64: one scan
// chunk per tile). kReserve_: shared-memory bytes the kernel keeps for itself beside the members of
// SharedStorage (the backward's dy tiles, sub-chunk states and dB/dC sums), taken from the ring.
template <class ElementIn_, int kN_, bool k3xTF32_, int kCh_ = 2, int kDt_ = 64, int kTM_ = 0, int kReserve_ = 0>
struct Config {
  using ElementIn = ElementIn_;                                   // bfloat16_t, half_t or float
  static constexpr bool kTF32 = cute::is_same_v<ElementIn, float>;
  static constexpr bool k3x = kTF32 && k3xTF32_;                  // float32 "highest": 3 TF32 products
  using Element = cute::conditional_t<kTF32, cute::tfloat32_t, ElementIn>;  // what the tensor cores read
  // TMA moves the raw bits (float stays float: the 3xTF32 split needs the untruncated value).
  using TmaElement = ElementIn;

  static constexpr int kN = kN_;
  static constexpr int kT = 64;                           // tokens per scan tile (hand-off stage)
  // Tokens per tensor-core tile: 128 (two wgmma M = 64 rows per K step) halves the weight bytes
  // each token costs (docs/perf/layer-forward.md, v3: the operand loads bound S3; v3.3: float32 "high" is
  // bound by rounding its ring stages, which 128-token tiles halve per token for the weights); 64
  // where the accumulators or the ring would not fit (N = 64; float32 N = 32; float32 "highest",
  // whose 3xTF32 products keep a second accumulator).
  static constexpr int kTM = kTM_ != 0 ? kTM_ : ((kN >= 64 || k3x || (kTF32 && kN >= 32)) ? 64 : 128);
  static_assert(kTM == 64 || kTM == 128, "tensor-core tiles of 64 or 128 tokens");
  static constexpr int kHalves = kTM / kT;               // scan tiles per tensor-core tile
  // Channels per CTA: 64, or 16 (the narrow layout, bf16/fp16 with N = 16: four times the streams, so
  // that few long sequences fill the GPU without an L split and its second pass over the exponentials;
  // fused_plan chooses, docs/perf/layer-forward.md v3.7).
  static constexpr int kDt = kDt_;
  static_assert(kDt == 64 || kDt == 16, "channel tile of 64 or 16");
  static constexpr int kBK = 128 / int(sizeof(Element));  // K per stage: one 128-byte swizzle row
  static constexpr int kPStages =                               // dt/B/C tiles between MMA and scan
      ((k3x && kN >= 32) || (kTF32 && kN == 64)) ? 1 : 2;
  static constexpr int kXStages = 2;                           // x tiles for the scan
  // The operand ring takes what is left of the 227 KB of shared memory, up to 8 stages (docs/perf/
  // layer-forward.md, v2: 7 stages instead of 4 measured 5% faster on S3 and 12% on S5, the same on S2).
  // Hand-off tiles (float32), rows padded so that the accumulator's float2 stores hit every bank once.
  // The narrow layout (kDt = 16) hands over (dt, dt * x) pairs, and B and C by token pairs
  // ([t / 2][n / 2][t % 2][n % 2], kLdBP floats per token pair): its scan threads (8 per channel) then
  // load one 8-byte value per token instead of dt and x and their product, and B or C of two tokens
  // with one 16-byte load (docs/perf/layer-forward.md, v3.7).
  static constexpr bool kNarrow = kDt_ == 16;
  static constexpr int kLdDt = kNarrow ? 2 * kDt_ + 8 : kDt_ + 8;
  static constexpr int kLdN = kN + (kN == 8 ? 16 : 8);
  static constexpr int kLdBP = 2 * kN + 8;
  static_assert(!kNarrow || (kT / 2) * kLdBP <= kT * kLdN, "token-pair B/C tiles fit the hand-off arrays");
  static constexpr int kNW = kDt + 2 * kN;  // rows of the stacked weight tile (below)
  static constexpr uint32_t kRingBytes = uint32_t((kTM + kNW) * kBK * sizeof(Element));  // one TMA fill
  static constexpr int kStageBytes = int(kRingBytes) * (k3x ? 2 : 1);  // with the remainder ring
  static constexpr int kOtherBytes = kXStages * kT * kDt * int(sizeof(TmaElement)) +
                                     kPStages * kT * (kLdDt + 2 * kLdN) * 4 + 4096;
  static constexpr int kStagesFit = (227 * 1024 - kOtherBytes - kReserve_) / kStageBytes;
  static constexpr int kStages = kStagesFit < 8 ? kStagesFit : 8;
  static_assert(kStages >= 2, "shared memory too small for a 2-deep ring");
  // float32: warps 1-3 of the producer warpgroup prepare each ring stage for the tensor cores, off
  // their critical path: "high" rounds it to TF32 in place (round to nearest; its x tile is rounded
  // by the tensor-core warpgroup, kMmaRoundsX); "highest" writes the TF32 remainders v - tf32(v) of
  // the stage to a remainder ring of the same depth.
  static constexpr bool kRoundWarps = kTF32;
  static constexpr int kRoundThreads = 96;
  // "high": the tensor-core warpgroup rounds each stage's x tile itself, just before its products
  // (the rounding warps only the weights): 7 warps share the rounding instead of 3 (docs/perf/layer-forward.md,
  // v3.3: the rounding warps bounded float32 "high").
  static constexpr bool kMmaRoundsX = kTF32 && !k3x;
  // Who loads the scan's x tiles (never the ring's producer, which would block on the scan between
  // two tiles' operands: measured, v3): without rounding warps, warp 1's elected lane, as soon as
  // the scan frees a stage; with them (float32), the tensor-core warpgroup's elected thread, right
  // after the scan has freed the hand-off tile of the same scan tile (docs/perf/layer-forward.md, v3.3).
  static constexpr bool kXtWarp = !kRoundWarps;

  // Threads: warpgroup 0 loads (one elected lane of warp 0), warpgroup 1 runs the tensor cores and
  // the softplus epilogue, the rest run the scan. kCh = 2: two adjacent channels per scan thread,
  // which share their B and C loads, one scan warpgroup (the default). kCh = 1: one channel per
  // thread, two scan warpgroups (two scan warps per scheduler): more instructions per exponential
  // but shorter latency per tile, used for short streams (FusedParams::seg_len <= kFusedShortStream;
  // docs/perf/layer-forward.md, v3.2).
  // kDt = 16 (narrow): one channel per thread, 8 threads per channel with 2 states each, one scan
  // warpgroup; y reduce-scattered over 8 threads (groups of 8 tokens).
  static constexpr int kCh = kCh_;               // channels per scan thread
  static_assert(kCh == 1 || kCh == 2, "one or two channels per scan thread");
  static_assert(kDt == 64 || (kCh == 1 && kN == 16), "the narrow layout: one channel per thread, N = 16");
  static constexpr int kP = kDt == 16 ? 8 : 4;   // scan threads per channel (= tokens per scan group)
  static constexpr int kNS = kN / kP;            // states per scan thread and channel
  static constexpr int kQ = kNS < 4 ? kNS : 4;   // states per inner step (one 8/16-byte load)
  static constexpr int kMmaThreads = 128;
  static constexpr int kScanThreads = kDt * kP / kCh;
  static constexpr int kThreads = 256 + kScanThreads;
  static_assert(kScanThreads % 128 == 0, "whole scan warpgroups");
  // setmaxnreg per role (65536 / kThreads each at launch): producer, tensor cores (the accumulator:
  // kTM * kNW / 128 floats), scan.
  static constexpr int kRegProducer = kThreads == 512 ? 40 : 56;
  static constexpr int kRegMma = kThreads == 512 ? 184 : 224;
  static constexpr int kRegScan = kThreads == 512 ? 144 : 224;
  static_assert(kRegProducer + kRegMma + kRegScan * (kScanThreads / 128) == (65536 / kThreads) / 8 * 8 * (kThreads / 128),
                "register budget of one CTA per SM");

  using BlkT = Int<kT>;
  using BlkTM = Int<kTM>;
  using BlkDt = Int<kDt>;
  using BlkN = Int<kN>;
  using BlkK = Int<kBK>;

  // The stacked weight tile [W_delta slice; W_B; W_C]: kNW rows, so that one wgmma of N = kNW per
  // K step reads the x tile once (three separate products read it three times, and the N = kN ones
  // are shared-memory bound: docs/perf/layer-forward.md, v2).
  using BlkNW = Int<kNW>;

  // K-major 128-byte-swizzled operand tiles, kStages deep.
  using SmemLayoutX = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                             make_shape(BlkTM{}, BlkK{}, Int<kStages>{})));
  using SmemLayoutW = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                             make_shape(BlkNW{}, BlkK{}, Int<kStages>{})));
  // The same bytes as TMA sees them (float for float32 inputs). W is written by three boxes per
  // stage (rows [0, kDt), [kDt, kDt + kN), [kDt + kN, kNW)); every box starts on a 1024-byte
  // boundary (kN rows of 128 bytes, kN a multiple of 8), so the hardware swizzle matches the
  // wgmma view of the whole tile.
  using SmemLayoutXTma = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<TmaElement>{},
                                                make_shape(BlkTM{}, BlkK{}, Int<kStages>{})));
  using SmemLayoutWdTma1 = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<TmaElement>{},
                                                  make_shape(BlkDt{}, BlkK{})));
  using SmemLayoutWnTma1 = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<TmaElement>{},
                                                  make_shape(BlkN{}, BlkK{})));
  static constexpr int kWStageElems = kNW * kBK;
  // x tile for the scan: (tokens, channels) row-major, no swizzle (rows read across channels).
  using SmemLayoutXt = Layout<Shape<BlkT, BlkDt, Int<kXStages>>, Stride<BlkDt, _1, Int<kT * kDt>>>;

  // One tensor-core product per K step: (kTM x kBK) . (kNW x kBK)^T -> acc (kTM x kNW) =
  // [delta pre-activation | B | C], as kTM / 64 wgmma of M = 64 by one warpgroup.
  using Mma = decltype(make_tiled_mma(GMMA::ss_op_selector<Element, Element, float, Shape<BlkTM, BlkNW, BlkK>,
                                                           GMMA::Major::K, GMMA::Major::K>()));

  static constexpr uint32_t kXtBytes = uint32_t(kT * kDt * sizeof(Element));
  using Ring = cutlass::PipelineTmaAsync<kStages>;   // operand tiles: producer -> MMA warpgroup
  using XPipe = cutlass::PipelineTmaAsync<kXStages>; // x tiles: producer -> scan warpgroups
};

// The dt/B/C hand-off through mbarriers instead of named barriers (fused_projection.cuh): 0, the
// default build; 1 with -DSELSCAN_HANDOFF_MBARRIER=1, for compute-sanitizer's racecheck.
#ifndef SELSCAN_HANDOFF_MBARRIER
#define SELSCAN_HANDOFF_MBARRIER 0
#endif

template <int kPStages>
struct HandOffBarriers {
  cutlass::arch::ClusterBarrier full[kPStages];   // kMmaThreads arrivals: the tile is written
  cutlass::arch::ClusterBarrier empty[kPStages];  // kScanThreads arrivals: the tile is read
};

template <class Cfg>
struct SharedStorage {
  using E = typename Cfg::Element;
  alignas(1024) cute::ArrayEngine<E, cosize_v<typename Cfg::SmemLayoutX>> x;
  alignas(1024) cute::ArrayEngine<E, cosize_v<typename Cfg::SmemLayoutW>> w;
  // TF32 remainders of the ring stages, same layouts (only with k3x).
  alignas(1024) cute::ArrayEngine<E, (Cfg::k3x ? cosize_v<typename Cfg::SmemLayoutX> : 1)> xs;
  alignas(1024) cute::ArrayEngine<E, (Cfg::k3x ? cosize_v<typename Cfg::SmemLayoutW> : 1)> ws;
  alignas(128) cute::ArrayEngine<E, cosize_v<typename Cfg::SmemLayoutXt>> xt;
  alignas(16) float dt[Cfg::kPStages][Cfg::kT][Cfg::kLdDt];   // softplus(acc + bias); 0 past L
  alignas(16) float B[Cfg::kPStages][Cfg::kT][Cfg::kLdN];
  alignas(16) float C[Cfg::kPStages][Cfg::kT][Cfg::kLdN];
  // The block's conv inside the kernel (FusedParams::conv_weight): the last W - 1 <= 3 inputs of the
  // previous x tile, by tile parity (fused_kernel.cuh, conv_in_tile).
  alignas(16) float conv_halo[2][3][Cfg::kDt];
  alignas(16) typename Cfg::Ring::SharedStorage ring;
  alignas(16) typename Cfg::XPipe::SharedStorage xpipe;
  alignas(8) cutlass::arch::ClusterBarrier rounded[Cfg::kRoundWarps ? Cfg::kStages : 1];  // stage rounded
#if SELSCAN_HANDOFF_MBARRIER
  alignas(8) HandOffBarriers<Cfg::kPStages> handoff;  // fused_projection.cuh
#endif
};

}  // namespace fused
}  // namespace selscan
