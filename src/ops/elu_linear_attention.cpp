// The elu_linear_attention operator: normalised linear attention with the
// feature map phi(x) = elu(x) + 1, causal or not, fused into one kernel per
// pass (src/kernels/linear_attention/). Input checks, the CPU forward/backward,
// the autograd function, the C++ entry point and the plain-ATen reference
// (O(L·S) memory, tests and benchmarks only).
// Tested by tests/cpp/test_linear_attention.cpp; timed by
// bench/bench_linear_attention.cpp.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cmath>

#include "fastattn/ops.h"
#include "kernels/common/cpu_isa.h"
#include "ops/elu_linear_output_sums.h"
#include "ops/linear_attention_args.h"
#include "ops/mask_util.h"
#include "ops/op_shell.h"
#include "ops/op_util.h"

namespace fastattn {
namespace {

using torch::Tensor;
using torch::autograd::variable_list;

constexpr char kOp[] = "fastattn::elu_linear_attention";
// Rows per chunk. The causal form does C×C work per chunk inside it: small
// chunks keep every tile in L1 and cut that work (the forward was fastest
// at 8 rows, the backward at 16); at the AVX-512 level a chunk is at least a
// vector of 16 floats, which beat 8 there. The non-causal form has no such
// work: its chunks only bound the phi tiles, and 64 rows (one 16 KiB tile,
// K = 64 for the state products) beat 16 (measured: git show
// 5f604de:docs/benchmarks.md, "Masked gemm tails: causal linear attention at
// the AVX-512 level" and "Output pages and linear chunks").
int64_t chunk_rows(bool causal, bool backward) {
  if (!causal) return 64;
  if (backward) return 16;
  return kernels::cpu_isa() == kernels::CpuIsa::kAvx512 ? 16 : 8;
}

void check_inputs(const Tensor& q, const Tensor& k, const Tensor& v,
                  const c10::optional<Tensor>& key_lengths, bool causal, double eps) {
  ops::check_elu_linear_inputs(kOp, q, k, v, key_lengths, causal, eps);
}

std::tuple<Tensor, Tensor, Tensor> elu_linear_attention_forward_cpu_op(
    const Tensor& q_in, const Tensor& k_in, const Tensor& v_in,
    const c10::optional<Tensor>& key_lengths, bool causal, double eps) {
  check_inputs(q_in, k_in, v_in, key_lengths, causal, eps);
  auto* sums_scope = ops::EluLinearOutputSums::active();
  if (q_in.scalar_type() == torch::kHalf) {  // bfloat16 goes to the kernels as it is
    auto [out, den, state] =
        ops::in_float32<1, 2>(q_in.scalar_type(), elu_linear_attention_forward_cpu_op, q_in, k_in,
                              v_in, key_lengths, causal, eps);
    if (sums_scope) sums_scope->set({});  // the float32 sums miss float16's rounding
    return {ops::in_rows_layout_of(out, q_in), den, state};
  }
  const auto p = ops::qkv_inputs(q_in, k_in, v_in, key_lengths);
  // out in q's row layout: the layers' transpose back to (N, L, H, M) is a view.
  auto out = ops::empty_rows_like(q_in, p.v.size(3));
  const auto stats = p.q.options().dtype(ops::stats_dtype(p.q));
  auto den = torch::empty({p.q.size(0), p.q.size(1), p.q.size(2)}, stats);
  // The key state [S | z] for the backward (non-causal only: the causal form's
  // state changes with every chunk).
  auto state = causal
                   ? torch::empty({0}, stats)
                   : torch::empty({p.q.size(0), p.q.size(1), p.q.size(3), p.v.size(3) + 1}, stats);
  ops::dispatch_cpu_kernel_type(p.q.scalar_type(), [&](auto type) {
    using T = typename decltype(type)::type;
    kernels::EluLinearForwardArgs<T> a;
    ops::fill_elu_linear_args<T>(a, kOp, p, causal, eps, chunk_rows(causal, /*backward=*/false));
    a.out = ops::kernel_data<T>(out);
    a.out_rows = ops::row_strides(out);
    a.den = den.data_ptr<kernels::KernelScalar<T>>();
    if (!causal) a.state = state.data_ptr<kernels::KernelScalar<T>>();
    Tensor sums;
    if (sums_scope) {
      if constexpr (std::is_same_v<T, kernels::KernelScalar<T>>) {
        sums = torch::zeros({p.q.size(0), p.q.size(1)}, stats);
        a.out_sums = sums.data_ptr<T>();
      }
    }
    kernels::elu_linear_attention_forward_cpu(a);
    if (sums_scope) sums_scope->set(sums);
  });
  return {out, den, state};
}

std::tuple<Tensor, Tensor, Tensor> elu_linear_attention_backward_cpu_op(
    const Tensor& grad_out, const Tensor& q_in, const Tensor& k_in, const Tensor& v_in,
    const Tensor& out_in, const Tensor& den_in, const c10::optional<Tensor>& key_lengths,
    bool causal, double eps, const c10::optional<Tensor>& state_in) {
  check_inputs(q_in, k_in, v_in, key_lengths, causal, eps);
  ops::check_elu_linear_grad(kOp, grad_out, out_in, den_in, q_in, v_in);
  // The causal kernel has no use for a state: one given is checked, not read.
  const bool with_state = ops::check_elu_linear_state(kOp, state_in, q_in, v_in) && !causal;
  if (q_in.scalar_type() == torch::kHalf) {
    return ops::in_rows_layouts_of(
        ops::in_float32(q_in.scalar_type(), elu_linear_attention_backward_cpu_op, grad_out, q_in,
                        k_in, v_in, out_in, den_in, key_lengths, causal, eps, state_in),
        q_in, k_in, v_in);
  }
  const auto p = ops::qkv_inputs(q_in, k_in, v_in, key_lengths);
  const auto dtype = p.q.scalar_type();
  const auto go = ops::rows_contiguous(grad_out.to(dtype));
  const auto out = ops::rows_contiguous(out_in.to(dtype));
  const auto den = den_in.to(ops::stats_dtype(p.q)).contiguous();
  const auto state = with_state ? state_in->to(den.scalar_type()).contiguous() : Tensor();
  // Gradients in the row layouts of their inputs.
  auto gq = ops::empty_rows_like(q_in, q_in.size(3));
  auto gk = ops::empty_rows_like(k_in, k_in.size(3));
  auto gv = ops::empty_rows_like(v_in, v_in.size(3));
  ops::dispatch_cpu_kernel_type(dtype, [&](auto type) {
    using T = typename decltype(type)::type;
    kernels::EluLinearBackwardArgs<T> a;
    ops::fill_elu_linear_args<T>(a, kOp, p, causal, eps, chunk_rows(causal, /*backward=*/true));
    a.grad_out = ops::kernel_data<T>(go);
    a.out = ops::kernel_data<T>(out);
    a.den = den.data_ptr<kernels::KernelScalar<T>>();
    if (with_state) a.state = state.data_ptr<kernels::KernelScalar<T>>();
    ops::set_qkv_grads<T>(a, gq, gk, gv);
    a.grad_out_rows = ops::row_strides(go);
    a.out_rows = ops::row_strides(out);
    a.grad_q_rows = ops::row_strides(gq);
    a.grad_k_rows = ops::row_strides(gk);
    a.grad_v_rows = ops::row_strides(gv);
    kernels::elu_linear_attention_backward_cpu(a);
  });
  return {gq, gk, gv};
}

constexpr char kForwardOp[] = "fastattn::elu_linear_attention_forward";
constexpr char kBackwardOp[] = "fastattn::elu_linear_attention_backward";

struct EluLinearOp {
  struct Saved {
    Tensor q, k, v, out, den, state, key_lengths;
    bool causal = false;
    double eps = 0.0;
    auto tensors() { return std::tie(q, k, v, out, den, state, key_lengths); }
  };

  static Tensor forward(Saved* saved, const Tensor& q, const Tensor& k, const Tensor& v,
                        const c10::optional<Tensor>& key_lengths, bool causal, double eps) {
    auto [out, den, state] = ops::call_op<kForwardOp, elu_linear_attention_forward_cpu_op>(
        q, k, v, key_lengths, causal, eps);
    if (saved) *saved = {q, k, v, out, den, state, ops::or_undefined(key_lengths), causal, eps};
    return out;
  }

  static auto backward(const Saved& s, const variable_list& grads) {
    return ops::call_op<kBackwardOp, elu_linear_attention_backward_cpu_op>(
        grads[0], s.q, s.k, s.v, s.out, s.den, ops::opt(s.key_lengths), s.causal, s.eps, s.state);
  }
};

using EluLinearShell = ops::Shell<EluLinearOp>;

}  // namespace

namespace ops {

namespace {
thread_local EluLinearOutputSums* active_output_sums = nullptr;
}  // namespace

EluLinearOutputSums::EluLinearOutputSums() : outer_(active_output_sums) {
  active_output_sums = this;
}
EluLinearOutputSums::~EluLinearOutputSums() { active_output_sums = outer_; }
EluLinearOutputSums* EluLinearOutputSums::active() { return active_output_sums; }

}  // namespace ops

TORCH_LIBRARY_FRAGMENT(fastattn, m) {
  ops::impl_shell<EluLinearOp>(m, "elu_linear_attention", elu_linear_attention_forward_cpu_op,
                               elu_linear_attention_backward_cpu_op);
}

Tensor elu_linear_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                            const std::optional<Tensor>& key_lengths, bool causal, double eps) {
  ops::check_defined(kOp, {"q", "k", "v"}, {q, k, v});
  return ops::call_op<kOp, EluLinearShell::no_grad>(q, k, v, to_c10(key_lengths), causal, eps);
}

namespace reference {

Tensor elu_linear_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                            const std::optional<Tensor>& key_lengths, bool causal, double eps) {
  check_inputs(q, k, v, to_c10(key_lengths), causal, eps);
  const int64_t N = q.size(0), L = q.size(2), S = k.size(2);
  auto qf = reference::elu_feature_map(q), kf = reference::elu_feature_map(k);
  auto w = torch::matmul(qf, kf.transpose(-1, -2));  // (N, H, L, S)
  auto keep = ops::dense_keep(N, L, S, std::nullopt, key_lengths, causal, q.device());
  w = w.masked_fill(keep.logical_not(), 0.0);
  return torch::matmul(w, v) / (w.sum(-1, /*keepdim=*/true) + eps);
}

}  // namespace reference
}  // namespace fastattn
