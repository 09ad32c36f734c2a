// Parameters of the fused kernel (csrc/fused/fused_kernel.cuh): one launch from x to y.
// Torch-free; every offset is 64-bit; counts are in elements.
#pragma once
#include <cstdint>

#include "../common/checkpoints.h"
#include "../common/dtype.h"
#include "../common/l_split.h"

namespace selscan {

struct FusedParams {
  // Sizes.
  int64_t batch = 0;    // number of sequences
  int64_t seqlen = 0;   // L
  int64_t dim = 0;      // D (d_model): a multiple of 64
  int64_t dstate = 0;   // N: 8, 16, 32 or 64
  DType dtype = DType::kBFloat16;  // x, the projection weights and y
  // float32 only: three TF32 products per product (big*big + big*small + small*big), accurate to
  // float32 ("highest"); false: one TF32 product ("high"/"medium").
  bool fp32_3xtf32 = true;
  // Ablation switch: one exponential in four on the FMA pipe (a polynomial exp2) instead of MUFU.
  bool exp_poly = false;
  // Ablation switch: operand-ring stages in use, 2 .. fused_max_ring_stages(); 0 = all that fit.
  int ring_stages = 0;
  // Channels per CTA (stream), set by fused_plan: 64, or 16 (bf16/fp16 with N = 16 only: the narrow
  // layout, chosen where it avoids an L split or most of its recomputation).
  int channel_tile = 64;

  // Inputs, all contiguous.
  const void* x = nullptr;          // (batch, L, D), dtype
  const void* W_delta = nullptr;    // (D, K), dtype; K = kdim() (D for the layer)
  const void* W_B = nullptr;        // (N, K), dtype
  const void* W_C = nullptr;        // (N, K), dtype
  const float* A_log = nullptr;     // (D, N)
  const float* b_delta = nullptr;   // (D,)
  const float* D = nullptr;         // (D,)
  const float* h0 = nullptr;        // (batch, D, N) or null

  // The Mamba block (selscan_fused.mamba_block, impl='fused'): the same kernel with the product's
  // operand and the output's gate given separately (all null / 0 for the layer).
  //  - delta from the low rank: the tensor cores read xk = [dt_low | B | C] (x_proj's output, (batch, L,
  //    k_dim), k_dim = R + 2N) against W_delta = [dt_proj's weight | 0] (D, k_dim), W_B = [0 | I | 0] and
  //    W_C = [0 | 0 | I] (N, k_dim): dt_proj runs on the tensor cores inside the scan's launch and B, C
  //    pass through as products by 1 and 0 (exact for bf16/fp16; float32 takes 3xTF32, within 2^-21);
  //    x (the scan's input and D's) is the conv's output u.
  //  - the gated output: y = (C h + D u) * silu(z), z (batch, L, D) with token stride z_stride (the right
  //    half of in_proj's output). The backward recomputes C h + D u (the backward scan's gate policy).
  //  - the conv inside the kernel (conv_weight set): x is then the conv's input xi (the left half of
  //    in_proj's output, tokens x_token_stride apart, sequences L x_token_stride apart), and the scan
  //    threads turn each x tile into u = silu(conv(xi)) in shared memory before its scan (the W - 1
  //    inputs before a tile: the previous tile's, conv_state's, or zeros), so that u never reaches
  //    device memory; the channel tile must be 64 (the narrow layout's epilogue reads the x tile).
  const void* xk = nullptr;         // (batch, L, k_dim), dtype, contiguous; null: x (the layer)
  int64_t k_dim = 0;                // the product's reduction length; 0: D (the layer)
  const void* z = nullptr;          // (batch, L, D) rows of z_stride elements, dtype; null: no gate
  int64_t z_stride = 0;
  int64_t x_token_stride = 0;       // elements between tokens of x; 0: D (contiguous)
  const float* conv_weight = nullptr;  // (D, conv_width), or null: x is the scan's input (no conv)
  const float* conv_bias = nullptr;    // (D,) or null
  const float* conv_state = nullptr;   // (batch, D, conv_width - 1): the inputs before token 0, or null (zeros)
  int conv_width = 0;                  // W (d_conv), 2 .. 4

  // Outputs.
  void* y = nullptr;                // (batch, L, D), dtype
  float* final_state = nullptr;     // (batch, D, N) or null
  // For the backward (common/checkpoints.h): the state entering every kCkptEvery-th token,
  // (batch, ckpt_count(L), D, N), or null when no backward will follow.
  float* ckpt = nullptr;

  // Packed sequences (fused_fwd_packed; compiled into the kernel unless built with
  // -DSELSCAN_FUSED_NO_PACKED: docs/design.md, "Packed sequences"): x is
  // one row of seqlen = the total tokens (batch 1, n_segments 1), and a stream is (sequence, channel
  // tile): sequence s is tokens cu_seqlens[s] .. cu_seqlens[s+1] - 1 (read on the device, clamped to
  // [0, seqlen]), h0 and final_state are (num_seqs, D, N), and its checkpoints start at slot
  // cu_seqlens[s] / kCkptEvery + s (common/checkpoints.h's packed layout). Null: the batch layout.
  const int32_t* cu_seqlens = nullptr;
  int64_t num_seqs = 0;

  // L split (see scan_params.h: same two-phase scheme, with the projections recomputed in phase 2).
  int64_t n_segments = 1;
  int64_t seg_len = 0;              // a multiple of the token tile (64)
  float* workspace = nullptr;       // split_workspace_floats(...) floats (common/l_split.h)

  // The product's operand and reduction length (the layer: x and D).
  __host__ __device__ const void* operand() const { return xk != nullptr ? xk : x; }
  __host__ __device__ int64_t kdim() const { return k_dim > 0 ? k_dim : dim; }
  __host__ __device__ int64_t xt_stride() const { return x_token_stride > 0 ? x_token_stride : dim; }
  __host__ __device__ int64_t xb_stride() const { return seqlen * xt_stride(); }  // sequences: L rows apart
};

}  // namespace selscan
