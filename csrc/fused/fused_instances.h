// One explicit instantiation per (dtype, TF32 mode), each in its own .cu so that builds run in parallel.
#pragma once
#include <cuda_runtime.h>

#include "fused_params.h"

namespace selscan {
namespace fused {

// E: cute::bfloat16_t, cute::half_t or float; k3x: 3xTF32 (float only). Switches over p.dstate.
template <class E, bool k3x>
cudaError_t launch_dtype(const FusedParams& p, cudaStream_t stream);

}  // namespace fused
}  // namespace selscan
