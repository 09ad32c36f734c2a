// Packed variable-length sequences (cu_seqlens): num_seqs sequences stored one after another as the rows
// of one (1, total, .) tensor, sequence s in rows [cu_seqlens[s], cu_seqlens[s + 1]). Shared by the
// scan kernels (an item per sequence and channel tile) and the conv kernels (runs that never cross a
// sequence start). Torch-free.
//
// The values are read on the device. The API checks them once on the host unless the caller promises
// they are valid (validate=False); so that unchecked bad values cannot send a kernel outside its
// tensors, every range is clamped into [0, total] here (a bad cu_seqlens then gives wrong results for
// the sequences it misdescribes, never an out-of-bounds access).
//
// Slots. A sequence of len tokens needs ceil(len / tile) of something per tile of tokens (the scan's
// checkpoints every 64 tokens, the conv's runs). Sequence s takes the slots from floor(start / tile) + s
// on: the ranges of consecutive sequences never overlap (floor((start + len) / tile) + 1 >=
// floor(start / tile) + ceil(len / tile)), and all of them fit in packed_slots(total, num_seqs, tile) =
// floor(total / tile) + num_seqs slots, a bound the host knows without reading the values.
#pragma once
#include <cstdint>

#include "checkpoints.h"

// Host and device: the kernels use these, and tests/test_seq_map.py runs them on the host (a plain C++
// build) over random length mixes.
// Internal linkage: the CUDA and the plain C++ translation units each get their own copy.
#ifdef __CUDACC__
#define SELSCAN_SEQ_FN static __host__ __device__ __forceinline__
#else
#define SELSCAN_SEQ_FN static inline
#endif

namespace selscan {

inline int64_t packed_slots(int64_t total, int64_t num_seqs, int64_t tile) { return total / tile + num_seqs; }

struct SeqRange {
  int64_t start, len;
};

SELSCAN_SEQ_FN SeqRange seq_range(const int32_t* __restrict__ cu, int64_t s, int64_t total) {
  int64_t a = cu[s], b = cu[s + 1];
  a = a < 0 ? 0 : (a > total ? total : a);
  b = b < a ? a : (b > total ? total : b);
  return {a, b - a};
}

SELSCAN_SEQ_FN int64_t seq_first_slot(int64_t start, int64_t s, int64_t tile) { return start / tile + s; }

// The sequence whose slots hold slot j: the last s with seq_first_slot(start_s, s) <= j (a binary search
// over num_seqs + 1 entries; the first slots are non-decreasing in s and step at least 1). Returns the
// sequence, its range and the slot's index inside it (which may be past the sequence's own slots: a gap).
SELSCAN_SEQ_FN int64_t seq_of_slot(const int32_t* __restrict__ cu, int64_t num_seqs, int64_t total, int64_t tile,
                                   int64_t j, SeqRange* range, int64_t* index) {
  int64_t lo = 0, hi = num_seqs - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    const SeqRange r = seq_range(cu, mid, total);
    if (seq_first_slot(r.start, mid, tile) <= j) lo = mid; else hi = mid - 1;
  }
  *range = seq_range(cu, lo, total);
  *index = j - seq_first_slot(range->start, lo, tile);
  return lo;
}

// The rows of one scan work item (both scan kernels, forward and backward): sequence b's tokens
// [t_begin, t_end) of segment seg, its first row and its first checkpoint slot. Packed: the whole
// sequence from cu_seqlens (never split), its checkpoints from seq_first_slot; a batch: segment seg of
// seg_len tokens, the sequence at row b * seqlen, its checkpoints at b * ckpt_count(seqlen).
struct ItemRows {
  int64_t t_begin, t_end, row0, ckpt0;
};

template <bool kPacked>
SELSCAN_SEQ_FN ItemRows item_rows(const int32_t* __restrict__ cu, int64_t b, int64_t seg, int64_t seg_len,
                                  int64_t seqlen) {
  if constexpr (kPacked) {
    const SeqRange r = seq_range(cu, b, seqlen);
    return {0, r.len, r.start, seq_first_slot(r.start, b, kCkptEvery)};
  } else {
    const int64_t t0 = seg * seg_len, t1 = t0 + seg_len;
    return {t0, t1 < seqlen ? t1 : seqlen, b * seqlen, b * ckpt_count(seqlen)};
  }
}

}  // namespace selscan
