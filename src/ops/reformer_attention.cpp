// The Reformer LSH operators (Kitaev et al. 2020):
//   lsh_hash(x (N,H,L,E), rotations (R,E,B2)) -> buckets (N,H,R,L) int64
//   reformer_attention(q (N,H,L,E), v (N,H,L,M), buckets (N,H,R,L), key_lengths?,
//                      chunk_size, causal, mask_self, softmax_temp?, dropout_p,
//                      dropout_seed?) -> (N,H,L,M)
// Input checks, CPU implementations over src/kernels/reformer/, the autograd
// function (gradients to q, through both its query and its normalised-key
// role, and to v; the buckets are integer), the C++ entry points, and the
// plain-ATen references used as test oracles.
// Cost: hashing N·H·L·R·E·B2; attention O(N·H·R·L·2·chunk·(E + M)), memory
// O(N·H·L·(E + M + R)), never L x L.
// Tested by tests/cpp/test_reformer_attention.cpp.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cmath>
#include <limits>

#include "fastattn/ops.h"
#include "kernels/reformer/reformer.h"
#include "ops/mask_util.h"
#include "ops/op_shell.h"
#include "ops/op_util.h"
#include "ops/row_dots.h"
#include "ops/reformer_attention_internal.h"

namespace fastattn {
namespace ops::reformer {

using torch::Tensor;

void check_hash_inputs(const Tensor& x, const Tensor& rotations) {
  TORCH_CHECK(x.defined() && rotations.defined(), kHashOp,
              ": x and rotations must be defined tensors");
  TORCH_CHECK(x.dim() == 4, kHashOp, ": x must have shape (N, H, L, E), got ", x.dim(),
              " dimensions ", x.sizes());
  check_float_dtype(kHashOp, "x", x);  // op_util.h: the dtypes of each device
  TORCH_CHECK(rotations.dim() == 3 && rotations.size(1) == x.size(3), kHashOp,
              ": rotations must have shape (R, E, n_buckets / 2) with E = ", x.size(3), ", got ",
              rotations.sizes());
  TORCH_CHECK(rotations.size(0) >= 1, kHashOp, ": rotations must hold >= 1 round, got ",
              rotations.sizes());
  TORCH_CHECK(2 * rotations.size(2) <= kMaxBuckets, kHashOp, ": at most ", kMaxBuckets,
              " buckets (rotations.size(2) <= ", kMaxBuckets / 2, "), got ", rotations.size(2));
  TORCH_CHECK(rotations.scalar_type() == x.scalar_type(), kHashOp, ": rotations must be ",
              x.scalar_type(), " like x, got ", rotations.scalar_type());
  TORCH_CHECK(rotations.device() == x.device(), kHashOp, ": rotations must be on ", x.device(),
              " like x, got ", rotations.device());
}

int64_t check_inputs(const Tensor& q, const Tensor& v, const Tensor& buckets,
                     const c10::optional<Tensor>& key_lengths, int64_t chunk_size) {
  TORCH_CHECK(q.defined() && v.defined() && buckets.defined(), kOp,
              ": q, v and buckets must be defined tensors");
  TORCH_CHECK(q.dim() == 4, kOp, ": q must have shape (N, H, L, E), got ", q.dim(), " dimensions ",
              q.sizes());
  TORCH_CHECK(q.size(3) >= 1, kOp, ": q's head dimension E must be >= 1, got ", q.size(3));
  check_float_dtype(kOp, "q", q);  // op_util.h: the dtypes of each device
  const int64_t N = q.size(0), H = q.size(1), L = q.size(2);
  TORCH_CHECK(v.dim() == 4 && v.size(0) == N && v.size(1) == H && v.size(2) == L, kOp,
              ": v must have shape (N, H, L, M) = (", N, ", ", H, ", ", L,
              ", M) (shared-QK attention: one length for queries, keys and values), got ",
              v.sizes());
  TORCH_CHECK(v.scalar_type() == q.scalar_type(), kOp, ": v must be ", q.scalar_type(),
              " like q, got ", v.scalar_type());
  TORCH_CHECK(v.device() == q.device() && buckets.device() == q.device(), kOp,
              ": q, v and buckets must be on one device, got ", q.device(), ", ", v.device(), ", ",
              buckets.device());
  TORCH_CHECK(buckets.dim() == 4 && buckets.size(0) == N && buckets.size(1) == H &&
                  buckets.size(2) >= 1 && buckets.size(3) == L,
              kOp, ": buckets must have shape (N, H, R, L) = (", N, ", ", H, ", R >= 1, ", L,
              "), got ", buckets.sizes());
  TORCH_CHECK(buckets.scalar_type() == torch::kLong, kOp, ": buckets must be int64, got ",
              buckets.scalar_type());
  TORCH_CHECK(chunk_size >= 1, kOp, ": chunk_size must be >= 1, got ", chunk_size);
  check_masks(kOp, q, L, std::nullopt, to_std(key_lengths));
  if (buckets.numel() == 0) return 1;
  const int64_t lo = buckets.min().item<int64_t>(), hi = buckets.max().item<int64_t>();
  TORCH_CHECK(lo >= 0 && hi < kMaxBuckets, kOp, ": buckets must be in [0, ", kMaxBuckets,
              "), got values in [", lo, ", ", hi, "]");
  return hi + 1;
}

void check_backward_inputs(const Tensor& grad_out, const Tensor& q, const Tensor& v,
                           const Tensor& out, const Tensor& stats) {
  const std::vector<int64_t> out_shape{q.size(0), q.size(1), q.size(2), v.size(3)};
  TORCH_CHECK(grad_out.sizes() == out_shape && out.sizes() == out_shape, kOp,
              ": grad_out and out must have shape ", c10::IntArrayRef(out_shape), ", got ",
              grad_out.sizes(), " and ", out.sizes());
  TORCH_CHECK(stats.dim() == 4 && stats.size(0) == q.size(0) && stats.size(1) == q.size(1) &&
                  stats.size(2) == q.size(2) && stats.size(3) == 2,
              kOp, ": stats must have shape (N, H, L, 2), got ", stats.sizes());
}

}  // namespace ops::reformer

namespace {

using torch::Tensor;
using torch::autograd::variable_list;
using namespace ops::reformer;

Tensor lsh_hash_cpu_op(const Tensor& x, const Tensor& rotations) {
  check_hash_inputs(x, rotations);
  if (ops::is_reduced_float(x))
    return ops::in_float32(x.scalar_type(), lsh_hash_cpu_op, x, rotations);
  auto xc = ops::rows_contiguous(x);  // rows read in place
  auto rc = rotations.contiguous();
  const int64_t R = rotations.size(0);
  auto buckets =
      torch::empty({x.size(0), x.size(1), R, x.size(2)}, x.options().dtype(torch::kLong));
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "lsh_hash_cpu_op", [&] {
    kernels::LshHashArgs<scalar_t> a;
    fill_lsh_hash_args(a, xc, rc, buckets);
    kernels::lsh_hash_cpu(a);
  });
  return buckets;
}

struct Prepared {
  Tensor q, v, buckets, lengths;
  int64_t n_buckets = 1;
};

Prepared prepare(const Tensor& q, const Tensor& v, const Tensor& buckets,
                 const c10::optional<Tensor>& key_lengths, int64_t chunk_size) {
  // Rows read in place (the layers' (N, L, H, E) views): the kernels take row strides.
  Prepared p{ops::rows_contiguous(q), ops::rows_contiguous(v), buckets.contiguous(), {}, 1};
  p.n_buckets = check_inputs(q, v, buckets, key_lengths, chunk_size);
  if (key_lengths) p.lengths = key_lengths->to(torch::kLong).contiguous();
  return p;
}

template <typename T>
void fill_params(kernels::ReformerParams<T>& a, const Prepared& p, int64_t chunk_size, bool causal,
                 bool mask_self, double temp, double dropout_p, int64_t dropout_seed) {
  fill_reformer_args(a, p.q, p.v, p.lengths, p.buckets.size(2), chunk_size, causal, mask_self,
                     temp);
  a.buckets = p.buckets.data_ptr<int64_t>();
  a.n_buckets = p.n_buckets;
  ops::set_dropout_args(a, dropout_p, dropout_seed);
}

std::tuple<Tensor, Tensor> reformer_attention_forward_cpu_op(
    const Tensor& q, const Tensor& v, const Tensor& buckets,
    const c10::optional<Tensor>& key_lengths, int64_t chunk_size, bool causal, bool mask_self,
    double softmax_temp, double dropout_p, int64_t dropout_seed) {
  const auto p = prepare(q, v, buckets, key_lengths, chunk_size);  // checks the arguments
  ops::check_dropout(kOp, dropout_p);
  if (ops::is_reduced_float(q)) {
    auto [out, stats] = ops::in_float32(q.scalar_type(), reformer_attention_forward_cpu_op, q, v,
                                        buckets, key_lengths, chunk_size, causal, mask_self,
                                        softmax_temp, dropout_p, dropout_seed);
    return {ops::in_rows_layout_of(out, q), stats};
  }
  // out in q's row layout: the layers' transpose back to (N, L, H, M) is a view.
  auto out = ops::empty_rows_like(q, v.size(3));
  auto stats =
      torch::empty({q.size(0), q.size(1), q.size(2), 2}, q.options().dtype(torch::kDouble));
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "reformer_attention_forward_cpu_op", [&] {
    kernels::ReformerForwardArgs<scalar_t> a;
    fill_params<scalar_t>(a, p, chunk_size, causal, mask_self, softmax_temp, dropout_p,
                          dropout_seed);
    a.out = out.data_ptr<scalar_t>();
    a.out_rows = ops::row_strides(out);
    a.stats = stats.data_ptr<double>();
    kernels::reformer_forward_cpu(a);
  });
  return {out, stats};
}

std::tuple<Tensor, Tensor> reformer_attention_backward_cpu_op(
    const Tensor& grad_out, const Tensor& q, const Tensor& v, const Tensor& buckets,
    const Tensor& out, const Tensor& stats, const c10::optional<Tensor>& key_lengths,
    int64_t chunk_size, bool causal, bool mask_self, double softmax_temp, double dropout_p,
    int64_t dropout_seed) {
  const auto p = prepare(q, v, buckets, key_lengths, chunk_size);
  check_backward_inputs(grad_out, q, v, out, stats);
  ops::check_dropout(kOp, dropout_p);
  if (ops::is_reduced_float(q)) {
    auto [gq, gv] = ops::in_float32(q.scalar_type(), reformer_attention_backward_cpu_op, grad_out,
                                    q, v, buckets, out, stats, key_lengths, chunk_size, causal,
                                    mask_self, softmax_temp, dropout_p, dropout_seed);
    return {ops::in_rows_layout_of(gq, q), ops::in_rows_layout_of(gv, v)};
  }
  auto go = ops::rows_contiguous(grad_out.to(q.scalar_type()));
  auto delta = ops::row_dots(go, out.to(go.scalar_type()));  // (N, H, L)
  auto stats_c = stats.to(torch::kDouble).contiguous();
  // Gradients in the inputs' row layouts (as the fake implementation promises).
  auto gq = ops::empty_rows_like(q, q.size(3)), gv = ops::empty_rows_like(v, v.size(3));
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "reformer_attention_backward_cpu_op", [&] {
    kernels::ReformerBackwardArgs<scalar_t> a;
    fill_params<scalar_t>(a, p, chunk_size, causal, mask_self, softmax_temp, dropout_p,
                          dropout_seed);
    a.grad_out = go.data_ptr<scalar_t>();
    a.stats = stats_c.data_ptr<double>();
    a.delta = delta.data_ptr<scalar_t>();
    a.grad_q = gq.data_ptr<scalar_t>();
    a.grad_v = gv.data_ptr<scalar_t>();
    a.grad_out_rows = ops::row_strides(go);
    a.grad_q_rows = ops::row_strides(gq);
    a.grad_v_rows = ops::row_strides(gv);
    kernels::reformer_backward_cpu(a);
  });
  return {gq, gv};
}

constexpr char kForwardOp[] = "fastattn::reformer_attention_forward";
constexpr char kBackwardOp[] = "fastattn::reformer_attention_backward";

struct ReformerOp {
  struct Saved {
    Tensor q, v, buckets, out, stats, key_lengths;
    int64_t chunk_size = 0;
    bool causal = false, mask_self = false;
    double temp = 0.0, dropout_p = 0.0;
    int64_t dropout_seed = 0;
    auto tensors() { return std::tie(q, v, buckets, out, stats, key_lengths); }
  };

  static Tensor forward(Saved* saved, const Tensor& q, const Tensor& v, const Tensor& buckets,
                        const c10::optional<Tensor>& key_lengths, int64_t chunk_size, bool causal,
                        bool mask_self, c10::optional<double> softmax_temp, double dropout_p,
                        c10::optional<int64_t> dropout_seed) {
    TORCH_CHECK(q.defined() && q.dim() == 4, kOp, ": q must have shape (N, H, L, E), got ",
                q.defined() ? q.sizes() : c10::IntArrayRef{});
    ops::check_dropout(kOp, dropout_p);
    const double temp = ops::resolve_softmax_temp(kOp, q, softmax_temp);
    // One seed for the forward and the backward: the same keep mask.
    const int64_t seed = ops::resolve_dropout_seed(dropout_p, dropout_seed);
    auto [out, stats] = ops::call_op<kForwardOp, reformer_attention_forward_cpu_op>(
        q, v, buckets, key_lengths, chunk_size, causal, mask_self, temp, dropout_p, seed);
    if (saved)
      *saved = {q,          v,      buckets,   out,  stats,     ops::or_undefined(key_lengths),
                chunk_size, causal, mask_self, temp, dropout_p, seed};
    return out;
  }

  static auto backward(const Saved& s, const variable_list& grads) {
    return ops::call_op<kBackwardOp, reformer_attention_backward_cpu_op>(
        grads[0], s.q, s.v, s.buckets, s.out, s.stats, ops::opt(s.key_lengths), s.chunk_size,
        s.causal, s.mask_self, s.temp, s.dropout_p, s.dropout_seed);
  }
};

using ReformerShell = ops::Shell<ReformerOp>;

}  // namespace

TORCH_LIBRARY_IMPL(fastattn, CPU, m) { m.impl("lsh_hash", lsh_hash_cpu_op); }

TORCH_LIBRARY_FRAGMENT(fastattn, m) {
  ops::impl_shell<ReformerOp>(m, "reformer_attention", reformer_attention_forward_cpu_op,
                              reformer_attention_backward_cpu_op);
}

Tensor lsh_hash(const Tensor& x, const Tensor& rotations) {
  ops::check_defined(kHashOp, {"x", "rotations"}, {x, rotations});
  return ops::call_op<kHashOp, lsh_hash_cpu_op>(x, rotations);
}

Tensor reformer_attention(const Tensor& q, const Tensor& v, const Tensor& buckets,
                          const std::optional<Tensor>& key_lengths, int64_t chunk_size, bool causal,
                          bool mask_self, std::optional<double> softmax_temp, double dropout_p,
                          std::optional<int64_t> dropout_seed) {
  ops::check_defined(kOp, {"q", "v", "buckets"}, {q, v, buckets});
  return ops::call_op<kOp, ReformerShell::no_grad>(q, v, buckets, to_c10(key_lengths), chunk_size,
                                                   causal, mask_self, to_c10(softmax_temp),
                                                   dropout_p, to_c10(dropout_seed));
}

// ---- plain-ATen references (tests and benchmarks only) ----------------------------

namespace reference {

Tensor lsh_hash(const Tensor& x, const Tensor& rotations) {
  const int64_t R = rotations.size(0);
  if (rotations.size(2) == 0) {
    return torch::zeros({x.size(0), x.size(1), R, x.size(2)}, x.options().dtype(torch::kLong));
  }
  // (N, H, 1, L, E) x (R, E, B2) -> (N, H, R, L, B2)
  auto proj = torch::matmul(x.unsqueeze(2), rotations);
  return torch::cat({proj, -proj}, -1).argmax(-1);
}

// Materialises (N, H, L, L): how many rounds let query i see key j, then one
// softmax over scores + log(count). That equals the kernels' per-round
// softmax combined with the rounds' lse weights.
Tensor reformer_attention(const Tensor& q, const Tensor& v, const Tensor& buckets,
                          const std::optional<Tensor>& key_lengths, int64_t chunk_size, bool causal,
                          bool mask_self, std::optional<double> softmax_temp,
                          std::optional<std::pair<int64_t, double>> dropout) {
  const int64_t N = q.size(0), H = q.size(1), L = q.size(2), E = q.size(3);
  const double temp = softmax_temp.value_or(1.0 / std::sqrt(static_cast<double>(E)));
  const auto lopt = buckets.options();
  auto pos = torch::arange(L, lopt);
  auto valid = torch::ones({N, L}, lopt.dtype(torch::kBool));
  if (key_lengths) valid = pos.view({1, L}).lt(key_lengths->to(torch::kLong).view({N, 1}));
  auto valid4 = valid.view({N, 1, 1, L});
  // Sort key: bucket, then position; padding last.
  auto key = torch::where(valid4, buckets * L + pos, torch::full({}, L * (int64_t(1) << 40), lopt));
  auto order = key.argsort(int64_t(-1));                                           // (N, H, R, L)
  auto rank = torch::empty_like(order).scatter_(-1, order, pos.expand_as(order));  // sorted pos
  auto chunk = torch::div(rank, chunk_size, "floor");                              // (N, H, R, L)
  auto dc = chunk.unsqueeze(-1) - chunk.unsqueeze(-2);  // (N, H, R, Lq, Lk)
  auto seen = dc.eq(0).logical_or(dc.eq(1));
  auto both = valid.view({N, 1, 1, L, 1}).logical_and(valid.view({N, 1, 1, 1, L}));
  seen = seen.logical_and(both);
  if (causal) seen = seen.logical_and(pos.view({L, 1}).ge(pos.view({1, L})));
  auto count = seen.sum(2).to(q.scalar_type());  // (N, H, L, L)
  auto keys = q / q.norm(2, -1, true).clamp_min(1e-12);
  auto scores = torch::matmul(q, keys.transpose(-1, -2)) * temp;
  if (mask_self) {
    scores =
        scores.masked_fill(torch::eye(L, lopt.dtype(torch::kBool)), kernels::kReformerSelfScore);
  }
  scores = scores + count.log();
  auto any = count.gt(0).any(-1, /*keepdim=*/true);
  scores = scores.masked_fill(any.logical_not(), 0.0);
  auto probs = torch::softmax(scores, -1).masked_fill(any.logical_not(), 0.0);
  if (dropout) {
    // The weight of (i, j) is shared by the count rounds in which i sees j;
    // each round drops its share by its own mask: the kept shares' sum over
    // the count, times 1 / (1 - p).
    auto kept = torch::zeros_like(probs);
    for (int64_t r = 0; r < buckets.size(2); ++r) {
      const auto seed = static_cast<int64_t>(
          kernels::reformer_round_seed(static_cast<uint64_t>(dropout->first), r));
      const auto keep = attention_dropout_keep(seed, dropout->second, N, H, L, L);
      kept = kept + seen.select(2, r).to(probs.scalar_type()) * keep.to(probs.scalar_type());
    }
    probs = probs * kept / count.clamp_min(1);
  }
  return torch::matmul(probs, v);
}

}  // namespace reference
}  // namespace fastattn
