// Can the tensor cores take the scan's non-exponential work, and does that lift its exponential rate
// beside the products? (H100/H200, one CTA per SM.)
//
// Every built scan layout spends five or more FMA-pipe instructions per element (token t, channel d,
// state n) around its one MUFU ex2: dt * A, dt * x * B, h = dA * h + dt * x * B, y += C * h, and the
// y reduction over the lanes that hold a channel's states. Two of those are products that a
// warpgroup-wide wgmma can form straight into the scan's registers, in the layout the scan wants:
// - y[d, t] = sum_n h[t, d, n] C[t, n]: A = the state itself (64 channels x the 16 states of one
//   token, from registers: the accumulator layout of the scan's chains is wgmma's A-fragment layout),
//   B = a block-diagonal tile whose column t holds C[t, :] (8 x 16 per token in shared memory);
// - u[t, d] B[t, n] (u = dt * x): A = u (64 channels x 8 tokens, shared memory), B = a block-
//   diagonal tile whose column (t, n) holds B[t, n] in row t: the result lands in the accumulator
//   layout, 2 channels x 4 states x 8 tokens per thread, and the recurrence updates it in place.
// What is left on the FMA pipe per element is then dt * A, the ex2 and one FFMA.
//
// Warpgroup 0 runs 1024 chains (64 channels x 16 states, 8 per thread, one warp per scheduler: the
// fused kernel's long-stream layout) over `tokens` tokens, in blocks of 8, reading dt (and u, B, C
// where the FMA pipe forms them) from shared memory as the kernel's hand-off would; warpgroup 1 runs
// products_role (products_role.cuh): none, paced to 1400 flops per SM clock (S2's rate), or at full
// rate. Modes (kMode):
//   0: every product on the FMA pipe (5 instructions per element, y summed per thread, no reduction);
//   1: y by wgmma (bf16 h, m64n8k16 per token), u * B on the FMA pipe;
//   2: u * B by wgmma (tf32, m64n128k8 per 8 tokens), y on the FMA pipe (summed per thread);
//   3: both by wgmma (u * B as in 2, y as in 1; ptxas serialises its wgmma, C7514, so this mode only
//      bounds the cost);
//   4: as 1, with the wait for a block's y a whole block later (just before the next block's y).
// Timing only: the shared-memory operands hold fixed values and the block-diagonal tiles are not
// built (the tensor cores take the same time whatever the values). Output: exponentials per SM clock
// (MUFU peak 16) and the products' flops per SM clock. docs/perf/layer-forward.md, "The scan's products on
// the tensor cores".
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
//        -I<cutlass>/include -o tensor_scan benchmarks/micro/tensor_scan.cu
//   (<cutlass>: the nvidia-cutlass wheel's cutlass_library/source)
//   ./tensor_scan
#include <cstdio>
#include <cstdlib>
#include <utility>

#include <cuda_bf16.h>

#include "micro_common.cuh"
#include "products_role.cuh"

using namespace cute;
namespace G = cute::SM90::GMMA;

// Shared memory (bytes from the dynamic base): the products' 64 KB region first (1024-aligned).
constexpr int kRegion = 0;
constexpr int kDt = 65536;            // dt: 16 blocks x [64 channels][8 tokens] fp32 (32 KB)
constexpr int kU = kDt + 32768;       // u = dt * x, same layout (32 KB)
constexpr int kB = kU + 32768;        // B and C rows for the FMA pipe: 8 tokens x 16 states x 2 (1 KB)
constexpr int kYB = kB + 1024;        // y's B operand: 16 slots x 256 B (4 KB)
constexpr int kUA = kYB + 4096;       // u * B's A: 64 x 8 tf32 (2 KB)
constexpr int kUB = kUA + 2048;       // u * B's B: 128 x 8 tf32 (4 KB)
constexpr int kFlag = kUB + 4096;     // the scan's stop flag for the products role (16 B)
constexpr int kSmem = kFlag + 16;

template <class T, int N, int K>
__device__ uint64_t kmajor_desc(void* p) {
  auto t = make_tensor(make_smem_ptr(reinterpret_cast<T*>(p)),
                       tile_to_shape(GMMA::Layout_K_INTER_Atom<T>{}, Shape<Int<N>, Int<K>>{}));
  return uint64_t(G::make_gmma_desc<GMMA::Major::K>(t));
}

template <size_t... I>
__device__ __forceinline__ void ub_mma(uint64_t da, uint64_t db, float* d, GMMA::ScaleOut s,
                                       std::index_sequence<I...>) {
  G::MMA_64x128x8_F32TF32TF32_SS_TN<>::fma(da, db, d[I]..., s);
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// One thread's chains: channels c0 = 16 * warp + lane / 4 and c0 + 8, states {2q, 2q + 1, 8 + 2q,
// 9 + 2q} (q = lane % 4), i.e. rows and columns of the wgmma accumulator. Index c * 4 + s.
//
// The wgmma pipeline, per block j of 8 tokens:
// - mode 2: wait for u * B of block j, then issue u * B of block j + 1 into the other buffer;
// - mode 3: u * B runs two blocks ahead: block j waits for u * B(j) (issued at the end of block
//   j - 2) and, at its end, issues u * B(j + 2) into its own buffer, whose last reader was its own
//   recurrence;
// - modes 1 and 3: after token 0's chains, wait for y of block j - 1 and read its accumulator; mode 4
//   waits for it at the end of block j instead, just before issuing y of block j;
// - modes 1, 3, 4: each token's bf16 fragment is packed as its chains finish; all 8 y wgmma go out at
//   the block's end, so all 8 fragments are live at once and ptxas keeps them in separate registers
//   (when it reused one quad for every token it serialised every wgmma: C7515).
// The y accumulator keeps summing across blocks (read, never zeroed: a zeroing instruction or a zero
// scale lets ptxas put a fragment in the accumulator's registers, serialising again). A real kernel
// would take differences or alternate two accumulators; the timing is the same.
template <int kMode>
__device__ __forceinline__ float scan_role(unsigned char* sm, int tid, int tokens, long long& clocks) {
  constexpr bool kFmaUB = kMode <= 1 || kMode == 4;  // u * B on the FMA pipe
  const int warp = tid / 32, lane = tid % 32, q = lane % 4;
  const int c0 = 16 * warp + lane / 4;
  float A[8], h[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    A[i] = -0.05f * (i + 1) - 1e-5f * tid;
    h[i] = 0.f;
  }
  const float4* dt_s = reinterpret_cast<const float4*>(sm + kDt);
  const float4* u_s = reinterpret_cast<const float4*>(sm + kU);
  const float4* bc_s = reinterpret_cast<const float4*>(sm + kB);  // [token][B q | C q] float4
  const uint64_t yb0 = kmajor_desc<cutlass::bfloat16_t, 8, 16>(sm + kYB);
  const uint64_t uba = kmajor_desc<cutlass::tfloat32_t, 64, 8>(sm + kUA);
  const uint64_t ubb = kmajor_desc<cutlass::tfloat32_t, 128, 8>(sm + kUB);
  float ysum = 0.f;
  float yacc[4] = {};
  float X[2][64];  // modes 2, 3: u * B of two blocks
  const int blocks = tokens / 8;
  const long long t_start = clock64();
  if constexpr (kMode == 2) {
    warpgroup_arrive();
    ub_mma(uba, ubb, X[0], GMMA::ScaleOut::Zero, std::make_index_sequence<64>{});
    warpgroup_commit_batch();
  }
  if constexpr (kMode == 3) {
    // u * B of blocks 0 and 1; the first done before the loop (no y group is ahead of it)
    warpgroup_arrive();
    ub_mma(uba, ubb, X[0], GMMA::ScaleOut::Zero, std::make_index_sequence<64>{});
    warpgroup_commit_batch();
    ub_mma(uba, ubb, X[1], GMMA::ScaleOut::Zero, std::make_index_sequence<64>{});
    warpgroup_commit_batch();
    warpgroup_wait<1>();
  }
  for (int j = 0; j < blocks; j += 2) {
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      const int blk = (j + b) & 15;
      if constexpr (kMode == 2) {
        warpgroup_wait<0>();  // u * B of this block
#pragma unroll
        for (int i = 0; i < 64; ++i) warpgroup_fence_operand(X[b][i]);
#pragma unroll
        for (int i = 0; i < 64; ++i) warpgroup_fence_operand(X[b ^ 1][i]);
        warpgroup_arrive();
        ub_mma(uba, ubb, X[b ^ 1], GMMA::ScaleOut::Zero, std::make_index_sequence<64>{});
        warpgroup_commit_batch();
      }
      if constexpr (kMode == 3) {
        // in flight, oldest first: y(j - 2), u * B(j), y(j - 1), u * B(j + 1)
        warpgroup_wait<2>();
#pragma unroll
        for (int i = 0; i < 64; ++i) warpgroup_fence_operand(X[b][i]);
      }
      // dt of the thread's two channels over the block's 8 tokens: [block][channel][token] in smem
      float dt[2][8], u[2][8];
      const auto load8 = [&](const float4* base, float (&v)[2][8]) {
        const float4* p = base + blk * 128 + c0 * 2;
        const float4 a0 = p[0], a1 = p[1], a2 = p[16], a3 = p[17];
        v[0][0] = a0.x; v[0][1] = a0.y; v[0][2] = a0.z; v[0][3] = a0.w;
        v[0][4] = a1.x; v[0][5] = a1.y; v[0][6] = a1.z; v[0][7] = a1.w;
        v[1][0] = a2.x; v[1][1] = a2.y; v[1][2] = a2.z; v[1][3] = a2.w;
        v[1][4] = a3.x; v[1][5] = a3.y; v[1][6] = a3.z; v[1][7] = a3.w;
      };
      load8(dt_s, dt);
      if constexpr (kFmaUB) load8(u_s, u);
      uint32_t fr[8][4];
#pragma unroll
      for (int t = 0; t < 8; ++t) {
        float Bv[4], Cv[4];
        if constexpr (kFmaUB) {
          const float4 bq = bc_s[t * 8 + q];
          Bv[0] = bq.x; Bv[1] = bq.y; Bv[2] = bq.z; Bv[3] = bq.w;
        }
        if constexpr (kMode == 0 || kMode == 2) {
          const float4 cq = bc_s[t * 8 + 4 + q];
          Cv[0] = cq.x; Cv[1] = cq.y; Cv[2] = cq.z; Cv[3] = cq.w;
        }
        float y0 = 0.f, y1 = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const int c = i / 4, s = i % 4;
          const float e = ex2(dt[c][t] * A[i]);
          if constexpr (kFmaUB) {
            h[i] = fmaf(e, h[i], u[c][t] * Bv[s]);
          } else {
            // accumulator index of (token t, channel c, state s): column 16 t + {2q, 2q + 1, 8 + 2q, 9 + 2q}
            h[i] = fmaf(e, h[i], X[b][8 * t + (s / 2) * 4 + c * 2 + (s % 2)]);
          }
          if constexpr (kMode == 0 || kMode == 2) {
            if (c) y1 = fmaf(Cv[s], h[i], y1); else y0 = fmaf(Cv[s], h[i], y0);
          }
        }
        if constexpr (kMode == 0 || kMode == 2) {
          ysum += y0 + y1;
        } else {
          if (t == 0 && kMode != 4) {
            warpgroup_wait<kMode == 3 ? 1 : 0>();  // y of the previous block (mode 3: u * B(j + 1) may run on)
#pragma unroll
            for (int i = 0; i < 4; ++i) warpgroup_fence_operand(yacc[i]);
            ysum += yacc[0] + yacc[1] + yacc[2] + yacc[3];
          }
          // A fragment (m64 k16, bf16): rows c0 / c0 + 8, k = states 2q, 2q + 1 / 8 + 2q, 9 + 2q.
          fr[t][0] = pack_bf16(h[0], h[1]);
          fr[t][1] = pack_bf16(h[4], h[5]);
          fr[t][2] = pack_bf16(h[2], h[3]);
          fr[t][3] = pack_bf16(h[6], h[7]);
        }
      }
      if constexpr (kMode == 4) {
        warpgroup_wait<0>();  // y of the previous block, issued a whole block ago
#pragma unroll
        for (int i = 0; i < 4; ++i) warpgroup_fence_operand(yacc[i]);
        ysum += yacc[0] + yacc[1] + yacc[2] + yacc[3];
      }
      if constexpr (kMode == 1 || kMode == 3 || kMode == 4) {
#pragma unroll
        for (int t = 0; t < 8; ++t)
#pragma unroll
          for (int i = 0; i < 4; ++i) warpgroup_fence_operand(fr[t][i]);
        warpgroup_arrive();
#pragma unroll
        for (int t = 0; t < 8; ++t)
          G::MMA_64x8x16_F32BF16BF16_RS<GMMA::Major::K, GMMA::Major::K>::fma(
              fr[t][0], fr[t][1], fr[t][2], fr[t][3], yb0 + 16 * t, yacc[0], yacc[1], yacc[2], yacc[3]);
        warpgroup_commit_batch();
#pragma unroll
        for (int i = 0; i < 4; ++i) warpgroup_fence_operand(yacc[i]);
      }
      if constexpr (kMode == 3) {
        // u * B of block j + 2 into this block's buffer, whose last reader was this block's recurrence
#pragma unroll
        for (int i = 0; i < 64; ++i) warpgroup_fence_operand(X[b][i]);
        warpgroup_arrive();
        // scale One: with a zero scale ptxas knows the buffer dead after the recurrence and packs the
        // fragments into it, then serialises every wgmma (C7515). A real kernel would pass a zero
        // scale that ptxas cannot see (a run-time value).
        ub_mma(uba, ubb, X[b], GMMA::ScaleOut::One, std::make_index_sequence<64>{});
        warpgroup_commit_batch();
      }
    }
  }
  if constexpr (kMode != 0) {
    warpgroup_wait<0>();
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      warpgroup_fence_operand(yacc[i]);
      ysum += yacc[i];
    }
  }
  if constexpr (kMode >= 2) {
#pragma unroll
    for (int i = 0; i < 64; ++i) {
      warpgroup_fence_operand(X[0][i]);
      ysum += X[0][i];
    }
  }
  clocks = clock64() - t_start;
  float s = ysum;
#pragma unroll
  for (int i = 0; i < 8; ++i) s += h[i];
  return s;
}

template <int kMode, int kNoise>
__global__ void __launch_bounds__(256, 1) tensor_scan(float* out, long long* cycles, int tokens) {
  extern __shared__ __align__(1024) unsigned char sm[];
  const int tid = threadIdx.x;
  float* f = reinterpret_cast<float*>(sm);
  for (int i = tid; i < kSmem / 4; i += blockDim.x) f[i] = 0.01f + 1e-6f * (i & 1023);  // finite, non-zero
  __syncthreads();  // the flag below lies in the filled region: set it after every thread's fill
  volatile int* done = reinterpret_cast<volatile int*>(sm + kFlag);
  if (tid == 0) *done = 0;
  __syncthreads();
  if (tid >= 128) {
    if constexpr (kNoise != 0)
      products_role<kNoise>(sm + kRegion, done, cycles, nullptr, out, tid);  // no bulk copies (modes 5, 6)
    else if (tid == 128)
      cycles[gridDim.x + blockIdx.x] = 0;
    return;
  }
  long long clocks = 0;
  const long long t0 = clock64();
  out[blockIdx.x * 128 + tid] = scan_role<kMode>(sm, tid, tokens, clocks);
  asm volatile("bar.sync 2, 128;\n" ::: "memory");  // every scan warp is done
  if (tid == 0) {
    cycles[blockIdx.x] = clock64() - t0;
    *done = 1;
  }
}

template <int kMode, int kNoise>
void run(int sms, int tokens, float* out, long long* cycles) {
  const long long worst = slowest_of_two_launches(tensor_scan<kMode, kNoise>, sms, 256, kSmem, cycles, out,
                                                  cycles, tokens);
  long long flops = 0;
  CHECK(cudaMemcpy(&flops, cycles + sms, sizeof(long long), cudaMemcpyDeviceToHost));
  static const char* names[] = {"all on the FMA pipe (5 / element)", "y by wgmma (bf16), u*B FMA",
                                "u*B by wgmma (tf32), y FMA", "u*B (tf32) and y (bf16) by wgmma", "as 1, y waited for a block later"};
  const double exps = 128.0 * 8 * tokens;
  std::printf("mode %d %-36s + %-14s: %6.2f exp per SM clock (%.0f%% of MUFU peak; products %.0f flops per SM clock)\n",
              kMode, names[kMode], kNoise ? products_label(kNoise) : "nothing", exps / double(worst),
              100.0 * exps / double(worst) / 16.0, double(flops) / double(worst));
}

template <int kMode>
void run_all(int sms, int tokens, float* out, long long* cycles) {
  run<kMode, 0>(sms, tokens, out, cycles);
  run<kMode, 4>(sms, tokens, out, cycles);
  run<kMode, 10>(sms, tokens, out, cycles);
  run<kMode, 3>(sms, tokens, out, cycles);
}

int main() {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  float* out;
  long long* cycles;
  CHECK(cudaMalloc(&out, sizeof(float) * sms * 256));
  CHECK(cudaMalloc(&cycles, sizeof(long long) * sms * 2));
  const int tokens = 1 << 14;
  run_all<0>(sms, tokens, out, cycles);
  run_all<1>(sms, tokens, out, cycles);
  run_all<2>(sms, tokens, out, cycles);
  run_all<3>(sms, tokens, out, cycles);
  run_all<4>(sms, tokens, out, cycles);
  CHECK(cudaFree(out));
  CHECK(cudaFree(cycles));
  return 0;
}
