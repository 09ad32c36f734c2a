// Instantiates the unfused scan kernel for one dtype (one file per dtype so that builds run in parallel).
#include "scan_kernel.cuh"

template struct selscan::scan::Dispatch<__nv_bfloat16>;
