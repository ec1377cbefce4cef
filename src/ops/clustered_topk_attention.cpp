// The clustered top-k operators, with input checks, CPU implementations of
// the forward/backward kernels (src/kernels/clustered_topk/) and autograd:
//  - clustered_topk_attention (the per-query sparse part of improved
//    clustered attention, given masses; exact-topk uses it):
//      q (N,H,L,E), k (N,H,S,E), v (N,H,S,M), topk (N,H,C,K) int64,
//      mass (N,H,C), assignments (N,H,L) int64 -> (N,H,L,M)
//    Cost: O(N·H·L·K·(E + M)); gradients to q, k, v and mass.
//  - improved_clustered_attention (the whole method given the clusters):
//    centroids, the centroid pass (full_attention_lse_topk), then the top-k
//    kernel in its improved form; the backward writes one buffer per input
//    (the centroid pass's backward accumulates into the top-k kernel's k and
//    v gradients). Cost O(N·H·(C·S·(E + M) + L·K·(E + M))).
// Tested through improved_clustered_attention and exact-topk in
// tests/cpp/test_clustered_attention.cpp and in tests/python/test_ops.py.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "fastattn/ops.h"
#include "kernels/clustered_topk/clustered_topk.h"
#include "ops/cluster_members.h"
#include "ops/clustered_topk_args.h"
#include "ops/full_attention_internal.h"
#include "ops/mask_util.h"
#include "ops/op_shell.h"
#include "ops/op_util.h"

namespace fastattn {
namespace ops {

using torch::Tensor;

void check_clustered_topk_inputs(const Tensor& q, const Tensor& k, const Tensor& v,
                                 const Tensor& topk, const Tensor& mass, const Tensor& assignments,
                                 const c10::optional<Tensor>& key_lengths) {
  ops::check_qkv(kClusteredTopkOp, q, k, v);
  ops::check_masks(kClusteredTopkOp, q, k.size(2), std::nullopt, to_std(key_lengths));
  const int64_t N = q.size(0), H = q.size(1), L = q.size(2);
  TORCH_CHECK(topk.dim() == 4 && topk.size(0) == N && topk.size(1) == H, kClusteredTopkOp,
              ": topk must have shape (N, H, C, K) with (N, H) = (", N, ", ", H, "), got ",
              topk.sizes());
  TORCH_CHECK(topk.scalar_type() == torch::kLong, kClusteredTopkOp, ": topk must be int64, got ",
              topk.scalar_type());
  TORCH_CHECK(
      mass.dim() == 3 && mass.size(0) == N && mass.size(1) == H && mass.size(2) == topk.size(2),
      kClusteredTopkOp, ": mass must have shape (N, H, C) = (", N, ", ", H, ", ", topk.size(2),
      "), got ", mass.sizes());
  TORCH_CHECK(mass.scalar_type() == q.scalar_type(), kClusteredTopkOp, ": mass must be ",
              q.scalar_type(), " like q, got ", mass.scalar_type());
  TORCH_CHECK(assignments.dim() == 3 && assignments.size(0) == N && assignments.size(1) == H &&
                  assignments.size(2) == L,
              kClusteredTopkOp, ": assignments must have shape (N, H, L) = (", N, ", ", H, ", ", L,
              "), got ", assignments.sizes());
  TORCH_CHECK(assignments.scalar_type() == torch::kLong, kClusteredTopkOp,
              ": assignments must be int64, got ", assignments.scalar_type());
  if (!check_values()) return;
  if (topk.numel() > 0) {
    TORCH_CHECK(topk.min().item<int64_t>() >= -1 && topk.max().item<int64_t>() < k.size(2),
                kClusteredTopkOp, ": topk must hold key indices in [0, S) = [0, ", k.size(2),
                ") or -1 (an empty slot)");
  }
  if (assignments.numel() > 0) {
    TORCH_CHECK(
        assignments.min().item<int64_t>() >= -1 && assignments.max().item<int64_t>() < topk.size(2),
        kClusteredTopkOp, ": assignments must be in [-1, C) = [-1, ", topk.size(2), ")");
  }
}

void check_improved_clusters(const Tensor& q, const Tensor& assignments, const Tensor& counts) {
  const int64_t N = q.size(0), H = q.size(1), L = q.size(2);
  TORCH_CHECK(assignments.dim() == 3 && assignments.size(0) == N && assignments.size(1) == H &&
                  assignments.size(2) == L,
              kImprovedClusteredOp, ": assignments must have shape (N, H, L) = (", N, ", ", H, ", ",
              L, "), got ", assignments.sizes());
  TORCH_CHECK(assignments.scalar_type() == torch::kLong, kImprovedClusteredOp,
              ": assignments must be int64, got ", assignments.scalar_type());
  TORCH_CHECK(counts.dim() == 3 && counts.size(0) == N && counts.size(1) == H, kImprovedClusteredOp,
              ": counts must have shape (N, H, C) with (N, H) = (", N, ", ", H, "), got ",
              counts.sizes());
  TORCH_CHECK(counts.scalar_type() == torch::kLong, kImprovedClusteredOp,
              ": counts must be int64, got ", counts.scalar_type());
  if (!check_values()) return;
  if (assignments.numel() > 0) {
    TORCH_CHECK(assignments.min().item<int64_t>() >= -1 &&
                    assignments.max().item<int64_t>() < counts.size(2),
                kImprovedClusteredOp, ": assignments must be in [-1, C) = [-1, ", counts.size(2),
                ")");
  }
  // The centroids divide by the counts: they must be the assignments' histogram.
  const int64_t C = counts.size(2);
  auto histogram = torch::zeros({N, H, C + 1}, counts.options().device(assignments.device()))
                       .scatter_add_(2, assignments + 1, torch::ones_like(assignments))
                       .narrow(2, 1, C);
  TORCH_CHECK(histogram.equal(counts.to(histogram.device())), kImprovedClusteredOp,
              ": counts must be the number of queries assigned to each cluster (counts[n, h, c] "
              "= |{l : assignments[n, h, l] = c}|); they disagree with the assignments");
}

}  // namespace ops

namespace {

using torch::Tensor;
using torch::autograd::variable_list;

constexpr char kOp[] = "fastattn::clustered_topk_attention";

struct Prepared {
  ops::QKVInputs in;
  Tensor topk, mass, assignments;
};

Prepared prepare(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& topk,
                 const Tensor& mass, const Tensor& assignments,
                 const c10::optional<Tensor>& key_lengths) {
  return {ops::qkv_inputs(q, k, v, key_lengths), topk.contiguous(), mass.contiguous(),
          assignments.contiguous()};
}

template <typename T>
void fill_params(kernels::ClusteredTopkParams<T>& a, const Prepared& p, double scale,
                 double dropout_p, int64_t dropout_seed) {
  ops::fill_clustered_topk_args(a, kOp, p.in, p.topk, p.assignments, scale);
  a.mass = p.mass.data_ptr<T>();
  ops::set_dropout_args(a, dropout_p, dropout_seed);
}

Tensor clustered_topk_attention_cpu_op(const Tensor& q, const Tensor& k, const Tensor& v,
                                       const Tensor& topk, const Tensor& mass,
                                       const Tensor& assignments,
                                       const c10::optional<Tensor>& key_lengths,
                                       double softmax_temp, double dropout_p,
                                       c10::optional<int64_t> dropout_seed) {
  ops::check_clustered_topk_inputs(q, k, v, topk, mass, assignments, key_lengths);
  ops::resolve_softmax_temp(kOp, q, softmax_temp);  // checks it is finite and > 0
  ops::check_dropout(kOp, dropout_p);
  const int64_t seed = ops::resolve_dropout_seed(dropout_p, dropout_seed);
  if (ops::is_reduced_float(q))
    return ops::in_rows_layout_of(
        ops::in_float32(q.scalar_type(), clustered_topk_attention_cpu_op, q, k, v, topk, mass,
                        assignments, key_lengths, softmax_temp, dropout_p,
                        c10::optional<int64_t>(seed)),
        q);
  const auto p = prepare(q, k, v, topk, mass, assignments, key_lengths);
  // out in q's row layout: the layers' transpose back to (N, L, H, M) is a view.
  auto out = ops::empty_rows_like(q, v.size(3));
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "clustered_topk_attention_cpu_op", [&] {
    kernels::ClusteredTopkForwardArgs<scalar_t> a;
    fill_params<scalar_t>(a, p, softmax_temp, dropout_p, seed);
    a.out = out.data_ptr<scalar_t>();
    a.out_rows = ops::row_strides(out);
    kernels::clustered_topk_forward_cpu(a);
  });
  return out;
}

std::tuple<Tensor, Tensor, Tensor, Tensor> clustered_topk_attention_backward_cpu_op(
    const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& topk,
    const Tensor& mass, const Tensor& assignments, const c10::optional<Tensor>& key_lengths,
    double softmax_temp, double dropout_p, int64_t dropout_seed) {
  ops::check_clustered_topk_inputs(q, k, v, topk, mass, assignments, key_lengths);
  ops::check_dropout(kOp, dropout_p);
  TORCH_CHECK(grad_out.dim() == 4 && grad_out.size(0) == q.size(0) &&
                  grad_out.size(1) == q.size(1) && grad_out.size(2) == q.size(2) &&
                  grad_out.size(3) == v.size(3),
              kOp, ": grad_out must have shape (N, H, L, M), got ", grad_out.sizes());
  if (ops::is_reduced_float(q)) {
    auto [gq, gk, gv, gm] = ops::in_float32(
        q.scalar_type(), clustered_topk_attention_backward_cpu_op, grad_out, q, k, v, topk, mass,
        assignments, key_lengths, softmax_temp, dropout_p, dropout_seed);
    return {ops::in_rows_layout_of(gq, q), ops::in_rows_layout_of(gk, k),
            ops::in_rows_layout_of(gv, v), gm};
  }
  const auto p = prepare(q, k, v, topk, mass, assignments, key_lengths);
  auto go = ops::rows_contiguous(grad_out.to(q.scalar_type()));
  // Gradients in the inputs' row layouts (as the fake implementation promises).
  auto gq = ops::empty_rows_like(q, q.size(3)), gk = ops::empty_rows_like(k, k.size(3)),
       gv = ops::empty_rows_like(v, v.size(3)), gm = torch::empty_like(p.mass);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "clustered_topk_attention_backward_cpu_op", [&] {
    kernels::ClusteredTopkBackwardArgs<scalar_t> a;
    fill_params<scalar_t>(a, p, softmax_temp, dropout_p, dropout_seed);
    a.grad_out = go.data_ptr<scalar_t>();
    ops::set_qkv_grads<scalar_t>(a, gq, gk, gv);
    a.grad_mass = gm.data_ptr<scalar_t>();
    ops::set_grad_rows(a, go, gq, gk, gv);
    kernels::clustered_topk_backward_cpu(a);
  });
  return {gq, gk, gv, gm};
}

constexpr char kBackwardOp[] = "fastattn::clustered_topk_attention_backward";

// The operator's CPU kernel is its forward; the autograd kernel calls it
// below autograd with the dropout seed drawn once, for both passes.
struct ClusteredTopkOp {
  struct Saved {
    Tensor q, k, v, topk, mass, assignments, key_lengths;
    double temp = 0.0, dropout_p = 0.0;
    int64_t dropout_seed = 0;
    auto tensors() { return std::tie(q, k, v, topk, mass, assignments, key_lengths); }
  };

  static Tensor forward(Saved* saved, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& topk, const Tensor& mass, const Tensor& assignments,
                        const c10::optional<Tensor>& key_lengths, double temp, double dropout_p,
                        c10::optional<int64_t> dropout_seed) {
    ops::check_dropout(kOp, dropout_p);
    // One seed for the forward and the backward: the same keep mask.
    const int64_t seed = ops::resolve_dropout_seed(dropout_p, dropout_seed);
    if (saved)
      *saved = {q,    k,         v,   topk, mass, assignments, ops::or_undefined(key_lengths),
                temp, dropout_p, seed};
    return ops::call_op<kOp, clustered_topk_attention_cpu_op>(q, k, v, topk, mass, assignments,
                                                              key_lengths, temp, dropout_p, seed);
  }

  static variable_list backward(const Saved& s, const variable_list& grads) {
    auto [gq, gk, gv, gm] = ops::call_op<kBackwardOp, clustered_topk_attention_backward_cpu_op>(
        grads[0], s.q, s.k, s.v, s.topk, s.mass, s.assignments, ops::opt(s.key_lengths), s.temp,
        s.dropout_p, s.dropout_seed);
    return {gq, gk, gv, Tensor(), gm};
  }
};

// ---- improved_clustered_attention (fused) ------------------------------------------

constexpr const char* kImprovedOp = "fastattn::improved_clustered_attention";

// Kernel parameters of the fused form: the top-k kernel's, with the
// centroid pass's results in place of the masses.
template <typename T>
void fill_improved(kernels::ClusteredTopkParams<T>& a, const ops::QKVInputs& in,
                   const Tensor& assignments, const Tensor& top_idx, const Tensor& centroids,
                   const Tensor& lse, const Tensor& out_c, double temp, double dropout_p,
                   int64_t dropout_seed) {
  ops::fill_clustered_topk_args(a, kImprovedOp, in, top_idx, assignments, temp);
  a.centroids = centroids.data_ptr<T>();
  a.lse = lse.data_ptr<T>();
  a.out_c = out_c.data_ptr<T>();
  ops::set_dropout_args(a, dropout_p, dropout_seed);
}

// The centroid rows' dropout seed (kernels/clustered_topk/clustered_topk.h).
int64_t centroid_dropout_seed(int64_t seed) {
  return static_cast<int64_t>(
      kernels::dropout_stream_seed(static_cast<uint64_t>(seed), kernels::kDropoutCentroidStream));
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> improved_clustered_attention_forward_cpu_op(
    const Tensor& q_in, const Tensor& k_in, const Tensor& v_in, const Tensor& assignments_in,
    const Tensor& counts_in, int64_t topk, const c10::optional<Tensor>& key_lengths,
    double softmax_temp, double dropout_p, int64_t dropout_seed) {
  ops::check_qkv(kImprovedOp, q_in, k_in, v_in);
  ops::check_masks(kImprovedOp, q_in, k_in.size(2), std::nullopt, to_std(key_lengths));
  ops::check_improved_clusters(q_in, assignments_in, counts_in);
  TORCH_CHECK(topk >= 1 && topk <= k_in.size(2), kImprovedOp, ": topk must be in [1, S] = [1, ",
              k_in.size(2), "], got ", topk);
  ops::check_dropout(kImprovedOp, dropout_p);
  if (ops::is_reduced_float(q_in)) {
    auto [out, centroids, lse, out_c, top_idx] = ops::in_float32<2>(
        q_in.scalar_type(), improved_clustered_attention_forward_cpu_op, q_in, k_in, v_in,
        assignments_in, counts_in, topk, key_lengths, softmax_temp, dropout_p, dropout_seed);
    return {ops::in_rows_layout_of(out, q_in), centroids, lse, out_c, top_idx};
  }
  // Rows read in place (the layers' (N, L, H, E) views): the kernels take row strides.
  const auto in = ops::qkv_inputs(q_in, k_in, v_in, key_lengths);
  const auto &q = in.q, &k = in.k, &v = in.v;
  auto assignments = assignments_in.contiguous(), counts = counts_in.contiguous();
  auto centroids = ops::cluster_means_no_grad(q, assignments, counts);
  // Named tensors, not structured bindings: lambdas cannot capture those before C++20 (clang).
  // With dropout, out_c's weights drop by the centroid rows' mask.
  Tensor out_c, lse, top_idx;
  std::tie(out_c, lse, top_idx) =
      ops::full_attention_lse_topk_cpu(centroids, k, v, key_lengths, softmax_temp, topk, dropout_p,
                                       centroid_dropout_seed(dropout_seed));
  auto out = ops::empty_rows_like(q, v.size(3));
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "improved_clustered_attention_forward_cpu_op", [&] {
    kernels::ClusteredTopkForwardArgs<scalar_t> a;
    fill_improved(a, in, assignments, top_idx, centroids, lse, out_c, softmax_temp, dropout_p,
                  dropout_seed);
    a.out = out.data_ptr<scalar_t>();
    a.out_rows = ops::row_strides(out);
    kernels::clustered_topk_forward_cpu(a);
  });
  return {out, centroids, lse, out_c, top_idx};
}

std::tuple<Tensor, Tensor, Tensor> improved_clustered_attention_backward_cpu_op(
    const Tensor& grad_out, const Tensor& q_in, const Tensor& k_in, const Tensor& v_in,
    const Tensor& assignments_in, const Tensor& counts_in, const Tensor& centroids,
    const Tensor& lse, const Tensor& out_c, const Tensor& top_idx,
    const c10::optional<Tensor>& key_lengths, double softmax_temp, double dropout_p,
    int64_t dropout_seed) {
  ops::check_qkv(kImprovedOp, q_in, k_in, v_in);
  ops::check_improved_clusters(q_in, assignments_in, counts_in);
  ops::check_dropout(kImprovedOp, dropout_p);
  if (ops::is_reduced_float(q_in)) {
    return ops::in_rows_layouts_of(
        ops::in_float32(q_in.scalar_type(), improved_clustered_attention_backward_cpu_op, grad_out,
                        q_in, k_in, v_in, assignments_in, counts_in, centroids, lse, out_c, top_idx,
                        key_lengths, softmax_temp, dropout_p, dropout_seed),
        q_in, k_in, v_in);
  }
  const auto in = ops::qkv_inputs(q_in, k_in, v_in, key_lengths);
  const auto &q = in.q, &k = in.k, &v = in.v;
  auto assignments = assignments_in.contiguous(), counts = counts_in.contiguous();
  auto go = ops::rows_contiguous(grad_out.to(q.scalar_type()));
  // Gradients in the inputs' row layouts (as the fake implementation promises).
  auto gq = ops::empty_rows_like(q_in, q.size(3)), gk = ops::empty_rows_like(k_in, k.size(3)),
       gv = ops::empty_rows_like(v_in, v.size(3));
  auto g_cen = torch::empty_like(centroids), g_lse = torch::empty_like(lse),
       g_out_c = torch::empty_like(out_c);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "improved_clustered_attention_backward_cpu_op", [&] {
    kernels::ClusteredTopkBackwardArgs<scalar_t> a;
    fill_improved(a, in, assignments, top_idx, centroids, lse, out_c, softmax_temp, dropout_p,
                  dropout_seed);
    a.grad_out = go.data_ptr<scalar_t>();
    ops::set_qkv_grads<scalar_t>(a, gq, gk, gv);
    a.grad_centroids = g_cen.data_ptr<scalar_t>();
    a.grad_lse = g_lse.data_ptr<scalar_t>();
    a.grad_out_c = g_out_c.data_ptr<scalar_t>();
    ops::set_grad_rows(a, go, gq, gk, gv);
    kernels::clustered_topk_backward_cpu(a);
  });
  // The centroid pass: its gradients to k and v add to the top-k ones; to the
  // centroids, then to every member query (centroid = mean of the members).
  ops::full_attention_backward_accumulate(g_out_c, g_lse, centroids, k, v, out_c, lse,
                                          to_std(key_lengths), softmax_temp, g_cen, gk, gv,
                                          dropout_p, centroid_dropout_seed(dropout_seed));
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "improved_clustered_centroid_grads", [&] {
    kernels::CentroidSpreadArgs<scalar_t> g;
    g.dst = gq.data_ptr<scalar_t>();
    g.dst_rows = ops::row_strides(gq);
    g.H = q.size(1);
    g.table = g_cen.data_ptr<scalar_t>();
    g.assignments = assignments.data_ptr<int64_t>();
    g.counts = counts.data_ptr<int64_t>();
    g.NH = q.size(0) * q.size(1);
    g.L = q.size(2);
    g.C = counts.size(2);
    g.E = q.size(3);
    g.num_threads = at::get_num_threads();
    kernels::spread_centroids_cpu(g);
  });
  return {gq, gk, gv};
}

constexpr char kImprovedForwardOp[] = "fastattn::improved_clustered_attention_forward";
constexpr char kImprovedBackwardOp[] = "fastattn::improved_clustered_attention_backward";

struct ImprovedClusteredOp {
  struct Saved {
    Tensor q, k, v, assignments, counts, centroids, lse, out_c, top_idx, key_lengths;
    double temp = 0.0, dropout_p = 0.0;
    int64_t dropout_seed = 0;
    auto tensors() {
      return std::tie(q, k, v, assignments, counts, centroids, lse, out_c, top_idx, key_lengths);
    }
  };

  static Tensor forward(Saved* saved, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& assignments, const Tensor& counts, int64_t topk,
                        const c10::optional<Tensor>& key_lengths,
                        c10::optional<double> softmax_temp, double dropout_p,
                        c10::optional<int64_t> dropout_seed) {
    ops::check_qkv(kImprovedOp, q, k, v);
    ops::check_dropout(kImprovedOp, dropout_p);
    const double temp = ops::resolve_softmax_temp(kImprovedOp, q, softmax_temp);
    // One seed for the forward and the backward: the same keep masks.
    const int64_t seed = ops::resolve_dropout_seed(dropout_p, dropout_seed);
    auto [out, centroids, lse, out_c, top_idx] =
        ops::call_op<kImprovedForwardOp, improved_clustered_attention_forward_cpu_op>(
            q, k, v, assignments, counts, topk, key_lengths, temp, dropout_p, seed);
    if (saved)
      *saved = {q,         k,         v,     assignments, counts,
                centroids, lse,       out_c, top_idx,     ops::or_undefined(key_lengths),
                temp,      dropout_p, seed};
    return out;
  }

  static auto backward(const Saved& s, const variable_list& grads) {
    return ops::call_op<kImprovedBackwardOp, improved_clustered_attention_backward_cpu_op>(
        grads[0], s.q, s.k, s.v, s.assignments, s.counts, s.centroids, s.lse, s.out_c, s.top_idx,
        ops::opt(s.key_lengths), s.temp, s.dropout_p, s.dropout_seed);
  }
};

using ImprovedClusteredShell = ops::Shell<ImprovedClusteredOp>;

}  // namespace

TORCH_LIBRARY_IMPL(fastattn, CPU, m) {
  m.impl("clustered_topk_attention", clustered_topk_attention_cpu_op);
  m.impl("clustered_topk_attention_backward", clustered_topk_attention_backward_cpu_op);
}

TORCH_LIBRARY_IMPL(fastattn, Autograd, m) {
  m.impl("clustered_topk_attention", ops::Shell<ClusteredTopkOp>::autograd);
}

TORCH_LIBRARY_FRAGMENT(fastattn, m) {
  ops::impl_shell<ImprovedClusteredOp>(m, "improved_clustered_attention",
                                       improved_clustered_attention_forward_cpu_op,
                                       improved_clustered_attention_backward_cpu_op);
}

Tensor clustered_topk_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                const Tensor& topk, const Tensor& mass, const Tensor& assignments,
                                const std::optional<Tensor>& key_lengths, double softmax_temp,
                                double dropout_p, std::optional<int64_t> dropout_seed) {
  ops::check_defined(kOp, {"q", "k", "v", "topk", "mass", "assignments"},
                     {q, k, v, topk, mass, assignments});
  return ops::call_op<kOp, clustered_topk_attention_cpu_op>(q, k, v, topk, mass, assignments,
                                                            to_c10(key_lengths), softmax_temp,
                                                            dropout_p, to_c10(dropout_seed));
}

}  // namespace fastattn
