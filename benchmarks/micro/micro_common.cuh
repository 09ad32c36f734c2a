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
