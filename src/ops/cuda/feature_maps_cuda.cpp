// CUDA registrations of elu_feature_map and its backward (the kernels of
// src/kernels/feature_maps/elu_feature_map_cuda.cu); the Autograd
// registration in src/ops/elu_feature_map.cpp serves every backend. Same
// checks and messages as the CPU op. Tested by
// tests/cuda/test_cuda_linear_attention.cpp.
#include <torch/library.h>

#include "kernels/feature_maps/elu_feature_map_cuda.h"
#include "ops/cuda/cuda_op_util.h"
#include "ops/linear_attention_args.h"

namespace fastattn {
namespace {

using torch::Tensor;

constexpr const char* kOp = "fastattn::elu_feature_map";

template <bool Backward>
Tensor run(const Tensor& x_in, const Tensor& grad_in) {
  const c10::cuda::CUDAGuard guard(x_in.device());
  const auto x = x_in.contiguous();
  Tensor g;
  if (Backward) g = grad_in.to(x.scalar_type()).contiguous();
  auto out = torch::empty_like(x);
  cuda::EluFeatureMapCudaArgs a;
  ops::fill_elu_feature_map_args(a, kOp, x, g, out);
  if (Backward) {
    cuda::elu_feature_map_backward_cuda(a, ops::cuda::current_stream());
  } else {
    cuda::elu_feature_map_forward_cuda(a, ops::cuda::current_stream());
  }
  return out;
}

Tensor elu_feature_map_cuda_op(const Tensor& x) {
  ops::check_elu_feature_map_input(kOp, "x", x);
  return run<false>(x, Tensor());
}

Tensor elu_feature_map_backward_cuda_op(const Tensor& grad_out, const Tensor& x) {
  ops::check_elu_feature_map_input(kOp, "x", x);
  TORCH_CHECK(grad_out.sizes() == x.sizes(), kOp, ": grad_out must have the shape of x ", x.sizes(),
              ", got ", grad_out.sizes());
  ops::cuda::check_same_device(kOp, "grad_out", grad_out, x.device());
  return run<true>(x, grad_out);
}

}  // namespace

TORCH_LIBRARY_IMPL(fastattn, CUDA, m) {
  m.impl("elu_feature_map", elu_feature_map_cuda_op);
  m.impl("elu_feature_map_backward", elu_feature_map_backward_cuda_op);
}

}  // namespace fastattn
