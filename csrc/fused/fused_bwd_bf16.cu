// Fused backward instances: cute::bfloat16_t, N = 16; 4 or 8 scan threads per channel (two or four scan
// warpgroups).
#include "fused_bwd_kernel.cuh"
#include "fused_instances.h"

namespace selscan {
namespace fused {

template <>
cudaError_t launch_bwd_dtype<cute::bfloat16_t>(const FusedParams& p, const ScanBwdParams& q, int threads_per_channel,
                                          cudaStream_t stream) {
  if (p.dstate != 16) return cudaErrorInvalidValue;
  switch (threads_per_channel) {
    case 4: return BwdLauncher<BwdTraits<cute::bfloat16_t, 16, 4>>::launch(p, q, stream);
    case 8: return BwdLauncher<BwdTraits<cute::bfloat16_t, 16, 8>>::launch(p, q, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace fused
}  // namespace selscan
