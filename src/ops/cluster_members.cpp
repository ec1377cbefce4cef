// Centroids from their members and back on the CPU (see cluster_members.h).
#include "ops/cluster_members.h"

#include <torch/autograd.h>

#include "kernels/clustered_topk/clustered_topk.h"
#include "ops/op_shell.h"
#include "ops/op_util.h"

namespace fastattn::ops {
namespace {

using torch::Tensor;
using torch::autograd::variable_list;

// (N, H, C, E): the sums of each cluster's rows of x, or their means when
// counts are given (cluster_means_cpu with or without `mean`).
Tensor reduce_clusters(const Tensor& x_in, const Tensor& assignments, int64_t C,
                       const Tensor& counts) {
  const auto x = rows_contiguous(x_in);
  const auto a = assignments.contiguous();
  const bool mean = counts.defined();
  Tensor c;
  if (mean) c = counts.contiguous();
  const int64_t N = x.size(0), H = x.size(1), L = x.size(2), E = x.size(3);
  auto out = torch::empty({N, H, C, E}, x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "reduce_clusters", [&] {
    kernels::ClusterMeansArgs<scalar_t> m;
    m.q = x.data_ptr<scalar_t>();
    m.q_rows = row_strides(x);
    m.H = H;
    m.assignments = a.data_ptr<int64_t>();
    if (mean) m.counts = c.data_ptr<int64_t>();
    m.centroids = out.data_ptr<scalar_t>();
    m.NH = N * H;
    m.L = L;
    m.C = C;
    m.E = E;
    m.num_threads = at::get_num_threads();
    m.mean = mean;
    kernels::cluster_means_cpu(m);
  });
  return out;
}

// (N, H, L, E) in like's row layout: row l = table[a_l] (divided by its
// count when counts are given), zeros for a_l = -1.
Tensor spread(const Tensor& table_in, const Tensor& assignments, const Tensor& counts,
              const Tensor& like) {
  const bool divide = counts.defined();
  const auto table = table_in.contiguous();
  const auto a = assignments.contiguous();
  const int64_t N = table.size(0), H = table.size(1), C = table.size(2), E = table.size(3),
                L = a.size(2);
  auto out = empty_rows_like(like, E, L);
  Tensor c;
  if (divide) c = counts.contiguous();
  AT_DISPATCH_FLOATING_TYPES(table.scalar_type(), "spread_centroids", [&] {
    kernels::CentroidSpreadArgs<scalar_t> s;
    s.dst = out.data_ptr<scalar_t>();
    s.dst_rows = row_strides(out);
    s.H = H;
    s.table = table.data_ptr<scalar_t>();
    s.assignments = a.data_ptr<int64_t>();
    if (divide) s.counts = c.data_ptr<int64_t>();
    s.NH = N * H;
    s.L = L;
    s.C = C;
    s.E = E;
    s.num_threads = at::get_num_threads();
    s.divide = divide;
    s.accumulate = false;
    kernels::spread_centroids_cpu(s);
  });
  return out;
}

// Means of each cluster's members; the gradient spreads back divided by the
// counts.
struct ClusterMeansOp {
  struct Saved {
    Tensor x, assignments, counts;
    auto tensors() { return std::tie(x, assignments, counts); }
  };
  static Tensor forward(Saved* saved, const Tensor& x, const Tensor& assignments,
                        const Tensor& counts) {
    if (saved) *saved = {x, assignments, counts};
    return cluster_means_no_grad(x, assignments, counts);
  }
  static variable_list backward(const Saved& s, const variable_list& grads) {
    if (!grads[0].defined()) return {};
    return {spread(grads[0], s.assignments, s.counts, s.x)};
  }
};

// Each member gets its cluster's row; the gradient sums the members' rows.
struct SpreadToMembersOp {
  struct Saved {
    Tensor assignments;
    int64_t clusters = 0;
    auto tensors() { return std::tie(assignments); }
  };
  static Tensor forward(Saved* saved, const Tensor& table, const Tensor& assignments,
                        const Tensor& like) {
    if (saved) *saved = {assignments, table.size(2)};
    return spread(table, assignments, Tensor(), like);
  }
  static variable_list backward(const Saved& s, const variable_list& grads) {
    if (!grads[0].defined()) return {};
    return {reduce_clusters(grads[0], s.assignments, s.clusters, Tensor())};
  }
};

}  // namespace

Tensor cluster_means_no_grad(const Tensor& x, const Tensor& assignments, const Tensor& counts) {
  return reduce_clusters(x, assignments, counts.size(2), counts);
}

bool cluster_members_supports(const Tensor& x) {
  return x.device().is_cpu() &&
         (x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kDouble);
}

Tensor cluster_means(const Tensor& x, const Tensor& assignments, const Tensor& counts) {
  TORCH_INTERNAL_ASSERT(cluster_members_supports(x));
  return Shell<ClusterMeansOp>::autograd(x, assignments, counts);
}

Tensor spread_to_members(const Tensor& table, const Tensor& assignments, const Tensor& like) {
  TORCH_INTERNAL_ASSERT(cluster_members_supports(table));
  return Shell<SpreadToMembersOp>::autograd(table, assignments, like);
}

}  // namespace fastattn::ops
