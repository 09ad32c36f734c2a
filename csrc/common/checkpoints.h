// The forward's checkpoints, shared by both paths: when a backward will follow, the forward (the
// unfused scan or the fused kernel) saves the state entering every kCkptEvery-th token, so that the
// backward (csrc/scan/scan_bwd_kernel.cuh) recomputes the forward states one chunk at a time instead
// of keeping (batch, L, D, N) of them. Layout (batch, ckpt_count(L), D, N) float32; checkpoint q
// holds the state before token q * kCkptEvery of its sequence (q = 0: h0, or zeros).
#pragma once
#include <cstdint>

namespace selscan {

constexpr int64_t kCkptEvery = 64;
inline constexpr int64_t ckpt_count(int64_t seqlen) { return (seqlen + kCkptEvery - 1) / kCkptEvery; }

}  // namespace selscan
