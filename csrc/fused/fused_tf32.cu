// Fused kernel instances: float, 3xTF32 = false, N in {8, 16, 32, 64}; N = 16 also with two scan
// warpgroups for short streams (kFusedShortStream).
#include "fused_instances.h"
#include "fused_kernel.cuh"

namespace selscan {
namespace fused {

template <>
cudaError_t launch_dtype<float, false>(const FusedParams& p, cudaStream_t stream) {
  switch (p.dstate) {
    case 8: return Launcher<Config<float, 8, false>>::launch(p, stream);
    case 16: return launch_n16<float>(p, stream);
    case 32: return Launcher<Config<float, 32, false>>::launch(p, stream);
    case 64: return Launcher<Config<float, 64, false>>::launch(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace fused
}  // namespace selscan
