// Error checking for the torch-free kernel translation units: launchers return cudaError_t and the
// host binding (csrc/torch_ops.cpp) turns a failure into a TORCH_CHECK with the CUDA error string.
#pragma once
#include <cuda_runtime.h>

#define SELSCAN_RETURN_IF_ERROR(...)           \
  do {                                         \
    cudaError_t selscan_err__ = (__VA_ARGS__);        \
    if (selscan_err__ != cudaSuccess) return selscan_err__; \
  } while (0)
