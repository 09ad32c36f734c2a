// Host side of the block's decode step kernels: the launch's shape (docs/perf/decode.md, "The decode
// kernels"), the dtype dispatch, and the launch: both phases in one cooperative launch, or two kernels.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
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
constexpr int kMaxDevices = 64;     // devices whose resident-CTA count is cached

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Fills p's launch shape: the first phase's x items (x tiles x row slices, slices only while the grid
// is small) and the second's scan tiles, each for every group of kSeqs sequences. `scan_threads` is the
// second phase's CTA width (kScanThreads for the two launches, kStepThreads for one) and
// `scan_target` the items it aims for.
struct Plan {
  int64_t groups = 0, x_items = 0, scan_tiles = 0;
};

Plan plan(DecodeParams& p, int scan_threads, int64_t scan_target) {
  Plan pl;
  pl.groups = ceil_div(p.batch, decode::kSeqs);
  const int64_t xtiles = decode_xproj_tiles(p.d_inner);
  const int n_out = p.dt_rank + 2 * p.dstate;
  int64_t slices = 1;
  if (xtiles * pl.groups < kXprojTargetCtas) slices = ceil_div(kXprojTargetCtas, xtiles * pl.groups);
  int rows = int(ceil_div(n_out, slices));
  rows = int(ceil_div(rows < kMinXprojRows ? kMinXprojRows : rows, decode::kRowBlock) * decode::kRowBlock);
  slices = ceil_div(n_out, rows);
  p.xproj_rows = rows;
  pl.x_items = xtiles * slices;
  // L lanes a channel (4 states a lane), scan_threads / L channels a pass, passes doubled while the
  // items stay at or above their target.
  int lanes = 1;
  while (4 * lanes < p.dstate) lanes *= 2;
  p.state_lanes = lanes;
  const int64_t per_pass = scan_threads / lanes;
  int passes = 1;
  while (passes < kMaxScanPasses && ceil_div(p.d_inner, per_pass * passes * 2) * pl.groups >= scan_target) passes *= 2;
  p.scan_passes = passes;
  pl.scan_tiles = ceil_div(p.d_inner, per_pass * passes);
  return pl;
}

template <class T>
cudaError_t launch_two(DecodeParams p, cudaStream_t stream) {
  const Plan pl = plan(p, decode::kScanThreads, kScanTargetCtas);
  const dim3 grid_x(unsigned(pl.x_items), unsigned(pl.groups)), grid_s(unsigned(pl.scan_tiles), unsigned(pl.groups));
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

// CTAs of `kernel` that fit on the current device at once (0 where it cannot take a cooperative
// launch), asked once per device and kernel.
template <class Kernel>
cudaError_t resident_ctas(Kernel kernel, int& out) {
  static std::atomic<int> cached[kMaxDevices];  // CTAs + 1; 0: not asked yet
  int dev = 0;
  SELSCAN_RETURN_IF_ERROR(cudaGetDevice(&dev));
  if (dev >= 0 && dev < kMaxDevices && cached[dev].load(std::memory_order_relaxed) > 0) {
    out = cached[dev].load(std::memory_order_relaxed) - 1;
    return cudaSuccess;
  }
  int coop = 0, sms = 0, per_sm = 0;
  SELSCAN_RETURN_IF_ERROR(cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, dev));
  SELSCAN_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  SELSCAN_RETURN_IF_ERROR(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, decode::kStepThreads, 0));
  out = coop ? sms * per_sm : 0;
  if (dev >= 0 && dev < kMaxDevices) cached[dev].store(out + 1, std::memory_order_relaxed);
  return cudaSuccess;
}

template <class T, int kL>
cudaError_t launch_one_lanes(DecodeParams p, const Plan& pl, cudaStream_t stream) {
  auto kernel = decode::decode_step_kernel<T, kL>;
  int resident = 0;
  SELSCAN_RETURN_IF_ERROR(resident_ctas(kernel, resident));
  if (resident <= 0) return launch_two<T>(p, stream);
  const int64_t items = std::max(pl.x_items, pl.scan_tiles) * pl.groups;
  const unsigned ctas = unsigned(std::min<int64_t>(items, resident));
  int64_t x_items = pl.x_items, groups = pl.groups, scan_tiles = pl.scan_tiles;
  void* args[] = {&p, &x_items, &groups, &scan_tiles};
  SELSCAN_RETURN_IF_ERROR(cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(kernel), dim3(ctas),
                                                      dim3(decode::kStepThreads), args, 0, stream));
  return cudaGetLastError();
}

template <class T>
cudaError_t launch_one(DecodeParams p, cudaStream_t stream) {
  const Plan pl = plan(p, decode::kStepThreads, kXprojTargetCtas);
  switch (p.state_lanes) {
    case 1: return launch_one_lanes<T, 1>(p, pl, stream);
    case 2: return launch_one_lanes<T, 2>(p, pl, stream);
    case 4: return launch_one_lanes<T, 4>(p, pl, stream);
    case 8: return launch_one_lanes<T, 8>(p, pl, stream);
    case 16: return launch_one_lanes<T, 16>(p, pl, stream);
    default: return cudaErrorInvalidValue;
  }
}

template <class T>
cudaError_t launch_typed(const DecodeParams& p, cudaStream_t stream) {
  return p.launches == 1 ? launch_one<T>(p, stream) : launch_two<T>(p, stream);
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
  if (params.launches != 1 && params.launches != 2) return cudaErrorInvalidValue;
  switch (params.dtype) {
    case DType::kFloat32: return launch_typed<float>(params, stream);
    case DType::kBFloat16: return launch_typed<__nv_bfloat16>(params, stream);
    case DType::kFloat16: return launch_typed<__half>(params, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace selscan
