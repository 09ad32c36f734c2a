// torch.library registration of the CUDA ops (namespace selscan_fused). No pybind11: the ops are
// reached as torch.ops.selscan_fused.*, and Python (selscan_fused/_ops.py) adds their fake (meta)
// implementations and the autograd registration.
//
// Every op validates its arguments and names the offending one before allocating or launching
// anything, runs on the current CUDA stream under a device guard, and never synchronises the host.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <atomic>
#include <cmath>
#include <string>
#include <limits>
#include <tuple>

#include "common/seq_map.h"
#include "op_checks.h"
#include "scan/scan_api.h"

namespace selscan {
namespace {

// Test hook (set_poison_outputs): fill every output with NaN before the kernel runs, so that a test
// can check that the kernel wrote every element.
std::atomic<bool> g_poison_outputs{false};

void poison(at::Tensor& t) {
  if (g_poison_outputs.load(std::memory_order_relaxed) && t.numel() > 0) t.fill_(NAN);
}

// The scan kernel on precomputed projections: delta_pre (batch, L, D) and [B | C] (batch, L, 2N) in x's
// dtype (any row-addressable layout, row_operand). z: the block's gate (batch, L, D), or null for the
// layer. ckpt: when given, (batch, ckpt_count(L), D, N) float32, filled with the forward's checkpoints.
// Returns (y, final state or an empty tensor).
std::tuple<at::Tensor, at::Tensor> run_scan(
    const at::Tensor& delta_in, const at::Tensor& bc_in, const at::Tensor& x_in, const at::Tensor& A_log,
    const at::Tensor& b_delta, const at::Tensor& D, const c10::optional<at::Tensor>& h0, bool return_final_state,
    int64_t l_segments, int64_t batch, int64_t L, int64_t Dm, int64_t N, at::Tensor* ckpt = nullptr,
    const at::Tensor* z_in = nullptr, const at::Tensor* cu = nullptr) {
  const c10::cuda::CUDAGuard guard(x_in.device());
  // Packed (cu given): batch sequences in one row of L tokens (common/seq_map.h); y is (1, L, D).
  const int64_t rows_batch = cu != nullptr ? 1 : batch;
  if (batch == 0 || L == 0) {
    return empty_result(x_in, batch, Dm, N, h0, return_final_state);
  }
  const at::Tensor x = aligned_contiguous(x_in);
  const auto [delta, delta_stride] = row_operand(delta_in);
  const auto [bc, bc_stride] = row_operand(bc_in);
  const at::Tensor A_c = A_log.contiguous(), b_c = b_delta.contiguous(), D_c = D.contiguous();
  at::Tensor h0_c;
  if (h0) h0_c = h0->contiguous();

  ScanParams p;
  p.batch = batch; p.seqlen = L; p.dim = Dm; p.dstate = N;
  p.dtype = to_dtype(x.scalar_type(), "x");
  p.delta = delta.data_ptr(); p.delta_stride = delta_stride;
  p.bc = bc.data_ptr(); p.bc_stride = bc_stride;
  p.x = x.data_ptr();
  p.A_log = A_c.data_ptr<float>(); p.b_delta = b_c.data_ptr<float>(); p.D = D_c.data_ptr<float>();
  p.h0 = h0 ? h0_c.data_ptr<float>() : nullptr;
  at::Tensor z;
  if (z_in != nullptr) {  // the gate's rows, loaded with the chunk's other operands (16-byte copies)
    int64_t z_stride = 0;
    std::tie(z, z_stride) = row_operand(*z_in);
    p.z = z.data_ptr(); p.z_stride = z_stride;
  }

  if (cu != nullptr) p.cu_seqlens = cu->data_ptr<int32_t>();
  ScanLaunchInfo plan;
  SELSCAN_CUDA_OK(scan_plan(p, cu != nullptr ? 1 : l_segments, x.get_device(), &plan), "planning the scan");
  p.n_segments = plan.n_segments; p.seg_len = plan.seg_len;

  at::Tensor y = at::empty({rows_batch, L, Dm}, x.options());
  at::Tensor hT = return_final_state ? at::empty({batch, Dm, N}, x.options().dtype(at::kFloat))
                                     : at::empty({0}, x.options().dtype(at::kFloat));
  const int64_t ws_floats = split_workspace_floats(batch, Dm, N, p.n_segments);
  at::Tensor ws = at::empty({ws_floats}, x.options().dtype(at::kFloat));
  poison(y);
  poison(hT);
  p.y = y.data_ptr();
  p.final_state = return_final_state ? hT.data_ptr<float>() : nullptr;
  p.workspace = ws_floats > 0 ? ws.data_ptr<float>() : nullptr;
  if (ckpt != nullptr) {
    poison(*ckpt);
    p.ckpt = ckpt->data_ptr<float>();
  }
  SELSCAN_CUDA_OK(scan_launch(p, c10::cuda::getCurrentCUDAStream().stream()), "the scan kernel launch");
  return {y, hT};
}

void check_scan_envelope(int64_t Dm, int64_t N) {
  TORCH_CHECK(scan_supports_dstate(N), "selscan_fused: d_state N = ", N,
              " is not supported by impl='unfused' (supported: 8, 16, 32, 64); use impl='reference'");
  TORCH_CHECK(Dm % kScanDimMultiple == 0, "selscan_fused: d_model D = ", Dm,
              " is not supported by impl='unfused' (D must be a multiple of ", kScanDimMultiple,
              "); use impl='reference'");
}

std::tuple<at::Tensor, at::Tensor> scan_fwd(const at::Tensor& proj, const at::Tensor& x, const at::Tensor& A_log,
                                            const at::Tensor& b_delta, const at::Tensor& D,
                                            const c10::optional<at::Tensor>& h0, bool return_final_state,
                                            int64_t l_segments) {
  auto [batch, L, Dm, N] = check_common(x, A_log, b_delta, D, h0);
  check_tensor(proj, "proj", x, {batch, L, Dm + 2 * N}, x.scalar_type());
  check_scan_envelope(Dm, N);
  auto [y, hT] = run_scan(proj.narrow(2, 0, Dm), proj.narrow(2, Dm, 2 * N), x, A_log, b_delta, D, h0,
                          return_final_state, l_segments, batch, L, Dm, N);
  return {y, hT};
}

// The unfused path: one library matrix product for [delta_pre | B | C], then the scan kernel. Returns
// (y, final state, proj); ckpt as in run_scan.
std::tuple<at::Tensor, at::Tensor, at::Tensor> unfused_forward(
    const at::Tensor& x, const at::Tensor& A_log, const at::Tensor& W_delta, const at::Tensor& b_delta,
    const at::Tensor& W_B, const at::Tensor& W_C, const at::Tensor& D, const c10::optional<at::Tensor>& h0,
    bool return_final_state, int64_t l_segments, at::Tensor* ckpt) {
  auto [batch, L, Dm, N] = check_layer(x, A_log, W_delta, b_delta, W_B, W_C, D, h0);
  check_scan_envelope(Dm, N);
  const c10::cuda::CUDAGuard guard(x.device());
  if (ckpt != nullptr) *ckpt = at::empty({batch, ckpt_count(L), Dm, N}, x.options().dtype(at::kFloat));
  // The dtypes were settled by the caller: no autocast inside the op.
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  // cuBLAS, following torch.get_float32_matmul_precision() for float32.
  const at::Tensor W = at::cat({W_delta, W_B, W_C}, 0);                                    // (D + 2N, D)
  const at::Tensor proj = at::mm(x.reshape({batch * L, Dm}), W.t()).view({batch, L, Dm + 2 * N});
  auto [y, hT] = run_scan(proj.narrow(2, 0, Dm), proj.narrow(2, Dm, 2 * N), x, A_log, b_delta, D, h0,
                          return_final_state, l_segments, batch, L, Dm, N, ckpt);
  return {y, hT, proj};
}

std::tuple<at::Tensor, at::Tensor> unfused_fwd(const at::Tensor& x, const at::Tensor& A_log,
                                               const at::Tensor& W_delta, const at::Tensor& b_delta,
                                               const at::Tensor& W_B, const at::Tensor& W_C, const at::Tensor& D,
                                               const c10::optional<at::Tensor>& h0, bool return_final_state,
                                               int64_t l_segments) {
  auto [y, hT, proj] = unfused_forward(x, A_log, W_delta, b_delta, W_B, W_C, D, h0, return_final_state, l_segments,
                                       nullptr);
  return {y, hT};
}

// The unfused forward for training: also returns proj (kept for the backward) and the checkpoints.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> unfused_fwd_res(
    const at::Tensor& x, const at::Tensor& A_log, const at::Tensor& W_delta, const at::Tensor& b_delta,
    const at::Tensor& W_B, const at::Tensor& W_C, const at::Tensor& D, const c10::optional<at::Tensor>& h0,
    int64_t l_segments) {
  at::Tensor ckpt;
  auto [y, hT, proj] = unfused_forward(x, A_log, W_delta, b_delta, W_B, W_C, D, h0, true, l_segments, &ckpt);
  return {y, hT, proj, ckpt};
}

// The backward scan kernel on the forward's projections (delta_pre (batch, L, D) and [B | C]
// (batch, L, 2N), any row-addressable layout), shared by the layer's and the block's backward. dP
// (batch, L, D + 2N) gets the gradient of delta_pre in its first D columns (sum_partials fills the
// rest); dx the scan's own part of the gradient of x, dt * sum_n g * B + D * dy.
struct ScanBwdOut {
  at::Tensor dP, dx, bc_part, dA_part, dDdb_part, dh0;
  at::Tensor dz;  // the gate's gradient (batch, L, D) under the block's gate, else empty
};

ScanBwdOut run_scan_bwd(const at::Tensor& delta_in, const at::Tensor& bc_in, const at::Tensor& x,
                        const at::Tensor& A_c, const at::Tensor& b_delta, const at::Tensor& D,
                        const at::Tensor& dy_in, const c10::optional<at::Tensor>& dhT, const at::Tensor& ckpt_in,
                        int64_t l_segments, int64_t batch, int64_t L, int64_t Dm, int64_t N,
                        const at::Tensor* cu = nullptr, const at::Tensor* gate_z = nullptr) {
  const int64_t rows_batch = cu != nullptr ? 1 : batch;  // packed: batch sequences in one row of L tokens
  const auto fopt = x.options().dtype(at::kFloat);
  const at::Tensor dy = aligned_contiguous(dy_in.to(x.scalar_type()));
  const at::Tensor ckpt = ckpt_in.contiguous();
  const at::Tensor b_c = b_delta.contiguous(), D_c = D.contiguous();
  const auto [delta, delta_stride] = row_operand(delta_in);
  const auto [bc, bc_stride] = row_operand(bc_in);
  at::Tensor dhT_c;
  if (dhT) dhT_c = dhT->to(at::kFloat).contiguous();

  ScanBwdParams p;
  p.batch = batch; p.seqlen = L; p.dim = Dm; p.dstate = N;
  p.dtype = to_dtype(x.scalar_type(), "x");
  p.delta = delta.data_ptr(); p.delta_stride = delta_stride;
  p.bc = bc.data_ptr(); p.bc_stride = bc_stride;
  p.x = x.data_ptr(); p.dy = dy.data_ptr();
  p.A_log = A_c.data_ptr<float>(); p.b_delta = b_c.data_ptr<float>(); p.D = D_c.data_ptr<float>();
  p.dhT = dhT ? dhT_c.data_ptr<float>() : nullptr;
  p.ckpt = ckpt.data_ptr<float>();
  if (cu != nullptr) p.cu_seqlens = cu->data_ptr<int32_t>();
  at::Tensor z;
  if (gate_z != nullptr) {  // the block's gate: dy is the gradient of y * silu(z)
    int64_t z_stride = 0;
    std::tie(z, z_stride) = row_operand(*gate_z);
    p.gate_z = z.data_ptr(); p.gate_z_stride = z_stride;
  }
  ScanBwdLaunchInfo plan;
  SELSCAN_CUDA_OK(scan_bwd_plan(p, cu != nullptr ? 1 : l_segments, x.get_device(), &plan),
                  "planning the backward scan");
  p.n_segments = plan.n_segments; p.seg_len = plan.seg_len;
  const int64_t n_tiles = (Dm + plan.channel_tile - 1) / plan.channel_tile;
  const int64_t rows = plan.n_segments * batch;

  ScanBwdOut r;
  r.dP = at::empty({rows_batch, L, Dm + 2 * N}, x.options());
  r.dx = at::empty({rows_batch, L, Dm}, x.options());
  r.bc_part = at::empty({rows_batch * L, n_tiles, 2 * N}, fopt);
  r.dA_part = at::empty({rows, Dm, N}, fopt);
  r.dDdb_part = at::empty({2, rows * plan.rows_per_col, Dm}, fopt);
  r.dh0 = at::empty({batch, Dm, N}, fopt);
  r.dz = at::empty({gate_z != nullptr ? rows_batch : 0, L, Dm}, x.options());
  const int64_t ws_floats = split_workspace_floats(batch, Dm, N, p.n_segments);
  at::Tensor ws = at::empty({ws_floats}, fopt);
  for (at::Tensor* t : {&r.dP, &r.dx, &r.bc_part, &r.dA_part, &r.dDdb_part, &r.dh0, &r.dz}) poison(*t);
  p.dP = r.dP.data_ptr(); p.dx = r.dx.data_ptr();
  p.bc_partial = r.bc_part.data_ptr<float>(); p.dA_partial = r.dA_part.data_ptr<float>();
  p.dD_partial = r.dDdb_part[0].data_ptr<float>(); p.db_partial = r.dDdb_part[1].data_ptr<float>();
  p.dh0 = r.dh0.data_ptr<float>();
  p.dgate_z = gate_z != nullptr ? r.dz.data_ptr() : nullptr;
  p.workspace = ws_floats > 0 ? ws.data_ptr<float>() : nullptr;
  SELSCAN_CUDA_OK(scan_bwd_launch(p, c10::cuda::getCurrentCUDAStream().stream()), "the backward scan launch");
  return r;
}

// One backward of the layer (both paths): the backward scan kernel, then the library products
// dx += dP . [W_delta; W_B; W_C] and dW = dP^T . x. proj: the unfused forward's; absent (the fused
// path, whose forward keeps nothing of shape (batch, L, .)), it is recomputed by one product here.
// Returns (dx, dA_log, dW_delta, db_delta, dW_B, dW_C, dD, dh0); dh0 is the gradient of the initial
// state (the initial state is zeros when h0 is absent).
std::vector<at::Tensor> unfused_bwd(const at::Tensor& x_in, const at::Tensor& A_log, const at::Tensor& W_delta,
                                    const at::Tensor& b_delta, const at::Tensor& W_B, const at::Tensor& W_C,
                                    const at::Tensor& D, const c10::optional<at::Tensor>& h0, const at::Tensor& dy_in,
                                    const c10::optional<at::Tensor>& dhT, const c10::optional<at::Tensor>& proj_in,
                                    const at::Tensor& ckpt_in, int64_t l_segments) {
  auto [batch, L, Dm, N] = check_layer(x_in, A_log, W_delta, b_delta, W_B, W_C, D, h0);
  check_scan_envelope(Dm, N);
  check_backward_args(x_in, dy_in, dhT, ckpt_in, batch, L, Dm, N);
  if (proj_in) check_tensor(*proj_in, "proj", x_in, {batch, L, Dm + 2 * N}, x_in.scalar_type());
  const c10::cuda::CUDAGuard guard(x_in.device());
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  const auto fopt = x_in.options().dtype(at::kFloat);
  if (batch == 0 || L == 0) {
    at::Tensor dh0 = dhT ? dhT->to(at::kFloat).clone(at::MemoryFormat::Contiguous) : at::zeros({batch, Dm, N}, fopt);
    return {at::zeros(x_in.sizes(), x_in.options()), at::zeros_like(A_log), at::zeros_like(W_delta),
            at::zeros_like(b_delta), at::zeros_like(W_B), at::zeros_like(W_C), at::zeros_like(D), dh0};
  }
  const at::Tensor x = aligned_contiguous(x_in);
  const at::Tensor A_c = A_log.contiguous();
  const at::Tensor W = at::cat({W_delta, W_B, W_C}, 0);  // (D + 2N, D)
  const at::Tensor proj = proj_in ? aligned_contiguous(*proj_in)
                                  : at::mm(x.view({batch * L, Dm}), W.t()).view({batch, L, Dm + 2 * N});
  ScanBwdOut r = run_scan_bwd(proj.narrow(2, 0, Dm), proj.narrow(2, Dm, 2 * N), x, A_c, b_delta, D, dy_in, dhT,
                              ckpt_in, l_segments, batch, L, Dm, N);
  return finish_backward(x, W, A_c, r.dP, r.dx, r.bc_part, r.dA_part, r.dDdb_part, r.dh0, batch, L, Dm, N);
}

// The Mamba-1 block's unfused scan (selscan_fused/block.py): delta_pre from dt_proj's product and
// [B | C] from x_proj's output (library products, made by the caller), u the conv's output and z the
// gate, both (batch, L, d_inner). y = (scan + D * u) * silu(z). training: also return the checkpoints,
// from which the backward scan (scan_bwd with gate_z) recomputes the states and y before the gate.
std::tuple<at::Tensor, at::Tensor, at::Tensor> gated_scan_fwd(
    const at::Tensor& delta, const at::Tensor& bc, const at::Tensor& u, const at::Tensor& z, const at::Tensor& A_log,
    const at::Tensor& b_delta, const at::Tensor& D, const c10::optional<at::Tensor>& h0, bool return_final_state,
    bool training, int64_t l_segments) {
  auto [batch, L, Dm, N] = check_common(u, A_log, b_delta, D, h0);
  check_tensor(delta, "delta", u, {batch, L, Dm}, u.scalar_type(), " (dt_proj's output, shaped as u)");
  check_tensor(bc, "bc", u, {batch, L, 2 * N}, u.scalar_type(), " ([B | C] of x_proj's output; N from A_log)");
  check_tensor(z, "z", u, {batch, L, Dm}, u.scalar_type(), " (the gate, shaped as u)");
  check_scan_envelope(Dm, N);
  const c10::cuda::CUDAGuard guard(u.device());
  at::Tensor ckpt = at::empty({training ? batch : 0, ckpt_count(L), Dm, N}, u.options().dtype(at::kFloat));
  auto [y, hT] = run_scan(delta, bc, u, A_log, b_delta, D, h0, return_final_state, l_segments, batch, L, Dm, N,
                          training ? &ckpt : nullptr, &z);
  return {y, hT, ckpt};
}

// The backward scan kernel alone on the forward's projections (the block's backward; its products
// are the caller's). gate_z: the block's gate z (batch, L, D); dy is then the gradient of the gated
// output y * silu(z). Returns (dP (batch, L, D + 2N) = [d delta_pre | dB | dC], dx (the scan's own part,
// dt * sum_n g * B + D * dy), dA_log, db_delta, dD, dh0, dz (the gate's gradient, or empty)).
std::vector<at::Tensor> scan_bwd(const at::Tensor& delta, const at::Tensor& bc, const at::Tensor& x,
                                 const at::Tensor& A_log, const at::Tensor& b_delta, const at::Tensor& D,
                                 const c10::optional<at::Tensor>& h0, const at::Tensor& dy,
                                 const c10::optional<at::Tensor>& dhT, const at::Tensor& ckpt, int64_t l_segments,
                                 const c10::optional<at::Tensor>& gate_z) {
  auto [batch, L, Dm, N] = check_common(x, A_log, b_delta, D, h0);
  check_tensor(delta, "delta", x, {batch, L, Dm}, x.scalar_type(), " (dt_proj's output, shaped as x)");
  check_tensor(bc, "bc", x, {batch, L, 2 * N}, x.scalar_type(), " ([B | C]; N from A_log)");
  check_scan_envelope(Dm, N);
  check_backward_args(x, dy, dhT, ckpt, batch, L, Dm, N);
  if (gate_z) check_tensor(*gate_z, "gate_z", x, {batch, L, Dm}, x.scalar_type(), " (the gate, shaped as x)");
  const c10::cuda::CUDAGuard guard(x.device());
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  if (batch == 0 || L == 0) {
    const auto fopt = x.options().dtype(at::kFloat);
    at::Tensor dh0 = dhT ? dhT->to(at::kFloat).clone(at::MemoryFormat::Contiguous) : at::zeros({batch, Dm, N}, fopt);
    return {at::zeros({batch, L, Dm + 2 * N}, x.options()), at::zeros({batch, L, Dm}, x.options()),
            at::zeros_like(A_log), at::zeros_like(b_delta), at::zeros_like(D), dh0,
            at::zeros({gate_z ? batch : 0, L, Dm}, x.options())};
  }
  const at::Tensor xc = aligned_contiguous(x);
  const at::Tensor A_c = A_log.contiguous();
  ScanBwdOut r = run_scan_bwd(delta, bc, xc, A_c, b_delta, D, dy, dhT, ckpt, l_segments, batch, L, Dm, N, nullptr,
                              gate_z ? &*gate_z : nullptr);
  auto [dA_log, dD, db] = sum_partials(A_c, r.dP, r.bc_part, r.dA_part, r.dDdb_part, batch, L, Dm, N);
  return {r.dP, r.dx, dA_log, db, dD, r.dh0, r.dz};
}

// [n_segments, seg_len] the scan kernel would use for x's shape (for tests and benchmarks).
std::vector<int64_t> scan_plan_op(const at::Tensor& x, int64_t dstate, int64_t l_segments) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 3, "selscan_fused: scan_plan needs a CUDA x of shape (batch, L, D)");
  check_scan_envelope(x.size(2), dstate);
  const c10::cuda::CUDAGuard guard(x.device());
  ScanParams p;
  p.batch = x.size(0); p.seqlen = x.size(1); p.dim = x.size(2); p.dstate = dstate;
  p.dtype = to_dtype(x.scalar_type(), "x");
  ScanLaunchInfo plan;
  SELSCAN_CUDA_OK(scan_plan(p, l_segments, x.get_device(), &plan), "planning the scan");
  return {plan.n_segments, plan.seg_len};
}

// ---- Packed sequences (common/seq_map.h): num_seqs sequences stored one after another in one row.

// The packed arguments both directions share: x (1, total, D), delta (1, total, D), bc (1, total, 2N), the
// channel parameters, h0 (num_seqs, D, N). Returns (num_seqs, total, D, N).
std::tuple<int64_t, int64_t, int64_t, int64_t> check_packed(const at::Tensor& delta, const at::Tensor& bc,
                                                            const at::Tensor& x, const at::Tensor& A_log,
                                                            const at::Tensor& b_delta, const at::Tensor& D,
                                                            const c10::optional<at::Tensor>& h0,
                                                            const at::Tensor& cu) {
  TORCH_CHECK(x.is_cuda(), "selscan_fused: x is on ", x.device(), "; the packed CUDA ops need CUDA tensors "
              "(impl='reference' runs on the CPU)");
  TORCH_CHECK(x.dim() == 3 && x.size(0) == 1, "selscan_fused: packed sequences take x of shape (1, total_tokens, "
              "D), got ", x.sizes());
  to_dtype(x.scalar_type(), "x");
  TORCH_CHECK(A_log.dim() == 2, "selscan_fused: A_log must have shape (D, N), got ", A_log.sizes());
  const int64_t T = x.size(1), Dm = x.size(2), N = A_log.size(1);
  const int64_t S = check_cu_seqlens_arg(cu, x, T);
  check_tensor(A_log, "A_log", x, {Dm, N}, at::kFloat, " (D from x)");
  check_tensor(b_delta, "b_delta", x, {Dm}, at::kFloat, " (D from x)");
  check_tensor(D, "D", x, {Dm}, at::kFloat, " (D from x)");
  check_tensor(delta, "delta", x, {1, T, Dm}, x.scalar_type(), " (delta_pre, shaped as x)");
  check_tensor(bc, "bc", x, {1, T, 2 * N}, x.scalar_type(), " ([B | C]; N from A_log)");
  if (h0) check_tensor(*h0, "h0", x, {S, Dm, N}, at::kFloat, " (one state per sequence: num_seqs from cu_seqlens)");
  check_scan_envelope(Dm, N);
  return {S, T, Dm, N};
}

// The scan kernel over packed sequences, each from h0[s] (or zeros) into the final state [s]:
// (y (1, total, D), final state (num_seqs, D, N) or empty, checkpoints (1, packed_slots, D, N) when
// training (else (0, ...))). z: the block's gate (1, total, D) or absent (the layer).
std::tuple<at::Tensor, at::Tensor, at::Tensor> scan_fwd_packed(
    const at::Tensor& delta, const at::Tensor& bc, const at::Tensor& x, const c10::optional<at::Tensor>& z,
    const at::Tensor& A_log, const at::Tensor& b_delta, const at::Tensor& D, const c10::optional<at::Tensor>& h0,
    const at::Tensor& cu_seqlens, bool return_final_state, bool training) {
  auto [S, T, Dm, N] = check_packed(delta, bc, x, A_log, b_delta, D, h0, cu_seqlens);
  if (z) check_tensor(*z, "z", x, {1, T, Dm}, x.scalar_type(), " (the gate, shaped as x)");
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor cu = cu_seqlens.contiguous();
  at::Tensor ckpt = at::empty({training ? 1 : 0, packed_slots(T, S, kCkptEvery), Dm, N},
                              x.options().dtype(at::kFloat));
  at::Tensor ckpt_rows = ckpt.view({-1, Dm, N});
  auto [y, hT] = run_scan(delta, bc, x, A_log, b_delta, D, h0, return_final_state, 1, S, T, Dm, N,
                          training ? &ckpt_rows : nullptr, z ? &*z : nullptr, &cu);
  return {y, hT, ckpt};
}

// The backward scan kernel over packed sequences: (dP (1, total, D + 2N) = [d delta_pre | dB | dC], dx (the
// scan's own part), dA_log, db_delta, dD, dh0 (num_seqs, D, N), dz (the gate's gradient (1, total, D)
// when gate_z is given, else empty)).
std::vector<at::Tensor> scan_bwd_packed(const at::Tensor& delta, const at::Tensor& bc, const at::Tensor& x,
                                        const at::Tensor& A_log, const at::Tensor& b_delta, const at::Tensor& D,
                                        const c10::optional<at::Tensor>& h0, const at::Tensor& dy,
                                        const c10::optional<at::Tensor>& dhT, const at::Tensor& ckpt,
                                        const at::Tensor& cu_seqlens, const c10::optional<at::Tensor>& gate_z) {
  auto [S, T, Dm, N] = check_packed(delta, bc, x, A_log, b_delta, D, h0, cu_seqlens);
  check_tensor(dy, "dy (the gradient of y)", x, x.sizes(), c10::nullopt);
  TORCH_CHECK(dy.is_floating_point(), "selscan_fused: dy must be floating-point, got ", dy.scalar_type());
  if (dhT) {
    check_tensor(*dhT, "dhT (the gradient of the final state)", x, {S, Dm, N}, c10::nullopt);
    TORCH_CHECK(dhT->is_floating_point(), "selscan_fused: dhT must be floating-point, got ", dhT->scalar_type());
  }
  check_tensor(ckpt, "ckpt (the forward's checkpoints)", x, {1, packed_slots(T, S, kCkptEvery), Dm, N}, at::kFloat,
               " (scan_fwd_packed's, with training=True)");
  if (gate_z) check_tensor(*gate_z, "gate_z", x, {1, T, Dm}, x.scalar_type(), " (the gate, shaped as x)");
  const c10::cuda::CUDAGuard guard(x.device());
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  if (T == 0) {
    const auto fopt = x.options().dtype(at::kFloat);
    at::Tensor dh0 = dhT ? dhT->to(at::kFloat).clone(at::MemoryFormat::Contiguous) : at::zeros({S, Dm, N}, fopt);
    return {at::zeros({1, T, Dm + 2 * N}, x.options()), at::zeros({1, T, Dm}, x.options()), at::zeros_like(A_log),
            at::zeros_like(b_delta), at::zeros_like(D), dh0, at::zeros({gate_z ? 1 : 0, T, Dm}, x.options())};
  }
  const at::Tensor cu = cu_seqlens.contiguous();
  const at::Tensor xc = aligned_contiguous(x);
  const at::Tensor A_c = A_log.contiguous();
  ScanBwdOut r = run_scan_bwd(delta, bc, xc, A_c, b_delta, D, dy, dhT, ckpt, 1, S, T, Dm, N, &cu,
                              gate_z ? &*gate_z : nullptr);
  auto [dA_log, dD, db] = sum_partials(A_c, r.dP, r.bc_part, r.dA_part, r.dDdb_part, 1, T, Dm, N);
  return {r.dP, r.dx, dA_log, db, dD, r.dh0, r.dz};
}

void set_poison_outputs(bool enable) { g_poison_outputs.store(enable); }

}  // namespace
}  // namespace selscan

TORCH_LIBRARY(selscan_fused, m) {
  m.def("scan_fwd(Tensor proj, Tensor x, Tensor A_log, Tensor b_delta, Tensor D, Tensor? h0, "
        "bool return_final_state, int l_segments) -> (Tensor, Tensor)");
  m.def("unfused_fwd(Tensor x, Tensor A_log, Tensor W_delta, Tensor b_delta, Tensor W_B, Tensor W_C, "
        "Tensor D, Tensor? h0, bool return_final_state, int l_segments) -> (Tensor, Tensor)");
  m.def("scan_plan(Tensor x, int dstate, int l_segments) -> int[]");
  // Training: the forward with what its backward needs (proj, checkpoints), and the backward.
  m.def("unfused_fwd_res(Tensor x, Tensor A_log, Tensor W_delta, Tensor b_delta, Tensor W_B, Tensor W_C, "
        "Tensor D, Tensor? h0, int l_segments) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("unfused_bwd(Tensor x, Tensor A_log, Tensor W_delta, Tensor b_delta, Tensor W_B, Tensor W_C, "
        "Tensor D, Tensor? h0, Tensor dy, Tensor? dhT, Tensor? proj, Tensor ckpt, int l_segments) -> Tensor[]");
  // The Mamba-1 block's unfused path (selscan_fused/block.py): the gated scan and the backward scan alone.
  m.def("gated_scan_fwd(Tensor delta, Tensor bc, Tensor u, Tensor z, Tensor A_log, Tensor b_delta, Tensor D, "
        "Tensor? h0, bool return_final_state, bool training, int l_segments) -> (Tensor, Tensor, Tensor)");
  m.def("scan_bwd(Tensor delta, Tensor bc, Tensor x, Tensor A_log, Tensor b_delta, Tensor D, Tensor? h0, "
        "Tensor dy, Tensor? dhT, Tensor ckpt, int l_segments, Tensor? gate_z=None) -> Tensor[]");
  // Packed sequences (cu_seqlens, int32 (num_seqs + 1,)): x (1, total, D); the layer passes no z.
  m.def("scan_fwd_packed(Tensor delta, Tensor bc, Tensor x, Tensor? z, Tensor A_log, Tensor b_delta, Tensor D, "
        "Tensor? h0, Tensor cu_seqlens, bool return_final_state, bool training) -> (Tensor, Tensor, Tensor)");
  m.def("scan_bwd_packed(Tensor delta, Tensor bc, Tensor x, Tensor A_log, Tensor b_delta, Tensor D, Tensor? h0, "
        "Tensor dy, Tensor? dhT, Tensor ckpt, Tensor cu_seqlens, Tensor? gate_z=None) -> Tensor[]");
  // Test hook: NaN-fill the outputs before every launch (off by default).
  m.def("set_poison_outputs(bool enable) -> ()", &selscan::set_poison_outputs);
}

TORCH_LIBRARY_IMPL(selscan_fused, CUDA, m) {
  m.impl("scan_fwd", &selscan::scan_fwd);
  m.impl("unfused_fwd", &selscan::unfused_fwd);
  m.impl("scan_plan", &selscan::scan_plan_op);
  m.impl("unfused_fwd_res", &selscan::unfused_fwd_res);
  m.impl("unfused_bwd", &selscan::unfused_bwd);
  m.impl("gated_scan_fwd", &selscan::gated_scan_fwd);
  m.impl("scan_bwd", &selscan::scan_bwd);
  m.impl("scan_fwd_packed", &selscan::scan_fwd_packed);
  m.impl("scan_bwd_packed", &selscan::scan_bwd_packed);
}

// CPU tensors reach the same functions so that the error says what to do instead of "no CPU kernel".
TORCH_LIBRARY_IMPL(selscan_fused, CPU, m) {
  m.impl("scan_fwd", &selscan::scan_fwd);
  m.impl("unfused_fwd", &selscan::unfused_fwd);
  m.impl("scan_plan", &selscan::scan_plan_op);
  m.impl("unfused_fwd_res", &selscan::unfused_fwd_res);
  m.impl("unfused_bwd", &selscan::unfused_bwd);
  m.impl("gated_scan_fwd", &selscan::gated_scan_fwd);
  m.impl("scan_bwd", &selscan::scan_bwd);
  m.impl("scan_fwd_packed", &selscan::scan_fwd_packed);
  m.impl("scan_bwd_packed", &selscan::scan_bwd_packed);
}
