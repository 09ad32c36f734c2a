// One explicit instantiation per (dtype, TF32 mode), each in its own .cu so that builds run in parallel.
#pragma once
#include <cuda_runtime.h>

#include "fused_params.h"
#include "../scan/scan_bwd_params.h"

namespace selscan {
namespace fused {

// E: cute::bfloat16_t, cute::half_t or float; k3x: 3xTF32 (float only). Switches over p.dstate.
template <class E, bool k3x>
cudaError_t launch_dtype(const FusedParams& p, cudaStream_t stream);

// The fused backward (E: cute::bfloat16_t or cute::half_t; N = 16; 4 or 8 scan threads per channel):
// fused_bwd_<dtype>.cu.
template <class E>
cudaError_t launch_bwd_dtype(const FusedParams& p, const ScanBwdParams& q, int threads_per_channel,
                             cudaStream_t stream);

}  // namespace fused
}  // namespace selscan
