// Host-side check of csrc/common/seq_map.h, driven by tests/test_seq_map.py: reads cases from stdin,
// each "total num_seqs tile cu[0] .. cu[num_seqs]", and for each prints "ok" or the first violation of:
//   runs (the conv's packed policy): every slot j < packed_slots(total, num_seqs, tile) is mapped by
//     seq_of_slot to a sequence; the live slots (index >= 0, index * tile < len) cover every token of
//     every sequence exactly once, each run inside its sequence;
//   checkpoints (the scan's): sequence s's slots seq_first_slot(start, s, 64) + q, q < ceil(len / 64),
//     are below packed_slots(total, num_seqs, 64) and no two sequences share one.
// With cu_seqlens values that are not a valid partition (the clamped case), only the bounds are checked.
#include <cstdint>
#include <cstdio>
#include <vector>

#include "common/seq_map.h"

using namespace selscan;

int main() {
  long long total, S, tile;
  while (std::scanf("%lld %lld %lld", &total, &S, &tile) == 3) {
    std::vector<int32_t> cu(S + 1);
    for (auto& v : cu) std::scanf("%d", &v);
    bool valid = cu[0] == 0 && cu[S] == total;
    for (long long s = 0; s < S; ++s) valid = valid && cu[s] <= cu[s + 1];
    const char* err = nullptr;
    char buf[256];
    // runs
    std::vector<int> cover(total, 0);
    const long long slots = packed_slots(total, S, tile);
    for (long long j = 0; j < slots && !err; ++j) {
      SeqRange r;
      int64_t index = 0;
      const int64_t s = seq_of_slot(cu.data(), S, total, tile, j, &r, &index);
      if (s < 0 || s >= S) {
        std::snprintf(buf, sizeof buf, "slot %lld: sequence %lld", j, (long long)s);
        err = buf;
      }
      if (err || index < 0 || index * tile >= r.len) continue;
      const long long a = r.start + index * tile;
      const long long e = r.start + (index * tile + tile < r.len ? index * tile + tile : r.len);
      if (a < r.start || e > r.start + r.len || e > total) {
        std::snprintf(buf, sizeof buf, "slot %lld: run [%lld, %lld) outside its sequence", j, a, e);
        err = buf;
      }
      for (long long t = a; t < e && !err; ++t) ++cover[t];
    }
    if (valid && !err) {
      for (long long t = 0; t < total; ++t)
        if (cover[t] != 1) {
          std::snprintf(buf, sizeof buf, "token %lld covered %d times", t, cover[t]);
          err = buf;
          break;
        }
    }
    // checkpoints
    std::vector<int> used(packed_slots(total, S, 64), 0);
    for (long long s = 0; s < S && !err; ++s) {
      const SeqRange r = seq_range(cu.data(), s, total);
      for (long long q = 0; q * 64 < r.len && !err; ++q) {
        const long long slot = seq_first_slot(r.start, s, 64) + q;
        if (slot < 0 || slot >= (long long)used.size()) {
          std::snprintf(buf, sizeof buf, "sequence %lld checkpoint %lld: slot %lld of %zu", s, q, slot, used.size());
          err = buf;
        } else if (valid && used[slot]++) {
          std::snprintf(buf, sizeof buf, "checkpoint slot %lld shared", slot);
          err = buf;
        }
      }
    }
    std::printf("%s\n", err ? err : "ok");
  }
  return 0;
}
