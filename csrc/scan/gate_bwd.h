// The derivative of the block's gate y = yu * silu(z) (the scan's "gated output" policy, backward), for
// the backward scan kernel's input: dyu = dy * silu(z) and dz = dy * yu * silu'(z). Torch-free.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "../common/dtype.h"

namespace selscan {

struct GateBwdParams {
  int64_t batch = 0, seqlen = 0, dim = 0;
  DType dtype = DType::kBFloat16;  // every tensor
  // (batch, L, dim), unit channel stride, any batch / token strides (z is the right half of in_proj's
  // output, (batch, L, 2 dim)).
  const void* dy = nullptr;
  int64_t dy_batch_stride = 0, dy_token_stride = 0;
  const void* z = nullptr;
  int64_t z_batch_stride = 0, z_token_stride = 0;
  const void* yu = nullptr;        // y before the gate, contiguous
  void* dyu = nullptr;             // contiguous outputs
  void* dz = nullptr;
};

// One launch on `stream`, in float32 (rounded to the dtype at the store): s = sigmoid(z),
// dyu = (dy z) s, dz = ((dy yu) s) (1 + z (1 - s)), the order of the PyTorch expressions it replaces.
cudaError_t gate_bwd_launch(const GateBwdParams& p, cudaStream_t stream);

}  // namespace selscan
