// Parameters of the block's decode step kernels (csrc/decode/decode_kernel.cuh): the middle of one
// token's step, from in_proj's output to the gated y (the conv update, x_proj, dt_proj, the state
// update, D and the gate). Torch-free; every offset is 64-bit; counts are in elements.
#pragma once
#include <cstdint>

#include "../common/dtype.h"

namespace selscan {

struct DecodeParams {
  // Sizes.
  int64_t batch = 0;    // sequences, one token each
  int64_t d_inner = 0;  // channels
  int dstate = 0;       // N: 1 .. kDecodeMaxState
  int dt_rank = 0;      // R: 1 .. kDecodeMaxRank
  int width = 0;        // d_conv: 2 .. 4
  DType dtype = DType::kBFloat16;  // xz, conv_state, the two weights, y

  // Inputs.
  const void* xz = nullptr;          // (batch, 2 d_inner): [xi | z], row stride xz_stride, channel stride 1
  int64_t xz_stride = 0;
  const void* x_proj_weight = nullptr;   // (R + 2N, d_inner), contiguous, dtype
  const void* dt_proj_weight = nullptr;  // (d_inner, R), contiguous, dtype
  // The small parameters, contiguous, all float32 (small_fp32) or all in dtype (a model cast as a whole):
  // read as they are, so that a step needs no cast of them.
  bool small_fp32 = true;
  const void* conv_weight = nullptr;  // (d_inner, width)
  const void* conv_bias = nullptr;    // (d_inner,) or null
  const void* dt_bias = nullptr;      // (d_inner,)
  const void* A_log = nullptr;        // (d_inner, N)
  const void* D = nullptr;            // (d_inner,)

  // States, read and written in place.
  void* conv_state = nullptr;        // (batch, d_inner, width - 1), contiguous, dtype; oldest input first
  float* ssm_state = nullptr;        // (batch, d_inner, N), contiguous

  // Workspace (decode_workspace_floats) and output.
  float* workspace = nullptr;
  void* y = nullptr;                 // (batch, d_inner), contiguous, dtype

  // 1: both phases in one cooperative launch (decode_step_kernel); 2: the two kernels. The results are
  // bitwise the same; 1 falls back to 2 where the device cannot take the cooperative launch.
  int launches = 1;

  // The launch's shape, set by decode_mid_launch (callers leave them): x_proj's rows per CTA of the first
  // phase (a multiple of 4), the lanes per channel (a power of two, 4 states a lane) and the channel
  // passes per item of the second. The results do not depend on them (bitwise).
  int xproj_rows = 0;
  int state_lanes = 0;
  int scan_passes = 0;
};

constexpr int kDecodeMaxState = 64;
constexpr int kDecodeMaxRank = 256;
constexpr int kDecodeMaxWidth = 4;
// Channels of one x_proj partial sum (the first kernel's channel tile): the second kernel adds
// d_inner / kDecodeXTile partial sums per output (8 at d_inner 4096), in tile order.
constexpr int kDecodeXTile = 512;

// constexpr: the kernels call it too (--expt-relaxed-constexpr).
constexpr int64_t decode_xproj_tiles(int64_t d_inner) { return (d_inner + kDecodeXTile - 1) / kDecodeXTile; }

// Floats of workspace: x_proj's partial sums (batch, x tiles, R + 2N).
inline int64_t decode_workspace_floats(int64_t batch, int64_t d_inner, int dstate, int dt_rank) {
  return batch * decode_xproj_tiles(d_inner) * (int64_t(dt_rank) + 2 * dstate);
}

}  // namespace selscan
