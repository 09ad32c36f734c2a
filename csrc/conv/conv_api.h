// Host entry points of the depthwise causal conv1d (no torch headers: csrc/conv/conv_ops.cpp is the
// binding). Each returns the first CUDA error met (launch errors included); none synchronises.
#pragma once
#include <cuda_runtime.h>

#include "conv_params.h"

namespace selscan {

// Fills p->shape for a forward launch (vector width from the alignment of x, out and x's strides;
// tokens per thread from the problem size). Needs p's sizes, dtype, x, its strides and out set.
cudaError_t conv_fwd_plan(ConvParams* p);
// Launches the forward on `stream`; p.shape must come from conv_fwd_plan.
cudaError_t conv_fwd_launch(const ConvParams& p, cudaStream_t stream);

// Fills p->shape for a backward launch. Needs p's sizes, dtype, x, dout (with their strides) and dx
// set; p->partial must then hold conv_bwd_partial_rows(*p) * (width + 1) * dim floats. The token
// partition (and so the summation order of dweight and dbias) depends on the sizes only, not on the
// alignment: the results are bitwise the same for any placement of the inputs.
cudaError_t conv_bwd_plan(ConvBwdParams* p);
inline int64_t conv_bwd_partial_rows(const ConvBwdParams& p) { return p.batch * p.shape.token_tiles; }
// Launches the backward on `stream`; p.shape must come from conv_bwd_plan.
cudaError_t conv_bwd_launch(const ConvBwdParams& p, cudaStream_t stream);

}  // namespace selscan
