// CUDA registrations of elu_linear_attention (the kernels of
// src/kernels/linear_attention/elu_linear_attention_cuda.cu): the forward
// (out and den; den is float32 on CUDA whatever the dtype) and backward ops,
// and the top-level op as a composite over the forward (the Autograd
// registration in src/ops/elu_linear_attention.cpp serves every backend).
// Same checks and messages as the CPU op; key_lengths is moved to q's device
// as int64; the float32 workspace (a row buffer and the chunk states, see
// elu_linear_attention_cuda_workspace_floats) comes from torch on q's device.
// Tested by tests/cuda/test_cuda_linear_attention.cpp.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "kernels/linear_attention/elu_linear_attention_cuda.h"
#include "ops/cuda/cuda_op_util.h"
#include "ops/linear_attention_args.h"
#include "ops/op_shell.h"

namespace fastattn {
namespace {

using torch::Tensor;

constexpr const char* kOp = "fastattn::elu_linear_attention";
constexpr int64_t kChunk = 64;

// The inputs as the kernels read them, and their float32 workspace.
struct Prepared {
  ops::QKVInputs in;
  Tensor workspace;
};

Prepared prepare(const Tensor& q, const Tensor& k, const Tensor& v,
                 const c10::optional<Tensor>& key_lengths) {
  Prepared p{ops::qkv_inputs(q, k, v, key_lengths), {}};
  p.workspace =
      torch::empty({cuda::elu_linear_attention_cuda_workspace_floats(
                       q.size(0), q.size(1), q.size(2), k.size(2), q.size(3), v.size(3), kChunk)},
                   q.options().dtype(torch::kFloat));
  return p;
}

template <typename Args>
void fill_params(Args& a, const Prepared& p, bool causal, double eps) {
  ops::fill_elu_linear_args<void>(a, kOp, p.in, causal, eps, kChunk);
  a.workspace = p.workspace.data_ptr<float>();
}

std::tuple<Tensor, Tensor, Tensor> elu_linear_attention_forward_cuda_op(
    const Tensor& q_in, const Tensor& k_in, const Tensor& v_in,
    const c10::optional<Tensor>& key_lengths, bool causal, double eps) {
  ops::check_elu_linear_inputs(kOp, q_in, k_in, v_in, key_lengths, causal, eps);
  const c10::cuda::CUDAGuard guard(q_in.device());
  const auto p = prepare(q_in, k_in, v_in, key_lengths);
  const auto& q = p.in.q;
  auto out = torch::empty({q.size(0), q.size(1), q.size(2), v_in.size(3)}, q.options());
  auto den = torch::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(torch::kFloat));
  cuda::EluLinearForwardCudaArgs a;
  fill_params(a, p, causal, eps);
  a.out = out.data_ptr();
  a.den = den.data_ptr<float>();
  cuda::elu_linear_attention_forward_cuda(a, ops::cuda::current_stream());
  // The CPU op's layout (its kernels write q's row layout), which the fake
  // implementation promises; no key state (the CUDA backward recomputes it).
  return {ops::in_rows_layout_of(out, q_in), den, torch::empty({0}, den.options())};
}

std::tuple<Tensor, Tensor, Tensor> elu_linear_attention_backward_cuda_op(
    const Tensor& grad_out, const Tensor& q_in, const Tensor& k_in, const Tensor& v_in,
    const Tensor& out_in, const Tensor& den_in, const c10::optional<Tensor>& key_lengths,
    bool causal, double eps, const c10::optional<Tensor>& state) {
  ops::check_elu_linear_inputs(kOp, q_in, k_in, v_in, key_lengths, causal, eps);
  ops::check_elu_linear_grad(kOp, grad_out, out_in, den_in, q_in, v_in);
  ops::check_elu_linear_state(kOp, state, q_in, v_in);  // checked, not read: recomputed here
  ops::cuda::check_same_device(kOp, "grad_out", grad_out, q_in.device());
  ops::cuda::check_same_device(kOp, "out", out_in, q_in.device());
  ops::cuda::check_same_device(kOp, "den", den_in, q_in.device());
  const c10::cuda::CUDAGuard guard(q_in.device());
  const auto p = prepare(q_in, k_in, v_in, key_lengths);
  const auto dtype = q_in.scalar_type();
  const auto go = grad_out.to(dtype).contiguous();
  const auto out = out_in.to(dtype).contiguous();
  const auto den = den_in.to(torch::kFloat).contiguous();
  auto gq = torch::empty_like(p.in.q), gk = torch::empty_like(p.in.k),
       gv = torch::empty_like(p.in.v);
  cuda::EluLinearBackwardCudaArgs a;
  fill_params(a, p, causal, eps);
  a.grad_out = go.data_ptr();
  a.out = out.data_ptr();
  a.den = den.data_ptr<float>();
  ops::set_qkv_grads<void>(a, gq, gk, gv);
  cuda::elu_linear_attention_backward_cuda(a, ops::cuda::current_stream());
  return {ops::in_rows_layout_of(gq, q_in), ops::in_rows_layout_of(gk, k_in),
          ops::in_rows_layout_of(gv, v_in)};
}

}  // namespace

TORCH_LIBRARY_IMPL(fastattn, CUDA, m) {
  ops::impl_halves(m, c10::DispatchKey::CUDA, "elu_linear_attention",
                   elu_linear_attention_forward_cuda_op, elu_linear_attention_backward_cuda_op);
}

}  // namespace fastattn
