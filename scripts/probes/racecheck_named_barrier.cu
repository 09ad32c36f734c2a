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
// Each checks its own output, so the run also says whether the hand-off delivered the values. Modes 0,
// 1 and 3 are race-free by the PTX barrier semantics (every read is ordered after its write by a
// completed barrier, every write after the previous read of its stage).
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o probe scripts/probes/racecheck_named_barrier.cu
//   for m in 0 1 2 3; do compute-sanitizer --tool racecheck --racecheck-report hazard ./probe $m; done
#include <cstdio>
#include <cstdlib>

constexpr int kThreads = 256, kHalf = 128, kRounds = 8;

__device__ __forceinline__ void bar_sync(int id, int n) { asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ void bar_arrive(int id, int n) { asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(n) : "memory"); }

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
  probe<kMode><<<1, kThreads>>>(out);
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
    default: std::fprintf(stderr, "mode must be 0, 1, 2 or 3\n"); return 2;
  }
}
