// Fused kernel instances: float, 3xTF32 = true, N in {8, 16, 32, 64}.
#include "fused_instances.h"
#include "fused_kernel.cuh"

namespace selscan {
namespace fused {

template <>
cudaError_t launch_dtype<float, true>(const FusedParams& p, cudaStream_t stream) {
  switch (p.dstate) {
    case 8: return Launcher<Config<float, 8, true>>::launch(p, stream);
    case 16: return Launcher<Config<float, 16, true>>::launch(p, stream);
    case 32: return Launcher<Config<float, 32, true>>::launch(p, stream);
    case 64: return Launcher<Config<float, 64, true>>::launch(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace fused
}  // namespace selscan
