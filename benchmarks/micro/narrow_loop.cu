// The fused kernel's narrow scan loop (16 channels per CTA, 8 threads per channel with 2 states each,
// one warp per scheduler: the layout S1 and S5 run, Config<E, 16, false, 1, 16>) alone on every SM, and
// variants of it, in exponentials per SM clock (clock64 around the loop; the MUFU peak is 16).
// The bare recurrence with the same 256 chains per SM reaches 11.2 exponentials per clock
// (scan_ceiling.cu, 2 chains per thread on 4 warps); the kernel's S1 runs at ~5 (docs/perf/layer-forward.md,
// v3.7 and "The narrow loop alone").
//
// Variants (kVar):
//   0  the kernel's loop as it is (scan_phase, kNarrow): (dt, dt * x) pairs and B, C by token pairs
//      from the hand-off tile, 16 exponentials per group of 8 tokens, y reduce-scattered over the 8
//      threads of a channel by 3 levels of shuffles (7 shuffles, 14 selects), D * x, bf16 store;
//   1  y transposed through shared memory instead (each thread writes its 8 partial sums, reads the
//      8 partial sums of its token: no selects, no shuffles);
//   2  the next group's loads and exponentials issued before this group's chains (software-pipelined
//      across the loop's back edge, which ptxas does not schedule across);
//   3  1 and 2;
//   4  as 0 without the reduce-scatter and the store (each thread sums its partial sums): what the y
//      reduction costs;
//   5  as 0 with B and C loaded once per tile instead of per token pair (the same values every group):
//      what the B and C loads cost;
//   7  as 0 with each group's y reduce-scatter and store done one group later, after the next group's
//      chains (across the loop's back edge);
//   8  as 0 with the 4 warps meeting at a named barrier every 64 tokens (the kernel's scan tile: its
//      scan warps meet at the hand-off barrier once per tile);
//   9  as 8, every 128 tokens;
//   loop16_helpers: the partial sums of y stored to shared memory and summed by two helper warps;
//   loop16_beside: the loop (or (dt, dt * x) by token pairs) beside paced shared-memory traffic from
//      four other warps: what the kernel's other shared-memory users cost it;
//   loop16_products: the loop beside S1's products (products_role.cuh: wgmma of 128 tokens against
//      48 feature rows on a fifth warpgroup), paced to the rate S1 at 2x the unfused path would ask,
//      or at full rate: the loop in a kernel that had nothing else (no hand-off writes, no TMA, no
//      softplus, no epilogue);
//   loop16x2_products: the narrow layout on two warps per scheduler (256 scan threads, one chain
//      each, y reduce-scattered over a channel's 16 lanes) in its cheapest form, alone or beside S1's
//      products.
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
//        -I<cutlass>/include -o narrow_loop benchmarks/micro/narrow_loop.cu
//   (<cutlass>: the nvidia-cutlass wheel's cutlass_library/source)
//   ./narrow_loop
#include <cstdio>
#include <cstdlib>

#include "micro_common.cuh"
#include "products_role.cuh"

constexpr int kT = 64, kDt = 16, kLdDt = 2 * kDt + 8, kLdBP = 2 * 16 + 8, kG = 8, kW = 4, kLdRed = 72;

// One group's operands: (dt, dt * x) of 8 tokens, B and C of 8 tokens x 2 states, the 16 decays.
struct Group {
  float dtx[kG], B[kG][2], C[kG][2], dA[kG][2];
};

// kPairs: (dt, dt * x) by token pairs, [token pair][channel][dt_j, dtx_j, dt_j+1, dtx_j+1] (rows of
// kLdDt2 floats), one 16-byte load for two tokens (loop16_beside).
constexpr int kLdDt2 = 4 * kDt + 8;
template <bool kPairs = false>
__device__ __forceinline__ Group load_group(const float* dtp, const float* bp, const float* cp, int tg,
                                            const float (&A2)[2]) {
  Group r;
  float dt[kG];
  if constexpr (kPairs) {
#pragma unroll
    for (int j = 0; j < kG; j += 2) {
      const float4 d4 = *reinterpret_cast<const float4*>(dtp + ((tg + j) / 2) * kLdDt2);
      dt[j] = d4.x; r.dtx[j] = d4.y; dt[j + 1] = d4.z; r.dtx[j + 1] = d4.w;
    }
  } else {
#pragma unroll
    for (int j = 0; j < kG; ++j) {
      const float2 d2 = *reinterpret_cast<const float2*>(dtp + (tg + j) * kLdDt);
      dt[j] = d2.x;
      r.dtx[j] = d2.y;
    }
  }
#pragma unroll
  for (int j = 0; j < kG; j += 2) {
    const float4 b4 = *reinterpret_cast<const float4*>(bp + ((tg + j) / 2) * kLdBP);
    const float4 c4 = *reinterpret_cast<const float4*>(cp + ((tg + j) / 2) * kLdBP);
    r.B[j][0] = b4.x; r.B[j][1] = b4.y; r.B[j + 1][0] = b4.z; r.B[j + 1][1] = b4.w;
    r.C[j][0] = c4.x; r.C[j][1] = c4.y; r.C[j + 1][0] = c4.z; r.C[j + 1][1] = c4.w;
  }
#pragma unroll
  for (int j = 0; j < kG; ++j)
#pragma unroll
    for (int n = 0; n < 2; ++n) r.dA[j][n] = ex2(dt[j] * A2[n]);
  return r;
}

// One group's chains: the two recurrences through 8 tokens, and each token's partial sum of y.
__device__ __forceinline__ void group_chains(const Group& r, float (&h)[2], float (&ys)[kG]) {
#pragma unroll
  for (int j = 0; j < kG; ++j) ys[j] = 0.f;
#pragma unroll
  for (int j = 0; j < kG; ++j)
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      h[n] = fmaf(r.dA[j][n], h[n], r.dtx[j] * r.B[j][n]);
      ys[j] = fmaf(r.C[j][n], h[n], ys[j]);
    }
}

// The y reduce-scatter of the kernel's narrow loop: over the 8 threads of a channel (lanes kW apart),
// halving the tokens at each level; thread g ends with the sum for token g of the group.
__device__ __forceinline__ float reduce_scatter8(float (&v)[8], int g) {
#pragma unroll
  for (int w = 4; w >= 1; w /= 2) {
    const bool hi = g & w;
#pragma unroll
    for (int i = 0; i < w; ++i) {
      const float keep = hi ? v[i + w] : v[i], send = hi ? v[i] : v[i + w];
      v[i] = keep + __shfl_xor_sync(0xffffffffu, send, kW * w);
    }
  }
  return v[0];
}

// Hand-off tiles with fixed values (the loop reads the same tile for every 64 tokens).
__device__ __forceinline__ void fill_tiles(float* sdt, float* sB, float* sC, unsigned short* sx) {
  for (int i = threadIdx.x; i < kT * kLdDt; i += blockDim.x)
    sdt[i] = (i % 2) ? 0.011f + 1e-5f * (i % 97) : 0.01f + 1e-5f * (i % 89);
  for (int i = threadIdx.x; i < (kT / 2) * kLdBP; i += blockDim.x) {
    sB[i] = 0.5f + 1e-3f * (i % 13);
    sC[i] = 1.f - 1e-3f * (i % 11);
  }
  for (int i = threadIdx.x; i < kT * kDt; i += blockDim.x) sx[i] = 0x3f80 + (i % 7);
}

template <int kVar>
__global__ void __launch_bounds__(128, 1) loop16(unsigned short* y, long long* cycles, int tokens, float* out) {
  constexpr bool kSmemReduce = kVar == 1 || kVar == 3, kAhead = kVar == 2 || kVar == 3;
  constexpr bool kNoReduce = kVar == 4, kBCOnce = kVar == 5, kDefer = kVar == 7;
  constexpr int kSyncTokens = kVar == 8 ? 64 : (kVar == 9 ? 128 : 0);  // tokens between barriers
  extern __shared__ __align__(1024) float4 sm4[];
  float* sdt = reinterpret_cast<float*>(sm4);      // [64 tokens][kLdDt]: (dt, dt * x) per channel
  float* sB = sdt + kT * kLdDt;                    // [32 token pairs][kLdBP]
  float* sC = sB + (kT / 2) * kLdBP;
  unsigned short* sx = reinterpret_cast<unsigned short*>(sC + (kT / 2) * kLdBP);  // [64][16] bf16
  float* sred = reinterpret_cast<float*>(sx + kT * kDt);  // [2 buffers][4 warps][4 channels][kLdRed]
  const int tid = threadIdx.x;
  fill_tiles(sdt, sB, sC, sx);
  __syncthreads();
  const int warp = tid / 32, cl = tid % kW, c = warp * kW + cl, g = (tid % 32) / kW, n0 = 2 * g;
  float A2[2], h[2] = {0.f, 0.f};
  A2[0] = -1.4427f * (n0 + 1) * (1.f + 0.01f * c);
  A2[1] = -1.4427f * (n0 + 2) * (1.f + 0.01f * c);
  const float dskip = 1.f + 0.001f * c;
  float acc = 0.f;
  const float* dtp = sdt + 2 * c;
  const float* bp = sB + g * 4;
  const float* cp = sC + g * 4;
  Group bc0;
  if constexpr (kBCOnce) bc0 = load_group(dtp, bp, cp, 0, A2);
  float prev[kG] = {};
  unsigned short* prev_yp = nullptr;
  int prev_x = 0;
  const long long t_start = clock64();
  for (int t0 = 0; t0 < tokens; t0 += kT) {
    unsigned short* yp = y + (size_t(blockIdx.x) * 1024 + (t0 & 1023) + g) * kDt + c;
    Group next;
    if constexpr (kAhead) next = load_group(dtp, bp, cp, 0, A2);
#pragma unroll 4
    for (int tg = 0; tg < kT; tg += kG) {
      Group r;
      if constexpr (kAhead) {
        r = next;
        if (tg + kG < kT) next = load_group(dtp, bp, cp, tg + kG, A2);
      } else {
        if constexpr (kBCOnce) {  // dt and dt * x of this group; B and C stay those of group 0
          r = bc0;
#pragma unroll
          for (int j = 0; j < kG; ++j) {
            const float2 d2 = *reinterpret_cast<const float2*>(dtp + (tg + j) * kLdDt);
            r.dtx[j] = d2.y;
#pragma unroll
            for (int n = 0; n < 2; ++n) r.dA[j][n] = ex2(d2.x * A2[n]);
          }
        } else {
          r = load_group(dtp, bp, cp, tg, A2);
        }
      }
      float ys[kG];
      group_chains(r, h, ys);
      float total = 0.f;
      if constexpr (kDefer) {
        // reduce the previous group's sums (prev, stored at prev_yp) now, this group's next time
        float v[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) { v[j] = prev[j]; prev[j] = ys[j]; }
        const float sum = reduce_scatter8(v, g);
        const float xg = __uint_as_float(unsigned(sx[prev_x]) << 16);
        if (prev_yp != nullptr) *prev_yp = static_cast<unsigned short>(__float_as_uint(fmaf(dskip, xg, sum)) >> 16);
        prev_yp = yp;
        prev_x = (tg + g) * kDt + c;
        yp += kG * kDt;
        continue;
      }
      if constexpr (kNoReduce) {
#pragma unroll
        for (int j = 0; j < kG; ++j) acc += ys[j];
        continue;
      } else if constexpr (kSmemReduce) {
        // Thread (channel cl, group g) writes its 8 partial sums; then sums the 8 threads' partial
        // sums of token g. Rows of kLdRed = 72 floats: the reads of a warp hit 32 banks.
        float* red = sred + ((tg / kG) % 2) * (4 * 4 * kLdRed) + (warp * 4 + cl) * kLdRed;
        *reinterpret_cast<float4*>(red + g * 8) = make_float4(ys[0], ys[1], ys[2], ys[3]);
        *reinterpret_cast<float4*>(red + g * 8 + 4) = make_float4(ys[4], ys[5], ys[6], ys[7]);
        __syncwarp();
        float s[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) s[k] = red[k * 8 + g];
        total = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
      } else {
        float v[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = ys[j];
        total = reduce_scatter8(v, g);
      }
      const float xg = __uint_as_float(unsigned(sx[(tg + g) * kDt + c]) << 16);
      const float o = fmaf(dskip, xg, total);
      *yp = static_cast<unsigned short>(__float_as_uint(o) >> 16);
      yp += kG * kDt;
    }
    if constexpr (kSyncTokens > 0) {  // the 4 scan warps meet, as at the kernel's hand-off barrier
      if ((t0 + kT) % kSyncTokens == 0) asm volatile("bar.sync 1, 128;\n" ::: "memory");
    }
  }
  if constexpr (kDefer) {  // the last group's sums (a plain sum here: the flush is not timed work)
#pragma unroll
    for (int j = 0; j < kG; ++j) acc += prev[j];
    acc += float(prev_x) + (prev_yp != nullptr ? 1.f : 0.f);
  }
  const long long t_end = clock64();
  acc += h[0] + h[1];
  out[blockIdx.x * 128 + tid] = acc;
  if (tid == 0) cycles[blockIdx.x] = t_end - t_start;
}

// Variant 6: y summed off the loop. The scan writes each thread's partial sums of y to a 2-stage ring
// in shared memory, [channel][token][state group] (rows of 8 floats per token, channels kLdPart
// floats apart: one STS per token, conflict-free), and moves on; two helper warps (threads 128-191:
// in the kernel, the producer warpgroup's idle warps 2 and 3) add the 8 partial sums of each
// (token, channel) with two 16-byte loads, add D * x and store y (16 channels of a token together).
// Named barriers per stage: 1 + s full (scan -> helpers), 3 + s empty (helpers -> scan).
constexpr int kLdPart = kT * 8 + 8;  // floats per channel: 64 tokens x 8 partial sums, + 8 (banks)
template <bool kHelpersIdle>
__global__ void __launch_bounds__(192, 1) loop16_helpers(unsigned short* y, long long* cycles, int tokens,
                                                         float* out) {
  extern __shared__ __align__(1024) float4 sm4[];
  float* sdt = reinterpret_cast<float*>(sm4);
  float* sB = sdt + kT * kLdDt;
  float* sC = sB + (kT / 2) * kLdBP;
  unsigned short* sx = reinterpret_cast<unsigned short*>(sC + (kT / 2) * kLdBP);
  float* spart = reinterpret_cast<float*>(sx + kT * kDt);  // [2][16 channels][kLdPart]
  constexpr int kStage = kDt * kLdPart;
  const int tid = threadIdx.x;
  fill_tiles(sdt, sB, sC, sx);
  __syncthreads();
  const long long t_start = clock64();
  if (tid >= 128) {  // helpers: 64 threads; item = (token, channel), channel fastest; 16 items each per tile
    const int ht = tid - 128, ch = ht % 16;
    const float dskip = 1.f + 0.001f * ch;
    asm volatile("bar.arrive 3, 192;\n" ::: "memory");
    asm volatile("bar.arrive 4, 192;\n" ::: "memory");
    int tile = 0;
    for (int t0 = 0; t0 < tokens; t0 += kT, ++tile) {
      const int st = tile % 2;
      if (st == 0) asm volatile("bar.sync 1, 192;\n" ::: "memory"); else asm volatile("bar.sync 2, 192;\n" ::: "memory");
      const float* part = spart + st * kStage + ch * kLdPart;
      unsigned short* yp = y + (size_t(blockIdx.x) * 1024 + (t0 & 1023)) * kDt + ch;
#pragma unroll 4
      for (int t = ht / 16; t < (kHelpersIdle ? 0 : kT); t += 4) {
        const float4 a = *reinterpret_cast<const float4*>(part + t * 8);
        const float4 b = *reinterpret_cast<const float4*>(part + t * 8 + 4);
        const float total = ((a.x + a.y) + (a.z + a.w)) + ((b.x + b.y) + (b.z + b.w));
        const float xg = __uint_as_float(unsigned(sx[t * kDt + ch]) << 16);
        yp[t * kDt] = static_cast<unsigned short>(__float_as_uint(fmaf(dskip, xg, total)) >> 16);
      }
      if (st == 0) asm volatile("bar.arrive 3, 192;\n" ::: "memory"); else asm volatile("bar.arrive 4, 192;\n" ::: "memory");
    }
    if (tid == 128) cycles[blockIdx.x] = clock64() - t_start;
    return;
  }
  const int warp = tid / 32, cl = tid % kW, c = warp * kW + cl, g = (tid % 32) / kW, n0 = 2 * g;
  float A2[2], h[2] = {0.f, 0.f};
  A2[0] = -1.4427f * (n0 + 1) * (1.f + 0.01f * c);
  A2[1] = -1.4427f * (n0 + 2) * (1.f + 0.01f * c);
  const float* dtp = sdt + 2 * c;
  const float* bp = sB + g * 4;
  const float* cp = sC + g * 4;
  int tile = 0;
  for (int t0 = 0; t0 < tokens; t0 += kT, ++tile) {
    const int st = tile % 2;
    if (st == 0) asm volatile("bar.sync 3, 192;\n" ::: "memory"); else asm volatile("bar.sync 4, 192;\n" ::: "memory");
    float* part = spart + st * kStage + c * kLdPart + g;
#pragma unroll 4
    for (int tg = 0; tg < kT; tg += kG) {
      const Group r = load_group(dtp, bp, cp, tg, A2);
#pragma unroll
      for (int j = 0; j < kG; ++j) {
        float yj = 0.f;
#pragma unroll
        for (int n = 0; n < 2; ++n) {
          h[n] = fmaf(r.dA[j][n], h[n], r.dtx[j] * r.B[j][n]);
          yj = fmaf(r.C[j][n], h[n], yj);
        }
        part[(tg + j) * 8] = yj;
      }
    }
    if (st == 0) asm volatile("bar.arrive 1, 192;\n" ::: "memory"); else asm volatile("bar.arrive 2, 192;\n" ::: "memory");
  }
  out[blockIdx.x * 128 + tid] = h[0] + h[1];
}

template <bool kHelpersIdle>
void run_helpers(int sms, int tokens, unsigned short* y, float* out, long long* cycles) {
  const long long worst = slowest_of_two_launches(loop16_helpers<kHelpersIdle>, sms, 192, 160 * 1024, cycles, y,
                                                  cycles, tokens, out);
  const double exps = 128.0 * 2 * tokens;
  std::printf("narrow loop, %-34s: %6.2f exp per SM clock (%.0f%% of MUFU peak)\n",
              kHelpersIdle ? "partial sums written, helpers idle" : "y summed by two helper warps",
              exps / double(worst), 100.0 * exps / double(worst) / 16.0);
}

template <int kVar>
void run(int sms, int tokens, unsigned short* y, float* out, long long* cycles) {
  const long long worst = slowest_of_two_launches(loop16<kVar>, sms, 128, 64 * 1024, cycles, y, cycles, tokens, out);
  const double exps = 128.0 * 2 * tokens;
  const char* what[] = {"the kernel's loop", "y through shared memory", "next group's loads and exps ahead",
                        "both", "no y reduction, no store", "B and C once per tile",
                        "" /* 6: loop16_helpers */, "y reduced one group later",
                        "warps meet every 64 tokens", "warps meet every 128 tokens"};
  std::printf("narrow loop, %-34s: %6.2f exp per SM clock (%.0f%% of MUFU peak)\n", what[kVar], exps / double(worst),
              100.0 * exps / double(worst) / 16.0);
}

// One 64-token tile of the kernel's loop (variant 0's body): loads, chains, y reduce-scatter, D * x,
// the store.
template <bool kPairs = false>
__device__ __forceinline__ void kernel_loop_tile(const float* dtp, const float* bp, const float* cp,
                                                 const unsigned short* sx, const float (&A2)[2], float (&h)[2],
                                                 float dskip, unsigned short* yp, int c, int g) {
#pragma unroll 4
  for (int tg = 0; tg < kT; tg += kG) {
    const Group r = load_group<kPairs>(dtp, bp, cp, tg, A2);
    float v[kG];
    group_chains(r, h, v);
    const float total = reduce_scatter8(v, g);
    const float xg = __uint_as_float(unsigned(sx[(tg + g) * kDt + c]) << 16);
    *yp = static_cast<unsigned short>(__float_as_uint(fmaf(dskip, xg, total)) >> 16);
    yp += kG * kDt;
  }
}

// A scan thread of the kernel's loop (tid < 128): its channel c, its state pair g and their fixed A
// (times log2 e) and D.
struct ScanThread {
  int c, g;
  float A2[2], dskip;
};
__device__ __forceinline__ ScanThread scan_thread(int tid) {
  ScanThread t;
  t.c = (tid / 32) * kW + tid % kW;
  t.g = (tid % 32) / kW;
  const int n0 = 2 * t.g;
  t.A2[0] = -1.4427f * (n0 + 1) * (1.f + 0.01f * t.c);
  t.A2[1] = -1.4427f * (n0 + 2) * (1.f + 0.01f * t.c);
  t.dskip = 1.f + 0.001f * t.c;
  return t;
}

// The kernel's loop beside shared-memory traffic (loop16_beside): warps 0-3 run the kernel's loop
// (variant 0), warps 4-7 read a separate 32 KB region in bursts of kBurst 16-byte loads per warp
// (4 wavefronts each, conflict-free) with a __nanosleep(sleep_ns) after each burst, until the scan
// is done: a model of the kernel's other shared-memory users (wgmma's operand reads, TMA and the
// epilogue's writes; at S1 they take ~0.33 wavefronts per clock, docs/perf/layer-forward.md). kPairs: the
// hand-off tile holds (dt, dt * x) by token pairs, [token pair][channel][dt_j, dtx_j, dt_j+1,
// dtx_j+1], so one 16-byte load serves two tokens: 26 wavefronts per warp and group of 8 tokens
// instead of 34.
constexpr int kBurst = 64;
template <bool kPairs>
__global__ void __launch_bounds__(256, 1) loop16_beside(unsigned short* y, long long* cycles, int tokens, float* out,
                                                        long long* traffic, int sleep_ns) {
  extern __shared__ __align__(1024) float4 sm4[];
  float* sdt = reinterpret_cast<float*>(sm4);                   // [64][kLdDt] or [32][kLdDt2]
  float* sB = sdt + kT * kLdDt;                                 // (kT / 2) * kLdDt2 <= kT * kLdDt
  float* sC = sB + (kT / 2) * kLdBP;
  unsigned short* sx = reinterpret_cast<unsigned short*>(sC + (kT / 2) * kLdBP);
  float4* region = reinterpret_cast<float4*>(sx + kT * kDt);  // 32 KB read by the traffic warps
  __shared__ volatile int done;
  const int tid = threadIdx.x;
  fill_tiles(sdt, sB, sC, sx);
  for (int i = tid; i < 2048; i += blockDim.x) region[i] = make_float4(1.f, 2.f, 3.f, float(i));
  if (tid == 0) done = 0;
  __syncthreads();
  if (tid >= 128) {  // traffic warps
    const int lane = tid % 32, w = tid / 32 - 4;
    const unsigned base = static_cast<unsigned>(__cvta_generic_to_shared(region)) + lane * 16;
    float acc = 0.f;
    long long bursts = 0;
    while (sleep_ns >= 0 && !done) {
#pragma unroll 8
      for (int i = 0; i < kBurst; ++i) {  // volatile: the loads must not be hoisted out of the while loop
        float a, b, c2, d;
        asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];"
                     : "=f"(a), "=f"(b), "=f"(c2), "=f"(d) : "r"(base + ((w * kBurst + i) % 64) * 512));
        acc += a;
      }
      ++bursts;
      if (sleep_ns > 0) __nanosleep(sleep_ns);
    }
    out[blockIdx.x * 256 + tid] = acc;
    if (lane == 0) traffic[blockIdx.x * 4 + w] = bursts;
    return;
  }
  const ScanThread th = scan_thread(tid);
  const int c = th.c, g = th.g;
  float h[2] = {0.f, 0.f};
  const float* dtp = kPairs ? sdt + 4 * c : sdt + 2 * c;
  const float* bp = sB + g * 4;
  const float* cp = sC + g * 4;
  const long long t_start = clock64();
  for (int t0 = 0; t0 < tokens; t0 += kT)
    kernel_loop_tile<kPairs>(dtp, bp, cp, sx, th.A2, h, th.dskip,
                             y + (size_t(blockIdx.x) * 1024 + (t0 & 1023) + g) * kDt + c, c, g);
  const long long t_end = clock64();
  asm volatile("bar.sync 1, 128;\n" ::: "memory");
  if (tid == 0) done = 1;
  out[blockIdx.x * 256 + tid] = h[0] + h[1];
  if (tid == 0) cycles[blockIdx.x] = t_end - t_start;
}

template <bool kPairs>
void run_beside(int sms, int tokens, unsigned short* y, float* out, long long* cycles, long long* traffic,
                int sleep_ns) {
  const long long worst = slowest_of_two_launches(loop16_beside<kPairs>, sms, 256, 160 * 1024, cycles, y, cycles,
                                                  tokens, out, traffic, sleep_ns);
  long long c0 = 0, t0[4];
  CHECK(cudaMemcpy(&c0, cycles, sizeof(c0), cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(t0, traffic, sizeof(t0), cudaMemcpyDeviceToHost));
  const double wavefronts = double(t0[0] + t0[1] + t0[2] + t0[3]) * kBurst * 4;
  const double exps = 128.0 * 2 * tokens;
  std::printf("narrow loop, %-22s beside traffic (sleep %5d ns, %.2f wavefronts per clock): %6.2f exp per SM clock\n",
              kPairs ? "dt by token pairs," : "the kernel's loop,", sleep_ns, wavefronts / double(c0),
              exps / double(worst));
}

// The kernel's loop (warps 0-3; kSync: meeting at a named barrier every 64 tokens, as the kernel's
// scan warps do at the hand-off) beside S1's products (warps 4-7, products_role<kNoise>: 11 paced to
// 740 flops per SM clock, 12 full rate; 13 and 14 the same with x in registers) on a 64 KB region of
// its own.
template <int kNoise, bool kSync>
__global__ void __launch_bounds__(256, 1) loop16_products(unsigned short* y, long long* cycles, int tokens, float* out) {
  extern __shared__ __align__(1024) float4 sm4[];
  float* sdt = reinterpret_cast<float*>(sm4);
  float* sB = sdt + kT * kLdDt;
  float* sC = sB + (kT / 2) * kLdBP;
  unsigned short* sx = reinterpret_cast<unsigned short*>(sC + (kT / 2) * kLdBP);
  unsigned char* region = reinterpret_cast<unsigned char*>(sm4) + 32768;  // past the tiles (23 KB), 1024-aligned
  __shared__ volatile int done;
  const int tid = threadIdx.x;
  fill_tiles(sdt, sB, sC, sx);
  for (int i = tid; i < 4096; i += blockDim.x) reinterpret_cast<float4*>(region)[i] = make_float4(0.f, 1.f, 2.f, 3.f);
  if (tid == 0) done = 0;
  __syncthreads();
  if (tid >= 128) {
    products_role<kNoise>(region, &done, cycles, nullptr, out, tid);
    return;
  }
  const ScanThread th = scan_thread(tid);
  const int c = th.c, g = th.g;
  float h[2] = {0.f, 0.f};
  const long long t_start = clock64();
  for (int t0 = 0; t0 < tokens; t0 += kT) {
    kernel_loop_tile(sdt + 2 * c, sB + g * 4, sC + g * 4, sx, th.A2, h, th.dskip,
                     y + (size_t(blockIdx.x) * 1024 + (t0 & 1023) + g) * kDt + c, c, g);
    if constexpr (kSync) asm volatile("bar.sync 3, 128;\n" ::: "memory");  // 1 is the products role's
  }
  const long long t_end = clock64();
  asm volatile("bar.sync 2, 128;\n" ::: "memory");
  if (tid == 0) done = 1;
  out[blockIdx.x * 128 + tid] = h[0] + h[1];
  if (tid == 0) cycles[blockIdx.x] = t_end - t_start;
}

template <int kNoise, bool kSync>
void run_products(int sms, int tokens, unsigned short* y, float* out, long long* cycles) {
  const long long worst = slowest_of_two_launches(loop16_products<kNoise, kSync>, sms, 256, 100 * 1024, cycles, y,
                                                  cycles, tokens, out);
  long long flops = 0;  // CTA 0's
  CHECK(cudaMemcpy(&flops, cycles + sms, sizeof(flops), cudaMemcpyDeviceToHost));
  const double exps = 128.0 * 2 * tokens;
  std::printf("narrow loop%s beside the products (%s): %6.2f exp per SM clock (wgmma %.0f flops per SM clock)\n",
              kSync ? ", warps meeting every 64 tokens," : "",
              products_label(kNoise),
              exps / double(worst), double(flops) / double(worst));
}

// A two-warp-per-scheduler narrow loop (loop16x2, beside nothing or S1's products): 256 scan threads,
// one chain each, thread = (channel, state), 16 lanes per channel. The cheapest form of that layout
// found: every operand load serves 4 tokens (16-byte loads: (dt, dt * x) by token pairs, B and C of the
// thread's state by token quads: 1 load per element), 5 instructions per element for the recurrence
// and C * h, and the y reduce-scatter over the channel's 16 lanes (4 shuffle levels, 15 shuffles, 15
// adds and 30 selects per 16 tokens), after which lane n holds token n's sum and stores its y. The
// kernel's two-warp narrow layout of v3.7 (11.25 instructions per exponential) was 20% slower on S1
// than the one-warp layout; this measures the layout's best case, beside S1's products at the pace
// 2x the unfused path would ask (products_role 11) or at full rate (12), or alone (0). Its loop is
// 10.5 instructions per exponential (SASS); measured: 6.67 alone, 3.53 beside the paced products
// (docs/perf/layer-forward.md, "The scan's products on the tensor cores", 2026-12-01).
constexpr int kG2 = 16;
// One level of the 16-lane reduce-scatter: reduce_scatter8's level as a template (a loop over the
// levels is not unrolled at 16 tokens and puts v in local memory). reduce_scatter8 keeps its loop:
// built on this template, the kernels measured with it compile to different SASS.
template <int kW2>
__device__ __forceinline__ void reduce_scatter_level16(float (&v)[kG2], int n) {
  const bool hi = n & kW2;
#pragma unroll
  for (int i = 0; i < kW2; ++i) {
    const float keep = hi ? v[i + kW2] : v[i], send = hi ? v[i] : v[i + kW2];
    v[i] = keep + __shfl_xor_sync(0xffffffffu, send, kW2);
  }
}
__device__ __forceinline__ float reduce_scatter16(float (&v)[kG2], int n) {
  reduce_scatter_level16<8>(v, n);
  reduce_scatter_level16<4>(v, n);
  reduce_scatter_level16<2>(v, n);
  reduce_scatter_level16<1>(v, n);
  return v[0];
}

template <int kNoise>
__global__ void __launch_bounds__(384, 1) loop16x2_products(unsigned short* y, long long* cycles, int tokens,
                                                            float* out) {
  extern __shared__ __align__(1024) float4 sm4[];
  // rows padded by one float4, so that the 16 states' (or 2 channels') rows start in different banks
  constexpr int kRowDt = kT / 2 + 1, kRowBC = kT / 4 + 1;
  float4* sdt4 = sm4;                                              // [16 channels][32 token pairs]: dt, dtx, dt, dtx
  float4* sB4 = sdt4 + kDt * kRowDt;                               // [16 states][16 token quads]
  float4* sC4 = sB4 + 16 * kRowBC;
  unsigned short* sx = reinterpret_cast<unsigned short*>(sC4 + 16 * kRowBC);  // [64 tokens][16 channels] bf16
  unsigned char* region = reinterpret_cast<unsigned char*>(sm4) + 32768;         // the products' 64 KB
  __shared__ volatile int done;
  const int tid = threadIdx.x;
  for (int i = tid; i < kDt * kRowDt; i += blockDim.x)
    sdt4[i] = make_float4(0.01f + 1e-5f * (i % 89), 0.011f + 1e-5f * (i % 97), 0.01f + 1e-5f * (i % 83),
                          0.011f + 1e-5f * (i % 79));
  for (int i = tid; i < 16 * kRowBC; i += blockDim.x) {
    sB4[i] = make_float4(0.5f + 1e-3f * (i % 13), 0.5f, 0.51f, 0.52f);
    sC4[i] = make_float4(1.f - 1e-3f * (i % 11), 1.f, 0.99f, 0.98f);
  }
  for (int i = tid; i < kT * kDt; i += blockDim.x) sx[i] = 0x3f80 + (i % 7);
  for (int i = tid; i < 4096; i += blockDim.x) reinterpret_cast<float4*>(region)[i] = make_float4(0.f, 1.f, 2.f, 3.f);
  if (tid == 0) done = 0;
  __syncthreads();
  if (tid >= 256) {
    if constexpr (kNoise != 0) products_role<kNoise>(region, &done, cycles, nullptr, out, tid - 128);
    else if (tid == 256) cycles[gridDim.x + blockIdx.x] = 0;
    return;
  }
  const int c = tid / 16, n = tid % 16;
  const float A = -1.4427f * (n + 1) * (1.f + 0.01f * c), dskip = 1.f + 0.001f * c;
  float h = 0.f;
  const long long t_start = clock64();
  for (int t0 = 0; t0 < tokens; t0 += kT) {
    unsigned short* yp = y + (size_t(blockIdx.x) * 1024 + (t0 & 1023) + n) * kDt + c;
#pragma unroll 2
    for (int tg = 0; tg < kT; tg += kG2) {
      float dt[kG2], dtx[kG2], B[kG2], v[kG2];
#pragma unroll
      for (int j = 0; j < kG2; j += 2) {
        const float4 d = sdt4[c * kRowDt + (tg + j) / 2];
        dt[j] = d.x; dtx[j] = d.y; dt[j + 1] = d.z; dtx[j + 1] = d.w;
      }
#pragma unroll
      for (int j = 0; j < kG2; j += 4) {
        const float4 b = sB4[n * kRowBC + (tg + j) / 4];
        B[j] = b.x; B[j + 1] = b.y; B[j + 2] = b.z; B[j + 3] = b.w;
      }
#pragma unroll
      for (int j = 0; j < kG2; ++j) {
        const float dA = ex2(dt[j] * A);
        h = fmaf(dA, h, dtx[j] * B[j]);
        v[j] = h;
      }
#pragma unroll
      for (int j = 0; j < kG2; j += 4) {
        const float4 cc = sC4[n * kRowBC + (tg + j) / 4];
        v[j] *= cc.x; v[j + 1] *= cc.y; v[j + 2] *= cc.z; v[j + 3] *= cc.w;
      }
      const float total = reduce_scatter16(v, n);
      const float xg = __uint_as_float(unsigned(sx[(tg + n) * kDt + c]) << 16);
      *yp = static_cast<unsigned short>(__float_as_uint(fmaf(dskip, xg, total)) >> 16);
      yp += kG2 * kDt;
    }
  }
  const long long t_end = clock64();
  asm volatile("bar.sync 2, 256;\n" ::: "memory");
  if (tid == 0) done = 1;
  out[blockIdx.x * 256 + tid] = h;
  if (tid == 0) cycles[blockIdx.x] = t_end - t_start;
}

template <int kNoise>
void run_x2(int sms, int tokens, unsigned short* y, float* out, long long* cycles) {
  const long long worst = slowest_of_two_launches(loop16x2_products<kNoise>, sms, 384, 100 * 1024, cycles, y,
                                                  cycles, tokens, out);
  long long flops = 0;  // CTA 0's
  CHECK(cudaMemcpy(&flops, cycles + sms, sizeof(flops), cudaMemcpyDeviceToHost));
  const double exps = 256.0 * tokens;
  std::printf("narrow loop, two warps per scheduler (one chain per thread), beside %-28s: %6.2f exp per SM clock "
              "(wgmma %.0f flops per SM clock)\n",
              kNoise ? products_label(kNoise) : "nothing", exps / double(worst), double(flops) / double(worst));
}

int main() {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  float* out;
  long long* cycles;
  unsigned short* y;
  CHECK(cudaMalloc(&out, sizeof(float) * sms * 128));
  CHECK(cudaMalloc(&cycles, sizeof(long long) * sms));
  CHECK(cudaMalloc(&y, sizeof(unsigned short) * size_t(sms) * 1024 * kDt));
  const int tokens = 1 << 14;
  for (int round = 0; round < 2; ++round) {
    run<0>(sms, tokens, y, out, cycles);
    run<1>(sms, tokens, y, out, cycles);
    run<2>(sms, tokens, y, out, cycles);
    run<3>(sms, tokens, y, out, cycles);
    run<4>(sms, tokens, y, out, cycles);
    run<5>(sms, tokens, y, out, cycles);
    run<7>(sms, tokens, y, out, cycles);
    run<8>(sms, tokens, y, out, cycles);
    run<9>(sms, tokens, y, out, cycles);
    run_helpers<false>(sms, tokens, y, out, cycles);
    run_helpers<true>(sms, tokens, y, out, cycles);
  }
  long long* traffic;
  float* out2;
  CHECK(cudaMalloc(&traffic, sizeof(long long) * sms * 4));
  CHECK(cudaMalloc(&out2, sizeof(float) * sms * 256));
  for (int round = 0; round < 2; ++round)
    for (int sleep_ns : {-1, 4000, 1000, 300, 0}) {  // -1: traffic warps stop at once (no traffic)
      run_beside<false>(sms, tokens, y, out2, cycles, traffic, sleep_ns);
      run_beside<true>(sms, tokens, y, out2, cycles, traffic, sleep_ns);
    }
  long long* cycles2;  // the loop's clocks, then the products' flops
  CHECK(cudaMalloc(&cycles2, sizeof(long long) * sms * 2));
  for (int round = 0; round < 2; ++round) {
    run_products<11, false>(sms, tokens, y, out2, cycles2);
    run_products<11, true>(sms, tokens, y, out2, cycles2);
    run_products<12, false>(sms, tokens, y, out2, cycles2);
    run_products<12, true>(sms, tokens, y, out2, cycles2);
    run_products<13, false>(sms, tokens, y, out2, cycles2);
    run_products<13, true>(sms, tokens, y, out2, cycles2);
    run_products<14, false>(sms, tokens, y, out2, cycles2);
    run_products<15, false>(sms, tokens, y, out2, cycles2);
  }
  for (int round = 0; round < 2; ++round) {
    run_x2<0>(sms, tokens, y, out2, cycles2);
    run_x2<11>(sms, tokens, y, out2, cycles2);
    run_x2<12>(sms, tokens, y, out2, cycles2);
  }
  CHECK(cudaFree(cycles2));
  CHECK(cudaFree(out2));
  CHECK(cudaFree(traffic));
  CHECK(cudaFree(y));
  CHECK(cudaFree(cycles));
  CHECK(cudaFree(out));
  return 0;
}
