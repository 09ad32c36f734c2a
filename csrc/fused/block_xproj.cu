// The fused block's first kernel: x_proj's product [dt_low | B | C] = u W_x^T over all d_inner channels,
// with u = silu(conv(xi)) made tile by tile in shared memory (fused_api.h, BlockXprojParams). u never
// reaches device memory: the fused kernel recomputes it for its own channels (fused_kernel.cuh,
// conv_in_tile), and the backward recomputes it once with the conv kernel.
//
// CTA = 64 tokens of one sequence x all out_dim outputs; 256 threads. Per chunk of 64 channels: thread
// (lane, warp) makes u for channels 2 lane, 2 lane + 1 and tokens [8 warp, 8 warp + 8) from xi (the 3
// inputs before its tokens re-read from global memory: L1/L2 hits) with the conv kernel's arithmetic
// (csrc/conv/conv_math.cuh: bitwise the unfused path's u), then the chunk's product.
//   16-bit: WMMA m16n16k16 (mma.sync), float32 accumulators; warp w owns rows 16 (w % 4) .. + 16 and every
//   other 16-column fragment (w / 4); the next chunk's weight rows arrive by cp.async and its xi rows in
//   registers while the tensor cores work on this one (two buffers, one __syncthreads per chunk).
//   float32: FMA, thread (token, 16 outputs) of a 64-output group (gridDim.y groups).
// Deterministic: every output is one thread's (or one fragment's) sum in a fixed order.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <atomic>
#include <cstdint>

#include "../common/cp_async.cuh"
#include "../common/cuda_check.h"
#include "../conv/conv_math.cuh"
#include "fused_api.h"

namespace selscan {
namespace {

constexpr int kTok = 64;     // tokens per CTA
constexpr int kChunk = 64;   // channels per chunk
constexpr int kThreads = 256;
constexpr int kRun = kTok / (kThreads / 32);  // tokens per thread in the conv: 8

// The raw inputs of one thread's conv run: rows t0 + r0 - (kW-1) .. t0 + r0 + kRun - 1 of channels
// c, c + 1 (xi, conv_state before token 0, zeros past L), as float.
template <class T, int kW>
__device__ __forceinline__ void load_run(const BlockXprojParams& p, int64_t b, int64_t t_first, int64_t c,
                                         float (&v)[kW - 1 + kRun][2]) {
  const T* x = static_cast<const T*>(p.x) + b * p.seqlen * p.x_token_stride + c;
#pragma unroll
  for (int i = 0; i < kW - 1 + kRun; ++i) {
    const int64_t t = t_first - (kW - 1) + i;
    if (t >= 0 && t < p.seqlen) {
      load_vec<T, 2>(x + t * p.x_token_stride, v[i]);
    } else if (t < 0 && p.conv_state != nullptr) {
      v[i][0] = p.conv_state[(b * p.dim + c) * (kW - 1) + (kW - 1) + t];
      v[i][1] = p.conv_state[(b * p.dim + c + 1) * (kW - 1) + (kW - 1) + t];
    } else {
      v[i][0] = v[i][1] = 0.f;
    }
  }
}

// u = silu(conv) of a run (the conv kernel's operations, in its order).
template <int kW>
__device__ __forceinline__ void conv_run(const BlockXprojParams& p, int64_t c, const float (&v)[kW - 1 + kRun][2],
                                         float (&u)[kRun][2]) {
  float w[kW][2], bs[2], win[kW - 1][2];
  load_weights<kW, 2>(p.conv_weight, p.conv_bias, c, w, bs);
#pragma unroll
  for (int k = 0; k < kW - 1; ++k) { win[k][0] = v[k][0]; win[k][1] = v[k][1]; }
#pragma unroll
  for (int i = 0; i < kRun; ++i) {
    float pre[2];
    conv_pre<kW, 2>(w, bs, win, v[kW - 1 + i], pre);
    u[i][0] = silu_f(pre[0]);
    u[i][1] = silu_f(pre[1]);
    shift_in<kW - 1, 2>(win, v[kW - 1 + i]);
  }
}

// ---- 16-bit: tensor cores.
constexpr int kLdA = kChunk + 8;  // padded rows (16-byte multiples; WMMA's ldm a multiple of 8)
// kF: 16-column fragments per warp (out_pad <= 32 kF): 6 for every released Mamba-1 size (R + 2N <= 192,
// two CTAs per SM), 12 up to kBlockXprojMaxOut.
template <class T, int kW, int kF>
__global__ void __launch_bounds__(kThreads, kF <= 6 ? 2 : 1) xproj_mma_kernel(const BlockXprojParams p, int out_pad) {
  using namespace nvcuda;
  extern __shared__ __align__(128) unsigned char smem[];
  T* As = reinterpret_cast<T*>(smem);                  // [2][kTok][kLdA]
  T* Ws = As + 2 * kTok * kLdA;                        // [2][out_pad][kLdA]
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int64_t tiles = (p.seqlen + kTok - 1) / kTok;
  const int64_t b = blockIdx.x / tiles, t0 = (blockIdx.x % tiles) * kTok;
  const int n_chunks = int(p.dim / kChunk);
  const int O = int(p.out_dim);
  const T* W = static_cast<const T*>(p.weight);
  // Weight rows past out_dim: zeros, in both buffers, once.
  for (int i = tid; i < 2 * (out_pad - O) * kLdA; i += kThreads) {
    const int buf = i / ((out_pad - O) * kLdA), rest = i % ((out_pad - O) * kLdA);
    Ws[buf * out_pad * kLdA + O * kLdA + rest] = from_float<T>(0.f);
  }
  auto load_w = [&](int chunk, int buf) {  // rows < O, 8 16-byte pieces each
    for (int i = tid; i < O * 8; i += kThreads) {
      const int o = i / 8, piece = i % 8;
      cp_async_16(Ws + (buf * out_pad + o) * kLdA + piece * 8, W + int64_t(o) * p.dim + chunk * kChunk + piece * 8);
    }
    cp_async_commit();
  };
  const int r0 = warp * kRun;
  auto make_u = [&](int chunk, int buf, const float (&v)[kW - 1 + kRun][2]) {
    float u[kRun][2];
    conv_run<kW>(p, int64_t(chunk) * kChunk + 2 * lane, v, u);
#pragma unroll
    for (int i = 0; i < kRun; ++i) store_vec<T, 2>(As + (buf * kTok + r0 + i) * kLdA + 2 * lane, u[i]);
  };

  const int mb = warp % 4, ncol = warp / 4, nf = out_pad / 16;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[kF];
#pragma unroll
  for (int i = 0; i < kF; ++i) wmma::fill_fragment(acc[i], 0.f);

  float v[kW - 1 + kRun][2];
  load_w(0, 0);
  load_run<T, kW>(p, b, t0 + r0, 2 * lane, v);
  make_u(0, 0, v);
  cp_async_wait_all();
  __syncthreads();
  for (int chunk = 0; chunk < n_chunks; ++chunk) {
    const int buf = chunk & 1;
    const bool more = chunk + 1 < n_chunks;
    if (more) {
      load_w(chunk + 1, buf ^ 1);
      load_run<T, kW>(p, b, t0 + r0, int64_t(chunk + 1) * kChunk + 2 * lane, v);
    }
#pragma unroll
    for (int k = 0; k < kChunk; k += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
      wmma::load_matrix_sync(a, As + (buf * kTok + mb * 16) * kLdA + k, kLdA);
#pragma unroll
      for (int i = 0; i < kF; ++i) {
        const int f = ncol + 2 * i;
        if (f < nf) {
          wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> bw;
          wmma::load_matrix_sync(bw, Ws + (buf * out_pad + f * 16) * kLdA + k, kLdA);
          wmma::mma_sync(acc[i], a, bw, acc[i]);
        }
      }
    }
    if (more) {
      make_u(chunk + 1, buf ^ 1, v);
      cp_async_wait_all();
    }
    __syncthreads();
  }
  // Accumulators -> shared memory (over the weight buffers) -> out, rows inside L, coalesced.
  float* Cs = reinterpret_cast<float*>(Ws);
  const int ldc = out_pad + 4;
#pragma unroll
  for (int i = 0; i < kF; ++i) {
    const int f = ncol + 2 * i;
    if (f < nf) wmma::store_matrix_sync(Cs + (mb * 16) * ldc + f * 16, acc[i], ldc, wmma::mem_row_major);
  }
  __syncthreads();
  T* out = static_cast<T*>(p.out) + (b * p.seqlen + t0) * int64_t(O);
  const int rows = int(p.seqlen - t0 < kTok ? p.seqlen - t0 : kTok);
  for (int i = tid; i < rows * O; i += kThreads) out[i] = from_float<T>(Cs[(i / O) * ldc + i % O]);
}

// ---- float32: FMA.
constexpr int kOutGroup = 64;   // outputs per CTA (gridDim.y groups)
constexpr int kPerThread = kOutGroup / (kThreads / kTok);  // 16

template <int kW>
__global__ void __launch_bounds__(kThreads) xproj_f32_kernel(const BlockXprojParams p) {
  __shared__ float As[kTok][kChunk + 1];
  __shared__ float Ws[kOutGroup][kChunk + 1];
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int64_t tiles = (p.seqlen + kTok - 1) / kTok;
  const int64_t b = blockIdx.x / tiles, t0 = (blockIdx.x % tiles) * kTok;
  const int O = int(p.out_dim), o0 = blockIdx.y * kOutGroup;
  const int r = tid % kTok, ob = (tid / kTok) * kPerThread;
  const float* W = static_cast<const float*>(p.weight);
  float acc[kPerThread];
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) acc[i] = 0.f;
  for (int64_t c0 = 0; c0 < p.dim; c0 += kChunk) {
    float v[kW - 1 + kRun][2], u[kRun][2];
    load_run<float, kW>(p, b, t0 + warp * kRun, c0 + 2 * lane, v);
    conv_run<kW>(p, c0 + 2 * lane, v, u);
#pragma unroll
    for (int i = 0; i < kRun; ++i) {
      As[warp * kRun + i][2 * lane] = u[i][0];
      As[warp * kRun + i][2 * lane + 1] = u[i][1];
    }
    for (int i = tid; i < kOutGroup * kChunk; i += kThreads) {
      const int o = i / kChunk, k = i % kChunk;
      Ws[o][k] = o0 + o < O ? W[int64_t(o0 + o) * p.dim + c0 + k] : 0.f;
    }
    __syncthreads();
#pragma unroll 8
    for (int k = 0; k < kChunk; ++k) {
      const float a = As[r][k];
#pragma unroll
      for (int i = 0; i < kPerThread; ++i) acc[i] = fmaf(a, Ws[ob + i][k], acc[i]);
    }
    __syncthreads();
  }
  if (t0 + r < p.seqlen) {
    float* out = static_cast<float*>(p.out) + (b * p.seqlen + t0 + r) * int64_t(O);
#pragma unroll
    for (int i = 0; i < kPerThread; ++i)
      if (o0 + ob + i < O) out[o0 + ob + i] = acc[i];
  }
}

template <class T, int kW, int kF>
cudaError_t launch_mma_f(const BlockXprojParams& p, int64_t grid, int out_pad, cudaStream_t stream) {
  // The shared-memory cap, once per device: the instantiation's largest out_pad (32 kF).
  constexpr int kMaxSmem = (2 * kTok * kLdA + 2 * 32 * kF * kLdA) * int(sizeof(T));
  static std::atomic<bool> prepared[64] = {};
  int device = 0;
  SELSCAN_RETURN_IF_ERROR(cudaGetDevice(&device));
  if (device < 0 || device >= 64 || !prepared[device].load(std::memory_order_acquire)) {
    SELSCAN_RETURN_IF_ERROR(cudaFuncSetAttribute(xproj_mma_kernel<T, kW, kF>,
                                                 cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxSmem));
    if (device >= 0 && device < 64) prepared[device].store(true, std::memory_order_release);
  }
  const size_t smem = size_t(2 * kTok * kLdA + 2 * out_pad * kLdA) * sizeof(T);
  xproj_mma_kernel<T, kW, kF><<<dim3(unsigned(grid)), kThreads, smem, stream>>>(p, out_pad);
  return cudaGetLastError();
}

template <class T, int kW>
cudaError_t launch_mma(const BlockXprojParams& p, int64_t grid, cudaStream_t stream) {
  const int out_pad = int((p.out_dim + 31) / 32 * 32);
  return out_pad <= 32 * 6 ? launch_mma_f<T, kW, 6>(p, grid, out_pad, stream)
                           : launch_mma_f<T, kW, 12>(p, grid, out_pad, stream);
}

template <int kW>
cudaError_t launch_width(const BlockXprojParams& p, int64_t grid, cudaStream_t stream) {
  switch (p.dtype) {
    case DType::kBFloat16: return launch_mma<__nv_bfloat16, kW>(p, grid, stream);
    case DType::kFloat16: return launch_mma<__half, kW>(p, grid, stream);
    case DType::kFloat32:
      xproj_f32_kernel<kW><<<dim3(unsigned(grid), unsigned((p.out_dim + kOutGroup - 1) / kOutGroup)), kThreads, 0,
                             stream>>>(p);
      return cudaGetLastError();
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t block_xproj_launch(const BlockXprojParams& p, cudaStream_t stream) {
  if (p.dim % kChunk != 0 || p.out_dim < 1 || p.out_dim > kBlockXprojMaxOut || p.width < 2 || p.width > 4 ||
      (p.dtype != DType::kFloat32 && reinterpret_cast<uintptr_t>(p.weight) % 16 != 0))
    return cudaErrorInvalidValue;
  if (p.batch == 0 || p.seqlen == 0) return cudaSuccess;
  const int64_t grid = p.batch * ((p.seqlen + kTok - 1) / kTok);
  if (grid > INT32_MAX) return cudaErrorInvalidValue;
  switch (p.width) {
    case 2: return launch_width<2>(p, grid, stream);
    case 3: return launch_width<3>(p, grid, stream);
    default: return launch_width<4>(p, grid, stream);
  }
}

}  // namespace selscan
