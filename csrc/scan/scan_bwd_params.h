// Parameters of the backward scan kernel (csrc/scan/scan_bwd_kernel.cuh), shared by both paths'
// backward: the unfused forward keeps proj = [delta_pre | B | C]; the fused path's backward
// recomputes it with one library product before the launch.
//
// The forward's checkpoints (common/checkpoints.h) give the state at the start of every chunk of
// kCkptEvery tokens. Torch-free; every offset is 64-bit; counts are in elements.
#pragma once
#include <cstdint>

#include "../common/checkpoints.h"
#include "../common/dtype.h"

namespace selscan {

struct ScanBwdParams {
  // Sizes.
  int64_t batch = 0, seqlen = 0, dim = 0, dstate = 0;
  DType dtype = DType::kFloat32;  // element type of proj, x, dy, dP and dx

  // Inputs. Token r = b * seqlen + t is row r of proj, x, dy, dP and dx.
  const void* __restrict__ delta = nullptr;  // (batch*seqlen, delta_stride): delta_pre in columns [0, dim)
  int64_t delta_stride = 0;
  const void* __restrict__ bc = nullptr;     // (batch*seqlen, bc_stride): [B | C] in columns [0, 2N)
  int64_t bc_stride = 0;                     // (16-byte aligned pointers and strides, as in ScanParams)
  const void* __restrict__ x = nullptr;     // (batch*seqlen, dim)
  const void* __restrict__ dy = nullptr;    // (batch*seqlen, dim): the gradient of y
  const float* __restrict__ A_log = nullptr;    // (dim, N)
  const float* __restrict__ b_delta = nullptr;  // (dim,)
  const float* __restrict__ D = nullptr;        // (dim,)
  const float* __restrict__ dhT = nullptr;      // (batch, dim, N): gradient of the final state, or null
  const float* __restrict__ ckpt = nullptr;     // (batch, ckpt_count(seqlen), dim, N): the forward's states
  // The block's gate (both or neither): dy is then the gradient of y * silu(z), and the kernel writes
  // the gate's gradient dy * y * silu'(z) to dgate_z (y recomputed from the states; the forward keeps no
  // y before the gate).
  const void* __restrict__ gate_z = nullptr;  // (batch*seqlen, gate_z_stride): z in columns [0, dim)
  int64_t gate_z_stride = 0;                  // (16-byte aligned pointer and stride)

  // Outputs (every element written).
  void* __restrict__ dP = nullptr;       // (batch*seqlen, dim + 2N): columns [0, dim) = dz, the gradient
                                         // of delta_pre (columns dim.. are filled from bc_partial)
  void* __restrict__ dx = nullptr;       // (batch*seqlen, dim): the scan's own part of dx,
                                         // dt * sum_n g * B + D * dy (the products add dP . W)
  void* __restrict__ dgate_z = nullptr;  // (batch*seqlen, dim): the gate's gradient, with gate_z
  float* __restrict__ bc_partial = nullptr;  // (batch*seqlen, n_tiles, 2N): [dB | dC] per channel tile
  float* __restrict__ dA_partial = nullptr;  // (n_segments * batch, dim, N): sum of g * dt * a * h_prev
  float* __restrict__ dD_partial = nullptr;  // (n_segments * batch * kRowsPerCol, dim): sum of dy * x
  float* __restrict__ db_partial = nullptr;  // (n_segments * batch * kRowsPerCol, dim): sum of dz
  float* __restrict__ dh0 = nullptr;         // (batch, dim, N): the gradient of the initial state

  // Splitting L (as the forward, mirrored): with n_segments > 1 the launch is cooperative; phase 1
  // runs the adjoint alone over every segment but the first, from a zero adjoint at its end, and
  // publishes a[t0] * g[t0] and the segment's sum of dt; after a grid-wide barrier every segment folds
  // its successors, last first, into the adjoint entering its end and runs the full backward.
  int64_t n_segments = 1;
  int64_t seg_len = 0;                   // a multiple of kCkptEvery
  float* __restrict__ workspace = nullptr;  // split_workspace_floats(batch, dim, N, n_segments) floats

  // Packed sequences: as ScanParams::cu_seqlens (batch sequences in one row of seqlen tokens; dhT, dh0
  // per sequence; the checkpoints in the forward's slots); n_segments == 1.
  const int32_t* __restrict__ cu_seqlens = nullptr;
};

}  // namespace selscan
