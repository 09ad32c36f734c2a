// The gate's derivative (gate_bwd.h): one thread per kVec channels of a token, 16-byte loads and
// stores where every row is aligned, else one channel a thread.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>

#include "../common/device_math.cuh"
#include "gate_bwd.h"

namespace selscan {
namespace {

constexpr int kThreads = 256;

template <class T, int kVec>
struct alignas(sizeof(T) * kVec) Pack {
  T v[kVec];
};

template <class T, int kVec>
__global__ void __launch_bounds__(kThreads) gate_bwd_kernel(GateBwdParams p) {
  const int64_t groups = p.dim / kVec;  // dim % kVec == 0 (the launcher's choice)
  const int64_t total = p.batch * p.seqlen * groups;
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < total; i += int64_t(gridDim.x) * kThreads) {
    const int64_t g = i % groups, row = i / groups;
    const int64_t b = row / p.seqlen, t = row % p.seqlen;
    const int64_t c = g * kVec;
    using P = Pack<T, kVec>;
    const P dy = *reinterpret_cast<const P*>(static_cast<const T*>(p.dy) + b * p.dy_batch_stride +
                                             t * p.dy_token_stride + c);
    const P z = *reinterpret_cast<const P*>(static_cast<const T*>(p.z) + b * p.z_batch_stride +
                                            t * p.z_token_stride + c);
    const P yu = *reinterpret_cast<const P*>(static_cast<const T*>(p.yu) + row * p.dim + c);
    P dyu, dz;
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const float zf = to_float<T>(z.v[k]), d = to_float<T>(dy.v[k]);
      const float s = 1.f / (1.f + expf(-zf));
      dyu.v[k] = from_float<T>(d * zf * s);
      dz.v[k] = from_float<T>(d * to_float<T>(yu.v[k]) * s * (1.f + zf * (1.f - s)));
    }
    *reinterpret_cast<P*>(static_cast<T*>(p.dyu) + row * p.dim + c) = dyu;
    *reinterpret_cast<P*>(static_cast<T*>(p.dz) + row * p.dim + c) = dz;
  }
}

bool aligned(const void* ptr, int64_t bytes) { return reinterpret_cast<uintptr_t>(ptr) % uint64_t(bytes) == 0; }

template <class T>
cudaError_t launch_typed(const GateBwdParams& p, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const bool vec = p.dim % kVec == 0 && aligned(p.dy, 16) && aligned(p.z, 16) && aligned(p.yu, 16) &&
                   aligned(p.dyu, 16) && aligned(p.dz, 16) && p.dy_batch_stride % kVec == 0 &&
                   p.dy_token_stride % kVec == 0 && p.z_batch_stride % kVec == 0 && p.z_token_stride % kVec == 0;
  const int64_t items = p.batch * p.seqlen * (vec ? p.dim / kVec : p.dim);
  // A grid-stride loop: enough CTAs to fill any GPU, no device query per launch.
  const int64_t want = (items + kThreads - 1) / kThreads, cap = int64_t(1) << 14;
  const unsigned grid = unsigned(want < cap ? want : cap);
  if (vec) gate_bwd_kernel<T, kVec><<<grid, kThreads, 0, stream>>>(p);
  else gate_bwd_kernel<T, 1><<<grid, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t gate_bwd_launch(const GateBwdParams& p, cudaStream_t stream) {
  if (p.batch <= 0 || p.seqlen <= 0 || p.dim <= 0 || p.dy == nullptr || p.z == nullptr || p.yu == nullptr ||
      p.dyu == nullptr || p.dz == nullptr)
    return cudaErrorInvalidValue;
  switch (p.dtype) {
    case DType::kFloat32: return launch_typed<float>(p, stream);
    case DType::kBFloat16: return launch_typed<__nv_bfloat16>(p, stream);
    case DType::kFloat16: return launch_typed<__half>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace selscan
