// Parameters of the standalone scan kernel of the unfused path (csrc/scan/scan_kernel.cuh).
//
// The layer's unfused path computes proj = x . [W_delta; W_B; W_C]^T with one library matrix product, so
// that each token's row of `proj` holds [delta_pre (dim) | B (dstate) | C (dstate)]; the Mamba-1 block's
// has delta_pre from dt_proj's product and [B | C] inside x_proj's output [dt_low | B | C]. The scan
// kernel reads delta_pre and [B | C] through their own pointers and row strides, x and the per-channel
// parameters, and writes y (the block's: gated by silu(z)) and (optionally) the final state.
// Every offset is computed in 64 bits; counts are in elements.
#pragma once
#include <cstdint>
#include "../common/dtype.h"
#include "../common/l_split.h"
#include "../common/checkpoints.h"

namespace selscan {

struct ScanParams {
  // Sizes.
  int64_t batch = 0;    // number of sequences
  int64_t seqlen = 0;   // L, tokens per sequence
  int64_t dim = 0;      // D, channels (d_model)
  int64_t dstate = 0;   // N, states per channel
  DType dtype = DType::kFloat32;  // element type of proj, x and y

  // Inputs. Token r = b * seqlen + t is row r of proj, x and y.
  const void* __restrict__ delta = nullptr;  // (batch*seqlen, delta_stride): delta_pre in columns [0, dim), dtype
  int64_t delta_stride = 0;                  // elements between consecutive rows of delta (>= dim)
  const void* __restrict__ bc = nullptr;     // (batch*seqlen, bc_stride): [B | C] in columns [0, 2N), dtype
  int64_t bc_stride = 0;                     // elements between consecutive rows of bc (>= 2N)
  // delta, bc, their strides (and z's) are 16-byte aligned (the loads are 16-byte cp.async).
  const void* __restrict__ x = nullptr;     // (batch*seqlen, dim), rows contiguous, dtype
  const float* __restrict__ A_log = nullptr;    // (dim, dstate); A = -exp(A_log)
  const float* __restrict__ b_delta = nullptr;  // (dim,), added to delta_pre before softplus
  const float* __restrict__ D = nullptr;        // (dim,), skip connection
  const float* __restrict__ h0 = nullptr;       // (batch, dim, dstate) initial state, or null for zeros

  // The output policy. Null: y = scan + D * x (the layer). Given: y = (scan + D * x) * silu(z) (the
  // block's gate; a compile-time choice of the kernel, Traits::kGate), z read at z[row * z_stride + d]
  // (16-byte aligned pointer and row stride, as delta's).
  const void* __restrict__ z = nullptr;         // (batch*seqlen, z_stride), dtype, or null
  int64_t z_stride = 0;

  // Outputs.
  void* __restrict__ y = nullptr;               // (batch*seqlen, dim), dtype
  float* __restrict__ final_state = nullptr;    // (batch, dim, dstate), or null when not asked for
  // For the backward (common/checkpoints.h): the state entering every kCkptEvery-th token,
  // (batch, ckpt_count(seqlen), dim, dstate), or null when no backward will follow.
  float* __restrict__ ckpt = nullptr;

  // Splitting L. The tokens of a sequence are cut into n_segments segments of seg_len tokens (the last
  // may be shorter). With more than one segment the kernel runs as a cooperative launch: a first phase
  // scans every segment but the last from a zero state and stores its end state and sum of delta in the
  // workspace, a grid-wide barrier, then each segment combines its predecessors into its true start
  // state and scans again writing y. Deterministic: fixed combine order, no atomics.
  int64_t n_segments = 1;
  int64_t seg_len = 0;
  float* __restrict__ workspace = nullptr;  // split_workspace_floats(...) floats (common/l_split.h)

  // Packed sequences (common/seq_map.h): with cu_seqlens, batch is the number of sequences and seqlen
  // the packed length (every tensor above has one row of seqlen tokens); sequence b is the rows
  // [cu_seqlens[b], cu_seqlens[b + 1]), scanned from h0[b] into final_state[b]; its checkpoints are the
  // slots from seq_first_slot(start, b, kCkptEvery) of a (packed_slots(seqlen, batch, kCkptEvery), dim,
  // dstate) tensor. Never split along L (n_segments == 1).
  const int32_t* __restrict__ cu_seqlens = nullptr;
};

}  // namespace selscan
