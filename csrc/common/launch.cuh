// Host helpers shared by the launchers of the scan kernels (the unfused forward and the backward of
// both paths): a kernel's per-device preparation, and the cooperative launch of a persistent grid for
// the L split, whose grid-wide barrier needs every CTA resident.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda_check.h"

namespace selscan {

// Raises kKernel's dynamic shared-memory limit to `smem`, takes all shared memory (no L1 split: the
// occupancy a cooperative launch is checked against) and returns its CTAs per SM; cached per device.
template <auto kKernel>
cudaError_t prepare_kernel(int threads, int smem, int device, int* blocks_per_sm) {
  static int cached[64] = {};  // blocks per SM + 1; 0 = not prepared yet
  if (device >= 0 && device < 64 && cached[device] > 0) {
    *blocks_per_sm = cached[device] - 1;
    return cudaSuccess;
  }
  SELSCAN_RETURN_IF_ERROR(cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  SELSCAN_RETURN_IF_ERROR(cudaFuncSetAttribute(kKernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                               int(cudaSharedmemCarveoutMaxShared)));
  int blocks = 0;
  SELSCAN_RETURN_IF_ERROR(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kKernel, threads, smem));
  if (device >= 0 && device < 64) cached[device] = blocks + 1;
  *blocks_per_sm = blocks;
  return cudaSuccess;
}

// A persistent grid of min(n_items, resident CTAs) over `kernel(p)`, launched cooperatively. The kernels'
// item loops take any grid size: should the driver find fewer co-resident CTAs than the occupancy
// query promised, the (non-sticky) launch error is cleared and the grid halved.
template <class P>
cudaError_t launch_cooperative(void (*kernel)(P), const P& p, int64_t n_items, int blocks_per_sm, int threads,
                               int smem, cudaStream_t stream) {
  int device = 0, sms = 0;
  SELSCAN_RETURN_IF_ERROR(cudaGetDevice(&device));
  SELSCAN_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  if (blocks_per_sm < 1) return cudaErrorInvalidConfiguration;
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[1];
  cfg.blockDim = dim3(unsigned(threads));
  cfg.dynamicSmemBytes = size_t(smem);
  cfg.stream = stream;
  const int64_t resident = int64_t(blocks_per_sm) * sms;
  cfg.gridDim = dim3(unsigned(n_items < resident ? n_items : resident));
  attr[0].id = cudaLaunchAttributeCooperative;
  attr[0].val.cooperative = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  cudaError_t err = cudaLaunchKernelEx(&cfg, kernel, p);
  while (err == cudaErrorCooperativeLaunchTooLarge && cfg.gridDim.x > 1) {
    (void)cudaGetLastError();
    cfg.gridDim.x = (cfg.gridDim.x + 1) / 2;
    err = cudaLaunchKernelEx(&cfg, kernel, p);
  }
  return err;
}

}  // namespace selscan
