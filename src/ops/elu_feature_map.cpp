// The elu_feature_map operator: phi(x) = elu(x) + 1 elementwise (the default
// feature map of linear attention), with vectorised CPU kernels
// (src/kernels/feature_maps/) for forward and backward, an autograd function
// and the C++ entry point; the reference is torch::elu(x) + 1.
// O(n) time, no extra memory. Tested by tests/cpp/test_linear_attention.cpp.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "fastattn/ops.h"
#include "kernels/feature_maps/elu_feature_map.h"
#include "ops/linear_attention_args.h"
#include "ops/op_shell.h"
#include "ops/op_util.h"

namespace fastattn {
namespace {

using torch::Tensor;

constexpr char kOp[] = "fastattn::elu_feature_map";

void check_input(const char* name, const Tensor& x) {
  ops::check_elu_feature_map_input(kOp, name, x);
}

template <bool Backward>
Tensor run(const Tensor& x_in, const Tensor& grad_in) {
  const auto x = ops::contiguous(x_in);
  Tensor g;
  if (Backward) g = ops::contiguous(grad_in.to(x.scalar_type()));
  auto out = ops::empty_output(x.sizes(), x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "elu_feature_map_cpu_op", [&] {
    kernels::EluFeatureMapArgs<scalar_t> a;
    ops::fill_elu_feature_map_args(a, kOp, x, g, out);
    if (Backward) {
      kernels::elu_feature_map_backward_cpu(a);
    } else {
      kernels::elu_feature_map_forward_cpu(a);
    }
  });
  return out;
}

Tensor elu_feature_map_cpu_op(const Tensor& x) {
  check_input("x", x);
  if (ops::is_reduced_float(x)) return ops::in_float32(x.scalar_type(), elu_feature_map_cpu_op, x);
  return run<false>(x, Tensor());
}

Tensor elu_feature_map_backward_cpu_op(const Tensor& grad_out, const Tensor& x) {
  check_input("x", x);
  TORCH_CHECK(grad_out.sizes() == x.sizes(), kOp, ": grad_out must have the shape of x ", x.sizes(),
              ", got ", grad_out.sizes());
  if (ops::is_reduced_float(x))
    return ops::in_float32(x.scalar_type(), elu_feature_map_backward_cpu_op, grad_out, x);
  return run<true>(x, grad_out);
}

constexpr char kBackwardOp[] = "fastattn::elu_feature_map_backward";

// The operator's CPU kernel is its forward; the autograd kernel calls it
// below autograd.
struct EluFeatureMapOp {
  struct Saved {
    Tensor x;
    auto tensors() { return std::tie(x); }
  };

  static Tensor forward(Saved* saved, const Tensor& x) {
    if (saved) saved->x = x;
    return ops::call_op<kOp, elu_feature_map_cpu_op>(x);
  }

  static torch::autograd::variable_list backward(const Saved& s,
                                                 const torch::autograd::variable_list& grads) {
    return {ops::call_op<kBackwardOp, elu_feature_map_backward_cpu_op>(grads[0], s.x)};
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(fastattn, CPU, m) {
  m.impl("elu_feature_map", elu_feature_map_cpu_op);
  m.impl("elu_feature_map_backward", elu_feature_map_backward_cpu_op);
}

TORCH_LIBRARY_IMPL(fastattn, Autograd, m) {
  m.impl("elu_feature_map", ops::Shell<EluFeatureMapOp>::autograd);
}

Tensor elu_feature_map(const Tensor& x) {
  ops::check_defined(kOp, {"x"}, {x});
  return ops::call_op<kOp, elu_feature_map_cpu_op>(x);
}

namespace reference {
// elu(x) + 1 written as exp(x) for x <= 0: elu(x) + 1 = (exp(x) - 1) + 1 loses
// the digits of exp(x) for very negative x (at x = -31, about 3 of 16 left),
// which the kernel keeps. exp of the clamped input keeps the unused branch's
// gradient finite.
Tensor elu_feature_map(const Tensor& x) {
  return torch::where(x > 0, x + 1, torch::exp(x.clamp_max(0)));
}
}  // namespace reference

}  // namespace fastattn
