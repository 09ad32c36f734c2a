// Host entry point of the block's decode step kernels (no torch headers: decode_ops.cpp is the
// binding). Returns the first CUDA error met (launch errors included); does not synchronise.
#pragma once
#include <cuda_runtime.h>

#include "decode_params.h"

namespace selscan {

// Whether the kernels take these sizes (the binding says which argument is out of range).
inline bool decode_supports(int dstate, int dt_rank, int width) {
  return dstate >= 1 && dstate <= kDecodeMaxState && dt_rank >= 1 && dt_rank <= kDecodeMaxRank && width >= 2 &&
         width <= kDecodeMaxWidth;
}

// Two launches on `stream`: the conv (conv_state only read) and x_proj's partial sums per channel tile,
// then the partial sums' reduction (in a fixed order: deterministic), dt_proj, the conv state's shift,
// the state update, D and the gate.
cudaError_t decode_mid_launch(const DecodeParams& p, cudaStream_t stream);

}  // namespace selscan
