// The fused kernel's products as a role beside a scan in the one-SM micro-benchmarks (scan_ceiling.cu,
// narrow_loop.cu): warpgroup-wide wgmma on a 64 KB region of shared memory, paced to a given rate.
#pragma once
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/numeric_types.h>

// The fused kernel's products beside the scan (kNoise 3-9), on a 64 KB region of shared memory:
// warpgroup 1 issues the kernel's wgmma, x (128 x 64) against a stacked weight tile (96 x 64), bf16,
// 128-byte swizzle, float32 accumulators, one batch of 4 K steps at a time: as fast as it can (3),
// or paced to 1400 flops per SM clock (4, 5: the kernel's rate on S2, ~41% of the tensor peak); warp 8
// (5, 6) streams 28 KB bulk copies (the TMA's path) from global memory into another part of the
// region, two in flight, as the kernel's operand ring does; 7-9 are paced like 4 with another tile
// shape or operand source; 10 is paced to 2000. 11 and 12 are S1's products: 128 tokens against its
// 48 feature rows (dt of 16 channels, B, C), paced to 740 flops per SM clock (11: the rate at which S1
// would run them at 2x the unfused path, 0.0415 ms) or as fast as they go (12); 13 and 14 are 11 and
// 12 with the 128 x 64 token tile (wgmma's A) in registers, brought there once: wgmma then reads only
// the 48-row weight tile from shared memory, as products whose x came from global memory straight
// into registers would; 15 is 13 with the token tile brought to registers by ldmatrix for every
// batch (as 9). Counters: flops and copied bytes of CTA 0. The role uses named barrier 1 (its 128
// threads): the scan beside it must use others.
// The flops per SM clock mode kNoise is paced to (0: as fast as it goes), and what it does, for the
// benchmarks' printouts.
constexpr int products_pace(int mode) {
  return (mode == 3 || mode == 12 || mode == 14) ? 0
         : mode == 10                            ? 2000
         : (mode == 11 || mode == 13 || mode == 15) ? 740
                                                    : 1400;
}
inline const char* products_label(int mode) {
  switch (mode) {
    case 3: return "full rate";
    case 5: return "1400 + copies";
    case 10: return "paced to 2000";
    case 11: return "S1's tile, paced to 740";
    case 12: return "S1's tile, full rate";
    case 13: return "S1's tile, x in registers, paced to 740";
    case 14: return "S1's tile, x in registers, full rate";
    case 15: return "S1's tile, x by ldmatrix every batch, paced to 740";
    default: return "paced to 1400";
  }
}

template <int kNoise>
__device__ __forceinline__ void products_role(unsigned char* region, volatile int* done, long long* cycles,
                                              const unsigned char* src, float* out, int tid) {
  using namespace cute;
  using E = cutlass::bfloat16_t;
  // The weight tile's rows (the wgmma's N): 96 as in the kernel at N = 16; 32 (7) and 192 (8) move
  // 1.8x and 0.8x the shared-memory bytes per flop, to tell shared-memory reads from other costs; 48
  // (11-15) is S1's narrow tile.
  constexpr int kNW = kNoise == 7 ? 32 : (kNoise == 8 ? 192 : (kNoise >= 11 ? 48 : 96));
  constexpr int kM = kNoise == 8 ? 64 : 128;  // 192 columns on 128 rows would not fit the registers
  using LayoutA = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<E>{}, make_shape(Int<kM>{}, Int<64>{})));
  using LayoutB = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<E>{}, make_shape(Int<kNW>{}, Int<64>{})));
  using Mma = decltype(make_tiled_mma(GMMA::ss_op_selector<E, E, float, Shape<Int<kM>, Int<kNW>, _64>, GMMA::Major::K,
                                                           GMMA::Major::K>()));
  constexpr int kBytesA = 128 * 64 * 2, kBytesB = 96 * 64 * 2, kCopy = kBytesA + kBytesB;
  if (tid < 256) {
    if constexpr (kNoise == 6) return;
    E* a_ptr = reinterpret_cast<E*>(region);           // 1024-aligned (region: 64 KB into the buffer)
    E* b_ptr = reinterpret_cast<E*>(region + kBytesA);
    Tensor sA = make_tensor(make_smem_ptr(a_ptr), LayoutA{});
    Tensor sB = make_tensor(make_smem_ptr(b_ptr), LayoutB{});
    Mma mma;
    auto thr = mma.get_thread_slice(tid - 128);
    Tensor tA = thr.make_fragment_A(thr.partition_A(sA));
    Tensor tB = thr.make_fragment_B(thr.partition_B(sB));
    Tensor acc = partition_fragment_C(mma, Shape<Int<kM>, Int<kNW>>{});
    clear(acc);
    // kNoise 9: the same products with x (A) in registers, brought from shared memory by ldmatrix
    // (wgmma then reads only the weight tile from shared memory).
    using MmaRS = decltype(make_tiled_mma(GMMA::rs_op_selector<E, E, float, Shape<Int<kM>, Int<kNW>, _64>,
                                                               GMMA::Major::K, GMMA::Major::K>()));
    MmaRS mma_rs;
    auto thr_rs = mma_rs.get_thread_slice(tid - 128);
    Tensor rA = thr_rs.partition_fragment_A(sA);
    Tensor tBrs = thr_rs.make_fragment_B(thr_rs.partition_B(sB));
    auto s2r = make_tiled_copy_A(Copy_Atom<SM75_U32x4_LDSM_N, E>{}, mma_rs);
    auto s2r_thr = s2r.get_thread_slice(tid - 128);
    Tensor sA_view = s2r_thr.partition_S(sA);
    Tensor rA_view = s2r_thr.retile_D(rA);
    long long batches = 0;
    const long long t0 = clock64();
    constexpr long long kFlops = 2LL * kM * kNW * 64;                   // per batch
    // clocks per batch; 10: paced to 2000 flops per clock, the rate S2 <= 0.22 ms would ask of the
    // products with B and C recomputed per channel tile
    constexpr long long kPeriod = products_pace(kNoise) == 0 ? 0 : kFlops / products_pace(kNoise);
    constexpr bool kRegsOnce = kNoise == 13 || kNoise == 14;  // A loaded to registers once, before the loop
    if constexpr (kRegsOnce) {
      copy(s2r, sA_view, rA_view);
      warpgroup_fence_operand(rA);
    }
    // wgmma is warpgroup-collective: the four warps must agree on when to stop (one reads the flag,
    // a named barrier hands it to all; two slots, so the next write never races this read).
    volatile int* agree = reinterpret_cast<volatile int*>(region + 65536 - 128);
    for (int it = 0;; ++it) {
      if (tid == 128) agree[it & 1] = *done;
      asm volatile("bar.sync 1, 128;\n" ::: "memory");
      if (agree[it & 1] != 0) break;
      if constexpr (kNoise == 9 || kNoise == 15) {
        copy(s2r, sA_view, rA_view);
        warpgroup_fence_operand(rA);
      }
      warpgroup_fence_operand(acc);
      warpgroup_arrive();
      CUTE_UNROLL
      for (int kb = 0; kb < size<2>(tA); ++kb) {
        if constexpr (kNoise == 9 || kNoise == 15 || kRegsOnce) {
          cute::gemm(mma_rs, rA(_, _, kb), tBrs(_, _, kb), acc);
          mma_rs.accumulate_ = GMMA::ScaleOut::One;
        } else {
          cute::gemm(mma, tA(_, _, kb), tB(_, _, kb), acc);
          mma.accumulate_ = GMMA::ScaleOut::One;
        }
      }
      warpgroup_commit_batch();
      warpgroup_wait<0>();
      warpgroup_fence_operand(acc);
      ++batches;
      if constexpr (kPeriod > 0)
        while (clock64() - t0 < batches * kPeriod) __nanosleep(64);
    }
    float sum = 0.f;
    CUTE_UNROLL
    for (int i = 0; i < size(acc); ++i) sum += acc(i);
    out[gridDim.x * 128 + blockIdx.x * 128 + tid - 128] = sum;
    if (tid == 128) cycles[gridDim.x + blockIdx.x] = batches * kFlops;
  } else if (tid == 256) {
    if constexpr (kNoise == 5 || kNoise == 6) {
      // Bulk copies into the region's second half (32 KB on), two in flight on two mbarriers.
      unsigned char* dst = region + 32768;
      uint64_t* bars = reinterpret_cast<uint64_t*>(region + 65536 - 64);
      const uint32_t bar0 = static_cast<uint32_t>(__cvta_generic_to_shared(bars));
      asm volatile("mbarrier.init.shared.b64 [%0], 1;\n" ::"r"(bar0));
      asm volatile("mbarrier.init.shared.b64 [%0], 1;\n" ::"r"(bar0 + 8));
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
      const unsigned char* base = src + size_t(blockIdx.x) * 16 * kCopy;  // 16 chunks per CTA, from L2
      long long copies = 0;
      uint32_t phase[2] = {0, 0};
      auto issue = [&](int slot, long long n) {
        const uint32_t bar = bar0 + 8 * slot;
        const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst + (slot ? kCopy / 2 : 0)));
        asm volatile("mbarrier.arrive.expect_tx.shared.b64 _, [%0], %1;\n" ::"r"(bar), "r"(kCopy / 2));
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                     ::"r"(d), "l"(base + (n % 32) * (kCopy / 2)), "r"(kCopy / 2), "r"(bar) : "memory");
      };
      issue(0, 0);
      issue(1, 1);
      long long n = 2;
      while (*done == 0) {
        for (int slot = 0; slot < 2; ++slot) {
          const uint32_t bar = bar0 + 8 * slot;
          uint32_t ok = 0;
          while (!ok)
            asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }\n"
                         : "=r"(ok) : "r"(bar), "r"(phase[slot]) : "memory");
          phase[slot] ^= 1;
          copies += kCopy / 2;
          issue(slot, n++);
        }
      }
      for (int slot = 0; slot < 2; ++slot) {  // drain the two copies in flight
        uint32_t ok = 0;
        while (!ok)
          asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }\n"
                       : "=r"(ok) : "r"(bar0 + 8 * slot), "r"(phase[slot]) : "memory");
      }
      if (blockIdx.x == 0) cycles[2 * gridDim.x] = copies;
    }
  }
}
