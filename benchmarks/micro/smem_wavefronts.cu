// Shared-memory wavefronts per load instruction for several lane -> address patterns (H100/H200).
// The scan's loads of B and C are 16-byte loads whose address depends only on the thread's state
// group; this measures what each layout costs (docs/perf/layer-forward.md, "after v3").
//
//   nvcc -O3 -gencode=arch=compute_90a,code=sm_90a -o smem_wavefronts benchmarks/micro/smem_wavefronts.cu
//   ncu --metrics l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum,smsp__sass_inst_executed_op_shared_ld.sum ./smem_wavefronts
//
// Wavefronts per instruction = the first metric / the second, per kernel k<P>.
#include <cstdio>
#include <cstdint>
template <int P>
__global__ void k(float* out, int iters) {
  __shared__ __align__(16) float s[1024];
  for (int i = threadIdx.x; i < 1024; i += blockDim.x) s[i] = float(i);
  __syncthreads();
  const int lane = threadIdx.x & 31;
  uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(s));
  uint32_t a;
  switch (P) {
    case 0: a = 16 * (lane % 4); break;  // LDS.128, 4 distinct, consecutive lanes differ (v3 B/C)
    case 1: a = 16 * (lane / 8); break;  // LDS.128, one address per quarter-warp
    case 2: a = 0; break;                // LDS.128, warp-uniform
    case 3: a = 8 * (lane % 4); break;   // LDS.64, 4 distinct, consecutive lanes differ (c1p B/C)
    case 4: a = 8 * (lane / 4); break;   // LDS.64, 8 distinct, groups of 4 lanes (v3 dt)
    case 5: a = 8 * (lane / 8); break;   // LDS.64, one per quarter
    case 6: a = 0; break;                // LDS.64, uniform
    case 7: a = 16 * (lane / 4); break;  // LDS.128, 8 distinct, groups of 4 lanes
    case 8: a = 8 * (lane % 4) + 64 * (lane / 16); break;  // LDS.64: 4 distinct per half, 8 total
    default: a = 4 * (lane % 4); break;  // LDS.32, 4 distinct
  }
  a += base;
  float acc = 0.f;
  for (int i = 0; i < iters; ++i) {
    float x, y, z, w;
    if (P == 0 || P == 1 || P == 2 || P == 7) {
      asm volatile("ld.volatile.shared.v4.f32 {%0,%1,%2,%3}, [%4];" : "=f"(x), "=f"(y), "=f"(z), "=f"(w) : "r"(a));
      acc += x + y + z + w;
    } else if (P <= 8) {
      asm volatile("ld.volatile.shared.v2.f32 {%0,%1}, [%2];" : "=f"(x), "=f"(y) : "r"(a));
      acc += x + y;
    } else {
      asm volatile("ld.volatile.shared.f32 %0, [%1];" : "=f"(x) : "r"(a));
      acc += x;
    }
  }
  out[blockIdx.x * blockDim.x + threadIdx.x] = acc;
}
int main() {
  float* out;
  if (cudaMalloc(&out, 132 * 128 * 4) != cudaSuccess) return 1;
  k<0><<<132, 128>>>(out, 1000); k<1><<<132, 128>>>(out, 1000); k<2><<<132, 128>>>(out, 1000);
  k<3><<<132, 128>>>(out, 1000); k<4><<<132, 128>>>(out, 1000); k<5><<<132, 128>>>(out, 1000);
  k<6><<<132, 128>>>(out, 1000); k<7><<<132, 128>>>(out, 1000); k<8><<<132, 128>>>(out, 1000);
  k<9><<<132, 128>>>(out, 1000);
  const cudaError_t err = cudaDeviceSynchronize();
  printf("%s\n", cudaGetErrorString(err));
  return err == cudaSuccess ? 0 : 1;
}
