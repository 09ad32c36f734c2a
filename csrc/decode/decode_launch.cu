// Host side of the block's decode step kernels: the launch's shape (docs/perf/decode.md, "The decode
// kernels"), the dtype dispatch and the two launches.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>

#include "../common/cuda_check.h"
#include "decode_api.h"
#include "decode_kernel.cuh"

namespace selscan {
namespace {

// CTAs a launch aims for (about 2 a multiprocessor for the first kernel, 4 for the second on a
// 132-SM H100): below them a kernel splits its work finer, above them it takes larger pieces (fewer
// re-reads of the weights and partial sums from L2). The results do not depend on them.
constexpr int64_t kXprojTargetCtas = 256;
constexpr int64_t kScanTargetCtas = 512;
constexpr int kMinXprojRows = 4;   // x_proj rows a CTA takes at least (each slice repeats the tile's conv)
constexpr int kMaxScanPasses = 8;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Fills p's launch shape; returns the two grids.
void plan(DecodeParams& p, dim3& grid_x, dim3& grid_s) {
  const int64_t groups = ceil_div(p.batch, decode::kSeqs);
  const int64_t xtiles = decode_xproj_tiles(p.d_inner);
  const int n_out = p.dt_rank + 2 * p.dstate;
  // The first kernel: x tiles x slices of x_proj's rows, slices only while the grid is small.
  int64_t slices = 1;
  if (xtiles * groups < kXprojTargetCtas) slices = ceil_div(kXprojTargetCtas, xtiles * groups);
  int rows = int(ceil_div(n_out, slices));
  rows = int(ceil_div(rows < kMinXprojRows ? kMinXprojRows : rows, decode::kRowBlock) * decode::kRowBlock);
  slices = ceil_div(n_out, rows);
  p.xproj_rows = rows;
  grid_x = dim3(unsigned(xtiles * slices), unsigned(groups));
  // The second: L lanes a channel (4 states a lane), 128 / L channels a pass, passes doubled while
  // the grid stays at or above its target.
  int lanes = 1;
  while (4 * lanes < p.dstate) lanes *= 2;
  p.state_lanes = lanes;
  const int64_t per_pass = decode::kScanThreads / lanes;
  int passes = 1;
  while (passes < kMaxScanPasses && ceil_div(p.d_inner, per_pass * passes * 2) * groups >= kScanTargetCtas) passes *= 2;
  p.scan_passes = passes;
  grid_s = dim3(unsigned(ceil_div(p.d_inner, per_pass * passes)), unsigned(groups));
}

template <class T>
cudaError_t launch_typed(const DecodeParams& p, const dim3& grid_x, const dim3& grid_s, cudaStream_t stream) {
  decode::conv_xproj_kernel<T><<<grid_x, decode::kXThreads, 0, stream>>>(p);
  SELSCAN_RETURN_IF_ERROR(cudaGetLastError());
  switch (p.state_lanes) {
    case 1: decode::scan_gate_kernel<T, 1><<<grid_s, decode::kScanThreads, 0, stream>>>(p); break;
    case 2: decode::scan_gate_kernel<T, 2><<<grid_s, decode::kScanThreads, 0, stream>>>(p); break;
    case 4: decode::scan_gate_kernel<T, 4><<<grid_s, decode::kScanThreads, 0, stream>>>(p); break;
    case 8: decode::scan_gate_kernel<T, 8><<<grid_s, decode::kScanThreads, 0, stream>>>(p); break;
    case 16: decode::scan_gate_kernel<T, 16><<<grid_s, decode::kScanThreads, 0, stream>>>(p); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t decode_mid_launch(const DecodeParams& params, cudaStream_t stream) {
  if (params.batch <= 0 || params.d_inner <= 0 || !decode_supports(params.dstate, params.dt_rank, params.width))
    return cudaErrorInvalidValue;
  // Grid limits: y is the group of sequences (65535 at most); x the tiles (2^31 - 1 at most).
  if (params.batch > 65535 || decode_xproj_tiles(params.d_inner) * ceil_div(params.dt_rank + 2 * params.dstate, 4) > INT_MAX ||
      params.d_inner > INT_MAX)
    return cudaErrorInvalidConfiguration;
  if (params.xz == nullptr || params.conv_weight == nullptr || params.x_proj_weight == nullptr ||
      params.dt_proj_weight == nullptr || params.dt_bias == nullptr || params.A_log == nullptr ||
      params.D == nullptr || params.conv_state == nullptr || params.ssm_state == nullptr ||
      params.workspace == nullptr || params.y == nullptr)
    return cudaErrorInvalidValue;
  DecodeParams p = params;
  dim3 grid_x, grid_s;
  plan(p, grid_x, grid_s);
  switch (p.dtype) {
    case DType::kFloat32: return launch_typed<float>(p, grid_x, grid_s, stream);
    case DType::kBFloat16: return launch_typed<__nv_bfloat16>(p, grid_x, grid_s, stream);
    case DType::kFloat16: return launch_typed<__half>(p, grid_x, grid_s, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace selscan
