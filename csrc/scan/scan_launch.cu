// Host entry points of the unfused scan: the L-split plan and the dtype dispatch.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "scan_api.h"
#include "scan_bwd_kernel.cuh"
#include "scan_kernel.cuh"

namespace selscan {

// Instantiated in scan_<dtype>.cu and scan_bwd_<dtype>.cu (in parallel), not here.
extern template struct scan::Dispatch<float>;
extern template struct scan::Dispatch<__nv_bfloat16>;
extern template struct scan::Dispatch<__half>;
extern template struct scan_bwd::Dispatch<float>;
extern template struct scan_bwd::Dispatch<__nv_bfloat16>;
extern template struct scan_bwd::Dispatch<__half>;

namespace {

cudaError_t occupancy(DType dtype, int64_t dstate, bool gate, int device, int* blocks, int* dc) {
  switch (dtype) {
    case DType::kFloat32: return scan::Dispatch<float>::occupancy(dstate, gate, device, blocks, dc);
    case DType::kBFloat16: return scan::Dispatch<__nv_bfloat16>::occupancy(dstate, gate, device, blocks, dc);
    case DType::kFloat16: return scan::Dispatch<__half>::occupancy(dstate, gate, device, blocks, dc);
  }
  return cudaErrorInvalidValue;
}

cudaError_t bwd_occupancy(DType dtype, int64_t dstate, bool gate, int device, int* blocks, int* dc, int* rows) {
  switch (dtype) {
    case DType::kFloat32: return scan_bwd::Dispatch<float>::occupancy(dstate, gate, device, blocks, dc, rows);
    case DType::kBFloat16: return scan_bwd::Dispatch<__nv_bfloat16>::occupancy(dstate, gate, device, blocks, dc, rows);
    case DType::kFloat16: return scan_bwd::Dispatch<__half>::occupancy(dstate, gate, device, blocks, dc, rows);
  }
  return cudaErrorInvalidValue;
}

// The L split of both scan kernels: with requested > 0, that many segments (at most one per tile of
// `tile` tokens); otherwise split only when the (sequence, channel tile) items cannot give every SM a
// CTA (measured on the H200: with one item per SM or more, splitting costs more than it gains), in
// segments of at least min_segment tokens, up to the resident capacity:
// - one_wave (the forward): the largest power of two of segments whose CTAs all fit at once (the
//   capacity rounded up took a second, nearly empty wave: 17 segments of 32 items where 16 measured
//   1.14x faster at (1, 65536, 1024), 5 of 128 where 4 measured 1.22x at (4, 8192, 1024);
//   docs/perf/batch1.md, "The batch-1 regime"), with segments of one chunk or more, and no split into
//   fewer than 4 (at L < 128 the second phase costs more than it saves);
// - otherwise (the backward): the capacity rounded up, segments of at least 256 tokens so that the
//   split's extra pass (the adjoint-only phase 1) stays small.
void plan_split(int64_t seqlen_in, int64_t items_per_segment, int blocks_per_sm, int sms, int64_t requested,
                int64_t tile, int64_t min_segment, bool one_wave, int64_t* n_segments, int64_t* seg_len) {
  const int64_t seqlen = std::max<int64_t>(seqlen_in, 1);
  int64_t n = 1;
  if (requested > 0) {
    n = std::min(requested, (seqlen + tile - 1) / tile);
  } else if (items_per_segment < int64_t(sms)) {
    const int64_t capacity = int64_t(std::max(blocks_per_sm, 1)) * sms;
    if (one_wave) {
      const int64_t fit = std::max<int64_t>(1, capacity / items_per_segment);
      n = 1;
      while (2 * n <= fit) n *= 2;
      n = std::min(n, std::max<int64_t>(1, seqlen / min_segment));
      if (n < 4) n = 1;  // 2 segments of 32 tokens: 1.14x slower than one at (1, 64, 1024)
    } else {
      n = (capacity + items_per_segment - 1) / items_per_segment;
      n = std::min(n, std::max<int64_t>(1, seqlen / min_segment));
    }
  }
  split_lengths(seqlen, std::max<int64_t>(n, 1), tile, n_segments, seg_len);
}

}  // namespace

cudaError_t scan_bwd_plan(const ScanBwdParams& p, int64_t requested_segments, int device, ScanBwdLaunchInfo* out) {
  int blocks = 0, dc = 0, rows = 0, sms = 0;
  SELSCAN_RETURN_IF_ERROR(bwd_occupancy(p.dtype, p.dstate, p.gate_z != nullptr, device, &blocks, &dc, &rows));
  SELSCAN_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  // Segments of whole checkpoint intervals; phase 1 (the adjoint alone) is the split's extra pass.
  const int64_t items = std::max<int64_t>(p.batch, 1) * ((p.dim + dc - 1) / dc);
  plan_split(p.seqlen, items, blocks, sms, requested_segments, kCkptEvery, 256, false, &out->n_segments,
             &out->seg_len);
  out->channel_tile = dc;
  out->rows_per_col = rows;
  return cudaSuccess;
}

cudaError_t scan_bwd_launch(const ScanBwdParams& p, cudaStream_t stream) {
  if (p.n_segments < 1 || p.seg_len < 1 || p.seg_len % kCkptEvery != 0 ||
      (p.n_segments > 1 && p.workspace == nullptr))
    return cudaErrorInvalidValue;
  switch (p.dtype) {
    case DType::kFloat32: return scan_bwd::Dispatch<float>::launch(p, stream);
    case DType::kBFloat16: return scan_bwd::Dispatch<__nv_bfloat16>::launch(p, stream);
    case DType::kFloat16: return scan_bwd::Dispatch<__half>::launch(p, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t scan_plan(const ScanParams& p, int64_t requested_segments, int device, ScanLaunchInfo* out) {
  constexpr int64_t kChunk = 32;        // tokens per chunk when L is split (TraitsSplit::kT)
  int blocks = 0, dc = 0, sms = 0;
  SELSCAN_RETURN_IF_ERROR(occupancy(p.dtype, p.dstate, p.z != nullptr, device, &blocks, &dc));
  SELSCAN_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int64_t items = std::max<int64_t>(p.batch, 1) * ((p.dim + dc - 1) / dc);
  plan_split(p.seqlen, items, blocks, sms, requested_segments, kChunk, kChunk, true, &out->n_segments, &out->seg_len);
  return cudaSuccess;
}

cudaError_t scan_launch(const ScanParams& p, cudaStream_t stream) {
  if (p.n_segments < 1 || p.seg_len < 1 || (p.n_segments > 1 && p.workspace == nullptr))
    return cudaErrorInvalidValue;
  switch (p.dtype) {
    case DType::kFloat32: return scan::Dispatch<float>::launch(p, stream);
    case DType::kBFloat16: return scan::Dispatch<__nv_bfloat16>::launch(p, stream);
    case DType::kFloat16: return scan::Dispatch<__half>::launch(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace selscan
