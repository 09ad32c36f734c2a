// What the one-SM micro-benchmarks share: error checks, the MUFU exponential, and timing a kernel
// that writes its loop's SM clocks to cycles[blockIdx.x] (one CTA per SM).
#pragma once
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

constexpr float kLog2eF = 1.4426950408889634f, kLn2F = 0.6931471805599453f;

// Reduce-scatter of v[0 .. m) over the G lanes whose lane / STRIDE differ in the bits below G (G, STRIDE
// powers of 2; STRIDE 1: adjacent lanes): afterwards v[0 .. m / G) holds the group's totals of indices
// base .. base + m / G. A shuffle, an add and two selects per pair and level. Call with m = M, base = 0.
template <int M, int m, int G, int STRIDE = 1>
__device__ __forceinline__ void reduce_scatter(float (&v)[M], int lane, int& base) {
  if constexpr (G > 1) {
    constexpr int half = m / 2;
    const bool upper = (lane / STRIDE) & (G / 2);
#pragma unroll
    for (int i = 0; i < half; ++i) {
      const float send = upper ? v[i] : v[i + half];
      const float keep = upper ? v[i + half] : v[i];
      v[i] = keep + __shfl_xor_sync(0xffffffffu, send, (G / 2) * STRIDE);
    }
    if (upper) base += half;
    reduce_scatter<M, half, G / 2, STRIDE>(v, lane, base);
  }
}

__device__ __forceinline__ float ex2(float x) {
  float y;
  asm volatile("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// The slowest CTA's loop time in SM clocks (cycles[0 .. sms), one per CTA), after a synchronised run.
inline long long slowest_cta(const long long* cycles, int sms) {
  long long* host = new long long[sms];
  CHECK(cudaMemcpy(host, cycles, sizeof(long long) * sms, cudaMemcpyDeviceToHost));
  long long worst = 0;
  for (int i = 0; i < sms; ++i) worst = host[i] > worst ? host[i] : worst;
  delete[] host;
  return worst;
}

// Launches `kern` on `sms` CTAs twice (the first launch warms up) and returns the slowest CTA's
// loop clocks of the second.
template <class Kernel, class... Args>
long long slowest_of_two_launches(Kernel kern, int sms, int threads, int smem, const long long* cycles,
                                  Args... args) {
  CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  for (int rep = 0; rep < 2; ++rep) {
    kern<<<sms, threads, smem>>>(args...);
    CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());
  }
  return slowest_cta(cycles, sms);
}
