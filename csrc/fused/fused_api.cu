// Host entry points of the fused kernel: availability, the L-split plan, the dtype dispatch.
#include <cute/numeric/numeric_types.hpp>

#include <algorithm>
#include <atomic>

#include "../common/cuda_check.h"
#include "fused_api.h"
#include "fused_config.h"
#include "fused_instances.h"

namespace selscan {

namespace {
std::atomic<bool> g_descriptor_cache{true};
}  // namespace

bool fused_descriptor_cache_enabled() { return g_descriptor_cache.load(std::memory_order_relaxed); }
void fused_set_descriptor_cache(bool enable) { g_descriptor_cache.store(enable, std::memory_order_relaxed); }

bool fused_available(int device) {
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return major == 9 && minor == 0;  // the kernel is built for sm_90a only
}

bool fused_has_narrow_layout(DType dtype, int64_t dstate) {
  return (dtype == DType::kBFloat16 || dtype == DType::kFloat16) && dstate == 16;
}

cudaError_t fused_plan(const FusedParams& p, int64_t requested_segments, int64_t requested_channel_tile, int device,
                       FusedLaunchInfo* out) {
  int sms = 0;
  SELSCAN_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const bool narrow_ok = fused_has_narrow_layout(p.dtype, p.dstate);
  if (requested_channel_tile != 0 && requested_channel_tile != 64 && !(requested_channel_tile == 16 && narrow_ok))
    return cudaErrorInvalidValue;
  const int64_t seqlen = std::max<int64_t>(p.seqlen, 1);
  const int64_t batch = std::max<int64_t>(p.batch, 1);
  const int64_t max_segments = (seqlen + kFusedTokenTile - 1) / kFusedTokenTile;
  // The L split and channel tile, by a cost model: the tokens of the busiest CTA (each phase's streams
  // spread over one persistent CTA per SM), times the larger of two per-token costs: the scan's (its
  // channels weighted by the measured cost per exponential of the layout: kFusedNarrowCost; the
  // 64-channel layouts 1 for long streams, 1.14 for short ones, docs/perf/layer-forward.md v3.2) and the
  // operand loads' (an x row and the token's share of the stacked weight tile, in
  // kFusedLoadBytesPerUnit); plus a fixed cost per grid phase.
  const double elem = p.dtype == DType::kFloat32 ? 4.0 : 2.0;
  // The largest split the plan considers for a channel tile: the requested one, or (one persistent
  // CTA per SM) streams close to one per SM, never more (a second stream on an SM doubles its time),
  // in segments of at least kFusedMinSegment tokens; at most one segment per token tile.
  auto top_split = [&](int64_t tile) {
    const int64_t streams = batch * (p.dim / tile);
    int64_t n = 1;
    if (requested_segments > 0) {
      n = requested_segments;
    } else if (streams < sms) {
      n = std::min<int64_t>(std::max<int64_t>(1, sms / streams), std::max<int64_t>(1, seqlen / kFusedMinSegment));
    }
    return std::max<int64_t>(1, std::min(n, max_segments));
  };
  // A split's cost: its phases' waves (streams x segments spread over the SMs) times the segment
  // length times the larger per-token cost, plus kFusedPhaseCost per grid phase (one without a
  // split, two with one).
  auto cost = [&](int64_t tile, int64_t n, FusedLaunchInfo* info) {
    const int64_t streams = batch * (p.dim / tile);
    split_lengths(seqlen, n, kFusedTokenTile, &info->n_segments, &info->seg_len);
    info->channel_tile = tile;
    const int64_t waves = (streams * info->n_segments + sms - 1) / sms +
                          (streams * (info->n_segments - 1) + sms - 1) / sms;
    const double per_exp = tile == 16 ? kFusedNarrowCost : (info->seg_len <= kFusedShortStream ? 1.14 : 1.0);
    const double scan = double(tile) * per_exp;
    const double load = double(p.kdim()) * elem * (1.0 + double(tile + 2 * p.dstate) / double(kFusedTokenTile)) /
                        kFusedLoadBytesPerUnit;
    return double(waves) * double(info->seg_len) * std::max(scan, load) +
           (info->n_segments == 1 ? 1.0 : 2.0) * kFusedPhaseCost;
  };
  // Candidates: per allowed channel tile, no split, the largest split and every power of two below
  // it (a requested split: that one only). Among those within kFusedPlanTie of the cheapest, the one
  // with the most segments (then the cheaper): the model cannot tell such splits apart and the
  // measured time favoured more segments (docs/perf/batch1.md).
  constexpr int kMaxCandidates = 2 * 10;
  FusedLaunchInfo cand[kMaxCandidates];
  double cand_cost[kMaxCandidates];
  int count = 0;
  for (int64_t tile : {int64_t(64), int64_t(16)}) {
    if (tile == 16 && (!narrow_ok || requested_channel_tile == 64)) continue;
    if (tile == 64 && requested_channel_tile == 16) continue;
    const int64_t top = top_split(tile);
    for (int64_t n = 1; count < kMaxCandidates; n *= 2) {
      const int64_t m = std::min(n, top);
      if (requested_segments <= 0 || m == top) {
        cand_cost[count] = cost(tile, m, &cand[count]);
        ++count;
      }
      if (m == top) break;
    }
  }
  double cheapest = cand_cost[0];
  for (int i = 1; i < count; ++i) cheapest = std::min(cheapest, cand_cost[i]);
  int best = -1;
  for (int i = 0; i < count; ++i) {
    if (cand_cost[i] > cheapest * (1.0 + kFusedPlanTie)) continue;
    if (best < 0 || cand[i].n_segments > cand[best].n_segments ||
        (cand[i].n_segments == cand[best].n_segments && cand_cost[i] < cand_cost[best]))
      best = i;
  }
  *out = cand[best];
  return cudaSuccess;
}

namespace {
template <class E, bool k3x>
int max_stages(int64_t n) {
  switch (n) {
    case 8: return fused::Config<E, 8, k3x>::kStages;
    case 16: return fused::Config<E, 16, k3x>::kStages;
    case 32: return fused::Config<E, 32, k3x>::kStages;
    case 64: return fused::Config<E, 64, k3x>::kStages;
    default: return 0;
  }
}
}  // namespace

int fused_max_ring_stages(DType dtype, int64_t dstate, bool fp32_3xtf32) {
  switch (dtype) {
    case DType::kBFloat16: return max_stages<::cute::bfloat16_t, false>(dstate);
    case DType::kFloat16: return max_stages<::cute::half_t, false>(dstate);
    case DType::kFloat32:
      return fp32_3xtf32 ? max_stages<float, true>(dstate) : max_stages<float, false>(dstate);
  }
  return 0;
}

bool fused_packed_built() {
#ifndef SELSCAN_FUSED_NO_PACKED
  return true;
#else
  return false;
#endif
}

cudaError_t fused_launch(const FusedParams& p, cudaStream_t stream) {
  if (p.n_segments < 1 || p.seg_len % kFusedTokenTile != 0 || (p.n_segments > 1 && p.workspace == nullptr))
    return cudaErrorInvalidValue;
  // Packed: this build's kernel must take them; one segment, one row of x, the 64-channel layout (the
  // narrow one's epilogue and the in-kernel conv are not adapted; the block's conv runs before it).
  if (p.cu_seqlens != nullptr &&
      (!fused_packed_built() || p.n_segments != 1 || p.batch != 1 || p.num_seqs < 1 || p.channel_tile != 64 ||
       p.conv_weight != nullptr))
    return cudaErrorInvalidValue;
  switch (p.dtype) {
    case DType::kBFloat16: return fused::launch_dtype<::cute::bfloat16_t, false>(p, stream);
    case DType::kFloat16: return fused::launch_dtype<::cute::half_t, false>(p, stream);
    case DType::kFloat32:
      return p.fp32_3xtf32 ? fused::launch_dtype<float, true>(p, stream)
                           : fused::launch_dtype<float, false>(p, stream);
  }
  return cudaErrorInvalidValue;
}

bool fused_bwd_supported(DType dtype, int64_t dstate) {
  return (dtype == DType::kBFloat16 || dtype == DType::kFloat16) && dstate == 16;
}

cudaError_t fused_bwd_plan(const FusedParams& p, int64_t requested_segments, int device, FusedLaunchInfo* out) {
  int sms = 0;
  SELSCAN_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int64_t seqlen = std::max<int64_t>(p.seqlen, 1);
  const int64_t streams = std::max<int64_t>(p.batch, 1) * (p.dim / kFusedChannelTile);
  const int64_t tile = kCkptEvery;  // a segment is whole tiles of one checkpoint interval
  const int64_t max_segments = (seqlen + tile - 1) / tile;
  int64_t n = 1;
  if (requested_segments > 0) {
    n = requested_segments;
  } else if (streams < sms) {
    n = std::max<int64_t>(1, sms / streams);
    n = std::min<int64_t>(n, std::max<int64_t>(1, seqlen / kFusedBwdMinSegment));
  }
  split_lengths(seqlen, std::max<int64_t>(1, std::min(n, max_segments)), tile, &out->n_segments, &out->seg_len);
  out->channel_tile = kFusedChannelTile;
  return cudaSuccess;
}

cudaError_t fused_bwd_launch(const FusedParams& p, const ScanBwdParams& q, int threads_per_channel,
                             cudaStream_t stream) {
  if (!fused_bwd_supported(p.dtype, p.dstate) || !fused_bwd_layout_ok(threads_per_channel) || p.n_segments < 1 ||
      p.seg_len % kCkptEvery != 0 || (p.n_segments > 1 && q.workspace == nullptr))
    return cudaErrorInvalidValue;
  switch (p.dtype) {
    case DType::kBFloat16: return fused::launch_bwd_dtype<::cute::bfloat16_t>(p, q, threads_per_channel, stream);
    case DType::kFloat16: return fused::launch_bwd_dtype<::cute::half_t>(p, q, threads_per_channel, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace selscan
