// Host entry points of the fused kernel (no torch headers; csrc/torch_ops.cpp is the binding).
#pragma once
#include <cuda_runtime.h>

#include "fused_params.h"
#include "../scan/scan_bwd_params.h"

namespace selscan {

constexpr int64_t kFusedTokenTile = 128;   // L segments are whole multiples of the largest token tile
constexpr int64_t kFusedChannelTile = 64;  // channels per CTA (16 in the narrow layout); D must be a multiple
constexpr int64_t kFusedMaxDim = 8192;
// bf16/fp16 and float32 "high" with N = 16: streams (L segments) of at most this many tokens take
// the kernel with two scan warpgroups (one channel per scan thread): bf16 9-13% faster on S1 and S5,
// 3% slower on S2/S3 (docs/perf/layer-forward.md, v3.2); float32 "high" S1 1.5% faster (v3.3).
constexpr int64_t kFusedShortStream = 1024;
// float32 under "high"/"medium": calls with at most this many outputs (batch x L x D) use 3xTF32.
constexpr int64_t kFusedTf32MinOutputs = 65536;

inline bool fused_supports_dstate(int64_t n) { return n == 8 || n == 16 || n == 32 || n == 64; }

// Whether this build has the fused kernel and the current device can run it (sm_90: H100/H200).
bool fused_available(int device);

// The narrow layout (16 channels per CTA): its cost per exponential relative to the 64-channel layout's
// on long streams, as fused_plan weighs it. Measured on the H200 (bf16, docs/perf/layer-forward.md v3.7): 2.0
// at S1 (0.063 ms narrow against 0.070 with 64 channels and L split in 4), 1.8 at S4, 2.1 at S2.
constexpr double kFusedNarrowCost = 2.0;
// ... and the operand bytes (x rows and weight rows, L2 -> shared memory) that cost one such unit per
// CTA: a CTA streams every x row of its tokens once per channel tile, so at large D the narrow layout
// is bound by L2 bandwidth (bf16: 1 x 4097 x 2048 0.274 ms narrow against 0.240 with 64 channels,
// 2 x 4096 x 1024 0.170 against 0.164; the value puts both on the 64-channel side and keeps the
// other shapes of docs/perf/layer-forward.md v3.7's table on the side that measured faster).
constexpr double kFusedLoadBytesPerUnit = 75.0;

// The plan's segment floor, its fixed cost per grid phase (in the units above) and its tie band:
// fitted on the sweep of every L split (docs/fwd_split_sweep.csv, docs/perf/batch1.md "The batch-1
// regime"): at shape P a unit is ~1.02 ns, so a phase costs ~7.7 us; without it the model splits
// 256-512 tokens that run faster in one segment, and the 512-token floor before it left P at 1K and
// 2K 1.45x / 1.63x slower than 8 segments.
constexpr int64_t kFusedMinSegment = 128;
constexpr double kFusedPhaseCost = 7500.0;
constexpr double kFusedPlanTie = 0.03;

// Whether the narrow layout exists for this dtype / N (bf16/fp16 with N = 16).
bool fused_has_narrow_layout(DType dtype, int64_t dstate);

struct FusedLaunchInfo {
  int64_t n_segments = 1;
  int64_t seg_len = 0;
  int64_t channel_tile = 64;
};

// L split and channel tile for a problem (requested_segments <= 0, requested_channel_tile == 0:
// automatic; a channel tile of 16 needs fused_has_narrow_layout, else cudaErrorInvalidValue).
cudaError_t fused_plan(const FusedParams& p, int64_t requested_segments, int64_t requested_channel_tile, int device,
                       FusedLaunchInfo* out);

// The deepest operand ring that fits in shared memory for this dtype / N / float32 mode (the upper
// bound of FusedParams::ring_stages); 0 if the combination has no kernel.
int fused_max_ring_stages(DType dtype, int64_t dstate, bool fp32_3xtf32);

// Whether the launchers reuse the TMA descriptors of the previous call on the thread for the same
// tensors (default true; fused_set_descriptor_cache(false) encodes every descriptor in every call).
bool fused_descriptor_cache_enabled();
void fused_set_descriptor_cache(bool enable);

// Launches on `stream` (p.n_segments/seg_len from fused_plan, p.workspace sized by
// split_workspace_floats). Returns the first CUDA error met.
cudaError_t fused_launch(const FusedParams& p, cudaStream_t stream);

// Whether this build's kernel takes packed sequences (FusedParams::cu_seqlens): true unless built with
// -DSELSCAN_FUSED_NO_PACKED (SELSCAN_FUSED_NVCC_FLAGS), the switch that leaves the batch layout alone.
// fused_launch refuses cu_seqlens where it is false.
bool fused_packed_built();

// ---- The fused backward (csrc/fused/fused_bwd_kernel.cuh).

// Whether the fused backward kernel exists for this dtype / N (bf16/fp16 with N = 16); elsewhere the
// fused path's backward recomputes the projections with one library product and runs the standalone
// backward scan kernel.
bool fused_bwd_supported(DType dtype, int64_t dstate);

// Scan threads per channel of the fused backward: 4 (N/4 states each, two scan warpgroups) or 8 (N/8
// states each, four scan warpgroups); the default, chosen by measurement (docs/perf/training.md, "Fused
// backward v1"). The dD / db_delta partials have threads_per_channel / 2 rows per (segment, sequence).
constexpr int kFusedBwdThreadsPerChannel = 4;
inline bool fused_bwd_layout_ok(int64_t threads_per_channel) {
  return threads_per_channel == 4 || threads_per_channel == 8;
}

// L split of the fused backward (requested_segments <= 0: automatic): streams of 64 channels; where
// they are fewer than the SMs, L is cut so that they come close to one per SM, segments of at least
// kFusedBwdMinSegment tokens (one checkpoint interval: the sweep of 2026-12-03, docs/perf/batch1.md
// "The batch-1 regime: the plans' L splits measured": at L = 512 the plans of 64- or 128-token segments took
// 1.4-2.0x less time than those of the 256-token floor before it; no measured plan was slower).
constexpr int64_t kFusedBwdMinSegment = 64;
// fused_bwd's automatic mode takes the kernel for a plan of n_segments x seg_len tokens where the
// sweeps of 2026-12-03 (docs/fused_bwd_sweep.csv) measured it faster than the recomputation, within 3%
// on every shape: segments of at most 128 tokens for D <= 1024 (the recomputation's fixed cost of
// launches dominates there); otherwise 2 .. kFusedBwdAutoMaxSegments segments (32 of 256-2048 tokens
// lose: S4), and then for D <= 1024 segments of at least 1024 tokens (the kernel's scan, one CTA per
// SM, beats the standalone kernel's) or of 512 in at most 4 segments; for D > 1024 (every 64-channel
// CTA recomputes B and C over K = D) only 4 or more segments of at least 2048 tokens.
constexpr int64_t kFusedBwdAutoMaxSegments = 16;
inline bool fused_bwd_auto_takes_kernel(int64_t dim, int64_t n_segments, int64_t seg_len) {
  if (n_segments < 2) return false;
  if (seg_len <= 128) return dim <= 1024;
  if (n_segments > kFusedBwdAutoMaxSegments) return false;
  if (dim > 1024) return n_segments >= 4 && seg_len >= 2048;
  return seg_len >= 1024 || (seg_len >= 512 && n_segments <= 4);
}
cudaError_t fused_bwd_plan(const FusedParams& p, int64_t requested_segments, int device, FusedLaunchInfo* out);

// Launches the fused backward on `stream`: p as for the forward (sizes, x, weights, per-channel
// parameters, n_segments / seg_len from fused_bwd_plan), q its dy, dhT, checkpoints, outputs and
// workspace (split_workspace_floats). Returns the first CUDA error met.
cudaError_t fused_bwd_launch(const FusedParams& p, const ScanBwdParams& q, int threads_per_channel,
                             cudaStream_t stream);

// ---- The fused block's first kernel (block_xproj.cu): x_proj's product [dt_low | B | C] = u W_x^T for
// every token, with u = silu(conv(xi)) made per (64-token, 64-channel) tile in shared memory, so that
// u never reaches device memory; the fused kernel then recomputes u for its own channels
// (FusedParams::conv_weight). 16-bit: tensor cores (mma.sync through WMMA), float32 accumulation, the
// output rounded once; float32: float32 FMA (exact products, as cuBLAS under "highest").
struct BlockXprojParams {
  int64_t batch = 0, seqlen = 0;
  int64_t dim = 0;                       // d_inner: a multiple of 64
  int64_t out_dim = 0;                   // R + 2N, at most kBlockXprojMaxOut
  int width = 4;                         // d_conv, 2 .. 4
  DType dtype = DType::kBFloat16;
  const void* x = nullptr;               // xi: (batch, L, dim), channel stride 1, dtype, sequences L rows apart
  int64_t x_token_stride = 0;            // elements between tokens of x
  const float* conv_weight = nullptr;    // (dim, width)
  const float* conv_bias = nullptr;      // (dim,) or null
  const float* conv_state = nullptr;     // (batch, dim, width - 1) or null (zeros)
  const void* weight = nullptr;          // x_proj's weight (out_dim, dim), contiguous, 16-byte aligned, dtype
  void* out = nullptr;                   // (batch, L, out_dim), contiguous, dtype
};
constexpr int64_t kBlockXprojMaxOut = 384;
cudaError_t block_xproj_launch(const BlockXprojParams& p, cudaStream_t stream);

}  // namespace selscan
