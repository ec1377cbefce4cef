// CUDA registrations of causal_linear_product (the kernels of
// src/kernels/causal_product/causal_product_cuda.cu): the forward and
// backward ops, and the top-level op as a composite over the forward (the
// Autograd registration in src/ops/causal_linear_product.cpp serves every
// backend). Same checks and messages as the CPU op; a float32 workspace of
// N·H·ceil(L/64)·F·M elements (the chunk states) comes from torch on q's
// device. Tested by tests/cuda/test_cuda_linear_attention.cpp.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "kernels/causal_product/causal_product_cuda.h"
#include "ops/cuda/cuda_op_util.h"
#include "ops/linear_attention_args.h"
#include "ops/op_shell.h"

namespace fastattn {
namespace {

using torch::Tensor;

constexpr const char* kOp = "fastattn::causal_linear_product";
constexpr int64_t kChunk = 64;

Tensor workspace(const Tensor& q, int64_t F, int64_t M) {
  return torch::empty(
      {cuda::causal_product_cuda_workspace_floats(q.size(0), q.size(1), q.size(2), F, M, kChunk)},
      q.options().dtype(torch::kFloat));
}

Tensor causal_linear_product_forward_cuda_op(const Tensor& q_in, const Tensor& k_in,
                                             const Tensor& v_in) {
  ops::check_causal_product_inputs(kOp, q_in, k_in, v_in);
  const c10::cuda::CUDAGuard guard(q_in.device());
  const auto q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous();
  auto out = torch::empty({q.size(0), q.size(1), q.size(2), v.size(3)}, q.options());
  auto ws = workspace(q, q.size(3), v.size(3));
  cuda::CausalProductForwardCudaArgs a;
  ops::fill_causal_product_args<void>(a, kOp, q, k, v, kChunk);
  a.out = out.data_ptr();
  a.workspace = ws.data_ptr<float>();
  cuda::causal_product_forward_cuda(a, ops::cuda::current_stream());
  return out;
}

std::tuple<Tensor, Tensor, Tensor> causal_linear_product_backward_cuda_op(const Tensor& grad_out,
                                                                          const Tensor& q_in,
                                                                          const Tensor& k_in,
                                                                          const Tensor& v_in) {
  ops::check_causal_product_inputs(kOp, q_in, k_in, v_in);
  ops::check_causal_product_grad(kOp, grad_out, q_in, v_in);
  ops::cuda::check_same_device(kOp, "grad_out", grad_out, q_in.device());
  const c10::cuda::CUDAGuard guard(q_in.device());
  const auto q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous();
  const auto go = grad_out.to(q.scalar_type()).contiguous();
  auto gq = torch::empty_like(q), gk = torch::empty_like(k), gv = torch::empty_like(v);
  auto ws = workspace(q, q.size(3), v.size(3));
  cuda::CausalProductBackwardCudaArgs a;
  ops::fill_causal_product_args<void>(a, kOp, q, k, v, kChunk);
  a.grad_out = go.data_ptr();
  ops::set_qkv_grads<void>(a, gq, gk, gv);
  a.workspace = ws.data_ptr<float>();
  cuda::causal_product_backward_cuda(a, ops::cuda::current_stream());
  return {gq, gk, gv};
}

}  // namespace

TORCH_LIBRARY_IMPL(fastattn, CUDA, m) {
  ops::impl_halves(m, c10::DispatchKey::CUDA, "causal_linear_product",
                   causal_linear_product_forward_cuda_op, causal_linear_product_backward_cuda_op);
}

}  // namespace fastattn
