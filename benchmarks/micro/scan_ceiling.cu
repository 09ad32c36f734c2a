// The ceiling of the scan's instruction mix on one SM (H100/H200), with no tensor-core work beside it,
// and what a shared-memory reader beside the fused kernel's scan loop costs it.
//
// Per element (token t, channel d, state n) the recurrence needs five instructions: the exponent's
// product dt*A, the exponential (MUFU ex2), dt*x*B, the state h = dA*h + dt*x*B and y += C*h. This
// runs exactly that with everything in registers (or, with kLoads, B and C read from shared memory
// per token as the fused kernel does), for several chains per thread (K) and warps per SM (W), and
// reports exponentials per SM clock (clock64 around the loop; the MUFU peak is 16, four per
// scheduler). It bounds what any layout of the fused kernel's scan can reach (docs/perf-notes.md,
// "After v3.7: the scan loop's ceiling, and what sharing the SM with the products costs").
//
//   nvcc -O3 -gencode=arch=compute_90a,code=sm_90a -o scan_ceiling benchmarks/micro/scan_ceiling.cu
//   ./scan_ceiling
#include <cstdio>
#include <cstdlib>

#define CHECK(x)                                                                         \
  do {                                                                                   \
    cudaError_t e_ = (x);                                                                \
    if (e_ != cudaSuccess) {                                                             \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_));    \
      std::exit(1);                                                                      \
    }                                                                                    \
  } while (0)

__device__ __forceinline__ float ex2(float x) {
  float y;
  asm volatile("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// K chains per thread, U tokens per unrolled step; kLoads: B and C of each token from shared memory
// (one 16-byte load per 4 states, the same address across the warp).
template <int K, int U, bool kLoads>
__global__ void __launch_bounds__(1024, 1) mix(float* out, long long* cycles, int tokens, float dt0) {
  extern __shared__ float4 sm[];
  const int tid = threadIdx.x;
  static_assert(K % 4 == 0, "whole groups of 4 states");
  for (int i = tid; i < 64 * (K / 2); i += blockDim.x)
    sm[i] = make_float4(0.5f + 1e-3f * i, 0.25f, 1.f - 1e-3f * i, 0.75f);
  __syncthreads();
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
  const long long t_end = clock64();
  float s = ysum;
#pragma unroll
  for (int c = 0; c < K; ++c) s += h[c];
  out[blockIdx.x * blockDim.x + tid] = s;
  if (tid == 0) cycles[blockIdx.x] = t_end - t_start;
}

template <int K, int U, bool kLoads>
void run(int warps, int sms, int tokens, float* out, long long* cycles) {
  const int threads = warps * 32;
  const int smem = 150 * 1024;  // one CTA per SM
  CHECK(cudaFuncSetAttribute(mix<K, U, kLoads>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  for (int rep = 0; rep < 2; ++rep) {  // the first launch warms up
    mix<K, U, kLoads><<<sms, threads, smem>>>(out, cycles, tokens, 0.01f);
    CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());
  }
  long long* host = new long long[sms];
  CHECK(cudaMemcpy(host, cycles, sizeof(long long) * sms, cudaMemcpyDeviceToHost));
  long long worst = 0;
  for (int i = 0; i < sms; ++i) worst = host[i] > worst ? host[i] : worst;
  delete[] host;
  const double exps = double(threads) * K * tokens;
  std::printf("%-6s K=%2d U=%d warps/SM=%2d (per scheduler %d): %6.2f exp per SM clock (%.0f%% of MUFU peak)\n",
              kLoads ? "loads" : "regs", K, U, warps, warps / 4, exps / double(worst), 100.0 * exps / double(worst) / 16.0);
}

// The fused kernel's long-stream scan loop as it is (csrc/fused/fused_kernel.cuh, scan_phase, Config
// kCh = 2: two channels x 4 states per thread, 4 threads per channel, 64 channels on 128 threads), on
// hand-off tiles that stay in shared memory: dt and B, C in float32, the x tile in bf16, the y of each
// 4 tokens reduce-scattered over the channel's 4 threads by shuffles and stored (kStore) to global
// memory. What separates it from `mix` is the loop's own structure; what separates the fused kernel
// from it is the tensor-core work, the hand-off barriers and the softplus sharing the SM.
// kNoise: a second warpgroup (one warp per scheduler) reads shared memory beside the scan, as the
// tensor cores' operand reads and the TMA's writes do in the fused kernel: 1 = each warp one 16-byte
// load at a time (a dependent chain: moderate traffic), 2 = independent 16-byte loads (as much
// shared-memory bandwidth as they can take).
template <bool kStore, int kNoise = 0>
__global__ void __launch_bounds__(256, 1) loop64(unsigned* y, long long* cycles, int tokens, float* out) {
  extern __shared__ float4 sm4[];
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
  if (tid >= 128) {  // the noise warpgroup
    if constexpr (kNoise > 0) {
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
      if (tid == 128) cycles[gridDim.x + blockIdx.x] = loads;  // per noise warp (all four alike)
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
#pragma unroll 4
    for (int tg = 0; tg < 64; tg += 4) {
      float dt[4][2], dtx[4][2], xv[4][2];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 d2 = *reinterpret_cast<const float2*>(dtp + (tg + j) * kLdDt);
        dt[j][0] = d2.x; dt[j][1] = d2.y;
        const unsigned u = *reinterpret_cast<const unsigned*>(xp + (tg + j) * kDt);
        xv[j][0] = __uint_as_float(u << 16); xv[j][1] = __uint_as_float(u & 0xffff0000u);
        dtx[j][0] = dt[j][0] * xv[j][0]; dtx[j][1] = dt[j][1] * xv[j][1];
      }
      float ys[2][4] = {};
      float Bq[4][4], Cq[4][4], dA[4][2][4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float4 b4 = *reinterpret_cast<const float4*>(sB + (tg + j) * kLdN + n0);
        const float4 c4 = *reinterpret_cast<const float4*>(sC + (tg + j) * kLdN + n0);
        Bq[j][0] = b4.x; Bq[j][1] = b4.y; Bq[j][2] = b4.z; Bq[j][3] = b4.w;
        Cq[j][0] = c4.x; Cq[j][1] = c4.y; Cq[j][2] = c4.z; Cq[j][3] = c4.w;
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

template <bool kStore, int kNoise = 0>
void run_loop64(int sms, int tokens, unsigned* y, float* out, long long* cycles) {
  const int smem = 150 * 1024;
  CHECK(cudaFuncSetAttribute(loop64<kStore, kNoise>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  for (int rep = 0; rep < 2; ++rep) {
    loop64<kStore, kNoise><<<sms, kNoise ? 256 : 128, smem>>>(y, cycles, tokens, out);
    CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());
  }
  long long* host = new long long[sms];
  CHECK(cudaMemcpy(host, cycles, sizeof(long long) * sms, cudaMemcpyDeviceToHost));
  long long worst = 0;
  for (int i = 0; i < sms; ++i) worst = host[i] > worst ? host[i] : worst;
  long long noise_loads = 0;
  if (kNoise) CHECK(cudaMemcpy(&noise_loads, cycles + sms, sizeof(long long), cudaMemcpyDeviceToHost));
  delete[] host;
  const double exps = 128.0 * 8 * tokens;
  // Each noise load: 32 lanes x 16 bytes; 4 noise warps. Approximate (CTA 0's count over the worst time).
  if (kNoise) std::printf("  (noise: %.0f bytes of shared memory per SM clock)\n", 4.0 * 512.0 * double(noise_loads) / double(worst));
  std::printf("fused kernel's loop (2 ch x 4 states, y reduce-scatter%s)%s: %6.2f exp per SM clock (%.0f%% of MUFU peak)\n",
              kStore ? " + store" : ", no store",
              kNoise == 0 ? "" : (kNoise == 1 ? " + smem reader, chained" : " + smem reader, streaming"), exps / double(worst), 100.0 * exps / double(worst) / 16.0);
}

int main() {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  float* out;
  long long* cycles;
  CHECK(cudaMalloc(&out, sizeof(float) * sms * 1024));  // loop64 writes 2 x 128 per CTA
  CHECK(cudaMalloc(&cycles, sizeof(long long) * sms * 2));
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
  unsigned* y;
  CHECK(cudaMalloc(&y, sizeof(unsigned) * size_t(sms) * 1024 * 32));
  run_loop64<false>(sms, tokens, y, out, cycles);
  run_loop64<true>(sms, tokens, y, out, cycles);
  run_loop64<true, 1>(sms, tokens, y, out, cycles);
  run_loop64<true, 2>(sms, tokens, y, out, cycles);
  CHECK(cudaFree(y));
  CHECK(cudaFree(out));
  CHECK(cudaFree(cycles));
  return 0;
}
