// Instantiates the backward scan kernel for one dtype (one file per dtype so that builds run in parallel).
#include "scan_bwd_kernel.cuh"

template struct selscan::scan_bwd::Dispatch<float>;
