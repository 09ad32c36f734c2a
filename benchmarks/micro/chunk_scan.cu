// The batch-1 regime's scan on one SM (H100/H200): the recurrence of a chunk of tokens split across the
// threads of a warp, instead of L split across CTAs. One decision: whether the in-CTA token-parallel
// layout of docs/perf/batch1.md, "Next: the batch-1 regime, modelled", reaches the rate it predicts.
//
// A warp owns one channel and its 16 states for the whole sequence; lane = (token part tp, state group
// sg), sg fastest: KN states per lane, TP = 32 / (16 / KN) token parts, chunks of TP * K tokens (lane
// tp takes tokens tp*K .. tp*K+K-1 of each chunk). Per chunk and lane:
//   pass 1: its K tokens from zero, keeping the decays a = 2^(dt A2) in registers, and their product P;
//   combine: an inclusive scan of (P, h) over the TP lanes of each state (Kogge-Stone by shuffles), the
//            exclusive prefix by one more shuffle, and the carry of the previous chunk, which gives
//            the lane's true start state;
//   pass 2: its K tokens again from that start with the kept decays (no exponential), y = sum_n C h
//           reduce-scattered over the 16 / KN lanes of the states, D x added, stored;
//   the chunk's end state (the last token part's) is the next chunk's carry.
// One exponential per element, as mamba-ssm's kernel (its threads split the tokens the same way); the
// fused kernel's L split across CTAs pays two for every segment but the last.
// The lanes of a warp read the inputs of TP different tokens at once, so the shared-memory rows are
// padded per block of K tokens (the token part's block): one word for dt and x (an odd block stride),
// and for B and C a per-part shift of 0 .. KN-1 or 16 .. 16+KN-1 words, so that the 32 lanes' words
// of a load lie in 32 different banks (unpadded, a row stride that is a multiple of 32 words put
// every token part in the same bank: an 8-way conflict on every load).
// Reported: elements (token x state) per SM clock (clock64 around the loop, the slowest CTA), one CTA of
// W warps (W channels) per SM. Before the timing, two chunks' y and the final state are checked
// against a float64 evaluation on the host (poisoned outputs, every element compared; the error is
// relative to the size of the terms summed, |D x| + sum_n |C_n h_n| for y, so that a y that cancels to
// near zero is not judged by float32's rounding of its terms).
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o chunk_scan benchmarks/micro/chunk_scan.cu
//   ./chunk_scan
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "micro_common.cuh"

constexpr int kN = 16;
constexpr int kRing = 256;  // tokens of synthetic input in shared memory (the stream cycles over them)

__host__ __device__ inline float in_dt(int t, int d) { return 0.02f + 2e-3f * float((t * 7 + d * 3) % 29); }
__host__ __device__ inline float in_x(int t, int d) { return 0.5f - 0.03f * float((t * 5 + d) % 31); }
__host__ __device__ inline float in_B(int t, int n) { return 0.25f + 0.03f * float((t + n * 5) % 17) - 0.2f; }
__host__ __device__ inline float in_C(int t, int n) { return 0.75f - 0.04f * float((t * 2 + n) % 19); }
__host__ __device__ inline float in_A(int d, int n) { return -(0.05f * float(n + 1) + 1e-2f * float(d % 16)); }
__host__ __device__ inline float in_D(int d) { return 0.5f + 0.01f * float(d); }

// Padded shared-memory layouts (see above): token r of the ring, channel d or state n.
template <int K, int W>
__device__ __forceinline__ int chan_at(int r, int d) { return (r / K) * (K * W + 1) + (r % K) * W + d; }
template <int KN, int K>
__device__ __forceinline__ int state_at(int r, int n) {
  const int b = r / K, part = b % (2 * KN);  // TP = 2 KN token parts per chunk
  return b * (K * kN + 32) + (r % K) * kN + (part % KN) + 16 * (part / KN) + n;
}
template <int K, int W>
__host__ __device__ constexpr int chan_words() { return (kRing / K) * (K * W + 1); }
template <int K>
__host__ __device__ constexpr int state_words() { return (kRing / K) * (K * kN + 32); }

// y: [CTA][kRing][32] (token t in slot t % kRing: every CTA its own rows, so that the timing run's
// stores do not all land on the same few lines of L2), h_out: [W][kN] (CTA 0).
template <int KN, int K, int W>
__global__ void __launch_bounds__(32 * W, 1) chunk_scan(float* y, float* h_out, long long* cycles, int tokens) {
  constexpr int PN = kN / KN, TP = 32 / PN, kChunk = TP * K;
  static_assert(kN % KN == 0 && K % PN == 0, "whole state groups; one y per lane after the reduction");
  static_assert(K % 2 == 0 && kRing % K == 0 && TP == 2 * KN, "the padded layouts' bank arithmetic");
  extern __shared__ float sm[];
  float* s_dt = sm;                         // chan_at
  float* s_x = s_dt + chan_words<K, W>();   // chan_at
  float* s_B = s_x + chan_words<K, W>();    // state_at
  float* s_C = s_B + state_words<K>();      // state_at
  const int tid = threadIdx.x, lane = tid % 32, d = tid / 32;
  for (int i = tid; i < kRing * W; i += blockDim.x) {
    s_dt[chan_at<K, W>(i / W, i % W)] = in_dt(i / W, i % W);
    s_x[chan_at<K, W>(i / W, i % W)] = in_x(i / W, i % W);
  }
  for (int i = tid; i < kRing * kN; i += blockDim.x) {
    s_B[state_at<KN, K>(i / kN, i % kN)] = in_B(i / kN, i % kN);
    s_C[state_at<KN, K>(i / kN, i % kN)] = in_C(i / kN, i % kN);
  }
  __syncthreads();
  y += size_t(blockIdx.x) * kRing * 32;
  const int sg = lane % PN, tp = lane / PN, n0 = sg * KN;
  float A2[KN], carry[KN];
#pragma unroll
  for (int i = 0; i < KN; ++i) {
    A2[i] = in_A(d, n0 + i) * kLog2eF;
    carry[i] = 0.f;
  }
  const float Dd = in_D(d);
  const long long t_start = clock64();
  for (int c0 = 0; c0 < tokens; c0 += kChunk) {
    const int t0 = c0 + tp * K;
    // pass 1: from zero, the decays kept
    float a[K][KN], P[KN], h[KN];
#pragma unroll
    for (int i = 0; i < KN; ++i) P[i] = 1.f, h[i] = 0.f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int r = (t0 + k) % kRing;
      const float dt = s_dt[chan_at<K, W>(r, d)], dtx = dt * s_x[chan_at<K, W>(r, d)];
#pragma unroll
      for (int i = 0; i < KN; ++i) {
        a[k][i] = ex2(dt * A2[i]);
        P[i] *= a[k][i];
        h[i] = fmaf(a[k][i], h[i], dtx * s_B[state_at<KN, K>(r, n0 + i)]);
      }
    }
    // combine over the TP token parts of each state: inclusive (P, h) prefix, then the exclusive one
#pragma unroll
    for (int s = 1; s < TP; s *= 2) {
#pragma unroll
      for (int i = 0; i < KN; ++i) {
        const float Pu = __shfl_up_sync(0xffffffffu, P[i], s * PN);
        const float hu = __shfl_up_sync(0xffffffffu, h[i], s * PN);
        if (tp >= s) {
          h[i] = fmaf(P[i], hu, h[i]);
          P[i] *= Pu;
        }
      }
    }
    float start[KN];
#pragma unroll
    for (int i = 0; i < KN; ++i) {
      const float Pe = __shfl_up_sync(0xffffffffu, P[i], PN), he = __shfl_up_sync(0xffffffffu, h[i], PN);
      start[i] = tp == 0 ? carry[i] : fmaf(Pe, carry[i], he);
      // the chunk's end state: the last token part's inclusive prefix, from the carry
      const float Pl = __shfl_sync(0xffffffffu, P[i], (TP - 1) * PN + sg);
      const float hl = __shfl_sync(0xffffffffu, h[i], (TP - 1) * PN + sg);
      carry[i] = fmaf(Pl, carry[i], hl);
    }
    // pass 2: from the true start with the kept decays; y over the states of the channel
    float v[K];
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int r = (t0 + k) % kRing;
      const float dtx = s_dt[chan_at<K, W>(r, d)] * s_x[chan_at<K, W>(r, d)];
      float yk = 0.f;
#pragma unroll
      for (int i = 0; i < KN; ++i) {
        start[i] = fmaf(a[k][i], start[i], dtx * s_B[state_at<KN, K>(r, n0 + i)]);
        yk = fmaf(s_C[state_at<KN, K>(r, n0 + i)], start[i], yk);
      }
      v[k] = yk;
    }
    int base = 0;
    reduce_scatter<K, K, PN>(v, lane, base);
#pragma unroll
    for (int q = 0; q < K / PN; ++q) {
      const int t = t0 + base + q, r = t % kRing;
      y[r * W + d] = fmaf(Dd, s_x[chan_at<K, W>(r, d)], v[q]);
    }
  }
  const long long clocks = clock64() - t_start;
  if (blockIdx.x == 0 && tp == 0) {
#pragma unroll
    for (int i = 0; i < KN; ++i) h_out[d * kN + n0 + i] = carry[i];
  }
  if (tid == 0) cycles[blockIdx.x] = clocks;
}

template <int KN, int K, int W>
bool run(int sms, int tokens, float* y, float* h_out, long long* cycles) {
  constexpr int PN = kN / KN, TP = 32 / PN, kChunk = TP * K;
  const int smem = int(sizeof(float)) * (2 * chan_words<K, W>() + 2 * state_words<K>());
  auto kern = chunk_scan<KN, K, W>;
  CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  // the check: two chunks from zero (the carry crosses once), outputs poisoned first
  const int T = 2 * kChunk;
  CHECK(cudaMemset(y, 0xff, sizeof(float) * kRing * W));
  CHECK(cudaMemset(h_out, 0xff, sizeof(float) * W * kN));
  kern<<<1, 32 * W, smem>>>(y, h_out, cycles, T);
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  std::vector<float> hy(kRing * W), hh(W * kN);
  CHECK(cudaMemcpy(hy.data(), y, sizeof(float) * kRing * W, cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(hh.data(), h_out, sizeof(float) * W * kN, cudaMemcpyDeviceToHost));
  double worst = 0.0;
  auto cmp = [&](float got, double want, double scale) {
    const double e = std::isnan(got) ? INFINITY : std::fabs(double(got) - want) / (scale + 1e-30);
    worst = e > worst ? e : worst;
  };
  for (int d = 0; d < W; ++d) {
    std::vector<double> h(kN, 0.0);
    for (int t = 0; t < T; ++t) {
      double yt = double(in_D(d)) * in_x(t, d), size = std::fabs(yt);
      for (int n = 0; n < kN; ++n) {
        h[n] = std::exp(double(in_dt(t, d)) * in_A(d, n)) * h[n] + double(in_dt(t, d)) * in_x(t, d) * in_B(t, n);
        yt += double(in_C(t, n)) * h[n];
        size += std::fabs(double(in_C(t, n)) * h[n]);
      }
      cmp(hy[(t % kRing) * W + d], yt, size);
    }
    double hmax = 0.0;
    for (int n = 0; n < kN; ++n) hmax = std::fmax(hmax, std::fabs(h[n]));
    for (int n = 0; n < kN; ++n) cmp(hh[d * kN + n], h[n], hmax);
  }
  const bool ok = worst < 1e-4;
  const long long slowest = slowest_of_two_launches(kern, sms, 32 * W, smem, cycles, y, h_out, cycles, tokens);
  const double elems = double(tokens) * W * kN;
  std::printf("KN=%d K=%2d (%2d token parts, chunks of %3d tokens) warps/SM=%2d: %5.2f elements per SM clock "
              "(%.0f%% of the MUFU peak)%s\n",
              KN, K, TP, kChunk, W, elems / double(slowest), 100.0 * elems / double(slowest) / 16.0,
              ok ? "" : "  (WRONG RESULTS)");
  if (!ok) std::printf("  largest relative error %.3g\n", worst);
  return ok;
}

int main() {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  float *y, *h_out;
  long long* cycles;
  CHECK(cudaMalloc(&y, sizeof(float) * kRing * 32 * sms));
  CHECK(cudaMalloc(&h_out, sizeof(float) * 32 * kN));
  CHECK(cudaMalloc(&cycles, sizeof(long long) * sms));
  const int tokens = 1 << 15;
  bool ok = true;
  // batch 1, D = 1024 on 132 SMs: about 8 channels per SM
  ok &= run<4, 8, 8>(sms, tokens, y, h_out, cycles);
  ok &= run<4, 8, 16>(sms, tokens, y, h_out, cycles);
  ok &= run<4, 16, 8>(sms, tokens, y, h_out, cycles);
  ok &= run<2, 8, 8>(sms, tokens, y, h_out, cycles);
  ok &= run<2, 8, 16>(sms, tokens, y, h_out, cycles);
  ok &= run<8, 4, 8>(sms, tokens, y, h_out, cycles);
  ok &= run<8, 8, 8>(sms, tokens, y, h_out, cycles);
  std::printf(ok ? "every layout matches the float64 evaluation\n" : "SOME LAYOUTS GAVE WRONG RESULTS\n");
  return ok ? 0 : 1;
}
