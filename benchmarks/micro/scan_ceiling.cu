// The ceiling of the scan's instruction mix on one SM (H100/H200), and what the work the fused kernel
// puts beside its scan (shared-memory traffic, bulk copies, the tensor cores' products) costs it.
//
// Per element (token t, channel d, state n) the recurrence needs five instructions: the exponent's
// product dt*A, the exponential (MUFU ex2), dt*x*B, the state h = dA*h + dt*x*B and y += C*h. This
// runs exactly that with everything in registers (or, with kLoads, B and C read from shared memory
// per token as the fused kernel does), for several chains per thread (K) and warps per SM (W), and
// reports exponentials per SM clock (clock64 around the loop; the MUFU peak is 16, four per
// scheduler). It bounds what any layout of the fused kernel's scan can reach. `loop64` then runs the
// fused kernel's own loop, alone and beside a second warpgroup (kNoise, below), and `mix_beside` the
// bare recurrence beside the products. docs/perf/layer-forward.md, "After v3.7: the scan loop's ceiling, and
// what sharing the SM with the products costs" and "Any scan layout beside the products".
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
//        -I<cutlass>/include -o scan_ceiling benchmarks/micro/scan_ceiling.cu
//   (<cutlass>: the nvidia-cutlass wheel's cutlass_library/source)
//   ./scan_ceiling
#include <cstdio>
#include <cstdlib>

#include "micro_common.cuh"
#include "products_role.cuh"

// B and C rows of 64 tokens for mix_loop (K / 4 float4 of each per token), fixed values.
template <int K>
__device__ __forceinline__ void fill_bc_rows(float4* sm) {
  for (int i = threadIdx.x; i < 64 * (K / 2); i += blockDim.x)
    sm[i] = make_float4(0.5f + 1e-3f * i, 0.25f, 1.f - 1e-3f * i, 0.75f);
}

// K chains per thread, U tokens per unrolled step; kLoads: B and C of each token from shared memory
// (one 16-byte load per 4 states, the same address across the warp).
template <int K, int U, bool kLoads>
__device__ __forceinline__ float mix_loop(const float4* sm, int tid, int tokens, float dt0, long long& clocks) {
  static_assert(!kLoads || K % 4 == 0, "whole groups of 4 states");
  float A[K], h[K], B[K], C[K];
#pragma unroll
  for (int c = 0; c < K; ++c) {
    A[c] = -0.05f * (c + 1) - 1e-5f * tid;
    h[c] = 0.f;
    B[c] = 0.5f + 0.01f * c;
    C[c] = 1.f - 0.01f * c;
  }
  const float x = 1.f + 1e-3f * (tid & 31);
  float dt = dt0, ysum = 0.f;
  const long long t_start = clock64();
  for (int t = 0; t < tokens; t += U) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      dt += 1e-7f;  // a new step size every token (no exponential is loop-invariant)
      const float dtx = dt * x;
      if constexpr (kLoads) {
        const float4* row = sm + ((t + u) & 63) * (K / 2);  // B then C of this token: K / 4 float4 each
#pragma unroll
        for (int q = 0; q < K; q += 4) {
          const float4 b = row[q / 4], cc = row[K / 4 + q / 4];
          B[q] = b.x; B[q + 1] = b.y; B[q + 2] = b.z; B[q + 3] = b.w;
          C[q] = cc.x; C[q + 1] = cc.y; C[q + 2] = cc.z; C[q + 3] = cc.w;
        }
      }
      float y0 = 0.f, y1 = 0.f;
#pragma unroll
      for (int c = 0; c < K; ++c) {
        const float e = ex2(dt * A[c]);
        h[c] = fmaf(e, h[c], dtx * B[c]);
        if (c & 1) y1 = fmaf(C[c], h[c], y1); else y0 = fmaf(C[c], h[c], y0);
      }
      ysum += y0 + y1;
    }
  }
  clocks = clock64() - t_start;
  float s = ysum;
#pragma unroll
  for (int c = 0; c < K; ++c) s += h[c];
  return s;
}

template <int K, int U, bool kLoads>
__global__ void __launch_bounds__(1024, 1) mix(float* out, long long* cycles, int tokens, float dt0) {
  extern __shared__ float4 sm[];
  const int tid = threadIdx.x;
  fill_bc_rows<K>(sm);
  __syncthreads();
  long long clocks = 0;
  out[blockIdx.x * blockDim.x + tid] = mix_loop<K, U, kLoads>(sm, tid, tokens, dt0, clocks);
  if (tid == 0) cycles[blockIdx.x] = clocks;
}

template <int K, int U, bool kLoads>
void run(int warps, int sms, int tokens, float* out, long long* cycles) {
  const int threads = warps * 32;
  // 150 KB of shared memory: one CTA per SM
  const long long worst = slowest_of_two_launches(mix<K, U, kLoads>, sms, threads, 150 * 1024, cycles, out, cycles,
                                                  tokens, 0.01f);
  const double exps = double(threads) * K * tokens;
  std::printf("%-6s K=%2d U=%d warps/SM=%2d (per scheduler %d): %6.2f exp per SM clock (%.0f%% of MUFU peak)\n",
              kLoads ? "loads" : "regs", K, U, warps, warps / 4, exps / double(worst), 100.0 * exps / double(worst) / 16.0);
}


// The fused kernel's long-stream scan loop as it is (scan_phase in csrc/fused/fused_kernel.cuh with
// Config kCh = 2: two channels x 4 states per thread, 4 threads per channel, 64 channels on 128
// threads), copied on purpose: scan_phase runs only inside the kernel's roles and pipelines. It runs
// on hand-off tiles that stay in shared memory: dt and B, C in float32, the x tile in bf16, the y of each
// 4 tokens reduce-scattered over the channel's 4 threads by shuffles and stored (kStore) to global
// memory. What separates it from `mix` is the loop's own structure; what separates the fused kernel
// from it is the tensor-core work, the hand-off barriers and the softplus sharing the SM.
// kNoise: what a second warpgroup (one warp per scheduler) does beside the scan. 1 = shared-memory
// reads, each warp one 16-byte load at a time (a dependent chain: moderate traffic); 2 = independent
// 16-byte loads (as much shared-memory bandwidth as they take); 3-9 = the products (products_role).
// kPrefetch: the loop's shared-memory loads issued one group of 4 tokens ahead.
template <bool kStore, int kNoise = 0, bool kPrefetch = false>
__global__ void __launch_bounds__(288, 1) loop64(unsigned* y, long long* cycles, int tokens, float* out,
                                                 const unsigned char* src) {
  extern __shared__ __align__(1024) float4 sm4[];
  constexpr int kLdDt = 72, kLdN = 24, kDt = 64;
  float* sdt = reinterpret_cast<float*>(sm4);
  float* sB = sdt + 64 * kLdDt;
  float* sC = sB + 64 * kLdN;
  unsigned short* sx = reinterpret_cast<unsigned short*>(sC + 64 * kLdN);
  const int tid = threadIdx.x;
  for (int i = tid; i < 64 * kLdDt; i += blockDim.x) sdt[i] = 0.01f + 1e-5f * (i % 97);
  for (int i = tid; i < 64 * kLdN; i += blockDim.x) { sB[i] = 0.5f + 1e-3f * (i % 13); sC[i] = 1.f - 1e-3f * (i % 11); }
  for (int i = tid; i < 64 * kDt; i += blockDim.x) sx[i] = 0x3f80 + (i % 7);  // bf16 values near 1
  float4* noise = sm4 + 4096;  // 64 KB past the start, beyond the tiles above
  volatile int* done = reinterpret_cast<volatile int*>(noise + 4096);
  for (int i = tid; i < 4096; i += blockDim.x) noise[i] = make_float4(0.f, 1.f, 2.f, 3.f);
  if (tid == 0) *done = 0;
  __syncthreads();
  if (tid >= 128) {  // the noise warpgroup (and, kNoise == 5 or 6, a copy warp)
    if constexpr (kNoise == 1 || kNoise == 2) {
      const int lane = tid % 32;
      int idx = (tid - 128) * 32 + lane;
      float a = 0.f;
      long long loads = 0;
      while (*done == 0) {
        loads += 16;
        if constexpr (kNoise == 1) {
#pragma unroll
          for (int i = 0; i < 16; ++i) {
            const float4 v = noise[idx & 4095];
            idx += 128 + __float_as_int(v.x);  // the next address waits for this load (v.x = +0)
          }
        } else {
          float4 v[16];
#pragma unroll
          for (int i = 0; i < 16; ++i) v[i] = noise[(idx + 128 * i) & 4095];
#pragma unroll
          for (int i = 0; i < 16; ++i) a += v[i].y;
          idx += 2048;
        }
      }
      out[gridDim.x * 128 + blockIdx.x * 128 + tid - 128] = a + float(idx);
      if (tid == 128) cycles[gridDim.x + blockIdx.x] = loads * 4 * 512;  // bytes: 4 warps x 512 per load
    } else if constexpr (kNoise >= 3) {
      products_role<kNoise>(reinterpret_cast<unsigned char*>(noise), done, cycles, src, out, tid);
    }
    return;
  }
  constexpr int kW = 8;
  const int c = ((tid / 32) * kW + tid % kW) * 2, g = (tid % 32) / kW, n0 = g * 4;
  float A2[2][4], h[2][4], dskip[2] = {1.f, 0.5f}, acc = 0.f;
#pragma unroll
  for (int ch = 0; ch < 2; ++ch)
#pragma unroll
    for (int n = 0; n < 4; ++n) { A2[ch][n] = -1.4427f * (n0 + n + 1) * (1.f + 0.01f * ch); h[ch][n] = 0.f; }
  const long long t_start = clock64();
  for (int t0 = 0; t0 < tokens; t0 += 64) {
    const int n_valid = tokens - t0 < 64 ? tokens - t0 : 64;
    const float* dtp = sdt + c;
    const unsigned short* xp = sx + c;
    unsigned* yp = y + (size_t(blockIdx.x) * 1024 + (t0 & 1023) + g) * (kDt / 2) + c / 2;
    // One group's shared-memory operands (4 tokens): dt and x of both channels, 4 states of B and C.
    struct Raw {
      float2 d2[4];
      unsigned xu[4];
      float4 b4[4], c4[4];
    };
    auto load = [&](int tg) {
      Raw r;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        r.d2[j] = *reinterpret_cast<const float2*>(dtp + (tg + j) * kLdDt);
        r.xu[j] = *reinterpret_cast<const unsigned*>(xp + (tg + j) * kDt);
        r.b4[j] = *reinterpret_cast<const float4*>(sB + (tg + j) * kLdN + n0);
        r.c4[j] = *reinterpret_cast<const float4*>(sC + (tg + j) * kLdN + n0);
      }
      return r;
    };
    Raw next;
    if constexpr (kPrefetch) next = load(0);
#pragma unroll 4
    for (int tg = 0; tg < 64; tg += 4) {
      // kPrefetch: the next group's loads are issued before this group's work (the last group of the
      // tile wraps to the first: the same tile again, as this micro-benchmark reuses it).
      Raw r;
      if constexpr (kPrefetch) {
        r = next;
        next = load((tg + 4) & 63);
      } else {
        r = load(tg);
      }
      float dt[4][2], dtx[4][2], xv[4][2];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        dt[j][0] = r.d2[j].x; dt[j][1] = r.d2[j].y;
        xv[j][0] = __uint_as_float(r.xu[j] << 16); xv[j][1] = __uint_as_float(r.xu[j] & 0xffff0000u);
        dtx[j][0] = dt[j][0] * xv[j][0]; dtx[j][1] = dt[j][1] * xv[j][1];
      }
      float ys[2][4] = {};
      float Bq[4][4], Cq[4][4], dA[4][2][4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        Bq[j][0] = r.b4[j].x; Bq[j][1] = r.b4[j].y; Bq[j][2] = r.b4[j].z; Bq[j][3] = r.b4[j].w;
        Cq[j][0] = r.c4[j].x; Cq[j][1] = r.c4[j].y; Cq[j][2] = r.c4[j].z; Cq[j][3] = r.c4[j].w;
      }
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int ch = 0; ch < 2; ++ch)
#pragma unroll
          for (int n = 0; n < 4; ++n) dA[j][ch][n] = ex2(dt[j][ch] * A2[ch][n]);
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int ch = 0; ch < 2; ++ch)
#pragma unroll
          for (int n = 0; n < 4; ++n) {
            h[ch][n] = fmaf(dA[j][ch][n], h[ch][n], dtx[j][ch] * Bq[j][n]);
            ys[ch][j] = fmaf(Cq[j][n], h[ch][n], ys[ch][j]);
          }
      const bool hi = g & 2, lo = g & 1;
      float o[2];
#pragma unroll
      for (int ch = 0; ch < 2; ++ch) {
        float k0 = hi ? ys[ch][2] : ys[ch][0], k1 = hi ? ys[ch][3] : ys[ch][1];
        const float s0 = hi ? ys[ch][0] : ys[ch][2], s1 = hi ? ys[ch][1] : ys[ch][3];
        k0 += __shfl_xor_sync(0xffffffffu, s0, 16);
        k1 += __shfl_xor_sync(0xffffffffu, s1, 16);
        float total = lo ? k1 : k0;
        total += __shfl_xor_sync(0xffffffffu, lo ? k0 : k1, 8);
        const float xg = g == 0 ? xv[0][ch] : (g == 1 ? xv[1][ch] : (g == 2 ? xv[2][ch] : xv[3][ch]));
        o[ch] = fmaf(dskip[ch], xg, total);
      }
      if (kStore) {
        if (tg + g < n_valid) {
          const unsigned lo16 = __float_as_uint(o[0]) >> 16, hi16 = __float_as_uint(o[1]) & 0xffff0000u;
          *yp = lo16 | hi16;  // truncating bf16 pair: the store, not its rounding, is what is measured
        }
        yp += 4 * (kDt / 2);
      } else {
        acc += o[0] + o[1];
      }
    }
  }
  const long long t_end = clock64();
#pragma unroll
  for (int ch = 0; ch < 2; ++ch)
#pragma unroll
    for (int n = 0; n < 4; ++n) acc += h[ch][n];
  out[blockIdx.x * 128 + tid] = acc;
  if (tid == 0) {
    cycles[blockIdx.x] = t_end - t_start;
    *done = 1;
  }
}

template <bool kStore, int kNoise = 0, bool kPrefetch = false>
void run_loop64(int sms, int tokens, unsigned* y, float* out, long long* cycles, const unsigned char* src) {
  const int threads = kNoise == 0 ? 128 : (kNoise == 5 || kNoise == 6 ? 288 : 256);
  const long long worst = slowest_of_two_launches(loop64<kStore, kNoise, kPrefetch>, sms, threads, 150 * 1024, cycles,
                                                  y, cycles, tokens, out, src);
  long long counters[2] = {0, 0};  // CTA 0's noise: bytes read or flops; bytes copied
  if (kNoise) CHECK(cudaMemcpy(&counters[0], cycles + sms, sizeof(long long), cudaMemcpyDeviceToHost));
  if (kNoise == 5 || kNoise == 6) CHECK(cudaMemcpy(&counters[1], cycles + 2 * sms, sizeof(long long), cudaMemcpyDeviceToHost));
  const double exps = 128.0 * 8 * tokens;
  const char* what[] = {"", " + smem reader, chained", " + smem reader, streaming", " + wgmma, full rate",
                        " + wgmma, paced", " + wgmma, paced, + bulk copies", " + bulk copies",
                        " + wgmma N = 32, paced", " + wgmma M = 64, N = 192, paced",
                        " + wgmma with x from registers (ldmatrix), paced"};
  if (kNoise == 1 || kNoise == 2)
    std::printf("  (noise: %.0f bytes of shared memory per SM clock)\n", double(counters[0]) / double(worst));
  if ((kNoise >= 3 && kNoise <= 5) || kNoise >= 7)
    std::printf("  (wgmma: %.0f flops per SM clock)\n", double(counters[0]) / double(worst));
  if (kNoise == 5 || kNoise == 6) std::printf("  (bulk copies: %.0f bytes per SM clock)\n", double(counters[1]) / double(worst));
  std::printf("fused kernel's loop (2 ch x 4 states, y reduce-scatter%s)%s%s: %6.2f exp per SM clock (%.0f%% of MUFU peak)\n",
              kStore ? " + store" : ", no store",
              what[kNoise],
              kPrefetch ? ", loads a group ahead" : "", exps / double(worst), 100.0 * exps / double(worst) / 16.0);
}

// The bare recurrence (mix_loop) on `warps` scan warps, beside the products of products_role<kNoise>
// on one more warpgroup (one warp per scheduler): what any scan layout can reach while the tensor
// cores work on the same SM.
template <int K, int U, bool kLoads, int kNoise>
__global__ void __launch_bounds__(416, 1) mix_beside(float* out, long long* cycles, int tokens, float dt0,
                                                     const unsigned char* src, int scan_threads) {
  extern __shared__ __align__(1024) float4 sm4[];
  const int tid = threadIdx.x;
  fill_bc_rows<K>(sm4);
  float4* noise = sm4 + 4096;  // 64 KB on
  volatile int* done = reinterpret_cast<volatile int*>(noise + 4096);
  for (int i = tid; i < 4096; i += blockDim.x) noise[i] = make_float4(0.f, 1.f, 2.f, 3.f);
  if (tid == 0) *done = 0;
  __syncthreads();
  if (tid >= scan_threads) {
    products_role<kNoise>(reinterpret_cast<unsigned char*>(noise), done, cycles, src, out, tid - scan_threads + 128);
    return;
  }
  long long clocks = 0;
  const long long t0 = clock64();
  out[blockIdx.x * 128 + tid % 128] = mix_loop<K, U, kLoads>(sm4, tid, tokens, dt0, clocks);
  asm volatile("bar.sync 2, %0;\n" ::"r"(scan_threads) : "memory");  // every scan warp is done
  if (tid == 0) {
    cycles[blockIdx.x] = clock64() - t0;
    *done = 1;
  }
}

template <int K, int U, bool kLoads, int kNoise>
void run_beside(int warps, int sms, int tokens, float* out, long long* cycles, const unsigned char* src) {
  const long long worst = slowest_of_two_launches(mix_beside<K, U, kLoads, kNoise>, sms,
                                                  warps * 32 + (kNoise == 5 ? 160 : 128), 150 * 1024, cycles, out,
                                                  cycles, tokens, 0.01f, src, warps * 32);
  long long flops = 0, copied = 0;
  CHECK(cudaMemcpy(&flops, cycles + sms, sizeof(long long), cudaMemcpyDeviceToHost));
  if (kNoise == 5) {
    CHECK(cudaMemcpy(&copied, cycles + 2 * sms, sizeof(long long), cudaMemcpyDeviceToHost));
    std::printf("  (bulk copies: %.0f bytes per SM clock)\n", double(copied) / double(worst));
  }
  const double exps = double(warps * 32) * K * tokens;
  std::printf("%-6s K=%2d U=%d warps/SM=%2d (per scheduler %d) + wgmma %-14s: %6.2f exp per SM clock (%.0f%% of MUFU peak; "
              "wgmma %.0f flops per SM clock)\n",
              kLoads ? "loads" : "regs", K, U, warps, warps / 4,
              products_label(kNoise), exps / double(worst),
              100.0 * exps / double(worst) / 16.0, double(flops) / double(worst));
}

int main() {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  float* out;
  long long* cycles;
  CHECK(cudaMalloc(&out, sizeof(float) * sms * 1024));  // loop64 writes 2 x 128 per CTA
  CHECK(cudaMalloc(&cycles, sizeof(long long) * sms * 3));
  const int tokens = 1 << 14;
  run<8, 4, false>(4, sms, tokens, out, cycles);
  run<8, 4, false>(8, sms, tokens, out, cycles);
  run<4, 8, false>(8, sms, tokens, out, cycles);
  run<16, 2, false>(4, sms, tokens, out, cycles);
  run<4, 8, false>(16, sms, tokens, out, cycles);
  run<8, 4, true>(4, sms, tokens, out, cycles);
  run<8, 4, true>(8, sms, tokens, out, cycles);
  run<4, 8, true>(8, sms, tokens, out, cycles);
  run<16, 2, true>(4, sms, tokens, out, cycles);
  // S1's narrow layout has 256 chains per SM (16 channels x 16 states): how fast can so few go?
  run<2, 8, false>(4, sms, tokens, out, cycles);
  run<1, 16, false>(8, sms, tokens, out, cycles);
  run<4, 8, false>(2, sms, tokens, out, cycles);
  run<2, 8, false>(8, sms, tokens, out, cycles);
  unsigned* y;
  CHECK(cudaMalloc(&y, sizeof(unsigned) * size_t(sms) * 1024 * 32));
  unsigned char* src;  // what the bulk copies read: 16 x 28 KB per CTA
  CHECK(cudaMalloc(&src, size_t(sms) * 16 * 28672));
  CHECK(cudaMemset(src, 0, size_t(sms) * 16 * 28672));
  run_loop64<false>(sms, tokens, y, out, cycles, src);
  run_loop64<true>(sms, tokens, y, out, cycles, src);
  run_loop64<true, 1>(sms, tokens, y, out, cycles, src);
  run_loop64<true, 2>(sms, tokens, y, out, cycles, src);
  run_loop64<true, 0, true>(sms, tokens, y, out, cycles, src);
  run_loop64<true, 2, true>(sms, tokens, y, out, cycles, src);
  run_loop64<true, 3>(sms, tokens, y, out, cycles, src);
  run_loop64<true, 4>(sms, tokens, y, out, cycles, src);
  run_loop64<true, 5>(sms, tokens, y, out, cycles, src);
  run_loop64<true, 6>(sms, tokens, y, out, cycles, src);
  run_loop64<true, 7>(sms, tokens, y, out, cycles, src);
  run_loop64<true, 8>(sms, tokens, y, out, cycles, src);
  run_loop64<true, 9>(sms, tokens, y, out, cycles, src);
  run_loop64<true, 4, true>(sms, tokens, y, out, cycles, src);
  run_loop64<true, 5, true>(sms, tokens, y, out, cycles, src);
  run_loop64<true, 6, true>(sms, tokens, y, out, cycles, src);
  // The bare recurrence beside the products (mix_beside): 1 and 2 scan warps per scheduler.
  run_beside<8, 4, false, 4>(4, sms, tokens, out, cycles, src);
  run_beside<8, 4, false, 4>(8, sms, tokens, out, cycles, src);
  run_beside<8, 4, true, 4>(4, sms, tokens, out, cycles, src);
  run_beside<8, 4, true, 4>(8, sms, tokens, out, cycles, src);
  run_beside<4, 8, true, 4>(8, sms, tokens, out, cycles, src);
  run_beside<8, 4, false, 10>(4, sms, tokens, out, cycles, src);
  run_beside<8, 4, false, 10>(8, sms, tokens, out, cycles, src);
  run_beside<8, 4, true, 10>(8, sms, tokens, out, cycles, src);
  run_beside<8, 4, false, 3>(8, sms, tokens, out, cycles, src);
  run_beside<8, 4, true, 3>(8, sms, tokens, out, cycles, src);
  run_beside<4, 8, true, 10>(8, sms, tokens, out, cycles, src);
  run_beside<4, 8, true, 3>(8, sms, tokens, out, cycles, src);
  run_beside<4, 8, true, 5>(8, sms, tokens, out, cycles, src);
  run_beside<8, 4, true, 5>(4, sms, tokens, out, cycles, src);
  // S1's 256 chains per SM beside S1's products (128 tokens x 48 features): paced to the rate that
  // S1 at 2x the unfused path would run them at, and at full rate.
  run_beside<2, 8, false, 11>(4, sms, tokens, out, cycles, src);
  run_beside<1, 16, false, 11>(8, sms, tokens, out, cycles, src);
  run_beside<2, 8, false, 12>(4, sms, tokens, out, cycles, src);
  run_beside<1, 16, false, 12>(8, sms, tokens, out, cycles, src);
  run_beside<2, 8, false, 13>(4, sms, tokens, out, cycles, src);
  CHECK(cudaFree(src));
  CHECK(cudaFree(y));
  CHECK(cudaFree(out));
  CHECK(cudaFree(cycles));
  return 0;
}
