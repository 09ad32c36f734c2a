// Host entry points of the depthwise causal conv1d: the launch plans and the dtype dispatch. The
// kernels are instantiated in conv_<dtype>.cu (in parallel), not here.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>
#include <cstdint>

#include "../common/seq_map.h"
#include "conv_api.h"
#include "conv_kernel.cuh"

namespace selscan {

extern template struct conv::Dispatch<float>;
extern template struct conv::Dispatch<__nv_bfloat16>;
extern template struct conv::Dispatch<__half>;

namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

int elem_bytes(DType t) { return t == DType::kFloat32 ? 4 : 2; }

bool aligned(const void* ptr, int64_t bytes) { return reinterpret_cast<uintptr_t>(ptr) % uint64_t(bytes) == 0; }

// A (batch, seqlen, dim) operand with channel stride 1 can be read `vec` channels at a time: its
// address and every row start (strides of the dimensions longer than 1) are vec-element aligned.
bool rows_aligned(const void* ptr, int64_t batch_stride, int64_t token_stride, int64_t batch, int64_t seqlen,
                  int vec, int bytes) {
  return aligned(ptr, int64_t(vec) * bytes) && (batch <= 1 || batch_stride % vec == 0) &&
         (seqlen <= 1 || token_stride % vec == 0);
}

bool sizes_ok(int64_t batch, int64_t seqlen, int64_t dim, int width) {
  return batch > 0 && seqlen > 0 && dim > 0 && conv_supports_width(width);
}

// The grid of a plan: blockIdx.x = (sequence, token tile) up to 2^31 - 1, blockIdx.y = channel tile.
bool grid_ok(int64_t batch, const ConvLaunchShape& s) {
  return s.token_tiles >= 1 && s.channel_tiles >= 1 && batch <= int64_t(INT_MAX) / s.token_tiles &&
         s.channel_tiles <= 65535;
}

// CTAs along the tokens: of one sequence of seqlen tokens, or (packed, num_seqs > 0) of the run slots of
// num_seqs sequences in one row (common/seq_map.h).
int64_t token_tiles(int64_t seqlen, int64_t num_seqs, int block_t, int64_t tok) {
  const int64_t runs = num_seqs > 0 ? packed_slots(seqlen, num_seqs, tok) : ceil_div(seqlen, tok);
  return ceil_div(runs, block_t);
}

}  // namespace

cudaError_t conv_fwd_plan(ConvParams* p) {
  if (!sizes_ok(p->batch, p->seqlen, p->dim, p->width) || p->x == nullptr || p->out == nullptr ||
      p->weight == nullptr)
    return cudaErrorInvalidValue;
  ConvLaunchShape s;
  const int bytes = elem_bytes(p->dtype), vmax = 16 / bytes;
  const bool vec_ok = p->dim % vmax == 0 && aligned(p->out, 16) &&
                      rows_aligned(p->x, p->x_batch_stride, p->x_token_stride, p->batch, p->seqlen, vmax, bytes);
  s.vec = vec_ok ? vmax : 1;
  const int64_t lanes = ceil_div(p->dim, s.vec);
  // Threads along channels: the widest of 128, 64, 32 that wastes few lanes.
  if (lanes >= 128 && (lanes % 128 == 0 || lanes >= 1024)) s.block_c = 128;
  else if (lanes >= 64 && (lanes % 64 == 0 || lanes >= 512)) s.block_c = 64;
  else s.block_c = 32;
  s.block_t = conv::kThreads / s.block_c;
  // Runs of 32 tokens (the halo re-read is (W-1)/32 of x), shorter when that leaves fewer than 2^18
  // threads (about one resident wave of the H200's 132 SMs at 2048 threads each).
  int64_t tok = 32;
  while (tok > conv::kGroup && p->batch * lanes * ceil_div(p->seqlen, tok) < (int64_t(1) << 18)) tok /= 2;
  s.tokens_per_thread = tok;
  s.token_tiles = token_tiles(p->seqlen, p->cu_seqlens != nullptr ? p->num_seqs : 0, s.block_t, tok);
  s.channel_tiles = ceil_div(lanes, s.block_c);
  if (!grid_ok(p->batch, s) || (p->cu_seqlens != nullptr && p->batch != 1)) return cudaErrorInvalidConfiguration;
  p->shape = s;
  return cudaSuccess;
}

cudaError_t conv_bwd_plan(ConvBwdParams* p) {
  if (!sizes_ok(p->batch, p->seqlen, p->dim, p->width) || p->x == nullptr || p->dout == nullptr ||
      p->dx == nullptr || p->weight == nullptr)
    return cudaErrorInvalidValue;
  ConvLaunchShape s;
  const int bytes = elem_bytes(p->dtype), v = conv::kBwdVec;
  const bool vec_ok =
      p->dim % v == 0 && aligned(p->dx, int64_t(v) * bytes) &&
      rows_aligned(p->x, p->x_batch_stride, p->x_token_stride, p->batch, p->seqlen, v, bytes) &&
      rows_aligned(p->dout, p->dout_batch_stride, p->dout_token_stride, p->batch, p->seqlen, v, bytes);
  s.vec = vec_ok ? v : 1;
  // Fixed CTA shape and a token partition from the sizes alone (not from vec): the summation order of
  // dweight and dbias is the same for every alignment.
  s.block_c = 32;
  s.block_t = conv::kThreads / s.block_c;
  // Runs of 64 tokens (the halo re-reads are 2(W-1)/64 of the inputs; one partial row per 256 tokens),
  // shorter when that leaves fewer than 2^17 threads.
  const int64_t nominal_lanes = ceil_div(p->dim, v);
  int64_t tok = 64;
  while (tok > 2 * conv::kGroup && p->batch * nominal_lanes * ceil_div(p->seqlen, tok) < (int64_t(1) << 17)) tok /= 2;
  s.tokens_per_thread = tok;
  s.token_tiles = token_tiles(p->seqlen, p->cu_seqlens != nullptr ? p->num_seqs : 0, s.block_t, tok);
  s.channel_tiles = ceil_div(ceil_div(p->dim, s.vec), s.block_c);
  if (!grid_ok(p->batch, s) || (p->cu_seqlens != nullptr && p->batch != 1)) return cudaErrorInvalidConfiguration;
  p->shape = s;
  return cudaSuccess;
}

cudaError_t conv_fwd_launch(const ConvParams& p, cudaStream_t stream) {
  if (!sizes_ok(p.batch, p.seqlen, p.dim, p.width) || !grid_ok(p.batch, p.shape) || p.shape.tokens_per_thread < 1 ||
      p.shape.block_c * p.shape.block_t != conv::kThreads)
    return cudaErrorInvalidValue;
  switch (p.dtype) {
    case DType::kFloat32: return conv::Dispatch<float>::fwd(p, stream);
    case DType::kBFloat16: return conv::Dispatch<__nv_bfloat16>::fwd(p, stream);
    case DType::kFloat16: return conv::Dispatch<__half>::fwd(p, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t conv_bwd_launch(const ConvBwdParams& p, cudaStream_t stream) {
  if (!sizes_ok(p.batch, p.seqlen, p.dim, p.width) || !grid_ok(p.batch, p.shape) || p.shape.tokens_per_thread < 1 ||
      p.shape.block_c * p.shape.block_t != conv::kThreads || p.partial == nullptr)
    return cudaErrorInvalidValue;
  switch (p.dtype) {
    case DType::kFloat32: return conv::Dispatch<float>::bwd(p, stream);
    case DType::kBFloat16: return conv::Dispatch<__nv_bfloat16>::bwd(p, stream);
    case DType::kFloat16: return conv::Dispatch<__half>::bwd(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace selscan
