// The block_sparse_attention operator (local attention and the Sparse
// Transformer patterns of Child et al. 2019): pattern checks, CPU
// implementations of the forward/backward kernels
// (src/kernels/block_sparse/), the autograd function, and the C++ entry point.
//   q (N,H,L,E), k (N,H,S,E), v (N,H,S,M) -> (N,H,L,M)
// Tested by tests/cpp/test_sparse_attention.cpp against
// reference::block_sparse_attention (a dense masked softmax).
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "fastattn/ops.h"
#include "kernels/block_sparse/block_sparse_attention.h"
#include "ops/block_sparse_pattern.h"
#include "ops/mask_util.h"
#include "ops/op_shell.h"
#include "ops/op_util.h"
#include "ops/row_dots.h"

namespace fastattn {

namespace ops {

int check_sparse_pattern(const char* op, const std::string& pattern,
                         const std::vector<int64_t>& params, int64_t H) {
  auto need = [&](size_t n, const char* names) {
    TORCH_CHECK(params.size() == n, op, ": pattern '", pattern, "' takes params ", names, " (", n,
                " integers), got ", params.size());
  };
  if (pattern == "local") {
    need(1, "[window]");
    TORCH_CHECK(params[0] >= 1, op, ": window must be >= 1, got ", params[0]);
    return kernels::kLocalPattern;
  }
  if (pattern == "window") {
    need(2, "[left, right]");
    TORCH_CHECK(params[0] >= 0 && params[1] >= 0, op,
                ": window offsets left and right must be >= 0, got [", params[0], ", ", params[1],
                "]");
    return kernels::kWindowPattern;
  }
  const bool fixed = pattern == "fixed";
  TORCH_CHECK(fixed || pattern == "strided", op,
              ": pattern must be one of local, strided, fixed, window, got '", pattern, "'");
  if (fixed)
    need(4, "[stride, summary, which, per_head_summary]");
  else
    need(2, "[stride, which]");
  TORCH_CHECK(params[0] >= 1, op, ": stride must be >= 1, got ", params[0]);
  const int64_t which = fixed ? params[2] : params[1];
  TORCH_CHECK(which >= 0 && which <= 3, op,
              ": which must be 0 (merged), 1 (A1), 2 (A2) or 3 (split heads), got ", which);
  TORCH_CHECK(which != 3 || H >= 2, op, ": mode split needs at least 2 heads, got ", H);
  if (fixed) {
    TORCH_CHECK(params[1] >= 1 && params[1] <= params[0], op,
                ": summary must be in [1, stride] = [1, ", params[0], "], got ", params[1]);
    TORCH_CHECK(params[3] == 0 || params[3] == 1, op, ": per_head_summary must be 0 or 1, got ",
                params[3]);
  }
  return fixed ? kernels::kFixedPattern : kernels::kStridedPattern;
}

int check_block_sparse_inputs(const char* op, const torch::Tensor& q, const torch::Tensor& k,
                              const torch::Tensor& v, const std::string& pattern,
                              const std::vector<int64_t>& params,
                              const c10::optional<torch::Tensor>& key_lengths) {
  check_qkv(op, q, k, v);
  check_masks(op, q, k.size(2), std::nullopt, to_std(key_lengths));
  return check_sparse_pattern(op, pattern, params, q.size(1));
}

void check_block_sparse_backward(const char* op, const torch::Tensor& grad_out,
                                 const torch::Tensor& out, const torch::Tensor& lse) {
  TORCH_CHECK(grad_out.sizes() == out.sizes(), op, ": grad_out must have shape ", out.sizes(),
              ", got ", grad_out.sizes());
  TORCH_CHECK(lse.sizes() == out.sizes().slice(0, 3), op,
              ": lse must have shape (N, H, L) = ", out.sizes().slice(0, 3), ", got ", lse.sizes());
}

}  // namespace ops

namespace {

using torch::Tensor;
using torch::autograd::variable_list;

constexpr char kOp[] = "fastattn::block_sparse_attention";

struct Prepared {
  ops::QKVInputs in;
  std::vector<kernels::SparsePart> parts;
};

Prepared prepare(const Tensor& q, const Tensor& k, const Tensor& v, const std::string& pattern,
                 c10::IntArrayRef params, const c10::optional<Tensor>& key_lengths, bool causal) {
  const std::vector<int64_t> pv(params.begin(), params.end());
  const int kind = ops::check_block_sparse_inputs(kOp, q, k, v, pattern, pv, key_lengths);
  return {ops::qkv_inputs(q, k, v, key_lengths),
          kernels::make_sparse_parts(kind, pv, causal, q.size(1))};
}

template <typename T>
void fill_params(kernels::BlockSparseParams<T>& a, const Prepared& p, double temp, double dropout_p,
                 int64_t dropout_seed) {
  ops::set_qkv_args(a, kOp, p.in);
  a.scale = static_cast<T>(temp);
  a.parts = p.parts.data();
  a.num_parts = static_cast<int>(p.parts.size());
  ops::set_dropout_args(a, dropout_p, dropout_seed);
}

std::tuple<Tensor, Tensor> block_sparse_attention_forward_cpu_op(
    const Tensor& q, const Tensor& k, const Tensor& v, c10::string_view pattern,
    c10::IntArrayRef params, const c10::optional<Tensor>& key_lengths, bool causal,
    double softmax_temp, double dropout_p, int64_t dropout_seed) {
  const auto p = prepare(q, k, v, std::string(pattern), params, key_lengths, causal);
  ops::check_dropout(kOp, dropout_p);
  if (ops::is_reduced_float(q)) {
    auto [out, lse] =
        ops::in_float32<1>(q.scalar_type(), block_sparse_attention_forward_cpu_op, q, k, v, pattern,
                           params, key_lengths, causal, softmax_temp, dropout_p, dropout_seed);
    return {ops::in_rows_layout_of(out, q), lse};
  }
  // out in q's row layout: the layers' transpose back to (N, L, H, M) is a view.
  auto out = ops::empty_rows_like(q, v.size(3));
  auto lse = torch::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "block_sparse_attention_forward_cpu", [&] {
    kernels::BlockSparseForwardArgs<scalar_t> a;
    fill_params<scalar_t>(a, p, softmax_temp, dropout_p, dropout_seed);
    a.out = out.data_ptr<scalar_t>();
    a.out_rows = ops::row_strides(out);
    a.lse = lse.data_ptr<scalar_t>();
    kernels::block_sparse_attention_forward_cpu(a);
  });
  return {out, lse};
}

std::tuple<Tensor, Tensor, Tensor> block_sparse_attention_backward_cpu_op(
    const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
    const Tensor& lse, c10::string_view pattern, c10::IntArrayRef params,
    const c10::optional<Tensor>& key_lengths, bool causal, double softmax_temp, double dropout_p,
    int64_t dropout_seed) {
  const auto p = prepare(q, k, v, std::string(pattern), params, key_lengths, causal);
  ops::check_block_sparse_backward(kOp, grad_out, out, lse);
  ops::check_dropout(kOp, dropout_p);
  if (ops::is_reduced_float(q)) {
    return ops::in_rows_layouts_of(
        ops::in_float32(q.scalar_type(), block_sparse_attention_backward_cpu_op, grad_out, q, k, v,
                        out, lse, pattern, params, key_lengths, causal, softmax_temp, dropout_p,
                        dropout_seed),
        q, k, v);
  }
  auto go = ops::rows_contiguous(grad_out.to(q.scalar_type()));
  auto delta = ops::row_dots(go, out.to(go.scalar_type()));  // (N, H, L)
  auto lse_c = lse.contiguous();
  // Gradients in the inputs' row layouts (as the fake implementation promises).
  auto gq = ops::empty_rows_like(q, q.size(3)), gk = ops::empty_rows_like(k, k.size(3)),
       gv = ops::empty_rows_like(v, v.size(3));
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "block_sparse_attention_backward_cpu", [&] {
    kernels::BlockSparseBackwardArgs<scalar_t> a;
    fill_params<scalar_t>(a, p, softmax_temp, dropout_p, dropout_seed);
    a.grad_out = go.data_ptr<scalar_t>();
    a.lse = lse_c.data_ptr<scalar_t>();
    a.delta = delta.data_ptr<scalar_t>();
    ops::set_qkv_grads<scalar_t>(a, gq, gk, gv);
    ops::set_grad_rows(a, go, gq, gk, gv);
    kernels::block_sparse_attention_backward_cpu(a);
  });
  return {gq, gk, gv};
}

constexpr char kForwardOp[] = "fastattn::block_sparse_attention_forward";
constexpr char kBackwardOp[] = "fastattn::block_sparse_attention_backward";

struct BlockSparseOp {
  struct Saved {
    Tensor q, k, v, out, lse, key_lengths;
    std::string pattern;
    std::vector<int64_t> params;
    bool causal = false;
    double temp = 0.0, dropout_p = 0.0;
    int64_t dropout_seed = 0;
    auto tensors() { return std::tie(q, k, v, out, lse, key_lengths); }
  };

  static Tensor forward(Saved* saved, const Tensor& q, const Tensor& k, const Tensor& v,
                        c10::string_view pattern, c10::IntArrayRef params,
                        const c10::optional<Tensor>& key_lengths, bool causal,
                        c10::optional<double> softmax_temp, double dropout_p,
                        c10::optional<int64_t> dropout_seed) {
    ops::check_qkv(kOp, q, k, v);
    ops::check_dropout(kOp, dropout_p);
    const double temp = ops::resolve_softmax_temp(kOp, q, softmax_temp);
    // One seed for the forward and the backward: the same keep mask.
    const int64_t seed = ops::resolve_dropout_seed(dropout_p, dropout_seed);
    auto [out, lse] = ops::call_op<kForwardOp, block_sparse_attention_forward_cpu_op>(
        q, k, v, pattern, params, key_lengths, causal, temp, dropout_p, seed);
    if (saved)
      *saved = {q,
                k,
                v,
                out,
                lse,
                ops::or_undefined(key_lengths),
                std::string(pattern),
                params.vec(),
                causal,
                temp,
                dropout_p,
                seed};
    return out;
  }

  static auto backward(const Saved& s, const variable_list& grads) {
    return ops::call_op<kBackwardOp, block_sparse_attention_backward_cpu_op>(
        grads[0], s.q, s.k, s.v, s.out, s.lse, s.pattern, s.params, ops::opt(s.key_lengths),
        s.causal, s.temp, s.dropout_p, s.dropout_seed);
  }
};

using BlockSparseShell = ops::Shell<BlockSparseOp>;

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastattn, m) {
  ops::impl_shell<BlockSparseOp>(m, "block_sparse_attention", block_sparse_attention_forward_cpu_op,
                                 block_sparse_attention_backward_cpu_op);
}

Tensor block_sparse_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                              const std::string& pattern, const std::vector<int64_t>& params,
                              const std::optional<Tensor>& key_lengths, bool causal,
                              std::optional<double> softmax_temp, double dropout_p,
                              std::optional<int64_t> dropout_seed) {
  ops::check_defined(kOp, {"q", "k", "v"}, {q, k, v});
  return ops::call_op<kOp, BlockSparseShell::no_grad>(q, k, v, pattern, params, to_c10(key_lengths),
                                                      causal, to_c10(softmax_temp), dropout_p,
                                                      to_c10(dropout_seed));
}

}  // namespace fastattn
