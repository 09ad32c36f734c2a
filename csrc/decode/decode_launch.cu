// Host side of the block's decode step kernels: the dtype and conv-width dispatch and the two launches.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>

#include "../common/cuda_check.h"
#include "decode_api.h"
#include "decode_kernel.cuh"

namespace selscan {
namespace {

template <class T>
cudaError_t launch_typed(const DecodeParams& p, cudaStream_t stream) {
  const dim3 grid(unsigned(decode_channel_tiles(p.d_inner)), unsigned((p.batch + decode::kSeqs - 1) / decode::kSeqs));
  const dim3 block(decode::kThreads);
  switch (p.width) {
    case 2: decode::conv_xproj_kernel<T, 2><<<grid, block, 0, stream>>>(p); break;
    case 3: decode::conv_xproj_kernel<T, 3><<<grid, block, 0, stream>>>(p); break;
    case 4: decode::conv_xproj_kernel<T, 4><<<grid, block, 0, stream>>>(p); break;
    default: return cudaErrorInvalidValue;
  }
  SELSCAN_RETURN_IF_ERROR(cudaGetLastError());
  decode::scan_gate_kernel<T><<<grid, block, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t decode_mid_launch(const DecodeParams& p, cudaStream_t stream) {
  if (p.batch <= 0 || p.d_inner <= 0 || !decode_supports(p.dstate, p.dt_rank, p.width)) return cudaErrorInvalidValue;
  if (p.batch > 65535 || decode_channel_tiles(p.d_inner) > INT_MAX) return cudaErrorInvalidConfiguration;
  if (p.xz == nullptr || p.conv_weight == nullptr || p.x_proj_weight == nullptr || p.dt_proj_weight == nullptr ||
      p.dt_bias == nullptr || p.A_log == nullptr || p.D == nullptr || p.conv_state == nullptr ||
      p.ssm_state == nullptr || p.workspace == nullptr || p.y == nullptr)
    return cudaErrorInvalidValue;
  switch (p.dtype) {
    case DType::kFloat32: return launch_typed<float>(p, stream);
    case DType::kBFloat16: return launch_typed<__nv_bfloat16>(p, stream);
    case DType::kFloat16: return launch_typed<__half>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace selscan
