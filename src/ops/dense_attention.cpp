// The dense-attention engine (src/ops/dense_attention.h): its CPU route on the
// block-sparse kernels' "window" pattern, packed sequences one by one, and the
// logsumexp merge.
#include "ops/dense_attention.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include <limits>
#include <string>

#include "ops/op_util.h"

namespace fastattn::ops {
namespace {

using torch::Tensor;

constexpr const char* kOp = "fastattn dense attention";

// The block-sparse "window" pattern's [left, right] for a spec (unbounded:
// the largest offset, which the kernels cut to what the positions need).
std::vector<int64_t> window_params(const DenseAttentionSpec& spec) {
  constexpr int64_t kUnbounded = std::numeric_limits<int64_t>::max();
  return {spec.window_left < 0 ? kUnbounded : spec.window_left,
          spec.window_right < 0 ? kUnbounded : spec.window_right};
}

void check_spec(const DenseAttentionSpec& spec) {
  TORCH_CHECK(std::isfinite(spec.scale), kOp, ": scale must be finite, got ", spec.scale);
  TORCH_CHECK(spec.window_left >= -1 && spec.window_right >= -1, kOp,
              ": window_left and window_right must be >= 0, or -1 for no bound, got ",
              spec.window_left, " and ", spec.window_right);
  TORCH_CHECK(spec.cu_seqlens_q.has_value() == spec.cu_seqlens_k.has_value(), kOp,
              ": cu_seqlens_q and cu_seqlens_k come together (the packed layout)");
  TORCH_CHECK(!spec.packed() || !spec.key_lengths, kOp,
              ": key_lengths apply to the padded layout; packed sequences have their lengths");
}

std::tuple<Tensor, Tensor> padded_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                          const DenseAttentionSpec& spec) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("fastattn::block_sparse_attention_forward", "")
                       .typed<std::tuple<Tensor, Tensor>(
                           const Tensor&, const Tensor&, const Tensor&, c10::string_view,
                           c10::IntArrayRef, const c10::optional<Tensor>&, bool, double)>();
  return op.call(q, k, v, "window", window_params(spec), spec.key_lengths, spec.causal, spec.scale);
}

std::tuple<Tensor, Tensor, Tensor> padded_backward(const Tensor& grad_out, const Tensor& q,
                                                   const Tensor& k, const Tensor& v,
                                                   const Tensor& out, const Tensor& lse,
                                                   const DenseAttentionSpec& spec) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("fastattn::block_sparse_attention_backward", "")
                       .typed<std::tuple<Tensor, Tensor, Tensor>(
                           const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                           const Tensor&, const Tensor&, c10::string_view, c10::IntArrayRef,
                           const c10::optional<Tensor>&, bool, double)>();
  return op.call(grad_out, q, k, v, out, lse, "window", window_params(spec), spec.key_lengths,
                 spec.causal, spec.scale);
}

// The packed layout's offsets on the host, checked against the row counts.
std::vector<int64_t> offsets(const Tensor& cu, const char* name, int64_t rows) {
  TORCH_CHECK(cu.dim() == 1 && cu.numel() >= 1 && !cu.is_floating_point(), kOp, ": ", name,
              " must be a 1-d integer tensor of B + 1 offsets, got ", cu.scalar_type(), " ",
              cu.sizes());
  auto c = cu.to(torch::kCPU, torch::kLong).contiguous();
  std::vector<int64_t> o(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
  TORCH_CHECK(o.front() == 0 && o.back() == rows, kOp, ": ", name,
              " must start at 0 and end at the number of rows (", rows, "), got ", o.front(),
              " ... ", o.back());
  for (size_t b = 1; b < o.size(); ++b)
    TORCH_CHECK(o[b] >= o[b - 1], kOp, ": ", name, " must not decrease, got ", o[b - 1], " then ",
                o[b], " at ", b);
  return o;
}

// Sequence b of a packed (T, H, D) tensor as a (1, H, rows, D) view.
Tensor sequence(const Tensor& x, int64_t begin, int64_t end) {
  return x.narrow(0, begin, end - begin).transpose(0, 1).unsqueeze(0);
}

struct Packed {
  std::vector<int64_t> cq, ck;
};

Packed check_packed(const Tensor& q, const Tensor& k, const Tensor& v,
                    const DenseAttentionSpec& spec) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, kOp,
              ": packed sequences take q (Tq, H, E), k (Tk, H, E), v (Tk, H, M), got q ", q.sizes(),
              ", k ", k.sizes(), ", v ", v.sizes());
  Packed p{offsets(*spec.cu_seqlens_q, "cu_seqlens_q", q.size(0)),
           offsets(*spec.cu_seqlens_k, "cu_seqlens_k", k.size(0))};
  TORCH_CHECK(p.cq.size() == p.ck.size(), kOp,
              ": cu_seqlens_q and cu_seqlens_k must hold as many sequences, got ", p.cq.size() - 1,
              " and ", p.ck.size() - 1);
  return p;
}

}  // namespace

std::tuple<Tensor, Tensor> dense_attention_forward(const Tensor& q, const Tensor& k,
                                                   const Tensor& v,
                                                   const DenseAttentionSpec& spec) {
  check_spec(spec);
  if (!spec.packed()) return padded_forward(q, k, v, spec);
  const auto p = check_packed(q, k, v, spec);
  const int64_t H = q.size(1);
  auto out = torch::empty({q.size(0), H, v.size(2)}, q.options());
  auto lse = torch::empty({H, q.size(0)}, q.options().dtype(stats_dtype(q)));
  for (size_t b = 0; b + 1 < p.cq.size(); ++b) {
    if (p.cq[b + 1] == p.cq[b]) continue;
    auto [o, l] =
        padded_forward(sequence(q, p.cq[b], p.cq[b + 1]), sequence(k, p.ck[b], p.ck[b + 1]),
                       sequence(v, p.ck[b], p.ck[b + 1]), spec);
    sequence(out, p.cq[b], p.cq[b + 1]).copy_(o);
    lse.narrow(1, p.cq[b], p.cq[b + 1] - p.cq[b]).copy_(l[0]);
  }
  return {out, lse};
}

std::tuple<Tensor, Tensor, Tensor> dense_attention_backward(const Tensor& grad_out, const Tensor& q,
                                                            const Tensor& k, const Tensor& v,
                                                            const Tensor& out, const Tensor& lse,
                                                            const DenseAttentionSpec& spec) {
  check_spec(spec);
  if (!spec.packed()) return padded_backward(grad_out, q, k, v, out, lse, spec);
  const auto p = check_packed(q, k, v, spec);
  TORCH_CHECK(grad_out.sizes() == out.sizes() && out.dim() == 3 && out.size(0) == q.size(0) &&
                  lse.dim() == 2 && lse.size(1) == q.size(0),
              kOp, ": packed grad_out and out must be (Tq, H, M) and lse (H, Tq), got grad_out ",
              grad_out.sizes(), ", out ", out.sizes(), ", lse ", lse.sizes());
  auto dq = torch::zeros_like(q), dk = torch::zeros_like(k), dv = torch::zeros_like(v);
  for (size_t b = 0; b + 1 < p.cq.size(); ++b) {
    if (p.cq[b + 1] == p.cq[b]) continue;  // no query: no gradient reaches its keys
    const int64_t q0 = p.cq[b], q1 = p.cq[b + 1], k0 = p.ck[b], k1 = p.ck[b + 1];
    auto [gq, gk, gv] = padded_backward(
        sequence(grad_out, q0, q1), sequence(q, q0, q1), sequence(k, k0, k1), sequence(v, k0, k1),
        sequence(out, q0, q1), lse.narrow(1, q0, q1 - q0).unsqueeze(0), spec);
    sequence(dq, q0, q1).copy_(gq);
    sequence(dk, k0, k1).copy_(gk);
    sequence(dv, k0, k1).copy_(gv);
  }
  return {dq, dk, dv};
}

std::tuple<Tensor, Tensor> merge_by_lse(const std::vector<Tensor>& outs,
                                        const std::vector<Tensor>& lses) {
  TORCH_CHECK(!outs.empty() && outs.size() == lses.size(), kOp,
              ": merge_by_lse takes one lse per output, got ", outs.size(), " outputs and ",
              lses.size(), " lses");
  auto lse = torch::stack(lses).logsumexp(0);  // all -inf: -inf
  // exp(lse_p - lse), 0 where lse is -inf (-inf - -inf would be NaN).
  const auto none = torch::isinf(lse) & lse.lt(0);
  Tensor out;
  for (size_t i = 0; i < outs.size(); ++i) {
    auto w = (lses[i] - lse).exp().masked_fill(none, 0.0);
    // lse (N, H, L) against out (N, H, L, M); packed: lse (H, T), out (T, H, M).
    w = outs[i].dim() == 3 ? w.t().unsqueeze(-1) : w.unsqueeze(-1);
    auto term = outs[i] * w.to(outs[i].scalar_type());
    out = out.defined() ? out + term : term;
  }
  return {out, lse};
}

}  // namespace fastattn::ops

namespace fastattn::reference {

namespace {

// (out, lse) of one padded batch in float64.
std::tuple<torch::Tensor, torch::Tensor> padded(const torch::Tensor& q, const torch::Tensor& k,
                                                const torch::Tensor& v,
                                                const ops::DenseAttentionSpec& spec) {
  const int64_t N = q.size(0), L = q.size(2), S = k.size(2);
  auto q64 = q.to(torch::kDouble), k64 = k.to(torch::kDouble), v64 = v.to(torch::kDouble);
  auto opts = torch::TensorOptions().dtype(torch::kLong);
  auto p = torch::arange(L, opts).view({L, 1}) + (S - L);
  auto j = torch::arange(S, opts).view({1, S});
  auto keep = torch::ones({L, S}, torch::kBool);
  if (spec.causal) keep = keep & (j <= p);
  if (spec.window_left >= 0) keep = keep & (j >= p - spec.window_left);
  if (spec.window_right >= 0) keep = keep & (j <= p + spec.window_right);
  auto keep4 = keep.view({1, 1, L, S}).expand({N, 1, L, S});
  if (spec.key_lengths)
    keep4 = keep4 & (j.view({1, 1, 1, S}) < spec.key_lengths->to(torch::kLong).view({N, 1, 1, 1}));
  auto s = torch::matmul(q64, k64.transpose(-1, -2)) * spec.scale;
  s = s.masked_fill(keep4.logical_not(), -std::numeric_limits<double>::infinity());
  auto lse = s.logsumexp(-1);  // -inf for a row without keys
  auto w = (s - lse.unsqueeze(-1)).exp().nan_to_num(0.0);
  return {torch::matmul(w, v64), lse};
}

}  // namespace

std::tuple<torch::Tensor, torch::Tensor> dense_attention(const torch::Tensor& q,
                                                         const torch::Tensor& k,
                                                         const torch::Tensor& v,
                                                         const ops::DenseAttentionSpec& spec) {
  if (!spec.packed()) return padded(q, k, v, spec);
  auto cq = spec.cu_seqlens_q->to(torch::kLong), ck = spec.cu_seqlens_k->to(torch::kLong);
  std::vector<torch::Tensor> outs, lses;
  for (int64_t b = 0; b + 1 < cq.numel(); ++b) {
    const int64_t q0 = cq[b].item<int64_t>(), q1 = cq[b + 1].item<int64_t>();
    const int64_t k0 = ck[b].item<int64_t>(), k1 = ck[b + 1].item<int64_t>();
    auto view = [](const torch::Tensor& x, int64_t a, int64_t e) {
      return x.narrow(0, a, e - a).transpose(0, 1).unsqueeze(0);
    };
    auto [o, l] = padded(view(q, q0, q1), view(k, k0, k1), view(v, k0, k1), spec);
    outs.push_back(o[0].transpose(0, 1));  // (Lb, H, M)
    lses.push_back(l[0]);                  // (H, Lb)
  }
  return {torch::cat(outs, 0), torch::cat(lses, 1)};
}

}  // namespace fastattn::reference
