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
#include "ops/op_shell.h"
#include "ops/op_util.h"

namespace fastattn {
namespace {

using torch::Tensor;
using torch::autograd::variable_list;

constexpr char kOp[] = "fastattn::causal_linear_product";

void check_inputs(const Tensor& q, const Tensor& k, const Tensor& v) {
  ops::check_causal_product_inputs(kOp, q, k, v);
}

Tensor causal_linear_product_forward_cpu_op(const Tensor& q_in, const Tensor& k_in,
                                            const Tensor& v_in) {
  check_inputs(q_in, k_in, v_in);
  if (ops::is_reduced_float(q_in))
    return ops::in_float32(q_in.scalar_type(), causal_linear_product_forward_cpu_op, q_in, k_in,
                           v_in);
  const auto q = ops::contiguous(q_in), k = ops::contiguous(k_in), v = ops::contiguous(v_in);
  auto out = ops::empty_output({q.size(0), q.size(1), q.size(2), v.size(3)}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "causal_linear_product_forward_cpu_op", [&] {
    kernels::CausalProductForwardArgs<scalar_t> a;
    ops::fill_causal_product_args<scalar_t>(a, kOp, q, k, v, kCausalLinearProductChunk);
    a.out = out.data_ptr<scalar_t>();
    kernels::causal_product_forward_cpu(a);
  });
  return out;
}

std::tuple<Tensor, Tensor, Tensor> causal_linear_product_backward_cpu_op(const Tensor& grad_out,
                                                                         const Tensor& q_in,
                                                                         const Tensor& k_in,
                                                                         const Tensor& v_in) {
  check_inputs(q_in, k_in, v_in);
  ops::check_causal_product_grad(kOp, grad_out, q_in, v_in);
  if (ops::is_reduced_float(q_in))
    return ops::in_float32(q_in.scalar_type(), causal_linear_product_backward_cpu_op, grad_out,
                           q_in, k_in, v_in);
  const auto q = ops::contiguous(q_in), k = ops::contiguous(k_in), v = ops::contiguous(v_in);
  const auto go = ops::contiguous(grad_out.to(q.scalar_type()));
  auto gq = ops::empty_output(q.sizes(), q.options()),
       gk = ops::empty_output(k.sizes(), k.options()),
       gv = ops::empty_output(v.sizes(), v.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "causal_linear_product_backward_cpu_op", [&] {
    kernels::CausalProductBackwardArgs<scalar_t> a;
    ops::fill_causal_product_args<scalar_t>(a, kOp, q, k, v, kCausalLinearProductChunk);
    a.grad_out = go.data_ptr<scalar_t>();
    ops::set_qkv_grads<scalar_t>(a, gq, gk, gv);
    kernels::causal_product_backward_cpu(a);
  });
  return {gq, gk, gv};
}

constexpr char kForwardOp[] = "fastattn::causal_linear_product_forward";
constexpr char kBackwardOp[] = "fastattn::causal_linear_product_backward";

struct CausalProductOp {
  struct Saved {
    Tensor q, k, v;
    auto tensors() { return std::tie(q, k, v); }
  };

  static Tensor forward(Saved* saved, const Tensor& q, const Tensor& k, const Tensor& v) {
    if (saved) *saved = {q, k, v};
    return ops::call_op<kForwardOp, causal_linear_product_forward_cpu_op>(q, k, v);
  }

  static auto backward(const Saved& s, const variable_list& grads) {
    return ops::call_op<kBackwardOp, causal_linear_product_backward_cpu_op>(grads[0], s.q, s.k,
                                                                            s.v);
  }
};

using CausalProductShell = ops::Shell<CausalProductOp>;

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastattn, m) {
  ops::impl_shell<CausalProductOp>(m, "causal_linear_product", causal_linear_product_forward_cpu_op,
                                   causal_linear_product_backward_cpu_op);
}

Tensor causal_linear_product(const Tensor& q, const Tensor& k, const Tensor& v) {
  ops::check_defined(kOp, {"q", "k", "v"}, {q, k, v});
  return ops::call_op<kOp, CausalProductShell::no_grad>(q, k, v);
}

namespace reference {

Tensor causal_linear_product(const Tensor& q, const Tensor& k, const Tensor& v) {
  check_inputs(q, k, v);
  return torch::matmul(torch::tril(torch::matmul(q, k.transpose(-1, -2))), v);
}

}  // namespace reference
}  // namespace fastattn
