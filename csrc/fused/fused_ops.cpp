// torch.library registration of the fused kernel's ops (extension selscan_fused._fused, built for
// sm_90a only). Same conventions as csrc/torch_ops.cpp: checks naming the argument before anything
// runs, current stream, device guard, no host synchronisation.
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <atomic>
#include <cmath>
#include <tuple>
#include <vector>

#include "../common/seq_map.h"
#include "../op_checks.h"
#include "fused_api.h"

namespace selscan {
namespace {

std::atomic<bool> g_poison_outputs{false};  // test hook, as set_poison_outputs in torch_ops.cpp

void check_fused_envelope(const at::Tensor& x, int64_t Dm, int64_t N, const char* dim_name = "d_model D") {
  TORCH_CHECK(fused_available(x.get_device()), "selscan_fused: impl='fused' needs an sm_90 GPU (H100/H200); ",
              x.device(), " is not one: use impl='unfused'");
  TORCH_CHECK(fused_supports_dstate(N), "selscan_fused: d_state N = ", N,
              " is not supported by impl='fused' (supported: 8, 16, 32, 64); use impl='unfused'");
  TORCH_CHECK(Dm % kFusedChannelTile == 0 && Dm >= kFusedChannelTile && Dm <= kFusedMaxDim,
              "selscan_fused: ", dim_name, " = ", Dm, " is not supported by impl='fused' (a multiple of ",
              kFusedChannelTile, " from ", kFusedChannelTile, " to ", kFusedMaxDim, "); use impl='unfused'");
}

// The kernel's outputs bound to p: y, the final states where returned (hT otherwise (0,)), the
// checkpoints where kept (ckpt otherwise empty or undefined); under the test hook NaN-poisoned first, so
// that an element the kernel never writes stays NaN.
void bind_outputs(FusedParams& p, at::Tensor& y, at::Tensor& hT, at::Tensor& ckpt, bool return_final_state,
                  bool with_ckpt) {
  if (g_poison_outputs.load(std::memory_order_relaxed)) {
    y.fill_(NAN);
    if (hT.numel() > 0) hT.fill_(NAN);
    if (with_ckpt && ckpt.numel() > 0) ckpt.fill_(NAN);
  }
  p.ckpt = with_ckpt ? ckpt.data_ptr<float>() : nullptr;
  p.y = y.data_ptr();
  p.final_state = return_final_state ? hT.data_ptr<float>() : nullptr;
}

// ScanConfig(channel_tile=...): 0 (chosen by fused_plan), 64, or 16 where the narrow layout exists.
void check_channel_tile(const FusedParams& p, int64_t channel_tile, at::ScalarType dtype) {
  TORCH_CHECK(channel_tile == 0 || channel_tile == 64 || channel_tile == 16,
              "selscan_fused: ScanConfig(channel_tile=", channel_tile, ") must be 0 (automatic), 16 or 64");
  TORCH_CHECK(channel_tile != 16 || fused_has_narrow_layout(p.dtype, p.dstate),
              "selscan_fused: ScanConfig(channel_tile=16) exists for bfloat16/float16 with N = 16 only (got ",
              dtype, ", N = ", p.dstate, "); use 0 or 64");
}

// The fused forward ops' bwd_mode (ScanConfig.fused_backward): which backward their autograd formula
// runs, passed on to fused_bwd's mode; the forward itself does not read it.
void check_bwd_mode(int64_t bwd_mode) {
  TORCH_CHECK(bwd_mode >= 0 && bwd_mode <= 2, "selscan_fused: bwd_mode = ", bwd_mode,
              " must be 0 (automatic), 1 (the fused backward kernel) or 2 (recompute the projections)");
}

FusedParams make_params(const at::Tensor& x, int64_t batch, int64_t L, int64_t Dm, int64_t N) {
  FusedParams p;
  p.batch = batch; p.seqlen = L; p.dim = Dm; p.dstate = N;
  p.dtype = to_dtype(x.scalar_type(), "x");
  // float32 products follow torch's TF32 switch for cuBLAS (allowTF32CuBLAS: off under
  // set_float32_matmul_precision("highest"), on under "high"/"medium"): off -> 3xTF32, on -> TF32 --
  // except for tiny calls (at most kFusedTf32MinOutputs outputs), which take 3xTF32 whatever the
  // precision: over so few outputs the relative error of TF32 products has a heavy tail (1, 1, 64, 16:
  // 3 of 300 random draws above the 1e-3 bound; benchmarks/accuracy_sweep.py), and such calls are
  // launch-bound, so the split costs little (S5 float32: 0.032 ms against 0.028 with TF32).
  p.fp32_3xtf32 = !at::globalContext().allowTF32CuBLAS() ||
                  batch * L * Dm <= kFusedTf32MinOutputs;
  return p;
}

// The fused forward; with_ckpt: also the checkpoints for the backward (a third output, else undefined).
std::tuple<at::Tensor, at::Tensor, at::Tensor> run_fused(const at::Tensor& x_in, const at::Tensor& A_log,
                                                         const at::Tensor& W_delta, const at::Tensor& b_delta,
                                                         const at::Tensor& W_B, const at::Tensor& W_C,
                                                         const at::Tensor& D, const c10::optional<at::Tensor>& h0,
                                                         bool return_final_state, int64_t l_segments, bool exp_poly,
                                                         int64_t ring_stages, int64_t channel_tile, bool with_ckpt) {
  auto [batch, L, Dm, N] = check_layer(x_in, A_log, W_delta, b_delta, W_B, W_C, D, h0);
  check_fused_envelope(x_in, Dm, N);
  TORCH_CHECK(L <= INT32_MAX && batch <= INT32_MAX, "selscan_fused: impl='fused' takes batch and L below 2^31 (got ",
              "batch = ", batch, ", L = ", L, "); use impl='unfused', or split the sequences into calls of fewer ",
              "tokens, each passing its final state on as the next call's h0");
  const c10::cuda::CUDAGuard guard(x_in.device());
  // The checkpoints exist only for fused_fwd_res (fused_fwd drops the third output unallocated).
  at::Tensor ckpt;
  if (with_ckpt) ckpt = at::empty({batch, ckpt_count(L), Dm, N}, x_in.options().dtype(at::kFloat));
  if (batch == 0 || L == 0) {
    auto [y, hT] = empty_result(x_in, batch, Dm, N, h0, return_final_state);
    return {y, hT, ckpt};
  }

  // TMA reads 16-byte aligned, contiguous tensors.
  const at::Tensor x = aligned_contiguous(x_in);
  const at::Tensor Wd = aligned_contiguous(W_delta), Wb = aligned_contiguous(W_B), Wc = aligned_contiguous(W_C);
  // b_delta is read two floats at a time (8-byte loads): aligned like the rest.
  const at::Tensor A_c = A_log.contiguous(), b_c = aligned_contiguous(b_delta), D_c = D.contiguous();
  at::Tensor h0_c;
  if (h0) h0_c = h0->contiguous();

  FusedParams p = make_params(x, batch, L, Dm, N);
  p.x = x.data_ptr(); p.W_delta = Wd.data_ptr(); p.W_B = Wb.data_ptr(); p.W_C = Wc.data_ptr();
  p.A_log = A_c.data_ptr<float>(); p.b_delta = b_c.data_ptr<float>(); p.D = D_c.data_ptr<float>();
  p.h0 = h0 ? h0_c.data_ptr<float>() : nullptr;
  p.exp_poly = exp_poly;
  const int max_stages = fused_max_ring_stages(p.dtype, N, p.fp32_3xtf32);
  TORCH_CHECK(ring_stages == 0 || (ring_stages >= 2 && ring_stages <= max_stages),
              "selscan_fused: ScanConfig(ring_stages=", ring_stages, ") is out of range: 0 (all that fit) or 2 .. ",
              max_stages, " for ", x.scalar_type(), " with N = ", N,
              (p.dtype == DType::kFloat32 ? (p.fp32_3xtf32 ? " (3xTF32)" : " (TF32)") : ""));
  p.ring_stages = int(ring_stages);
  check_channel_tile(p, channel_tile, x.scalar_type());
  FusedLaunchInfo plan;
  SELSCAN_CUDA_OK(fused_plan(p, l_segments, channel_tile, x.get_device(), &plan), "planning the fused kernel");
  p.n_segments = plan.n_segments; p.seg_len = plan.seg_len; p.channel_tile = int(plan.channel_tile);

  at::Tensor y = at::empty({batch, L, Dm}, x.options());
  at::Tensor hT = return_final_state ? at::empty({batch, Dm, N}, x.options().dtype(at::kFloat))
                                     : at::empty({0}, x.options().dtype(at::kFloat));
  const int64_t ws_floats = split_workspace_floats(batch, Dm, N, p.n_segments);
  at::Tensor ws;
  if (ws_floats > 0) ws = at::empty({ws_floats}, x.options().dtype(at::kFloat));
  bind_outputs(p, y, hT, ckpt, return_final_state, with_ckpt);
  p.workspace = ws_floats > 0 ? ws.data_ptr<float>() : nullptr;
  SELSCAN_CUDA_OK(fused_launch(p, c10::cuda::getCurrentCUDAStream().stream()), "the fused kernel launch");
  return {y, hT, ckpt};
}

std::tuple<at::Tensor, at::Tensor> fused_fwd(const at::Tensor& x, const at::Tensor& A_log, const at::Tensor& W_delta,
                                             const at::Tensor& b_delta, const at::Tensor& W_B, const at::Tensor& W_C,
                                             const at::Tensor& D, const c10::optional<at::Tensor>& h0,
                                             bool return_final_state, int64_t l_segments, bool exp_poly,
                                             int64_t ring_stages, int64_t channel_tile, int64_t bwd_mode) {
  check_bwd_mode(bwd_mode);
  auto [y, hT, ckpt] = run_fused(x, A_log, W_delta, b_delta, W_B, W_C, D, h0, return_final_state, l_segments,
                                 exp_poly, ring_stages, channel_tile, false);
  return {y, hT};
}

// The fused forward for training: y, the final state and the checkpoints (batch, ckpt_count(L), D, N)
// its backward starts from (selscan_fused::unfused_bwd with proj absent).
std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_fwd_res(
    const at::Tensor& x, const at::Tensor& A_log, const at::Tensor& W_delta, const at::Tensor& b_delta,
    const at::Tensor& W_B, const at::Tensor& W_C, const at::Tensor& D, const c10::optional<at::Tensor>& h0,
    int64_t l_segments, bool exp_poly, int64_t ring_stages, int64_t channel_tile, int64_t bwd_mode) {
  check_bwd_mode(bwd_mode);
  return run_fused(x, A_log, W_delta, b_delta, W_B, W_C, D, h0, true, l_segments, exp_poly, ring_stages,
                   channel_tile, true);
}

// The block's product on the tensor cores: xk = [dt_low | B | C] (x_proj's output) padded to whole
// 16-byte rows Kp (TMA; the padding columns are zeros on both sides), against W_delta = [dt_proj's
// weight | 0], W_B = [0 | I | 0] and W_C = [0 | 0 | I] (FusedParams, "The Mamba block").
struct BlockOperands {
  at::Tensor xk, Wd, Wb, Wc;
  int64_t Kp = 0;
};

BlockOperands block_operands(const at::Tensor& xdbl, const at::Tensor& dt_proj_weight, int64_t N,
                             const at::TensorOptions& options) {
  const int64_t Dm = dt_proj_weight.size(0), R = dt_proj_weight.size(1), K = R + 2 * N;
  const int64_t kq = 16 / int64_t(xdbl.element_size());
  BlockOperands o;
  o.Kp = (K + kq - 1) / kq * kq;
  o.xk = (o.Kp == K) ? aligned_contiguous(xdbl) : at::constant_pad_nd(xdbl, {0, o.Kp - K}, 0).contiguous();
  o.Wd = at::zeros({Dm, o.Kp}, options);
  o.Wb = at::zeros({N, o.Kp}, options);
  o.Wc = at::zeros({N, o.Kp}, options);
  o.Wd.narrow(1, 0, R).copy_(dt_proj_weight);
  const at::Tensor eye = at::eye(N, options);
  o.Wb.narrow(1, R, N).copy_(eye);
  o.Wc.narrow(1, R + N, N).copy_(eye);
  return o;
}

// The packed ops' common end: p's packed streams (num_seqs S from cu over T tokens, one segment, the
// 64-channel layout), y (1, T, D) in `like`'s dtype and the final states (S, D, N) or (0,) allocated
// (NaN-poisoned under the test hook, ckpt too), the launch. Returns (y, final states).
std::tuple<at::Tensor, at::Tensor> launch_packed(FusedParams& p, const at::Tensor& cu, int64_t S, int64_t T,
                                                 const at::Tensor& like, bool return_final_state, at::Tensor& ckpt,
                                                 bool with_ckpt, const char* what) {
  p.cu_seqlens = cu.data_ptr<int32_t>();
  p.num_seqs = S;
  p.channel_tile = 64;
  p.n_segments = 1;
  p.seg_len = (T + kFusedTokenTile - 1) / kFusedTokenTile * kFusedTokenTile;  // the long-stream layout past 1024
  const auto f32 = like.options().dtype(at::kFloat);
  at::Tensor y = at::empty({1, T, p.dim}, like.options());
  at::Tensor hT = at::empty(return_final_state ? at::IntArrayRef{S, p.dim, p.dstate} : at::IntArrayRef{0}, f32);
  bind_outputs(p, y, hT, ckpt, return_final_state, with_ckpt);
  SELSCAN_CUDA_OK(fused_launch(p, c10::cuda::getCurrentCUDAStream().stream()), what);
  return {y, hT};
}

// Packed sequences (cu_seqlens, int32 (num_seqs + 1,)): x (1, total, D). Returns y (1, total, D), the
// final states (num_seqs, D, N) (empty unless return_final_state) and, with_ckpt, the checkpoints
// (1, packed_slots(total, num_seqs, 64), D, N) in scan_bwd_packed's layout (else (0, ...)), so that the
// unfused path's packed backward serves the fused forward's training step. One stream per (sequence,
// 64-channel tile), no L split; each sequence's tokens, states and checkpoints as when it runs alone.
// Only where fused_packed_built() (every build but one with -DSELSCAN_FUSED_NO_PACKED).
std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_fwd_packed(
    const at::Tensor& x_in, const at::Tensor& A_log, const at::Tensor& W_delta, const at::Tensor& b_delta,
    const at::Tensor& W_B, const at::Tensor& W_C, const at::Tensor& D, const c10::optional<at::Tensor>& h0,
    const at::Tensor& cu_seqlens, bool return_final_state, bool with_ckpt) {
  TORCH_CHECK(fused_packed_built(), "selscan_fused: this build's fused kernel does not take packed sequences "
              "(cu_seqlens): it was built with SELSCAN_FUSED_NVCC_FLAGS=-DSELSCAN_FUSED_NO_PACKED; use impl='unfused'");
  TORCH_CHECK(x_in.dim() == 3 && x_in.size(0) == 1, "selscan_fused: packed sequences take x of shape (1, "
              "total_tokens, D), got ", x_in.sizes());
  auto [batch, T, Dm, N] = check_layer(x_in, A_log, W_delta, b_delta, W_B, W_C, D, c10::nullopt);
  const int64_t S = check_cu_seqlens_arg(cu_seqlens, x_in, T);
  if (h0) check_tensor(*h0, "h0", x_in, {S, Dm, N}, at::kFloat, " (one state per sequence: num_seqs from cu_seqlens)");
  check_fused_envelope(x_in, Dm, N);
  const c10::cuda::CUDAGuard guard(x_in.device());
  at::Tensor ckpt = at::empty({with_ckpt ? 1 : 0, packed_slots(T, S, kCkptEvery), Dm, N},
                              x_in.options().dtype(at::kFloat));
  if (T == 0) {
    auto [y, hT] = empty_result(x_in, S, Dm, N, h0, return_final_state);
    return {y, hT, ckpt};
  }
  const at::Tensor x = aligned_contiguous(x_in);
  const at::Tensor Wd = aligned_contiguous(W_delta), Wb = aligned_contiguous(W_B), Wc = aligned_contiguous(W_C);
  const at::Tensor A_c = A_log.contiguous(), b_c = aligned_contiguous(b_delta), D_c = D.contiguous();
  const at::Tensor cu = cu_seqlens.contiguous();
  at::Tensor h0_c;
  if (h0) h0_c = h0->contiguous();

  FusedParams p = make_params(x, 1, T, Dm, N);
  p.x = x.data_ptr(); p.W_delta = Wd.data_ptr(); p.W_B = Wb.data_ptr(); p.W_C = Wc.data_ptr();
  p.A_log = A_c.data_ptr<float>(); p.b_delta = b_c.data_ptr<float>(); p.D = D_c.data_ptr<float>();
  p.h0 = h0 ? h0_c.data_ptr<float>() : nullptr;
  auto [y, hT] = launch_packed(p, cu, S, T, x, return_final_state, ckpt, with_ckpt, "the fused kernel launch (packed)");
  return {y, hT, ckpt};
}

// The block's scan on packed sequences (cu_seqlens; not in a build with -DSELSCAN_FUSED_NO_PACKED): from the
// packed conv's output u (1, total, d_inner), x_proj's output xdbl = [dt_low | B | C] (1, total, R + 2N)
// and the gate z (1, total, d_inner), tokens z_stride apart (the right half of in_proj's output in
// place): dt_proj on the tensor cores, the scan, D and the gate, as fused_block_fwd's second kernel with
// its conv outside. Returns (y, final states (num_seqs, d_inner, N) or (0,), checkpoints in the packed
// slot layout or (0, ...)).
std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_block_scan_packed(
    const at::Tensor& u_in, const at::Tensor& xdbl, const at::Tensor& z, const at::Tensor& dt_proj_weight,
    const at::Tensor& A_log, const at::Tensor& dt_bias, const at::Tensor& D, const c10::optional<at::Tensor>& h0,
    const at::Tensor& cu_seqlens, bool return_final_state, bool with_ckpt) {
  TORCH_CHECK(fused_packed_built(), "selscan_fused: this build's fused kernel does not take packed sequences "
              "(cu_seqlens): it was built with SELSCAN_FUSED_NVCC_FLAGS=-DSELSCAN_FUSED_NO_PACKED; use impl='unfused'");
  TORCH_CHECK(u_in.is_cuda(), "selscan_fused: fused_block_scan_packed: u is on ", u_in.device(),
              "; impl='fused' needs CUDA tensors");
  TORCH_CHECK(u_in.dim() == 3 && u_in.size(0) == 1, "selscan_fused: packed sequences take u of shape (1, "
              "total_tokens, d_inner), got ", u_in.sizes());
  const auto dt = u_in.scalar_type();
  to_dtype(dt, "u (fused_block_scan_packed)");
  TORCH_CHECK(A_log.dim() == 2 && dt_proj_weight.dim() == 2, "selscan_fused: fused_block_scan_packed: A_log and "
              "dt_proj_weight must be matrices, got ", A_log.sizes(), " and ", dt_proj_weight.sizes());
  const int64_t T = u_in.size(1), Dm = A_log.size(0), N = A_log.size(1), R = dt_proj_weight.size(1), K = R + 2 * N;
  const int64_t S = check_cu_seqlens_arg(cu_seqlens, u_in, T);
  const char* sizes = " (total from u; d_inner and d_state from A_log; dt_rank from dt_proj_weight; num_seqs from "
                      "cu_seqlens)";
  check_tensor(u_in, "u (fused_block_scan_packed: the conv's output)", u_in, {1, T, Dm}, dt, sizes);
  check_tensor(xdbl, "xdbl (fused_block_scan_packed: x_proj's output [dt_low | B | C])", u_in, {1, T, K}, dt, sizes);
  check_tensor(z, "z (fused_block_scan_packed: the gate)", u_in, {1, T, Dm}, dt, sizes);
  TORCH_CHECK(z.stride(2) == 1 && (z.stride(1) * z.element_size()) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(z.data_ptr()) % 16 == 0,
              "selscan_fused: fused_block_scan_packed: z must have unit channel stride and 16-byte aligned rows, got "
              "strides ", z.strides());
  check_tensor(A_log, "A_log (fused_block_scan_packed)", u_in, {Dm, N}, at::kFloat, sizes);
  check_tensor(dt_bias, "dt_bias (fused_block_scan_packed)", u_in, {Dm}, at::kFloat, sizes);
  check_tensor(D, "D (fused_block_scan_packed)", u_in, {Dm}, at::kFloat, sizes);
  check_tensor(dt_proj_weight, "dt_proj_weight (fused_block_scan_packed)", u_in, {Dm, R}, dt, sizes);
  if (h0) check_tensor(*h0, "h0 (fused_block_scan_packed)", u_in, {S, Dm, N}, at::kFloat, sizes);
  check_fused_envelope(u_in, Dm, N, "d_inner");
  const c10::cuda::CUDAGuard guard(u_in.device());
  const auto f32 = u_in.options().dtype(at::kFloat);
  at::Tensor ckpt = at::empty({with_ckpt ? 1 : 0, packed_slots(T, S, kCkptEvery), Dm, N}, f32);
  if (T == 0) {
    auto [y, hT] = empty_result(u_in, S, Dm, N, h0, return_final_state);
    return {y, hT, ckpt};
  }
  const at::Tensor u = aligned_contiguous(u_in);
  const BlockOperands ops = block_operands(xdbl, dt_proj_weight, N, u.options());
  const at::Tensor A_c = A_log.contiguous(), b_c = aligned_contiguous(dt_bias), D_c = D.contiguous();
  const at::Tensor cu = cu_seqlens.contiguous();
  at::Tensor h0_c;
  if (h0) h0_c = h0->contiguous();

  FusedParams p = make_params(u, 1, T, Dm, N);
  p.fp32_3xtf32 = true;  // B and C through the identity rows to float32 accuracy, as fused_block_fwd
  p.x = u.data_ptr();
  p.xk = ops.xk.data_ptr(); p.k_dim = ops.Kp;
  p.W_delta = ops.Wd.data_ptr(); p.W_B = ops.Wb.data_ptr(); p.W_C = ops.Wc.data_ptr();
  p.A_log = A_c.data_ptr<float>(); p.b_delta = b_c.data_ptr<float>(); p.D = D_c.data_ptr<float>();
  p.h0 = h0 ? h0_c.data_ptr<float>() : nullptr;
  p.z = z.data_ptr(); p.z_stride = z.stride(1);
  auto [y, hT] = launch_packed(p, cu, S, T, u, return_final_state, ckpt, with_ckpt,
                               "the fused kernel launch (block, packed)");
  return {y, hT, ckpt};
}

bool fused_packed_built_op() { return fused_packed_built(); }

// [n_segments, seg_len, channel_tile] the fused kernel would use for x's shape.
std::vector<int64_t> fused_plan_op(const at::Tensor& x, int64_t dstate, int64_t l_segments, int64_t channel_tile) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 3, "selscan_fused: fused_plan needs a CUDA x of shape (batch, L, D)");
  check_fused_envelope(x, x.size(2), dstate);
  const c10::cuda::CUDAGuard guard(x.device());
  FusedParams p = make_params(x, x.size(0), x.size(1), x.size(2), dstate);
  check_channel_tile(p, channel_tile, x.scalar_type());
  FusedLaunchInfo plan;
  SELSCAN_CUDA_OK(fused_plan(p, l_segments, channel_tile, x.get_device(), &plan), "planning the fused kernel");
  return {plan.n_segments, plan.seg_len, plan.channel_tile};
}

// ---- The backward of the fused path.

// Whether fused_bwd takes the fused backward kernel for this call (mode: 0 automatic, 1 the kernel,
// 2 the recomputation); threads_per_channel: 0 (the default layout), 4 or 8.
bool fused_bwd_takes_kernel(const at::Tensor& x, int64_t batch, int64_t L, int64_t Dm, int64_t N, int64_t mode,
                            int64_t threads_per_channel) {
  TORCH_CHECK(mode >= 0 && mode <= 2, "selscan_fused: fused_bwd's mode = ", mode,
              " must be 0 (automatic), 1 (the fused backward kernel) or 2 (recompute the projections)");
  TORCH_CHECK(threads_per_channel == 0 || fused_bwd_layout_ok(threads_per_channel),
              "selscan_fused: fused_bwd's threads_per_channel = ", threads_per_channel, " must be 0 (the default), 4 or 8");
  const bool supported = fused_available(x.get_device()) && fused_bwd_supported(to_dtype(x.scalar_type(), "x"), N) &&
                         Dm % kFusedChannelTile == 0 && Dm >= kFusedChannelTile && Dm <= kFusedMaxDim &&
                         L <= INT32_MAX && batch <= INT32_MAX;
  TORCH_CHECK(mode != 1 || supported, "selscan_fused: the fused backward kernel takes bfloat16/float16 with N = 16 "
              "and D a multiple of ", kFusedChannelTile, " up to ", kFusedMaxDim, " on an sm_90 GPU (got ",
              x.scalar_type(), ", N = ", N, ", D = ", Dm, "); use mode = 0 or 2");
  if (!supported || mode == 2 || batch == 0 || L == 0) return false;
  if (mode == 1) return true;
  // Automatic: the kernel where its plan measured faster than the recomputation (fused_api.h,
  // fused_bwd_auto_takes_kernel; docs/perf/batch1.md, "The batch-1 regime: the plans changed").
  FusedParams p = make_params(x, batch, L, Dm, N);
  FusedLaunchInfo plan;
  SELSCAN_CUDA_OK(fused_bwd_plan(p, 0, x.get_device(), &plan), "planning the fused backward");
  return fused_bwd_auto_takes_kernel(Dm, plan.n_segments, plan.seg_len);
}

// The fused path's backward. Where the fused backward kernel exists (fused_bwd_supported), one launch
// recomputes the projections on the tensor cores and runs the reverse scan (csrc/fused/
// fused_bwd_kernel.cuh); elsewhere (and with mode = 2) the projections are recomputed by one library
// product and the standalone backward scan kernel runs (selscan_fused::unfused_bwd without proj).
// Returns (dx, dA_log, dW_delta, db_delta, dW_B, dW_C, dD, dh0), as unfused_bwd.
std::vector<at::Tensor> fused_bwd(const at::Tensor& x_in, const at::Tensor& A_log, const at::Tensor& W_delta,
                                  const at::Tensor& b_delta, const at::Tensor& W_B, const at::Tensor& W_C,
                                  const at::Tensor& D, const c10::optional<at::Tensor>& h0, const at::Tensor& dy_in,
                                  const c10::optional<at::Tensor>& dhT, const at::Tensor& ckpt_in, int64_t l_segments,
                                  int64_t mode, int64_t threads_per_channel) {
  auto [batch, L, Dm, N] = check_layer(x_in, A_log, W_delta, b_delta, W_B, W_C, D, h0);
  check_backward_args(x_in, dy_in, dhT, ckpt_in, batch, L, Dm, N);
  if (!fused_bwd_takes_kernel(x_in, batch, L, Dm, N, mode, threads_per_channel)) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("selscan_fused::unfused_bwd", "")
                         .typed<std::vector<at::Tensor>(
                             const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                             const at::Tensor&, const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&,
                             const at::Tensor&, const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&,
                             const at::Tensor&, int64_t)>();
    return op.call(x_in, A_log, W_delta, b_delta, W_B, W_C, D, h0, dy_in, dhT, c10::nullopt, ckpt_in, l_segments);
  }
  const c10::cuda::CUDAGuard guard(x_in.device());
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  const auto fopt = x_in.options().dtype(at::kFloat);
  const at::Tensor x = aligned_contiguous(x_in);
  const at::Tensor dy = aligned_contiguous(dy_in.to(x.scalar_type()));
  const at::Tensor Wd = aligned_contiguous(W_delta), Wb = aligned_contiguous(W_B), Wc = aligned_contiguous(W_C);
  const at::Tensor ckpt = aligned_contiguous(ckpt_in);  // read 8 or 16 bytes at a time
  // b_delta is read two floats at a time (8-byte loads): aligned like the rest.
  const at::Tensor A_c = A_log.contiguous(), b_c = aligned_contiguous(b_delta), D_c = D.contiguous();
  at::Tensor dhT_c;
  if (dhT) dhT_c = dhT->to(at::kFloat).contiguous();
  const int64_t BL = batch * L, P = Dm + 2 * N;

  FusedParams p = make_params(x, batch, L, Dm, N);
  p.x = x.data_ptr(); p.W_delta = Wd.data_ptr(); p.W_B = Wb.data_ptr(); p.W_C = Wc.data_ptr();
  p.A_log = A_c.data_ptr<float>(); p.b_delta = b_c.data_ptr<float>(); p.D = D_c.data_ptr<float>();
  FusedLaunchInfo plan;
  SELSCAN_CUDA_OK(fused_bwd_plan(p, l_segments, x.get_device(), &plan), "planning the fused backward");
  p.n_segments = plan.n_segments; p.seg_len = plan.seg_len;
  const int64_t n_tiles = Dm / kFusedChannelTile;
  const int64_t rows = plan.n_segments * batch;
  const int tpc = int(threads_per_channel != 0 ? threads_per_channel : kFusedBwdThreadsPerChannel);

  at::Tensor dP = at::empty({batch, L, P}, x.options());
  at::Tensor dx = at::empty({batch, L, Dm}, x.options());
  at::Tensor bc_part = at::empty({BL, n_tiles, 2 * N}, fopt);
  at::Tensor dA_part = at::empty({rows, Dm, N}, fopt);
  at::Tensor dDdb_part = at::empty({2, rows * (tpc / 2), Dm}, fopt);
  at::Tensor dh0 = at::empty({batch, Dm, N}, fopt);
  const int64_t ws_floats = split_workspace_floats(batch, Dm, N, p.n_segments);
  at::Tensor ws;
  if (ws_floats > 0) ws = at::empty({ws_floats}, fopt);
  if (g_poison_outputs.load(std::memory_order_relaxed)) {
    for (at::Tensor* t : {&dP, &dx, &bc_part, &dA_part, &dDdb_part, &dh0}) t->fill_(NAN);
  }
  ScanBwdParams q;
  q.batch = batch; q.seqlen = L; q.dim = Dm; q.dstate = N; q.dtype = p.dtype;
  q.x = x.data_ptr(); q.dy = dy.data_ptr();
  q.A_log = p.A_log; q.b_delta = p.b_delta; q.D = p.D;
  q.dhT = dhT ? dhT_c.data_ptr<float>() : nullptr;
  q.ckpt = ckpt.data_ptr<float>();
  q.dP = dP.data_ptr(); q.dx = dx.data_ptr();
  q.bc_partial = bc_part.data_ptr<float>(); q.dA_partial = dA_part.data_ptr<float>();
  q.dD_partial = dDdb_part[0].data_ptr<float>(); q.db_partial = dDdb_part[1].data_ptr<float>();
  q.dh0 = dh0.data_ptr<float>();
  q.n_segments = p.n_segments; q.seg_len = p.seg_len;
  q.workspace = ws_floats > 0 ? ws.data_ptr<float>() : nullptr;
  SELSCAN_CUDA_OK(fused_bwd_launch(p, q, tpc, c10::cuda::getCurrentCUDAStream().stream()),
                  "the fused backward launch");
  const at::Tensor W = at::cat({Wd, Wb, Wc}, 0);  // (D + 2N, D)
  return finish_backward(x, W, A_c, dP, dx, bc_part, dA_part, dDdb_part, dh0, batch, L, Dm, N);
}

// [takes the fused backward kernel (1) or the recomputation (0), n_segments, seg_len, threads per
// channel] for x's shape.
std::vector<int64_t> fused_bwd_plan_op(const at::Tensor& x, int64_t dstate, int64_t l_segments, int64_t mode,
                                       int64_t threads_per_channel) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 3, "selscan_fused: fused_bwd_plan needs a CUDA x of shape (batch, L, D)");
  const c10::cuda::CUDAGuard guard(x.device());
  if (!fused_bwd_takes_kernel(x, x.size(0), x.size(1), x.size(2), dstate, mode, threads_per_channel)) return {0, 0, 0, 0};
  FusedParams p = make_params(x, x.size(0), x.size(1), x.size(2), dstate);
  FusedLaunchInfo plan;
  SELSCAN_CUDA_OK(fused_bwd_plan(p, l_segments, x.get_device(), &plan), "planning the fused backward");
  return {1, plan.n_segments, plan.seg_len,
          threads_per_channel != 0 ? threads_per_channel : int64_t(kFusedBwdThreadsPerChannel)};
}

// ---- The Mamba block's fused forward: the layer's kernel with the product's operand [dt_low | B | C]
// (x_proj's output) and the gated output (FusedParams, "The Mamba block").

// (y, final_state, ckpt, xdbl). From xz, in_proj's output (batch, L, 2 d_inner) = [xi | z]:
//   u     = silu(conv(xi)) with conv_weight (d_inner, W), conv_bias, conv_state (batch, d_inner, W - 1)
//           (float32; zeros without one): made in shared memory by both kernels, never in device memory;
//   xdbl  = [dt_low | B | C] = u x_proj_weight^T (batch, L, R + 2N) by the first kernel (block_xproj.cu),
//           or given (xdbl_in, then x_proj_weight is null: the paper tasks' time-invariant ablation);
//   y     = (C h + D u) * silu(z), delta = softplus(dt_low dt_proj_weight^T + dt_bias) made on the tensor
//           cores in the fused kernel.
// training: the checkpoints (batch, ckpt_count(L), D, N) (the backward scan recomputes the states and y
// before the gate from them), else (0, ckpt_count(L), D, N). xdbl is returned when made here (the
// backward reads it), else (0,).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fused_block_fwd(
    const at::Tensor& xz_in, const at::Tensor& conv_weight, const c10::optional<at::Tensor>& conv_bias,
    const c10::optional<at::Tensor>& conv_state, const c10::optional<at::Tensor>& x_proj_weight,
    const c10::optional<at::Tensor>& xdbl_in, const at::Tensor& dt_proj_weight, const at::Tensor& A_log,
    const at::Tensor& dt_bias, const at::Tensor& D, const c10::optional<at::Tensor>& h0, bool return_final_state,
    bool training, int64_t l_segments) {
  TORCH_CHECK(xz_in.is_cuda(), "selscan_fused: fused_block_fwd: xz is on ", xz_in.device(),
              "; impl='fused' needs CUDA tensors (impl='reference' runs on the CPU)");
  TORCH_CHECK(xz_in.dim() == 3, "selscan_fused: fused_block_fwd: xz (in_proj's output) must have shape (batch, L, "
              "2 d_inner), got ", xz_in.sizes());
  to_dtype(xz_in.scalar_type(), "xz (fused_block_fwd)");
  TORCH_CHECK(A_log.dim() == 2, "selscan_fused: fused_block_fwd: A_log must have shape (d_inner, d_state), got ",
              A_log.sizes());
  TORCH_CHECK(dt_proj_weight.dim() == 2, "selscan_fused: fused_block_fwd: dt_proj_weight must have shape (d_inner, "
              "dt_rank), got ", dt_proj_weight.sizes());
  TORCH_CHECK(conv_weight.dim() == 2, "selscan_fused: fused_block_fwd: conv_weight must have shape (d_inner, d_conv), "
              "got ", conv_weight.sizes());
  TORCH_CHECK(x_proj_weight.has_value() != xdbl_in.has_value(), "selscan_fused: fused_block_fwd takes exactly one "
              "of x_proj_weight (xdbl made by the kernel) and xdbl (given)");
  const int64_t batch = xz_in.size(0), L = xz_in.size(1), Dm = A_log.size(0), N = A_log.size(1),
                R = dt_proj_weight.size(1), K = R + 2 * N, W = conv_weight.size(1);
  const char* sizes = " (batch and L from xz; d_inner and d_state from A_log; dt_rank from dt_proj_weight; d_conv "
                      "from conv_weight)";
  const auto dt = xz_in.scalar_type();
  check_tensor(xz_in, "xz (fused_block_fwd: in_proj's output [x | z])", xz_in, {batch, L, 2 * Dm}, dt, sizes);
  check_tensor(A_log, "A_log (fused_block_fwd)", xz_in, {Dm, N}, at::kFloat, sizes);
  check_tensor(dt_bias, "dt_bias (fused_block_fwd)", xz_in, {Dm}, at::kFloat, sizes);
  check_tensor(D, "D (fused_block_fwd)", xz_in, {Dm}, at::kFloat, sizes);
  check_tensor(dt_proj_weight, "dt_proj_weight (fused_block_fwd)", xz_in, {Dm, R}, dt, sizes);
  check_tensor(conv_weight, "conv_weight (fused_block_fwd)", xz_in, {Dm, W}, at::kFloat, sizes);
  if (conv_bias) check_tensor(*conv_bias, "conv_bias (fused_block_fwd)", xz_in, {Dm}, at::kFloat, sizes);
  if (conv_state) check_tensor(*conv_state, "conv_state (fused_block_fwd)", xz_in, {batch, Dm, W - 1}, at::kFloat, sizes);
  if (x_proj_weight) check_tensor(*x_proj_weight, "x_proj_weight (fused_block_fwd)", xz_in, {K, Dm}, dt, sizes);
  if (xdbl_in) check_tensor(*xdbl_in, "xdbl (fused_block_fwd: x_proj's output [dt_low | B | C])", xz_in,
                            {batch, L, K}, dt, sizes);
  if (h0) check_tensor(*h0, "h0 (fused_block_fwd)", xz_in, {batch, Dm, N}, at::kFloat, sizes);
  check_fused_envelope(xz_in, Dm, N, "d_inner");
  TORCH_CHECK(W >= 2 && W <= 4, "selscan_fused: d_conv = ", W, " is not supported by impl='fused' (2 to 4); "
              "use impl='reference'");
  TORCH_CHECK(!x_proj_weight || K <= kBlockXprojMaxOut, "selscan_fused: impl='fused' takes dt_rank + 2 d_state up to ",
              kBlockXprojMaxOut, " (got ", R, " + 2 * ", N, " = ", K, "); use impl='unfused'");
  TORCH_CHECK(L <= INT32_MAX && batch <= INT32_MAX && K <= INT32_MAX, "selscan_fused: impl='fused' takes batch and "
              "L below 2^31 (got batch = ", batch, ", L = ", L, "); use impl='unfused'");
  const c10::cuda::CUDAGuard guard(xz_in.device());
  const auto f32 = xz_in.options().dtype(at::kFloat);
  at::Tensor ckpt = at::empty({training ? batch : 0, ckpt_count(L), Dm, N}, f32);
  at::Tensor y = at::empty({batch, L, Dm}, xz_in.options());
  at::Tensor hT = at::empty(return_final_state ? at::IntArrayRef{batch, Dm, N} : at::IntArrayRef{0}, f32);
  at::Tensor xdbl = at::empty(x_proj_weight ? at::IntArrayRef{batch, L, K} : at::IntArrayRef{0}, xz_in.options());
  if (batch == 0 || L == 0) {
    if (return_final_state) {
      if (h0) hT.copy_(*h0); else hT.zero_();
    }
    return {y, hT, ckpt, xdbl};
  }
  // xi and z are read in place from xz (channel stride 1, tokens 2 d_inner apart): a contiguous copy
  // otherwise.
  const at::Tensor xz = aligned_contiguous(xz_in);
  const at::Tensor cw = conv_weight.contiguous();
  at::Tensor cb, cs;
  if (conv_bias) cb = conv_bias->contiguous();
  if (conv_state) cs = conv_state->contiguous();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  if (g_poison_outputs.load(std::memory_order_relaxed) && xdbl.numel() > 0) xdbl.fill_(NAN);
  if (x_proj_weight) {
    const at::Tensor wx = aligned_contiguous(*x_proj_weight);
    BlockXprojParams q;
    q.batch = batch; q.seqlen = L; q.dim = Dm; q.out_dim = K; q.width = int(W);
    q.dtype = to_dtype(dt, "xz");
    q.x = xz.data_ptr(); q.x_token_stride = 2 * Dm;
    q.conv_weight = cw.data_ptr<float>(); q.conv_bias = conv_bias ? cb.data_ptr<float>() : nullptr;
    q.conv_state = conv_state ? cs.data_ptr<float>() : nullptr;
    q.weight = wx.data_ptr(); q.out = xdbl.data_ptr();
    SELSCAN_CUDA_OK(block_xproj_launch(q, stream), "the fused block's x_proj kernel launch");
  }
  const BlockOperands ops = block_operands(x_proj_weight ? xdbl : *xdbl_in, dt_proj_weight, N, xz.options());
  const int64_t elem = dt == at::kFloat ? 4 : 2;
  const at::Tensor A_c = A_log.contiguous(), b_c = aligned_contiguous(dt_bias), D_c = D.contiguous();
  at::Tensor h0_c;
  if (h0) h0_c = h0->contiguous();

  FusedParams p = make_params(xz, batch, L, Dm, N);
  // float32: 3xTF32 whatever the matmul precision (K = R + 2N is small, so it costs little), so that B
  // and C pass through the identity rows to float32 accuracy (one TF32 product would round them).
  p.fp32_3xtf32 = true;
  p.x = xz.data_ptr(); p.x_token_stride = 2 * Dm;
  p.conv_weight = cw.data_ptr<float>(); p.conv_bias = conv_bias ? cb.data_ptr<float>() : nullptr;
  p.conv_state = conv_state ? cs.data_ptr<float>() : nullptr; p.conv_width = int(W);
  p.xk = ops.xk.data_ptr(); p.k_dim = ops.Kp;
  p.W_delta = ops.Wd.data_ptr(); p.W_B = ops.Wb.data_ptr(); p.W_C = ops.Wc.data_ptr();
  p.A_log = A_c.data_ptr<float>(); p.b_delta = b_c.data_ptr<float>(); p.D = D_c.data_ptr<float>();
  p.h0 = h0 ? h0_c.data_ptr<float>() : nullptr;
  p.z = static_cast<const char*>(xz.data_ptr()) + Dm * elem; p.z_stride = 2 * Dm;
  FusedLaunchInfo plan;
  // The channel tile of 64: the in-kernel conv's layout (the narrow layout's epilogue reads the x tile).
  SELSCAN_CUDA_OK(fused_plan(p, l_segments, 64, xz.get_device(), &plan), "planning the fused kernel");
  p.n_segments = plan.n_segments; p.seg_len = plan.seg_len; p.channel_tile = int(plan.channel_tile);
  const int64_t ws_floats = split_workspace_floats(batch, Dm, N, p.n_segments);
  at::Tensor ws;
  if (ws_floats > 0) ws = at::empty({ws_floats}, f32);
  bind_outputs(p, y, hT, ckpt, return_final_state, training);
  p.workspace = ws_floats > 0 ? ws.data_ptr<float>() : nullptr;
  SELSCAN_CUDA_OK(fused_launch(p, stream), "the fused kernel launch (block)");
  return {y, hT, ckpt, xdbl};
}

void fused_set_poison_outputs(bool enable) { g_poison_outputs.store(enable); }
void fused_set_descriptor_cache_op(bool enable) { fused_set_descriptor_cache(enable); }

}  // namespace
}  // namespace selscan

TORCH_LIBRARY_FRAGMENT(selscan_fused, m) {
  m.def("fused_fwd(Tensor x, Tensor A_log, Tensor W_delta, Tensor b_delta, Tensor W_B, Tensor W_C, "
        "Tensor D, Tensor? h0, bool return_final_state, int l_segments, bool exp_poly=False, "
        "int ring_stages=0, int channel_tile=0, int bwd_mode=0) -> (Tensor, Tensor)");
  m.def("fused_plan(Tensor x, int dstate, int l_segments, int channel_tile=0) -> int[]");
  // Packed sequences (x (1, total, D), cu_seqlens int32 (num_seqs + 1,)): (y, final states, checkpoints
  // for scan_bwd_packed); only where fused_packed_built() (not in a build with -DSELSCAN_FUSED_NO_PACKED).
  m.def("fused_fwd_packed(Tensor x, Tensor A_log, Tensor W_delta, Tensor b_delta, Tensor W_B, Tensor W_C, "
        "Tensor D, Tensor? h0, Tensor cu_seqlens, bool return_final_state, bool with_ckpt) -> (Tensor, Tensor, Tensor)");
  m.def("fused_block_scan_packed(Tensor u, Tensor xdbl, Tensor z, Tensor dt_proj_weight, Tensor A_log, "
        "Tensor dt_bias, Tensor D, Tensor? h0, Tensor cu_seqlens, bool return_final_state, bool with_ckpt) -> "
        "(Tensor, Tensor, Tensor)");
  m.def("fused_packed_built() -> bool", &selscan::fused_packed_built_op);
  m.def("fused_fwd_res(Tensor x, Tensor A_log, Tensor W_delta, Tensor b_delta, Tensor W_B, Tensor W_C, "
        "Tensor D, Tensor? h0, int l_segments, bool exp_poly=False, int ring_stages=0, int channel_tile=0, "
        "int bwd_mode=0) -> (Tensor, Tensor, Tensor)");
  // The fused path's backward (mode: 0 automatic, 1 the fused backward kernel, 2 the recomputation;
  // threads_per_channel: the kernel's scan layout, 0 = the default, 4 or 8).
  m.def("fused_bwd(Tensor x, Tensor A_log, Tensor W_delta, Tensor b_delta, Tensor W_B, Tensor W_C, Tensor D, "
        "Tensor? h0, Tensor dy, Tensor? dhT, Tensor ckpt, int l_segments, int mode=0, int threads_per_channel=0) "
        "-> Tensor[]");
  m.def("fused_bwd_plan(Tensor x, int dstate, int l_segments, int mode=0, int threads_per_channel=0) -> int[]");
  // The Mamba block's fused forward (block_xproj.cu's kernel, then the same fused kernel with the conv
  // inside): (y, final_state, ckpt, xdbl).
  m.def("fused_block_fwd(Tensor xz, Tensor conv_weight, Tensor? conv_bias, Tensor? conv_state, "
        "Tensor? x_proj_weight, Tensor? xdbl, Tensor dt_proj_weight, Tensor A_log, Tensor dt_bias, Tensor D, "
        "Tensor? h0, bool return_final_state, bool training, int l_segments) "
        "-> (Tensor, Tensor, Tensor, Tensor)");
  m.def("fused_set_poison_outputs(bool enable) -> ()", &selscan::fused_set_poison_outputs);
  // Test and benchmark hook: off, every call encodes all its TMA descriptors (fused_api.h).
  m.def("fused_set_descriptor_cache(bool enable) -> ()", &selscan::fused_set_descriptor_cache_op);
}

TORCH_LIBRARY_IMPL(selscan_fused, CUDA, m) {
  m.impl("fused_fwd_packed", &selscan::fused_fwd_packed);
  m.impl("fused_block_scan_packed", &selscan::fused_block_scan_packed);
  m.impl("fused_block_fwd", &selscan::fused_block_fwd);
  m.impl("fused_fwd", &selscan::fused_fwd);
  m.impl("fused_bwd", &selscan::fused_bwd);
  m.impl("fused_bwd_plan", &selscan::fused_bwd_plan_op);
  m.impl("fused_fwd_res", &selscan::fused_fwd_res);
  m.impl("fused_plan", &selscan::fused_plan_op);
}

TORCH_LIBRARY_IMPL(selscan_fused, CPU, m) {
  m.impl("fused_fwd_packed", &selscan::fused_fwd_packed);
  m.impl("fused_block_scan_packed", &selscan::fused_block_scan_packed);
  m.impl("fused_block_fwd", &selscan::fused_block_fwd);
  m.impl("fused_fwd", &selscan::fused_fwd);
  m.impl("fused_bwd", &selscan::fused_bwd);
  m.impl("fused_bwd_plan", &selscan::fused_bwd_plan_op);
  m.impl("fused_fwd_res", &selscan::fused_fwd_res);
  m.impl("fused_plan", &selscan::fused_plan_op);
}
