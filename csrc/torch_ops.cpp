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
#include <tuple>

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

// The scan kernel alone: proj (batch, L, D + 2N) = [delta_pre | B | C] in x's dtype.
std::tuple<at::Tensor, at::Tensor> run_scan(const at::Tensor& proj_in, const at::Tensor& x_in,
                                            const at::Tensor& A_log, const at::Tensor& b_delta,
                                            const at::Tensor& D, const c10::optional<at::Tensor>& h0,
                                            bool return_final_state, int64_t l_segments, int64_t batch,
                                            int64_t L, int64_t Dm, int64_t N) {
  const c10::cuda::CUDAGuard guard(x_in.device());
  if (batch == 0 || L == 0) return empty_result(x_in, batch, Dm, N, h0, return_final_state);
  const at::Tensor x = aligned_contiguous(x_in);
  const at::Tensor proj = aligned_contiguous(proj_in);
  const at::Tensor A_c = A_log.contiguous(), b_c = b_delta.contiguous(), D_c = D.contiguous();
  at::Tensor h0_c;
  if (h0) h0_c = h0->contiguous();

  ScanParams p;
  p.batch = batch; p.seqlen = L; p.dim = Dm; p.dstate = N;
  p.dtype = to_dtype(x.scalar_type(), "x");
  p.proj = proj.data_ptr(); p.proj_stride = proj.size(-1);
  p.x = x.data_ptr();
  p.A_log = A_c.data_ptr<float>(); p.b_delta = b_c.data_ptr<float>(); p.D = D_c.data_ptr<float>();
  p.h0 = h0 ? h0_c.data_ptr<float>() : nullptr;

  ScanLaunchInfo plan;
  SELSCAN_CUDA_OK(scan_plan(p, l_segments, x.get_device(), &plan), "planning the scan");
  p.n_segments = plan.n_segments; p.seg_len = plan.seg_len;

  at::Tensor y = at::empty({batch, L, Dm}, x.options());
  at::Tensor hT = return_final_state ? at::empty({batch, Dm, N}, x.options().dtype(at::kFloat))
                                     : at::empty({0}, x.options().dtype(at::kFloat));
  const int64_t ws_floats = split_workspace_floats(batch, Dm, N, p.n_segments);
  at::Tensor ws = at::empty({ws_floats}, x.options().dtype(at::kFloat));
  poison(y);
  poison(hT);
  p.y = y.data_ptr();
  p.final_state = return_final_state ? hT.data_ptr<float>() : nullptr;
  p.workspace = ws_floats > 0 ? ws.data_ptr<float>() : nullptr;
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
  return run_scan(proj, x, A_log, b_delta, D, h0, return_final_state, l_segments, batch, L, Dm, N);
}

// The unfused path: one library matrix product for [delta_pre | B | C], then the scan kernel.
std::tuple<at::Tensor, at::Tensor> unfused_fwd(const at::Tensor& x, const at::Tensor& A_log,
                                               const at::Tensor& W_delta, const at::Tensor& b_delta,
                                               const at::Tensor& W_B, const at::Tensor& W_C, const at::Tensor& D,
                                               const c10::optional<at::Tensor>& h0, bool return_final_state,
                                               int64_t l_segments) {
  auto [batch, L, Dm, N] = check_common(x, A_log, b_delta, D, h0);
  check_tensor(W_delta, "W_delta", x, {Dm, Dm}, x.scalar_type());
  check_tensor(W_B, "W_B", x, {N, Dm}, x.scalar_type());
  check_tensor(W_C, "W_C", x, {N, Dm}, x.scalar_type());
  check_scan_envelope(Dm, N);
  const c10::cuda::CUDAGuard guard(x.device());
  if (batch == 0 || L == 0) return empty_result(x, batch, Dm, N, h0, return_final_state);
  // The dtypes were settled by the caller: no autocast inside the op.
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  // cuBLAS, following torch.get_float32_matmul_precision() for float32.
  const at::Tensor W = at::cat({W_delta, W_B, W_C}, 0);            // (D + 2N, D)
  const at::Tensor proj = at::mm(x.reshape({batch * L, Dm}), W.t());  // (batch*L, D + 2N)
  return run_scan(proj.view({batch, L, Dm + 2 * N}), x, A_log, b_delta, D, h0, return_final_state, l_segments,
                  batch, L, Dm, N);
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

void set_poison_outputs(bool enable) { g_poison_outputs.store(enable); }

}  // namespace
}  // namespace selscan

TORCH_LIBRARY(selscan_fused, m) {
  m.def("scan_fwd(Tensor proj, Tensor x, Tensor A_log, Tensor b_delta, Tensor D, Tensor? h0, "
        "bool return_final_state, int l_segments) -> (Tensor, Tensor)");
  m.def("unfused_fwd(Tensor x, Tensor A_log, Tensor W_delta, Tensor b_delta, Tensor W_B, Tensor W_C, "
        "Tensor D, Tensor? h0, bool return_final_state, int l_segments) -> (Tensor, Tensor)");
  m.def("scan_plan(Tensor x, int dstate, int l_segments) -> int[]");
  // Test hook: NaN-fill the outputs before every launch (off by default).
  m.def("set_poison_outputs(bool enable) -> ()", &selscan::set_poison_outputs);
}

TORCH_LIBRARY_IMPL(selscan_fused, CUDA, m) {
  m.impl("scan_fwd", &selscan::scan_fwd);
  m.impl("unfused_fwd", &selscan::unfused_fwd);
  m.impl("scan_plan", &selscan::scan_plan_op);
}

// CPU tensors reach the same functions so that the error says what to do instead of "no CPU kernel".
TORCH_LIBRARY_IMPL(selscan_fused, CPU, m) {
  m.impl("scan_fwd", &selscan::scan_fwd);
  m.impl("unfused_fwd", &selscan::unfused_fwd);
  m.impl("scan_plan", &selscan::scan_plan_op);
}
