// The L split shared by the unfused scan and the fused kernel: each sequence is cut into segments; in
// phase 1 every segment but the last scans from a zero state and publishes its end state and sum of
// dt; after a grid-wide barrier each segment folds its predecessors, in order, into its true start
// state, h = exp2(A2 * sum_dt) * h + h_end. Workspace: sum_dt[(seg * batch + b) * dim + d], then
// h_end[((seg * batch + b) * dim + d) * dstate + n]; written before it is read, so no initialisation.
#pragma once
#include <cstdint>

#ifdef __CUDACC__
#include "device_math.cuh"
#endif

namespace selscan {

__host__ __device__ __forceinline__ int64_t min_i64(int64_t a, int64_t b) { return a < b ? a : b; }

// Floats of workspace a launch with n_segments needs (0 when L is not split).
inline int64_t split_workspace_floats(int64_t batch, int64_t dim, int64_t dstate, int64_t n_segments) {
  return n_segments > 1 ? (n_segments - 1) * batch * dim * (dstate + 1) : 0;
}

// Segments of whole tiles: at most n of them, covering seqlen tokens.
inline void split_lengths(int64_t seqlen, int64_t n, int64_t tile, int64_t* n_segments, int64_t* seg_len) {
  const int64_t len = ((seqlen + n - 1) / n + tile - 1) / tile * tile;
  *seg_len = len;
  *n_segments = (seqlen + len - 1) / len;
}

#ifdef __CUDACC__
struct SplitWorkspace {
  float* sum_dt;
  float* h;
  int64_t batch, dim, dstate;

  __device__ __forceinline__ SplitWorkspace(float* ws, int64_t n_segments, int64_t batch_, int64_t dim_,
                                            int64_t dstate_)
      : sum_dt(ws), h(ws + (n_segments - 1) * batch_ * dim_), batch(batch_), dim(dim_), dstate(dstate_) {}

  // Phase 1: the end state of segment `seg` for channel d, states s0 .. s0+kNS-1.
  template <int kNS>
  __device__ __forceinline__ void publish(int64_t seg, int64_t b, int64_t d, int s0, const float (&hs)[kNS],
                                          float sum, bool write_sum) const {
    const int64_t cd = (seg * batch + b) * dim + d;
    if (write_sum) sum_dt[cd] = sum;
#pragma unroll
    for (int n = 0; n < kNS; ++n) h[cd * dstate + s0 + n] = hs[n];
  }

  // Phase 2: fold segments 0 .. seg-1, in order, into hs (which holds h0 or zeros).
  template <int kNS>
  __device__ __forceinline__ void fold(int64_t seg, int64_t b, int64_t d, int s0, const float (&A2)[kNS],
                                       float (&hs)[kNS]) const {
    for (int64_t sp = 0; sp < seg; ++sp) {
      const int64_t cd = (sp * batch + b) * dim + d;
      const float sd = __ldcg(sum_dt + cd);
#pragma unroll
      for (int n = 0; n < kNS; ++n) hs[n] = fmaf(ex2_approx(A2[n] * sd), hs[n], __ldcg(h + cd * dstate + s0 + n));
    }
  }

  // The backward's mirror image (csrc/scan/scan_bwd_kernel.cuh): segments 1 .. n_segments-1 publish at
  // index seg - 1 the adjoint a[t0] * g[t0] they pass to their predecessor (from a zero adjoint at
  // their end) and their sum of dt; segment `seg` folds its successors, last first, into gs (which
  // holds the gradient of the final state, or zeros): E = pub + exp2(A2 * sum_dt) * E.
  template <int kNS>
  __device__ __forceinline__ void fold_reverse(int64_t seg, int64_t n_segments, int64_t b, int64_t d, int s0,
                                               const float (&A2)[kNS], float (&gs)[kNS]) const {
    for (int64_t sp = n_segments - 1; sp > seg; --sp) {
      const int64_t cd = ((sp - 1) * batch + b) * dim + d;
      const float sd = __ldcg(sum_dt + cd);
#pragma unroll
      for (int n = 0; n < kNS; ++n) gs[n] = fmaf(ex2_approx(A2[n] * sd), gs[n], __ldcg(h + cd * dstate + s0 + n));
    }
  }
};
#endif

}  // namespace selscan
