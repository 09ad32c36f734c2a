// What compute-sanitizer's racecheck makes of the fused kernel's hand-off (docs/reliability.md, "Runs"):
// one group of warps writes a shared-memory tile and signals with `bar.arrive id, n`, the other waits
// with `bar.sync id, n` and reads it (the tensor-core warpgroup -> scan warpgroup hand-off of
// csrc/fused/fused_kernel.cuh, named barriers kBarFull / kBarEmpty), through a two-stage ring. One CTA
// of 256 threads; the mode (the program's argument) picks the kernel:
//   0  writer bar.arrive on "full", reader bar.sync; the first two rounds skip the "empty" wait
//   1  the same with bar.sync on both sides of "full"
//   2  no barrier at all: a real race, which the tool must report
//   3  the fused kernel's own order: the reader arrives on both "empty" barriers first, the writer
//      waits on "empty" before every write and arrives on "full" after it
//   4  the same ring through mbarriers in shared memory ("full": 128 writer arrivals, "empty": 128
//      reader arrivals; waits on the phase parity, the writer's first wait on each "empty" passing at
//      once), the form of the hand-off built with SELSCAN_HANDOFF_MBARRIER=1
// Each checks its own output, so the run also says whether the hand-off delivered the values. Modes 0,
// 1, 3 and 4 are race-free by the PTX barrier semantics (every read is ordered after its write by a
// completed barrier, every write after the previous read of its stage).
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o probe scripts/probes/racecheck_named_barrier.cu
//   for m in 0 1 2 3 4; do compute-sanitizer --tool racecheck --racecheck-report hazard ./probe $m; done
#include <cstdint>
#include <cstdio>
#include <cstdlib>

constexpr int kThreads = 256, kHalf = 128, kRounds = 8;

__device__ __forceinline__ void bar_sync(int id, int n) { asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ void bar_arrive(int id, int n) { asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(n) : "memory"); }

__device__ __forceinline__ uint32_t smem(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void mbar_init(uint64_t* b, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem(b)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* b) {  // release at CTA scope
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem(b)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* b, uint32_t parity) {  // acquire at CTA scope
  uint32_t done = 0;
  while (!done) {
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done) : "r"(smem(b)), "r"(parity) : "memory");
  }
}

__global__ void __launch_bounds__(kThreads) probe_mbarrier(int* out) {
  __shared__ int tile[2][kHalf];
  __shared__ uint64_t full[2], empty[2];
  const int tid = threadIdx.x;
  if (tid == 0) {
    for (int s = 0; s < 2; ++s) { mbar_init(&full[s], kHalf); mbar_init(&empty[s], kHalf); }
  }
  __syncthreads();
  if (tid < kHalf) {  // the writer group
    for (int r = 0; r < kRounds; ++r) {
      const int st = r % 2;
      const uint32_t phase = (r / 2) & 1;
      mbar_wait(&empty[st], phase ^ 1);  // round 0 and 1: the phase before the first, complete
      tile[st][tid] = r * 1000 + tid;
      mbar_arrive(&full[st]);
    }
  } else {  // the reader group
    int sum = 0;
    for (int r = 0; r < kRounds; ++r) {
      const int st = r % 2;
      const uint32_t phase = (r / 2) & 1;
      mbar_wait(&full[st], phase);
      sum += tile[st][tid - kHalf] - r * 1000;
      mbar_arrive(&empty[st]);
    }
    out[tid - kHalf] = sum;
  }
}

// Barrier ids 1, 2: "full" of stages 0, 1; 3, 4: "empty" of stages 0, 1.
template <int kMode>
__global__ void __launch_bounds__(kThreads) probe(int* out) {
  __shared__ int tile[2][kHalf];
  const int tid = threadIdx.x;
  if (tid < kHalf) {  // the writer group
    for (int r = 0; r < kRounds; ++r) {
      const int st = r % 2;
      if ((r >= 2 && kMode != 2) || kMode == 3) bar_sync(3 + st, kThreads);  // the reader is done with it
      tile[st][tid] = r * 1000 + tid;
      if (kMode == 0 || kMode == 3) bar_arrive(1 + st, kThreads);
      if (kMode == 1) bar_sync(1 + st, kThreads);
    }
  } else {  // the reader group
    if (kMode == 3) {
      bar_arrive(3, kThreads);
      bar_arrive(4, kThreads);
    }
    int sum = 0;
    for (int r = 0; r < kRounds; ++r) {
      const int st = r % 2;
      if (kMode != 2) bar_sync(1 + st, kThreads);
      sum += tile[st][tid - kHalf] - r * 1000;
      if (kMode != 2 && r + 2 < kRounds) bar_arrive(3 + st, kThreads);
    }
    out[tid - kHalf] = sum;  // kRounds * (tid - kHalf) when every round's value arrived
  }
}

template <int kMode>
bool run(const char* name, int* out) {
  cudaMemset(out, 0xff, kHalf * sizeof(int));
  if constexpr (kMode == 4) probe_mbarrier<<<1, kThreads>>>(out); else probe<kMode><<<1, kThreads>>>(out);
  cudaError_t e = cudaDeviceSynchronize();
  int host[kHalf];
  cudaMemcpy(host, out, sizeof(host), cudaMemcpyDeviceToHost);
  int wrong = 0;
  for (int i = 0; i < kHalf; ++i) wrong += host[i] != kRounds * i;
  std::printf("%s: %s, %d of %d values wrong\n", name, cudaGetErrorString(e), wrong, kHalf);
  return e == cudaSuccess;
}

int main(int argc, char** argv) {
  const int mode = argc > 1 ? std::atoi(argv[1]) : 0;
  int* out = nullptr;
  if (cudaMalloc(&out, kHalf * sizeof(int)) != cudaSuccess) return 2;
  switch (mode) {
    case 0: return run<0>("mode 0 (writer bar.arrive, reader bar.sync)", out) ? 0 : 1;
    case 1: return run<1>("mode 1 (bar.sync on both sides)", out) ? 0 : 1;
    case 2: return run<2>("mode 2 (no barrier: a real race)", out) ? 0 : 1;
    case 3: return run<3>("mode 3 (the fused kernel's order: empty pre-arrived)", out) ? 0 : 1;
    case 4: return run<4>("mode 4 (the same ring through mbarriers)", out) ? 0 : 1;
    default: std::fprintf(stderr, "mode must be 0, 1, 2, 3 or 4\n"); return 2;
  }
}
