// CUDA registrations of gather_tokens and gather_tokens_backward (schemas in
// src/ops/schemas.cpp; CPU side, checks and autograd in
// src/ops/token_gather.cpp):
//   gather_tokens(x (N,H,L,E), index (N,T)) -> (N,H,T,E), zeros where index = -1;
//   gather_tokens_backward(grad_out (N,H,T,E), index, length) -> (N,H,length,E),
//     a scatter-add (float32 atomics into a float32 buffer, then the dtype),
//     so repeated indices may sum in any order.
// Kernels: src/kernels/token_gather/token_gather_cuda.cu.
// Tested by tests/cuda/test_cuda_token_gather.cpp against the CPU op.
#include <torch/library.h>

#include "kernels/token_gather/token_gather_cuda.h"
#include "ops/cuda/cuda_op_util.h"
#include "ops/token_gather_args.h"

namespace fastattn {
namespace {

using torch::Tensor;

Tensor gather_tokens_cuda_op(const Tensor& x_in, const Tensor& index_in) {
  ops::check_gather_x("x", x_in);
  ops::check_gather_index(index_in, x_in.size(0), x_in.size(2));
  const c10::cuda::CUDAGuard guard(x_in.device());
  const auto x = x_in.contiguous();
  const auto index = index_in.to(x.device()).contiguous();
  auto out = torch::empty({x.size(0), x.size(1), index.size(1), x.size(3)}, x.options());
  cuda::TokenGatherCudaArgs a;
  ops::fill_token_gather_args(a, "x", x, index, x.size(2));
  a.x = x.data_ptr();
  a.out = out.data_ptr();
  cuda::token_gather_forward_cuda(a, ops::cuda::current_stream());
  return out;
}

Tensor gather_tokens_backward_cuda_op(const Tensor& grad_out_in, const Tensor& index_in,
                                      int64_t length) {
  ops::check_gather_x("grad_out", grad_out_in);
  TORCH_CHECK(length >= 0, ops::kGatherTokensOp, ": length must be >= 0, got ", length);
  ops::check_gather_index(index_in, grad_out_in.size(0), length);
  TORCH_CHECK(grad_out_in.size(2) == index_in.size(1), ops::kGatherTokensOp,
              ": grad_out must have T = index.size(1) = ", index_in.size(1), " rows, got ",
              grad_out_in.sizes());
  const c10::cuda::CUDAGuard guard(grad_out_in.device());
  const auto g = grad_out_in.contiguous();
  const auto index = index_in.to(g.device()).contiguous();
  auto grad_x =
      torch::zeros({g.size(0), g.size(1), length, g.size(3)}, g.options().dtype(torch::kFloat));
  cuda::TokenGatherCudaArgs a;
  ops::fill_token_gather_args(a, "grad_out", g, index, length);
  a.grad_out = g.data_ptr();
  a.grad_x = grad_x.data_ptr<float>();
  cuda::token_gather_backward_cuda(a, ops::cuda::current_stream());
  return grad_x.to(g.scalar_type());
}

}  // namespace

TORCH_LIBRARY_IMPL(fastattn, CUDA, m) {
  m.impl("gather_tokens", gather_tokens_cuda_op);
  m.impl("gather_tokens_backward", gather_tokens_backward_cuda_op);
}

}  // namespace fastattn
