// The backward scan's inner loop on one SM (H100/H200): which thread layout forms the backward's
// per-token sums at the lowest cost. One decision: the layout of the fused backward's scan role
// (docs/perf/training.md, "Next: the backward's layout, modelled").
//
// A thread owns KD channels x KN states (KD * KN chains); N / KN threads (adjacent lanes) share a
// channel, 32 / (N / KN) lanes of a warp and all warps share a state. Per sub-chunk of S tokens:
//   F (the forward states again, kept in registers):   a = 2^(dt A2),  h = a h + dtx B
//   R (last token first):   a again;  g = a_next g + C dy;  gha = g h_prev a;
//       s1[t, d] += gha A  and  s2[t, d] += g B     (over the channel's states: ddelta's two parts)
//       dA[d, n] += gha dt                          (in registers)
//       pB[t, n] += g dtx  and  pC[t, n] += dy h    (over the tile's channels: dB and dC)
//   then s1, s2 are reduce-scattered over the N / KN lanes of a channel and pB, pC over the warp's
//   lanes of a state (a shuffle, an add and two selects per value and level, one value per lane at
//   the end), pB and pC then over the warps through shared memory, all in a fixed order: bitwise
//   deterministic. KD = 1 is the layout of the backward kernel v1 (KN = 4) and v1.1 (KN = 2); KD > 1
//   sums over the thread's own channels in registers first, so fewer values cross lanes per element:
//   2 KD + 2 KN per KD x KN elements and token.
// Reported: elements (token x channel x state) per SM clock over the loop (clock64, the slowest CTA),
// one CTA per SM. Before the timing, one sub-chunk's sums are checked against a float64 evaluation of
// the same formulas on the host (poisoned outputs, every element compared).
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o bwd_layouts benchmarks/micro/bwd_layouts.cu
//   ./bwd_layouts
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "micro_common.cuh"

constexpr int kN = 16;       // states per channel
constexpr int kRing = 64;    // tokens of synthetic input in shared memory (the stream cycles over them)

__host__ __device__ inline float in_dt(int t, int d) { return 0.01f + 1e-4f * float((t * 7 + d * 3) % 29); }
__host__ __device__ inline float in_dtx(int t, int d) { return 0.5f - 0.02f * float((t * 5 + d) % 31); }
__host__ __device__ inline float in_dy(int t, int d) { return 0.3f + 0.01f * float((t * 3 + d * 11) % 23) - 0.1f; }
__host__ __device__ inline float in_B(int t, int n) { return 0.25f + 0.03f * float((t + n * 5) % 17) - 0.2f; }
__host__ __device__ inline float in_C(int t, int n) { return 0.75f - 0.04f * float((t * 2 + n) % 19); }
__host__ __device__ inline float in_A(int d, int n) { return -(0.05f * float(n + 1) + 1e-3f * float(d % 64)); }

template <int KD, int KN, int S, int WARPS>
struct Layout {
  static constexpr int kPN = kN / KN;                 // lanes per channel
  static constexpr int kCPW = 32 / kPN;               // channel groups per warp
  static constexpr int kDC = WARPS * kCPW * KD;       // channels per CTA
  static constexpr int kM1 = 2 * KD * S;              // s1, s2 values per lane and sub-chunk
  static constexpr int kM2 = 2 * KN * S;              // pB, pC values per lane and sub-chunk
  static_assert(kN % KN == 0 && 32 % kPN == 0, "whole state groups in a warp");
  static_assert(kM1 % kPN == 0 && kM2 % kCPW == 0, "S too small for one value per lane");
};

// out_s: [2][kRing][kDC] (s1, s2); out_bc: [2][kRing][kN] (dB, dC); out_dA: [kDC][kN] (CTA 0). Token t is
// stored in slot t % kRing (the timing run overwrites; the check runs one sub-chunk).
template <int KD, int KN, int S, int WARPS>
__global__ void __launch_bounds__(32 * WARPS, 1)
bwd_loop(float* out_s, float* out_bc, float* out_dA, long long* cycles, int tokens) {
  using L = Layout<KD, KN, S, WARPS>;
  extern __shared__ float sm[];
  float* s_dt = sm;                           // [kRing][kDC]
  float* s_dtx = s_dt + kRing * L::kDC;
  float* s_dy = s_dtx + kRing * L::kDC;
  float* s_B = s_dy + kRing * L::kDC;         // [kRing][kN]
  float* s_C = s_B + kRing * kN;
  float* s_part = s_C + kRing * kN;           // [2 buffers][WARPS][2 * S * kN]
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  for (int i = tid; i < kRing * L::kDC; i += blockDim.x) {
    s_dt[i] = in_dt(i / L::kDC, i % L::kDC);
    s_dtx[i] = in_dtx(i / L::kDC, i % L::kDC);
    s_dy[i] = in_dy(i / L::kDC, i % L::kDC);
  }
  for (int i = tid; i < kRing * kN; i += blockDim.x) {
    s_B[i] = in_B(i / kN, i % kN);
    s_C[i] = in_C(i / kN, i % kN);
  }
  __syncthreads();
  const int sg = lane % L::kPN, cg = lane / L::kPN;
  const int d0 = (warp * L::kCPW + cg) * KD, n0 = sg * KN;
  float A2[KD][KN], h[KD][KN], g[KD][KN], anext[KD][KN], dA[KD][KN];  // A = A2 ln 2
#pragma unroll
  for (int j = 0; j < KD; ++j)
#pragma unroll
    for (int i = 0; i < KN; ++i) {
      A2[j][i] = in_A(d0 + j, n0 + i) * kLog2eF;
      h[j][i] = 0.f;
      g[j][i] = 0.f;
      anext[j][i] = 1.f;
      dA[j][i] = 0.f;
    }
  const long long t_start = clock64();
  for (int c0 = 0, buf = 0; c0 < tokens; c0 += S, buf ^= 1) {
    // F: the states of the sub-chunk (hs[t + 1] after token t; hs[0] its start)
    float hs[S + 1][KD][KN];
#pragma unroll
    for (int j = 0; j < KD; ++j)
#pragma unroll
      for (int i = 0; i < KN; ++i) hs[0][j][i] = h[j][i];
#pragma unroll
    for (int t = 0; t < S; ++t) {
      const int r = (c0 + t) % kRing;
#pragma unroll
      for (int j = 0; j < KD; ++j) {
        const float dt = s_dt[r * L::kDC + d0 + j], dtx = s_dtx[r * L::kDC + d0 + j];
#pragma unroll
        for (int i = 0; i < KN; ++i)
          hs[t + 1][j][i] = fmaf(ex2(dt * A2[j][i]), hs[t][j][i], dtx * s_B[r * kN + n0 + i]);
      }
    }
    // R: last token first; v1 / v2: the values each lane sends into the reductions
    float v1[L::kM1], v2[L::kM2];
#pragma unroll
    for (int t = S - 1; t >= 0; --t) {
      const int r = (c0 + t) % kRing;
      float s1[KD], s2[KD], pB[KN], pC[KN];
#pragma unroll
      for (int j = 0; j < KD; ++j) s1[j] = s2[j] = 0.f;
#pragma unroll
      for (int i = 0; i < KN; ++i) pB[i] = pC[i] = 0.f;
#pragma unroll
      for (int j = 0; j < KD; ++j) {
        const float dt = s_dt[r * L::kDC + d0 + j], dtx = s_dtx[r * L::kDC + d0 + j];
        const float dy = s_dy[r * L::kDC + d0 + j];
#pragma unroll
        for (int i = 0; i < KN; ++i) {
          const float B = s_B[r * kN + n0 + i], C = s_C[r * kN + n0 + i];
          const float a = ex2(dt * A2[j][i]);
          g[j][i] = fmaf(anext[j][i], g[j][i], C * dy);
          const float gha = g[j][i] * hs[t][j][i] * a;
          s1[j] = fmaf(gha, A2[j][i], s1[j]);  // times ln 2 once per channel, below
          dA[j][i] = fmaf(gha, dt, dA[j][i]);
          s2[j] = fmaf(g[j][i], B, s2[j]);
          pB[i] = fmaf(g[j][i], dtx, pB[i]);
          pC[i] = fmaf(dy, hs[t + 1][j][i], pC[i]);
          anext[j][i] = a;
        }
      }
#pragma unroll
      for (int j = 0; j < KD; ++j) {
        v1[(0 * S + t) * KD + j] = s1[j] * kLn2F;
        v1[(1 * S + t) * KD + j] = s2[j];
      }
#pragma unroll
      for (int i = 0; i < KN; ++i) {
        v2[(0 * S + t) * KN + i] = pB[i];
        v2[(1 * S + t) * KN + i] = pC[i];
      }
    }
#pragma unroll
    for (int j = 0; j < KD; ++j)
#pragma unroll
      for (int i = 0; i < KN; ++i) h[j][i] = hs[S][j][i];
    // s1, s2: over the channel's kPN lanes (adjacent), then stored: each lane kM1 / kPN totals
    int b1 = 0;
    reduce_scatter<L::kM1, L::kM1, L::kPN, 1>(v1, lane, b1);
#pragma unroll
    for (int q = 0; q < L::kM1 / L::kPN; ++q) {
      const int idx = b1 + q, kind = idx / (S * KD), t = (idx / KD) % S, j = idx % KD;
      out_s[(size_t(kind) * kRing + (c0 + t) % kRing) * L::kDC + d0 + j] = v1[q];
    }
    // pB, pC: over the warp's kCPW lanes of the same states (stride kPN), then over the warps
    int b2 = 0;
    reduce_scatter<L::kM2, L::kM2, L::kCPW, L::kPN>(v2, lane, b2);
    float* part = s_part + buf * WARPS * 2 * S * kN;
#pragma unroll
    for (int q = 0; q < L::kM2 / L::kCPW; ++q) {
      const int idx = b2 + q, kind = idx / (S * KN), t = (idx / KN) % S, i = idx % KN;
      part[warp * 2 * S * kN + (kind * S + t) * kN + n0 + i] = v2[q];
    }
    __syncthreads();  // one barrier per sub-chunk: the parts of the other buffer are free again by now
    for (int e = tid; e < 2 * S * kN; e += blockDim.x) {
      float sum = 0.f;
#pragma unroll
      for (int w = 0; w < WARPS; ++w) sum += part[w * 2 * S * kN + e];
      const int kind = e / (S * kN), t = (e / kN) % S, n = e % kN;
      out_bc[(size_t(kind) * kRing + (c0 + t) % kRing) * kN + n] = sum;
    }
  }
  const long long clocks = clock64() - t_start;
  if (blockIdx.x == 0) {
#pragma unroll
    for (int j = 0; j < KD; ++j)
#pragma unroll
      for (int i = 0; i < KN; ++i) out_dA[(d0 + j) * kN + n0 + i] = dA[j][i];
  }
  if (tid == 0) cycles[blockIdx.x] = clocks;
}

// The same formulas in float64 for one sub-chunk of S tokens from h = 0 and g = 0 (CTA 0's outputs).
template <int KD, int KN, int S, int WARPS>
bool check(const float* out_s, const float* out_bc, const float* out_dA) {
  using L = Layout<KD, KN, S, WARPS>;
  constexpr int DC = L::kDC;
  std::vector<double> hs((S + 1) * DC * kN, 0.0), s(2 * S * DC, 0.0), bc(2 * S * kN, 0.0), dA(DC * kN, 0.0);
  for (int t = 0; t < S; ++t)
    for (int d = 0; d < DC; ++d)
      for (int n = 0; n < kN; ++n)
        hs[((t + 1) * DC + d) * kN + n] = std::exp(double(in_dt(t, d)) * in_A(d, n)) * hs[(t * DC + d) * kN + n] +
                                          double(in_dtx(t, d)) * in_B(t, n);
  std::vector<double> g(DC * kN, 0.0), anext(DC * kN, 1.0);
  for (int t = S - 1; t >= 0; --t)
    for (int d = 0; d < DC; ++d)
      for (int n = 0; n < kN; ++n) {
        const int c = d * kN + n;
        const double a = std::exp(double(in_dt(t, d)) * in_A(d, n));
        g[c] = anext[c] * g[c] + double(in_C(t, n)) * in_dy(t, d);
        const double gha = g[c] * hs[(t * DC + d) * kN + n] * a;
        s[(0 * S + t) * DC + d] += gha * in_A(d, n);
        s[(1 * S + t) * DC + d] += g[c] * in_B(t, n);
        dA[c] += gha * in_dt(t, d);
        bc[(0 * S + t) * kN + n] += g[c] * in_dtx(t, d);
        bc[(1 * S + t) * kN + n] += double(in_dy(t, d)) * hs[((t + 1) * DC + d) * kN + n];
        anext[c] = a;
      }
  double worst = 0.0;
  auto cmp = [&](float got, double want) {
    const double e = std::fabs(double(got) - want) / (std::fabs(want) + 1e-3);
    worst = (std::isnan(got) || e > worst) ? (std::isnan(got) ? INFINITY : e) : worst;
  };
  for (int k = 0; k < 2; ++k)
    for (int t = 0; t < S; ++t) {
      for (int d = 0; d < DC; ++d) cmp(out_s[(size_t(k) * kRing + t) * DC + d], s[(k * S + t) * DC + d]);
      for (int n = 0; n < kN; ++n) cmp(out_bc[(size_t(k) * kRing + t) * kN + n], bc[(k * S + t) * kN + n]);
    }
  for (int c = 0; c < DC * kN; ++c) cmp(out_dA[c], dA[c]);
  const bool ok = worst < 1e-4;
  if (!ok) std::printf("  CHECK FAILED: largest relative error %.3g\n", worst);
  return ok;
}

template <int KD, int KN, int S, int WARPS>
bool run(int sms, int tokens, float* out_s, float* out_bc, float* out_dA, long long* cycles) {
  using L = Layout<KD, KN, S, WARPS>;
  const int smem = int(sizeof(float)) * (3 * kRing * L::kDC + 2 * kRing * kN + 2 * WARPS * 2 * S * kN);
  auto kern = bwd_loop<KD, KN, S, WARPS>;
  CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  // the check: one sub-chunk, outputs poisoned (NaN) first
  const size_t ns = 2 * size_t(kRing) * L::kDC, nbc = 2 * size_t(kRing) * kN, nda = size_t(L::kDC) * kN;
  CHECK(cudaMemset(out_s, 0xff, sizeof(float) * ns));
  CHECK(cudaMemset(out_bc, 0xff, sizeof(float) * nbc));
  CHECK(cudaMemset(out_dA, 0xff, sizeof(float) * nda));
  kern<<<1, 32 * WARPS, smem>>>(out_s, out_bc, out_dA, cycles, S);
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  std::vector<float> hs(ns), hbc(nbc), hda(nda);
  CHECK(cudaMemcpy(hs.data(), out_s, sizeof(float) * ns, cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(hbc.data(), out_bc, sizeof(float) * nbc, cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(hda.data(), out_dA, sizeof(float) * nda, cudaMemcpyDeviceToHost));
  const bool ok = check<KD, KN, S, WARPS>(hs.data(), hbc.data(), hda.data());
  // the timing: every SM, `tokens` tokens per CTA
  const long long worst = slowest_of_two_launches(kern, sms, 32 * WARPS, smem, cycles, out_s, out_bc, out_dA, cycles,
                                                  tokens);
  const double elems = double(tokens) * L::kDC * kN;
  const double per_clk = elems / double(worst);
  std::printf("KD=%d KN=%2d S=%2d warps/SM=%2d (%3d channels per CTA, %2d chains per thread): %5.2f elements per SM "
              "clock, %.2f values crossing lanes per element%s\n",
              KD, KN, S, WARPS, L::kDC, KD * KN, per_clk, double(2 * KD + 2 * KN) / double(KD * KN),
              ok ? "" : "  (WRONG SUMS)");
  return ok;
}

int main() {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  float *out_s, *out_bc, *out_dA;
  long long* cycles;
  CHECK(cudaMalloc(&out_s, sizeof(float) * 2 * kRing * 512));
  CHECK(cudaMalloc(&out_bc, sizeof(float) * 2 * kRing * kN));
  CHECK(cudaMalloc(&out_dA, sizeof(float) * 512 * kN));
  CHECK(cudaMalloc(&cycles, sizeof(long long) * sms));
  const int tokens = 1 << 13;
  bool ok = true;
  // KD = 1: the backward kernel's layouts (v1: 4 states per thread, 8 warps; v1.1: 2 states, 16 warps)
  ok &= run<1, 4, 4, 8>(sms, tokens, out_s, out_bc, out_dA, cycles);
  ok &= run<1, 4, 4, 16>(sms, tokens, out_s, out_bc, out_dA, cycles);
  ok &= run<1, 2, 8, 16>(sms, tokens, out_s, out_bc, out_dA, cycles);
  // KD > 1: channel sums in registers first (S chosen so that nothing spills: ptxas -v)
  ok &= run<2, 4, 4, 8>(sms, tokens, out_s, out_bc, out_dA, cycles);
  ok &= run<2, 4, 2, 16>(sms, tokens, out_s, out_bc, out_dA, cycles);
  ok &= run<4, 4, 2, 4>(sms, tokens, out_s, out_bc, out_dA, cycles);
  ok &= run<4, 4, 2, 8>(sms, tokens, out_s, out_bc, out_dA, cycles);
  ok &= run<2, 8, 2, 8>(sms, tokens, out_s, out_bc, out_dA, cycles);
  std::printf(ok ? "every layout's sums match the float64 evaluation\n" : "SOME LAYOUTS GAVE WRONG SUMS\n");
  return ok ? 0 : 1;
}
