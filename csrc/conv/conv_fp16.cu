// Instantiates the causal conv1d kernels (forward and backward) for one dtype (one file per dtype so
// that builds run in parallel).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "conv_kernel.cuh"

template struct selscan::conv::Dispatch<__half>;
