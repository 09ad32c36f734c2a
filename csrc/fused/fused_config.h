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

template <class ElementIn_, int kN_, bool k3xTF32_>
struct Config {
  using ElementIn = ElementIn_;                                   // bfloat16_t, half_t or float
  static constexpr bool kTF32 = cute::is_same_v<ElementIn, float>;
  static constexpr bool k3x = kTF32 && k3xTF32_;                  // float32 "highest": 3 TF32 products
  using Element = cute::conditional_t<kTF32, cute::tfloat32_t, ElementIn>;  // what the tensor cores read
  // TMA moves the raw bits (float stays float: the 3xTF32 split needs the untruncated value).
  using TmaElement = ElementIn;

  static constexpr int kN = kN_;
  static constexpr int kT = 64;                           // tokens per tile = wgmma M
  static constexpr int kDt = 64;                          // channels per CTA
  static constexpr int kBK = 128 / int(sizeof(Element));  // K per stage: one 128-byte swizzle row
  // Shared-memory budget (227 KB): ring depth and hand-off depth by N and mode (docs/perf-notes.md).
  static constexpr int kStages = kN <= 16 ? 4 : (kN == 32 ? (k3x ? 3 : 4) : (k3x ? 2 : 3));
  static constexpr int kPStages =                               // dt/B/C tiles between MMA and scan
      ((k3x && kN >= 32) || (kTF32 && kN == 64)) ? 1 : 2;
  static constexpr int kXStages = 2;                           // x tiles for the scan

  // Threads: warpgroup 0 loads (one elected lane of warp 0), warpgroup 1 runs the tensor cores and
  // the softplus epilogue, warpgroups 2-3 run the scan.
  static constexpr int kThreads = 512;
  static constexpr int kMmaThreads = 128;
  static constexpr int kScanThreads = 256;
  static constexpr int kP = 4;                       // scan threads per channel
  static constexpr int kNS = kN / kP;                // states per scan thread: 2, 4, 8, 16
  static constexpr int kQ = kNS < 4 ? kNS : 4;       // states per inner step (one 8/16-byte load)
  static_assert(kScanThreads == kDt * kP, "one channel per group of kP scan threads");

  // Hand-off tiles (float32), rows padded so that the accumulator's float2 stores hit every bank once.
  static constexpr int kLdDt = kDt + 8;
  static constexpr int kLdN = kN + (kN == 8 ? 16 : 8);

  using BlkT = Int<kT>;
  using BlkDt = Int<kDt>;
  using BlkN = Int<kN>;
  using BlkK = Int<kBK>;

  // The stacked weight tile [W_delta slice; W_B; W_C]: kNW rows, so that one wgmma of N = kNW per
  // K step reads the x tile once (three separate products read it three times, and the N = kN ones
  // are shared-memory bound: docs/perf-notes.md, v2).
  static constexpr int kNW = kDt + 2 * kN;
  using BlkNW = Int<kNW>;

  // K-major 128-byte-swizzled operand tiles, kStages deep.
  using SmemLayoutX = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                             make_shape(BlkT{}, BlkK{}, Int<kStages>{})));
  using SmemLayoutW = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                             make_shape(BlkNW{}, BlkK{}, Int<kStages>{})));
  // The same bytes as TMA sees them (float for float32 inputs). W is written by three boxes per
  // stage (rows [0, kDt), [kDt, kDt + kN), [kDt + kN, kNW)); every box starts on a 1024-byte
  // boundary (kN rows of 128 bytes, kN a multiple of 8), so the hardware swizzle matches the
  // wgmma view of the whole tile.
  using SmemLayoutXTma = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<TmaElement>{},
                                                make_shape(BlkT{}, BlkK{}, Int<kStages>{})));
  using SmemLayoutWdTma1 = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<TmaElement>{},
                                                  make_shape(BlkDt{}, BlkK{})));
  using SmemLayoutWnTma1 = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<TmaElement>{},
                                                  make_shape(BlkN{}, BlkK{})));
  static constexpr int kWStageElems = kNW * kBK;
  // TF32 remainders of one ring stage (only with k3x).
  static constexpr int kSmallPipe = 1;
  using SmemLayoutXs = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                              make_shape(BlkT{}, BlkK{}, Int<kSmallPipe>{})));
  using SmemLayoutWs = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                              make_shape(BlkNW{}, BlkK{}, Int<kSmallPipe>{})));
  // x tile for the scan: (tokens, channels) row-major, no swizzle (rows read across channels).
  using SmemLayoutXt = Layout<Shape<BlkT, BlkDt, Int<kXStages>>, Stride<BlkDt, _1, Int<kT * kDt>>>;

  // One tensor-core product per K step: (kT x kBK) . (kNW x kBK)^T -> acc (kT x kNW) =
  // [delta pre-activation | B | C].
  using Mma = decltype(make_tiled_mma(GMMA::ss_op_selector<Element, Element, float, Shape<BlkT, BlkNW, BlkK>,
                                                           GMMA::Major::K, GMMA::Major::K>()));

  static constexpr uint32_t kRingBytes = uint32_t((kT + kDt + 2 * kN) * kBK * sizeof(Element));
  static constexpr uint32_t kXtBytes = uint32_t(kT * kDt * sizeof(Element));
  using Ring = cutlass::PipelineTmaAsync<kStages>;   // operand tiles: producer -> MMA warpgroup
  using XPipe = cutlass::PipelineTmaAsync<kXStages>; // x tiles: producer -> scan warpgroups
};

template <class Cfg>
struct SharedStorage {
  using E = typename Cfg::Element;
  alignas(1024) cute::ArrayEngine<E, cosize_v<typename Cfg::SmemLayoutX>> x;
  alignas(1024) cute::ArrayEngine<E, cosize_v<typename Cfg::SmemLayoutW>> w;
  alignas(1024) cute::ArrayEngine<E, (Cfg::k3x ? cosize_v<typename Cfg::SmemLayoutXs> : 1)> xs;
  alignas(1024) cute::ArrayEngine<E, (Cfg::k3x ? cosize_v<typename Cfg::SmemLayoutWs> : 1)> ws;
  alignas(128) cute::ArrayEngine<E, cosize_v<typename Cfg::SmemLayoutXt>> xt;
  alignas(16) float dt[Cfg::kPStages][Cfg::kT][Cfg::kLdDt];   // softplus(acc + bias); 0 past L
  alignas(16) float B[Cfg::kPStages][Cfg::kT][Cfg::kLdN];
  alignas(16) float C[Cfg::kPStages][Cfg::kT][Cfg::kLdN];
  alignas(16) typename Cfg::Ring::SharedStorage ring;
  alignas(16) typename Cfg::XPipe::SharedStorage xpipe;
};

}  // namespace fused
}  // namespace selscan
