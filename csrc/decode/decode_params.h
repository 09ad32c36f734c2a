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
};

constexpr int kDecodeChannels = 256;  // channels per CTA, one thread each
constexpr int kDecodeMaxState = 64;
constexpr int kDecodeMaxRank = 256;

inline int64_t decode_channel_tiles(int64_t d_inner) { return (d_inner + kDecodeChannels - 1) / kDecodeChannels; }

// Floats of workspace: u (batch, d_inner) and the x_proj partial sums (batch, tiles, R + 2N).
inline int64_t decode_workspace_floats(int64_t batch, int64_t d_inner, int dstate, int dt_rank) {
  return batch * d_inner + batch * decode_channel_tiles(d_inner) * (int64_t(dt_rank) + 2 * dstate);
}

}  // namespace selscan
