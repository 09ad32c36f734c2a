// Parameters of the depthwise causal conv1d (with optional fused SiLU) of the Mamba-1 block
// (csrc/conv/conv_kernel.cuh), forward and backward. Torch-free; csrc/conv/conv_ops.cpp fills them.
//
//   pre[b,t,c] = bias[c] + sum_{k<W} weight[c,k] * xx[b, t-W+1+k, c]
//   xx[b,s,c]  = x[b,s,c] for s >= 0, initial_state[b,c,W-1+s] for s < 0 (zeros without one)
//   out        = silu(pre) or pre;  final_state[b,c,j] = xx[b, L-(W-1)+j, c], j < W-1
//
// Every offset is computed in 64 bits; counts and strides are in elements.
#pragma once
#include <cstdint>

#include "../common/dtype.h"

namespace selscan {

// Widths (d_conv) the kernels are compiled for.
inline bool conv_supports_width(int64_t w) { return w >= 2 && w <= 4; }

// How a launch cuts the work; written by conv_fwd_plan / conv_bwd_plan (conv_api.h), read by the
// launchers. CTA = block_c x block_t threads: thread (i, j) owns `vec` consecutive channels of channel
// tile blockIdx.y and the run of tokens_per_thread tokens number blockIdx.x % token_tiles * block_t + j
// of sequence blockIdx.x / token_tiles.
struct ConvLaunchShape {
  int vec = 1;                    // channels per thread (vector loads of vec elements), 1 when unaligned
  int block_c = 32;               // threads along channels per CTA (blockDim.x)
  int block_t = 4;                // threads along tokens per CTA (blockDim.y); block_c * block_t = 128
  int64_t tokens_per_thread = 0;  // tokens of one thread's run
  int64_t token_tiles = 0;        // CTAs along the tokens of one sequence: ceil(L / (block_t * tokens_per_thread))
  int64_t channel_tiles = 0;      // CTAs along the channels (gridDim.y): ceil(dim / (vec * block_c))
};

struct ConvParams {
  // Sizes.
  int64_t batch = 0;   // sequences
  int64_t seqlen = 0;  // L, tokens per sequence
  int64_t dim = 0;     // C, channels
  int width = 4;       // W (d_conv), 2..4
  DType dtype = DType::kFloat32;  // element type of x, out and final_state
  bool silu = true;    // apply SiLU to pre

  // Inputs.
  const void* __restrict__ x = nullptr;  // (batch, seqlen, dim), dtype, channel stride 1
  int64_t x_batch_stride = 0;            // elements between sequences of x
  int64_t x_token_stride = 0;            // elements between tokens of x (>= dim; in_proj's output: 2 * dim)
  const float* __restrict__ weight = nullptr;         // (dim, width) contiguous
  const float* __restrict__ bias = nullptr;           // (dim,), or null for none
  const float* __restrict__ initial_state = nullptr;  // (batch, dim, width-1) contiguous, or null for zeros

  // Outputs.
  void* __restrict__ out = nullptr;          // (batch, seqlen, dim) contiguous, dtype
  void* __restrict__ final_state = nullptr;  // (batch, dim, width-1) contiguous, dtype, or null when not asked

  // Packed sequences (common/seq_map.h): with cu_seqlens, batch is 1 and x / out one row of seqlen
  // tokens holding num_seqs sequences, rows [cu_seqlens[s], cu_seqlens[s + 1]); the window restarts at
  // every start from initial_state[s] (or zeros), final_state[s] is sequence s's (initial_state and
  // final_state are (num_seqs, dim, width-1)). A run never crosses a sequence start: run slot j of
  // packed_slots(seqlen, num_seqs, tokens_per_thread) belongs to the sequence seq_of_slot gives, so that
  // every token's result is bitwise the one of its sequence alone. An empty sequence has no run: the
  // caller fills its final state (its initial state) before the launch.
  const int32_t* __restrict__ cu_seqlens = nullptr;
  int64_t num_seqs = 0;

  ConvLaunchShape shape;  // from conv_fwd_plan
};

// The backward: recomputes pre from x, dpre = dout * silu'(pre) (dout without SiLU), then
//   dx[t] = sum_k weight[c,k] * dpre[t+W-1-k]  (terms with t+W-1-k < L)  + dfinal_state's part,
//   dinitial_state likewise for the positions s < 0, dweight[c,k] = sum_{b,t} dpre[t] * xx[t-W+1+k],
//   dbias[c] = sum_{b,t} dpre[t].
// dweight and dbias leave the kernel as one partial sum per CTA row (no atomics), summed by the caller
// over the rows in a fixed order.
struct ConvBwdParams {
  // Sizes (as ConvParams).
  int64_t batch = 0;
  int64_t seqlen = 0;
  int64_t dim = 0;
  int width = 4;
  DType dtype = DType::kFloat32;  // element type of x, dout and dx
  bool silu = true;

  // Inputs.
  const void* __restrict__ x = nullptr;  // (batch, seqlen, dim), dtype, channel stride 1
  int64_t x_batch_stride = 0;
  int64_t x_token_stride = 0;
  const float* __restrict__ weight = nullptr;         // (dim, width) contiguous
  const float* __restrict__ bias = nullptr;           // (dim,), or null
  const float* __restrict__ initial_state = nullptr;  // (batch, dim, width-1) contiguous, or null for zeros
  const void* __restrict__ dout = nullptr;             // (batch, seqlen, dim), dtype, channel stride 1
  int64_t dout_batch_stride = 0;
  int64_t dout_token_stride = 0;
  const float* __restrict__ dfinal_state = nullptr;   // (batch, dim, width-1) contiguous, or null for zeros

  // Outputs.
  void* __restrict__ dx = nullptr;                // (batch, seqlen, dim) contiguous, dtype
  float* __restrict__ dinitial_state = nullptr;  // (batch, dim, width-1) contiguous, or null when not asked
  // (batch * shape.token_tiles, width + 1, dim): row r = blockIdx.x holds its CTA's sums of
  // dpre * xx[t-W+1+k] (k < width) and of dpre (k = width) over the CTA's tokens. Every element is
  // written by exactly one CTA (no initialisation needed).
  float* __restrict__ partial = nullptr;

  // Packed sequences: as ConvParams (dinitial_state and dfinal_state per sequence; the caller fills an
  // empty sequence's dinitial_state, its dfinal_state, before the launch).
  const int32_t* __restrict__ cu_seqlens = nullptr;
  int64_t num_seqs = 0;

  ConvLaunchShape shape;  // from conv_bwd_plan
};

}  // namespace selscan
