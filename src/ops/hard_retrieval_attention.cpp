// The hard_retrieval_attention operator (Xu et al., "Learning Hard Retrieval
// Decoder Attention for Transformers"): input checks, CPU implementations of
// the forward/backward kernels (src/kernels/hard_retrieval/), the autograd
// function, the C++ entry point and the plain-ATen reference.
//   q (N,H,L,E), k (N,H,S,E), v (N,H,S,M) -> out (N,H,L,M), index (N,H,L) int64
//
// Backward (straight-through, the paper's eqs. 8-10). The forward is
// out = A V with A one-hot (row i has its 1 at index_i), A regarded as the
// softmax P = softmax(temp·Q K^T + mask) plus noise. So
//   dV     = A^T dout                      (an index-add of dout rows)
//   dP     = dA = dout V^T                 (g_P[i,j] = dout_i·v_j)
//   dS     = P ∘ (dP - delta) · temp,      delta_i = sum_j P_ij g_P[i,j] = dout_i·(P V)_i
//   dQ     = dS K,  dK = dS^T Q.
// dQ and dK are therefore exactly the gradients soft attention P V would get
// for the same dout: after a delta pass (kernels/hard_retrieval) the fused
// full-attention backward kernel computes them from the saved log-sum-exp
// (its dV = P^T dout is discarded; dV comes from the index-add). Nothing
// L×S is materialised. In argmax mode the same rule applies (P is the softmax
// the argmax sharpens); the forward then computes the lse only when q or k
// need a gradient.
// Tested by tests/cpp/test_hard_retrieval.cpp.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cmath>
#include <limits>

#include "fastattn/ops.h"
#include "kernels/full/full_attention.h"
#include "kernels/hard_retrieval/hard_retrieval.h"
#include "ops/hard_retrieval_args.h"
#include "ops/mask_util.h"
#include "ops/op_shell.h"
#include "ops/op_util.h"

namespace fastattn {
namespace ops {

void check_hard_retrieval_inputs(const char* op, const torch::Tensor& q, const torch::Tensor& k,
                                 const torch::Tensor& v,
                                 const c10::optional<torch::Tensor>& attn_mask,
                                 const c10::optional<torch::Tensor>& key_lengths) {
  check_qkv(op, q, k, v);
  TORCH_CHECK(!attn_mask || attn_mask->scalar_type() == torch::kBool, op,
              ": attn_mask must be a bool keep mask (true = keep); additive (floating) masks "
              "are not supported by hard retrieval, got ",
              attn_mask->scalar_type());
  check_masks(op, q, k.size(2), to_std(attn_mask), to_std(key_lengths));
}

void check_hard_retrieval_backward(const char* op, const torch::Tensor& grad_out,
                                   const torch::Tensor& q, const torch::Tensor& k,
                                   const torch::Tensor& v, const torch::Tensor& index,
                                   const torch::Tensor& lse, const torch::Tensor& soft_out) {
  const auto lse_dtype = stats_dtype(q);
  const int64_t N = q.size(0), H = q.size(1), L = q.size(2), S = k.size(2), M = v.size(3);
  TORCH_CHECK(grad_out.dim() == 4 && grad_out.size(0) == N && grad_out.size(1) == H &&
                  grad_out.size(2) == L && grad_out.size(3) == M,
              op, ": grad_out must have shape (N, H, L, M) = (", N, ", ", H, ", ", L, ", ", M,
              "), got ", grad_out.sizes());
  TORCH_CHECK(index.dim() == 3 && index.size(0) == N && index.size(1) == H && index.size(2) == L &&
                  index.scalar_type() == torch::kLong,
              op, ": index must be int64 of shape (N, H, L) = (", N, ", ", H, ", ", L, "), got ",
              index.scalar_type(), " ", index.sizes());
  TORCH_CHECK(lse.dim() == 3 && lse.sizes() == index.sizes() && lse.scalar_type() == lse_dtype, op,
              ": lse must be ", lse_dtype, " of shape (N, H, L) = (", N, ", ", H, ", ", L,
              "), got ", lse.scalar_type(), " ", lse.sizes());
  TORCH_CHECK(
      soft_out.numel() == 0 || (soft_out.dim() == 4 && soft_out.sizes() == grad_out.sizes() &&
                                soft_out.scalar_type() == lse_dtype),
      op, ": soft_out must be empty or ", lse_dtype, " of shape (N, H, L, M) = (", N, ", ", H, ", ",
      L, ", ", M, "), got ", soft_out.scalar_type(), " ", soft_out.sizes());
  if (index.numel() > 0 && check_values()) {
    TORCH_CHECK(index.min().item<int64_t>() >= -1 && index.max().item<int64_t>() < S, op,
                ": index must be in [-1, S) = [-1, ", S, ")");
  }
}

}  // namespace ops

namespace {

using torch::Tensor;
using torch::autograd::variable_list;

constexpr char kOp[] = "fastattn::hard_retrieval_attention";

void check_inputs(const Tensor& q, const Tensor& k, const Tensor& v,
                  const c10::optional<Tensor>& attn_mask,
                  const c10::optional<Tensor>& key_lengths) {
  ops::check_hard_retrieval_inputs(kOp, q, k, v, attn_mask, key_lengths);
}

// (out, index, lse, soft_out); lse is empty (numel 0) unless sample or
// need_lse, soft_out (the softmax output P V, for the backward's delta)
// unless need_lse.
std::tuple<Tensor, Tensor, Tensor, Tensor> hard_retrieval_attention_forward_cpu_op(
    const Tensor& q, const Tensor& k, const Tensor& v, const c10::optional<Tensor>& attn_mask,
    const c10::optional<Tensor>& key_lengths, bool causal, bool sample, double softmax_temp,
    int64_t seed, bool need_lse) {
  check_inputs(q, k, v, attn_mask, key_lengths);
  ops::resolve_softmax_temp(kOp, q, softmax_temp);
  if (ops::is_reduced_float(q)) {
    auto [out, index, lse, soft_out] =
        ops::in_float32<2, 3>(q.scalar_type(), hard_retrieval_attention_forward_cpu_op, q, k, v,
                              attn_mask, key_lengths, causal, sample, softmax_temp, seed, need_lse);
    return {ops::in_rows_layout_of(out, q), index, lse, soft_out};
  }
  const auto p = ops::prepare_hard_retrieval(q, k, v, attn_mask, key_lengths);
  const int64_t N = q.size(0), H = q.size(1), L = q.size(2);
  // out in q's row layout: the layers' transpose back to (N, L, H, M) is a view.
  auto out = ops::empty_rows_like(q, v.size(3));
  auto index = torch::empty({N, H, L}, q.options().dtype(torch::kLong));
  const bool with_lse = sample || need_lse;
  auto lse = with_lse ? torch::empty({N, H, L}, q.options()) : torch::empty({0}, q.options());
  auto soft_out =
      need_lse ? torch::empty({N, H, L, v.size(3)}, q.options()) : torch::empty({0}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "hard_retrieval_attention_forward_cpu_op", [&] {
    kernels::HardRetrievalForwardArgs<scalar_t> a;
    ops::fill_hard_retrieval_args(a, kOp, p, causal, softmax_temp);
    a.sample = sample;
    a.seed = static_cast<uint64_t>(seed);
    a.out = out.data_ptr<scalar_t>();
    a.out_rows = ops::row_strides(out);
    a.index = index.data_ptr<int64_t>();
    a.lse = with_lse ? lse.data_ptr<scalar_t>() : nullptr;
    a.soft_out = need_lse ? soft_out.data_ptr<scalar_t>() : nullptr;
    kernels::hard_retrieval_forward_cpu(a);
  });
  return {out, index, lse, soft_out};
}

std::tuple<Tensor, Tensor, Tensor> hard_retrieval_attention_backward_cpu_op(
    const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& index,
    const Tensor& lse, const Tensor& soft_out, const c10::optional<Tensor>& attn_mask,
    const c10::optional<Tensor>& key_lengths, bool causal, double softmax_temp) {
  check_inputs(q, k, v, attn_mask, key_lengths);
  ops::check_hard_retrieval_backward(kOp, grad_out, q, k, v, index, lse, soft_out);
  if (ops::is_reduced_float(q)) {
    return ops::in_rows_layouts_of(
        ops::in_float32(q.scalar_type(), hard_retrieval_attention_backward_cpu_op, grad_out, q, k,
                        v, index, lse, soft_out, attn_mask, key_lengths, causal, softmax_temp),
        q, k, v);
  }
  const int64_t N = q.size(0), H = q.size(1), L = q.size(2), S = k.size(2), M = v.size(3);
  const auto p = ops::prepare_hard_retrieval(q, k, v, attn_mask, key_lengths);
  auto go = ops::rows_contiguous(grad_out.to(q.scalar_type()));
  auto idx = index.contiguous();
  auto lse_c = lse.contiguous();
  // delta_i = dout_i·(P V)_i: from the forward's soft output, else a pass of its own.
  const bool have_soft = soft_out.numel() > 0;
  auto delta = have_soft ? (go * soft_out.to(q.scalar_type())).sum(-1).contiguous()
                         : torch::empty({N, H, L}, q.options());
  // Gradients in the inputs' row layouts (as the fake implementation promises).
  auto gq = ops::empty_rows_like(q, q.size(3)), gk = ops::empty_rows_like(k, k.size(3)),
       gv = ops::empty_rows_like(v, v.size(3));
  // The full-attention kernel takes an additive mask: 0 keeps, -inf drops.
  Tensor additive;
  if (attn_mask) {
    additive = ops::broadcast_mask(ops::additive_mask(*attn_mask, q.scalar_type()).contiguous(), N,
                                   H, L, S);
  }
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "hard_retrieval_attention_backward_cpu_op", [&] {
    using T = scalar_t;
    kernels::HardRetrievalDeltaArgs<T> d;
    ops::fill_hard_retrieval_args(d, kOp, p, causal, softmax_temp);
    d.lse = lse_c.data_ptr<T>();
    d.grad_out = go.data_ptr<T>();
    d.grad_out_rows = ops::row_strides(go);
    d.delta = delta.data_ptr<T>();
    if (!have_soft) kernels::hard_retrieval_delta_cpu(d);

    kernels::FullAttentionBackwardArgs<T> f;
    static_cast<kernels::QKVParams<T>&>(f) = d;  // the operands and sizes
    if (additive.defined()) {
      f.mask = additive.data_ptr<T>();
      f.mask_sn = additive.stride(0);
      f.mask_sh = additive.stride(1);
      f.mask_sl = additive.stride(2);
    }
    f.causal = causal;
    f.scale = d.scale;
    f.grad_out = d.grad_out;
    f.grad_out_rows = d.grad_out_rows;
    f.lse = d.lse;
    f.delta = d.delta;
    f.grad_q = gq.data_ptr<T>();
    f.grad_k = gk.data_ptr<T>();
    f.grad_v = nullptr;  // V's gradient is the straight-through one below
    f.grad_q_rows = ops::row_strides(gq);
    f.grad_k_rows = ops::row_strides(gk);
    kernels::full_attention_backward_cpu(f);

    kernels::HardRetrievalGradVArgs<T> g;
    g.grad_out = go.data_ptr<T>();
    g.index = idx.data_ptr<int64_t>();
    g.grad_v = gv.data_ptr<T>();
    g.grad_out_rows = d.grad_out_rows;
    g.grad_v_rows = ops::row_strides(gv);
    g.H = H;
    g.NH = N * H;
    g.L = L;
    g.S = S;
    g.M = M;
    g.num_threads = d.num_threads;
    kernels::hard_retrieval_grad_v_cpu(g);
  });
  return {gq, gk, gv};
}

constexpr char kForwardOp[] = "fastattn::hard_retrieval_attention_forward";
constexpr char kBackwardOp[] = "fastattn::hard_retrieval_attention_backward";

// (out, index of the retrieved key): gradients to q and k through the
// training softmax (its lse and soft output saved only when q or k needs
// one), to v through the retrieved rows.
struct HardRetrievalOp {
  struct Saved {
    Tensor q, k, v, index, lse, soft_out, attn_mask, key_lengths;
    bool causal = false, qk_grad = false;
    double temp = 0.0;
    auto tensors() { return std::tie(q, k, v, index, lse, soft_out, attn_mask, key_lengths); }
  };

  static std::tuple<Tensor, Tensor> forward(Saved* saved, const Tensor& q, const Tensor& k,
                                            const Tensor& v, const c10::optional<Tensor>& attn_mask,
                                            const c10::optional<Tensor>& key_lengths, bool causal,
                                            bool sample, c10::optional<double> softmax_temp,
                                            int64_t seed) {
    ops::check_qkv(kOp, q, k, v);
    const bool need_lse = saved && (q.requires_grad() || k.requires_grad());
    const double temp = ops::resolve_softmax_temp(kOp, q, softmax_temp);
    auto [out, index, lse, soft_out] =
        ops::call_op<kForwardOp, hard_retrieval_attention_forward_cpu_op>(
            q, k, v, attn_mask, key_lengths, causal, sample, temp, seed, need_lse);
    if (saved)
      *saved = {q,
                k,
                v,
                index,
                lse,
                soft_out,
                ops::or_undefined(attn_mask),
                ops::or_undefined(key_lengths),
                causal,
                need_lse,
                temp};
    return {out, index};
  }

  static variable_list backward(const Saved& s, const variable_list& grads) {
    if (!grads[0].defined()) return {};
    if (!s.qk_grad) {
      // Only v needed a gradient: the index-add alone (no softmax backward).
      auto go = grads[0].to(s.v.scalar_type());
      auto src = go * (s.index >= 0).unsqueeze(-1).to(go.scalar_type());
      auto gv = torch::zeros_like(s.v).scatter_add_(
          2, s.index.clamp_min(0).unsqueeze(-1).expand_as(go), src);
      return {Tensor(), Tensor(), gv};
    }
    auto [gq, gk, gv] = ops::call_op<kBackwardOp, hard_retrieval_attention_backward_cpu_op>(
        grads[0], s.q, s.k, s.v, s.index, s.lse, s.soft_out, ops::opt(s.attn_mask),
        ops::opt(s.key_lengths), s.causal, s.temp);
    return {gq, gk, gv};
  }
};

using HardRetrievalShell = ops::Shell<HardRetrievalOp>;

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastattn, m) {
  ops::impl_shell<HardRetrievalOp>(m, "hard_retrieval_attention",
                                   hard_retrieval_attention_forward_cpu_op,
                                   hard_retrieval_attention_backward_cpu_op);
}

std::tuple<Tensor, Tensor> hard_retrieval_attention(
    const Tensor& q, const Tensor& k, const Tensor& v, const std::optional<Tensor>& attn_mask,
    const std::optional<Tensor>& key_lengths, bool causal, bool sample,
    std::optional<double> softmax_temp, int64_t seed) {
  ops::check_defined(kOp, {"q", "k", "v"}, {q, k, v});
  return ops::call_op<kOp, HardRetrievalShell::no_grad>(
      q, k, v, to_c10(attn_mask), to_c10(key_lengths), causal, sample, to_c10(softmax_temp), seed);
}

// ---- reference ----------------------------------------------------------------

namespace reference {

std::tuple<Tensor, Tensor> hard_retrieval_attention(const Tensor& q, const Tensor& k,
                                                    const Tensor& v,
                                                    const std::optional<Tensor>& attn_mask,
                                                    const std::optional<Tensor>& key_lengths,
                                                    bool causal, std::optional<double> softmax_temp,
                                                    const std::optional<Tensor>& index) {
  const int64_t N = q.size(0), L = q.size(2), S = k.size(2), E = q.size(3);
  const double temp = softmax_temp.value_or(1.0 / std::sqrt(static_cast<double>(E)));
  const double inf = std::numeric_limits<double>::infinity();
  auto keep = ops::dense_keep(N, L, S, attn_mask, key_lengths, causal, q.device());  // (N,1|H,L,S)
  auto raw = torch::matmul(q, k.transpose(-1, -2));                                  // (N,H,L,S)
  auto dead = keep.any(-1).logical_not();                                            // (N,1|H,L)
  Tensor idx;
  if (index) {
    idx = *index;
  } else {
    torch::NoGradGuard no_grad;
    // torch::argmax returns the first maximal index: ties go to the lowest j.
    idx = raw.masked_fill(keep.logical_not(), -inf).argmax(-1).masked_fill(dead, -1);
  }
  auto scores = (raw * temp).masked_fill(keep.logical_not(), -inf);
  scores = scores.masked_fill(dead.unsqueeze(-1), 0.0);  // finite rows: softmax stays NaN-free
  auto probs = torch::softmax(scores, -1).masked_fill(dead.unsqueeze(-1), 0.0);
  auto hard = torch::one_hot(idx.clamp_min(0), S).to(q.scalar_type()) *
              (idx >= 0).unsqueeze(-1).to(q.scalar_type());
  // Straight-through: forward is the one-hot, backward sees P.
  auto a = probs + (hard - probs).detach();
  return {torch::matmul(a, v), idx};
}

}  // namespace reference
}  // namespace fastattn
