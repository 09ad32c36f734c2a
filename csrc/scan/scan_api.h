// Host entry points of the unfused scan (no torch headers: see csrc/torch_ops.cpp for the binding).
#pragma once
#include <cuda_runtime.h>
#include "scan_bwd_params.h"
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

// The backward scan (csrc/scan/scan_bwd_kernel.cuh): its L split (segments of whole checkpoint
// intervals; requested_segments <= 0: automatic) and channels per CTA, from which the caller sizes
// the partial-sum buffers of ScanBwdParams.
struct ScanBwdLaunchInfo {
  int64_t n_segments;
  int64_t seg_len;
  int64_t channel_tile;  // channels per CTA: bc_partial holds ceil(dim / channel_tile) tiles per token
  int64_t rows_per_col;  // rows of dD_partial / db_partial per (segment, sequence)
};
cudaError_t scan_bwd_plan(const ScanBwdParams& p, int64_t requested_segments, int device, ScanBwdLaunchInfo* out);
cudaError_t scan_bwd_launch(const ScanBwdParams& p, cudaStream_t stream);

}  // namespace selscan
