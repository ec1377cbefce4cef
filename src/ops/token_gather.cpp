// The gather_tokens operator (ClusterFormer's sort / unsort): input checks,
// CPU implementations of the gather and its scatter-add adjoint
// (src/kernels/token_gather/), the autograd function, the C++ entry point
// and the plain-ATen reference.
//   x (N,H,L,E), index (N,T) int64 in [-1, L) -> (N,H,T,E), zero rows for -1.
// O(N·H·T·E); gradients flow to x. Tested by tests/cpp/test_clusterformer.cpp.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "fastattn/ops.h"
#include "kernels/token_gather/token_gather.h"
#include "ops/op_shell.h"
#include "ops/op_util.h"
#include "ops/token_gather_args.h"

namespace fastattn {
namespace ops {

using torch::Tensor;

void check_gather_index(const Tensor& index, int64_t N, int64_t L) {
  TORCH_CHECK(index.defined() && index.dim() == 2 && index.size(0) == N, kGatherTokensOp,
              ": index must have shape (N, T) with N = ", N, ", got ",
              index.defined() ? index.sizes() : torch::IntArrayRef{});
  TORCH_CHECK(index.scalar_type() == torch::kLong, kGatherTokensOp, ": index must be int64, got ",
              index.scalar_type());
  if (index.numel() > 0 && ops::check_values()) {
    const int64_t lo = index.min().item<int64_t>(), hi = index.max().item<int64_t>();
    TORCH_CHECK(lo >= -1 && hi < L, kGatherTokensOp,
                ": index must hold token positions in [-1, L) = [-1, ", L, "), got values in [", lo,
                ", ", hi, "]");
  }
}

void check_gather_x(const char* name, const Tensor& x) {
  TORCH_CHECK(x.defined() && x.dim() == 4, kGatherTokensOp, ": ", name,
              " must have shape (N, H, L, E), got ",
              x.defined() ? x.sizes() : torch::IntArrayRef{});
  ops::check_float_dtype(kGatherTokensOp, name, x);
}

}  // namespace ops

namespace {

using torch::Tensor;

constexpr const char* kOp = ops::kGatherTokensOp;

Tensor gather_tokens_cpu_op(const Tensor& x_in, const Tensor& index_in) {
  ops::check_gather_x("x", x_in);
  ops::check_gather_index(index_in, x_in.size(0), x_in.size(2));
  if (ops::is_reduced_float(x_in))
    return ops::in_float32(x_in.scalar_type(), gather_tokens_cpu_op, x_in, index_in);
  const auto x = ops::contiguous(x_in);
  const auto index = index_in.contiguous();
  auto out = ops::empty_output({x.size(0), x.size(1), index.size(1), x.size(3)}, x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "gather_tokens_cpu_op", [&] {
    kernels::TokenGatherArgs<scalar_t> a;
    ops::fill_token_gather_args(a, "x", x, index, x.size(2));
    a.x = x.data_ptr<scalar_t>();
    a.out = out.data_ptr<scalar_t>();
    kernels::token_gather_forward_cpu(a);
  });
  return out;
}

Tensor gather_tokens_backward_cpu_op(const Tensor& grad_out_in, const Tensor& index_in,
                                     int64_t length) {
  ops::check_gather_x("grad_out", grad_out_in);
  TORCH_CHECK(length >= 0, kOp, ": length must be >= 0, got ", length);
  ops::check_gather_index(index_in, grad_out_in.size(0), length);
  TORCH_CHECK(grad_out_in.size(2) == index_in.size(1), kOp,
              ": grad_out must have T = index.size(1) = ", index_in.size(1), " rows, got ",
              grad_out_in.sizes());
  if (ops::is_reduced_float(grad_out_in))
    return ops::in_float32(grad_out_in.scalar_type(), gather_tokens_backward_cpu_op, grad_out_in,
                           index_in, length);
  const auto g = ops::contiguous(grad_out_in);
  const auto index = index_in.contiguous();
  auto out = ops::empty_output({g.size(0), g.size(1), length, g.size(3)}, g.options());
  AT_DISPATCH_FLOATING_TYPES(g.scalar_type(), "gather_tokens_backward_cpu_op", [&] {
    kernels::TokenGatherArgs<scalar_t> a;
    ops::fill_token_gather_args(a, "grad_out", g, index, length);
    a.grad_out = g.data_ptr<scalar_t>();
    a.out = out.data_ptr<scalar_t>();
    kernels::token_gather_backward_cpu(a);
  });
  return out;
}

constexpr char kBackwardOp[] = "fastattn::gather_tokens_backward";

// The operator's CPU kernel is its forward; the autograd kernel calls it
// below autograd.
struct GatherTokensOp {
  struct Saved {
    Tensor index;
    int64_t length = 0;
    auto tensors() { return std::tie(index); }
  };

  static Tensor forward(Saved* saved, const Tensor& x, const Tensor& index) {
    if (saved) *saved = {index, x.size(2)};
    return ops::call_op<ops::kGatherTokensOp, gather_tokens_cpu_op>(x, index);
  }

  static torch::autograd::variable_list backward(const Saved& s,
                                                 const torch::autograd::variable_list& grads) {
    return {ops::call_op<kBackwardOp, gather_tokens_backward_cpu_op>(grads[0], s.index, s.length)};
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(fastattn, CPU, m) {
  m.impl("gather_tokens", gather_tokens_cpu_op);
  m.impl("gather_tokens_backward", gather_tokens_backward_cpu_op);
}

TORCH_LIBRARY_IMPL(fastattn, Autograd, m) {
  m.impl("gather_tokens", ops::Shell<GatherTokensOp>::autograd);
}

Tensor gather_tokens(const Tensor& x, const Tensor& index) {
  ops::check_defined(kOp, {"x", "index"}, {x, index});
  return ops::call_op<ops::kGatherTokensOp, gather_tokens_cpu_op>(x, index);
}

namespace reference {
Tensor gather_tokens(const Tensor& x, const Tensor& index) {
  // Append a zero row per (n, h) for index -1, then index_select per batch.
  const int64_t N = x.size(0), H = x.size(1), L = x.size(2), E = x.size(3), T = index.size(1);
  auto padded = torch::cat({x, torch::zeros({N, H, 1, E}, x.options())}, 2);  // (N, H, L+1, E)
  auto idx = torch::where(index.ge(0), index, torch::full({}, L, index.options()));
  auto gather_idx = idx.view({N, 1, T, 1}).expand({N, H, T, E});
  return padded.gather(2, gather_idx);
}
}  // namespace reference

}  // namespace fastattn
