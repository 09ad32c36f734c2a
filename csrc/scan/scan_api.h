// Host entry points of the unfused scan (no torch headers: see csrc/torch_ops.cpp for the binding).
#pragma once
#include <cuda_runtime.h>
#include "scan_params.h"

namespace selscan {

// dstate values the scan kernel is compiled for.
inline bool scan_supports_dstate(int64_t n) { return n == 8 || n == 16 || n == 32 || n == 64; }
// dim must be a multiple of this (16-byte rows for every dtype).
constexpr int64_t kScanDimMultiple = 8;

struct ScanLaunchInfo {
  int64_t n_segments;  // segments the launch will use
  int64_t seg_len;     // tokens per segment
};

// Chooses n_segments and seg_len for a problem (requested_segments <= 0: automatic). Needs the device
// only for its multiprocessor count and the kernel's occupancy; the result is cached per device.
cudaError_t scan_plan(const ScanParams& p, int64_t requested_segments, int device, ScanLaunchInfo* out);

// Launches the scan on `stream`. p.n_segments/p.seg_len must come from scan_plan and p.workspace must
// hold scan_workspace_floats(...) floats. Returns the first CUDA error met (launch errors included).
cudaError_t scan_launch(const ScanParams& p, cudaStream_t stream);

}  // namespace selscan
