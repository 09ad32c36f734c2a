// Host entry point of the decode step's residual add + RMSNorm (csrc/decode/norm_launch.cu; no torch
// headers: decode_ops.cpp is the binding). Returns the first CUDA error met; does not synchronise.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "../common/dtype.h"

namespace selscan {

struct AddNormParams {
  int64_t rows = 0;
  int64_t dim = 0;
  DType dtype = DType::kBFloat16;    // hidden, weight, normed (and the residuals when not float32)
  float eps = 1e-5f;
  const void* hidden = nullptr;      // (rows, dim), row stride hidden_stride, unit column stride
  int64_t hidden_stride = 0;
  const void* residual = nullptr;    // (rows, dim) contiguous, float32 (residual_fp32) or dtype; or null
  bool residual_fp32 = false;
  const void* weight = nullptr;      // (dim,)
  void* normed = nullptr;            // (rows, dim) contiguous, dtype
  void* residual_out = nullptr;      // (rows, dim) contiguous, float32 (residual_out_fp32) or dtype
  bool residual_out_fp32 = false;
};

cudaError_t add_rmsnorm_launch(const AddNormParams& p, cudaStream_t stream);

}  // namespace selscan
