// The causal_linear_product operator: out_i = sum_{j<=i} (q_i·k_j) v_j for
// feature-mapped q, k (N,H,L,F) and v (N,H,L,M). Input checks, the CPU
// forward/backward (chunked kernels of src/kernels/causal_product/, O(L·(F+M))
// memory), the autograd function, the C++ entry point and the plain-ATen
// reference tril(Q K^T) V (O(L²) memory, tests and benchmarks only).
// Tested by tests/cpp/test_linear_attention.cpp; timed by
// bench/bench_linear_attention.cpp.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "fastattn/ops.h"
#include "ops/linear_attention_args.h"
#include "ops/op_util.h"

namespace fastattn {
namespace {

using torch::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr const char* kOp = "fastattn::causal_linear_product";

void check_inputs(const Tensor& q, const Tensor& k, const Tensor& v) {
  ops::check_causal_product_inputs(kOp, q, k, v);
}

Tensor causal_linear_product_forward_cpu(const Tensor& q_in, const Tensor& k_in,
                                         const Tensor& v_in) {
  check_inputs(q_in, k_in, v_in);
  if (ops::is_reduced_float(q_in))
    return ops::in_float32(q_in.scalar_type(), causal_linear_product_forward_cpu, q_in, k_in, v_in);
  const auto q = ops::contiguous(q_in), k = ops::contiguous(k_in), v = ops::contiguous(v_in);
  auto out = ops::empty_output({q.size(0), q.size(1), q.size(2), v.size(3)}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "causal_linear_product_forward_cpu", [&] {
    kernels::CausalProductForwardArgs<scalar_t> a;
    ops::fill_causal_product_args<scalar_t>(a, kOp, q, k, v, kCausalLinearProductChunk);
    a.out = out.data_ptr<scalar_t>();
    kernels::causal_product_forward_cpu(a);
  });
  return out;
}

std::tuple<Tensor, Tensor, Tensor> causal_linear_product_backward_cpu(const Tensor& grad_out,
                                                                      const Tensor& q_in,
                                                                      const Tensor& k_in,
                                                                      const Tensor& v_in) {
  check_inputs(q_in, k_in, v_in);
  ops::check_causal_product_grad(kOp, grad_out, q_in, v_in);
  if (ops::is_reduced_float(q_in))
    return ops::in_float32(q_in.scalar_type(), causal_linear_product_backward_cpu, grad_out, q_in,
                           k_in, v_in);
  const auto q = ops::contiguous(q_in), k = ops::contiguous(k_in), v = ops::contiguous(v_in);
  const auto go = ops::contiguous(grad_out.to(q.scalar_type()));
  auto gq = ops::empty_output(q.sizes(), q.options()),
       gk = ops::empty_output(k.sizes(), k.options()),
       gv = ops::empty_output(v.sizes(), v.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "causal_linear_product_backward_cpu", [&] {
    kernels::CausalProductBackwardArgs<scalar_t> a;
    ops::fill_causal_product_args<scalar_t>(a, kOp, q, k, v, kCausalLinearProductChunk);
    a.grad_out = go.data_ptr<scalar_t>();
    a.grad_q = gq.data_ptr<scalar_t>();
    a.grad_k = gk.data_ptr<scalar_t>();
    a.grad_v = gv.data_ptr<scalar_t>();
    kernels::causal_product_backward_cpu(a);
  });
  return {gq, gk, gv};
}

Tensor call_forward(const Tensor& q, const Tensor& k, const Tensor& v) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("fastattn::causal_linear_product_forward", "")
                       .typed<decltype(causal_linear_product_forward_cpu)>();
  return op.call(q, k, v);
}

class CausalLinearProductFunction : public torch::autograd::Function<CausalLinearProductFunction> {
 public:
  static Tensor forward(AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& v) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto out = call_forward(q, k, v);
    ctx->save_for_backward({q, k, v});
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("fastattn::causal_linear_product_backward", "")
                         .typed<decltype(causal_linear_product_backward_cpu)>();
    const auto saved = ctx->get_saved_variables();
    auto [gq, gk, gv] = op.call(grads[0], saved[0], saved[1], saved[2]);
    return {gq, gk, gv};
  }
};

Tensor causal_linear_product_autograd(const Tensor& q, const Tensor& k, const Tensor& v) {
  return CausalLinearProductFunction::apply(q, k, v);
}

}  // namespace

namespace ops {

// Registered under CPU and CUDA: the forward op through the dispatcher.
Tensor causal_linear_product_no_grad_entry(const Tensor& q, const Tensor& k, const Tensor& v) {
  return call_forward(q, k, v);
}

}  // namespace ops

TORCH_LIBRARY_IMPL(fastattn, CPU, m) {
  m.impl("causal_linear_product", ops::causal_linear_product_no_grad_entry);
  m.impl("causal_linear_product_forward", causal_linear_product_forward_cpu);
  m.impl("causal_linear_product_backward", causal_linear_product_backward_cpu);
}

TORCH_LIBRARY_IMPL(fastattn, Autograd, m) {
  m.impl("causal_linear_product", causal_linear_product_autograd);
}

Tensor causal_linear_product(const Tensor& q, const Tensor& k, const Tensor& v) {
  ops::check_defined("fastattn::causal_linear_product", {"q", "k", "v"}, {q, k, v});
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("fastattn::causal_linear_product", "")
                       .typed<Tensor(const Tensor&, const Tensor&, const Tensor&)>();
  return op.call(q, k, v);
}

namespace reference {

Tensor causal_linear_product(const Tensor& q, const Tensor& k, const Tensor& v) {
  check_inputs(q, k, v);
  return torch::matmul(torch::tril(torch::matmul(q, k.transpose(-1, -2))), v);
}

}  // namespace reference
}  // namespace fastattn
