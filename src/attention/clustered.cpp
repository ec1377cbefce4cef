// Clustered (`clustered`), improved clustered (`improved-clustered`) and
// causal improved clustered (`causal-improved-clustered`) attention, Vyas et
// al. 2020 sec. 3.2-3.3, and their registration.
//
// Pipeline: hash_queries -> cluster_codes (our kernels) -> centroids as the
// mean of the members -> fused full attention of the C centroids over the S
// keys -> broadcast to the members. The mean and the broadcast are kernels
// with autograd on the CPU (ops/cluster_members.h), ATen's index_add and
// index_select elsewhere and for bfloat16 / float16.
// Improved: the fused improved_clustered_attention operator given the
// clusters (src/ops/clustered_topk_attention.cpp): one pass of the centroids
// over the keys gives each centroid's full output, log-sum-exp and top-k keys
// (never (N,H,C,S)); per cluster, its members' exact attention on those k
// keys scaled by the centroid's mass there, plus the centroid's weights on the
// other keys (its full output minus the top-k share). Attention dropout in
// training is fused on the CPU (full attention's and the top-k kernels' keep
// masks); on CUDA training with dropout > 0 still materialises the centroid
// weights (N,H,C,S) and gathers (N,H,L,k,E) keys and (N,H,L,k,M) values
// through ATen.
// Causal improved: prefix top-k sets per cluster and block of local_context
// positions (a running top-k over the blocks, selection only), then per query
// an exact softmax over its set (keys <= i - w) and its window (i-w+1 .. i),
// composed from ATen gathers of (N,H,L,k+w,E/M): no key after i is read.
//
// Cost: O(N·H·(L·B·E + iterations·L·C + C·S·(E+M) + L·k·(E+M))).
// Tested by tests/cpp/test_clustered_attention.cpp; timed by
// bench/bench_clustered_attention.cpp.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "attention/builtin_types.h"
#include "fastattn/clustered.h"
#include "fastattn/ops.h"
#include "fastattn/registry.h"
#include "ops/cluster_members.h"
#include "ops/dense_attention.h"
#include "ops/op_util.h"

namespace fastattn {
namespace {

using torch::Tensor;

double temp_or_default(const Tensor& q, std::optional<double> softmax_temp) {
  return softmax_temp.value_or(1.0 / std::sqrt(static_cast<double>(q.size(3))));
}

// Row index of each query's cluster in a flat (N·H·C + 1) table; padded
// queries point at the last row (a zero row / a sink). (N·H·L,) int64, in
// the (N, L, H) order when heads_in_rows (the memory order of the layers'
// (N, L, H, E) projections viewed as (N, H, L, E): ops::heads_within_rows).
Tensor flat_cluster_index(const QueryClusters& c, bool heads_in_rows = false) {
  const auto& a = c.assignments;
  const int64_t N = a.size(0), H = a.size(1), C = c.counts.size(2);
  auto base = torch::arange(N * H, a.options()).view({N, H, 1}) * C;
  auto index = torch::where(a.ge(0), base + a, torch::full({}, N * H * C, a.options()));
  return (heads_in_rows ? index.transpose(1, 2) : index).reshape({-1});
}

void check_clusters(const char* what, const Tensor& q, const QueryClusters& c) {
  TORCH_CHECK(c.assignments.defined() && c.counts.defined(), what,
              ": clusters must hold assignments and counts");
  TORCH_CHECK(c.assignments.dim() == 3 && c.assignments.size(0) == q.size(0) &&
                  c.assignments.size(1) == q.size(1) && c.assignments.size(2) == q.size(2),
              what, ": clusters.assignments must have shape (N, H, L) = (", q.size(0), ", ",
              q.size(1), ", ", q.size(2), "), got ", c.assignments.sizes());
  TORCH_CHECK(c.counts.dim() == 3 && c.counts.size(0) == q.size(0) && c.counts.size(1) == q.size(1),
              what, ": clusters.counts must have shape (N, H, C), got ", c.counts.sizes());
}

// (N, 1, 1, S) bool: keys before each length (std::nullopt: all kept).
std::optional<Tensor> key_keep(const std::optional<Tensor>& key_lengths, int64_t N, int64_t S,
                               const torch::Device& device) {
  if (!key_lengths) return std::nullopt;
  auto len = key_lengths->to(device, torch::kLong).view({N, 1, 1, 1});
  return torch::arange(S, torch::TensorOptions().dtype(torch::kLong).device(device))
      .view({1, 1, 1, S})
      .lt(len);
}

// The CPU form of causal-improved-clustered's prefix sets: for every row
// (n, h, c) of scores (N, H, C, S) and block b >= 1, table[n, h, c, b] = the k
// keys j < b·w of the highest scores (ties: the lower index), -1 past the
// number of such keys; keys of score -inf (past the key lengths) are left
// out, NaN counts as the highest. One pass over the keys with a min-heap of
// the k best: O(S·log k) per row instead of a top-k per block.
template <typename T>
void prefix_topk_table(const Tensor& scores, int64_t k, int64_t w, Tensor& table) {
  const int64_t S = scores.size(3), nb = table.size(3),
                rows = scores.numel() / std::max<int64_t>(S, 1);
  const T* sc = scores.data_ptr<T>();
  int64_t* tab = table.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    std::vector<std::pair<T, int64_t>> heap;  // the worst of the best at the front
    auto worse = [](const std::pair<T, int64_t>& a, const std::pair<T, int64_t>& b) {
      return a.first != b.first ? a.first > b.first : a.second < b.second;  // min-heap
    };
    for (int64_t r = r0; r < r1; ++r) {
      const T* s = sc + r * S;
      int64_t* out = tab + r * nb * k;
      heap.clear();
      for (int64_t b = 1; b < nb; ++b) {
        for (int64_t j = (b - 1) * w; j < b * w; ++j) {
          const T x = std::isnan(s[j]) ? std::numeric_limits<T>::infinity() : s[j];
          if (x == -std::numeric_limits<T>::infinity()) continue;
          if (static_cast<int64_t>(heap.size()) < k) {
            heap.emplace_back(x, j);
            std::push_heap(heap.begin(), heap.end(), worse);
          } else if (x > heap.front().first) {  // equal scores: the earlier key stays
            std::pop_heap(heap.begin(), heap.end(), worse);
            heap.back() = {x, j};
            std::push_heap(heap.begin(), heap.end(), worse);
          }
        }
        for (size_t t = 0; t < heap.size(); ++t) out[b * k + t] = heap[t].second;
      }
    }
  });
}

// Softmax over the last dimension of scores where `keep` (broadcastable)
// holds; a row that keeps nothing gives zeros (and zero gradients).
Tensor masked_softmax(const Tensor& scores, const std::optional<Tensor>& keep) {
  if (!keep) return torch::softmax(scores, -1);
  auto s = scores.masked_fill(keep->logical_not(), -std::numeric_limits<double>::infinity());
  auto dead = keep->logical_not().all(-1, /*keepdim=*/true);
  s = s.masked_fill(dead, 0.0);
  return torch::softmax(s, -1).masked_fill(dead, 0.0);
}

Tensor maybe_dropout(const Tensor& x, double p) {
  return p > 0 ? torch::dropout(x, p, /*train=*/true) : x;
}

// Centroid values (N, H, C, M) -> per query (N, H, L, M), zeros for padding,
// in the row layout of the queries (ops::empty_rows_like's rule), so that
// the layers' transpose back is a view.
Tensor broadcast_to_queries(const Tensor& centroid_values, const QueryClusters& c,
                            const Tensor& queries) {
  if (ops::cluster_members_supports(centroid_values))
    return ops::spread_to_members(centroid_values, c.assignments, queries);
  const int64_t N = centroid_values.size(0), H = centroid_values.size(1),
                C = centroid_values.size(2), M = centroid_values.size(3), L = c.assignments.size(2);
  auto table = torch::cat(
      {centroid_values.reshape({N * H * C, M}), torch::zeros({1, M}, centroid_values.options())});
  if (ops::heads_within_rows(queries))
    return table.index_select(0, flat_cluster_index(c, true)).view({N, L, H, M}).transpose(1, 2);
  return table.index_select(0, flat_cluster_index(c)).view({N, H, L, M});
}

// The per-query top-k part composed from ATen, for training with dropout on
// the weights: gathers (N, H, L, k, E) keys and (N, H, L, k, M) values.
Tensor top_part_with_dropout(const Tensor& queries, const Tensor& keys, const Tensor& values,
                             const QueryClusters& clusters, const Tensor& top_idx,
                             const Tensor& mass, const std::optional<Tensor>& key_lengths,
                             double temp, double dropout) {
  const int64_t N = queries.size(0), H = queries.size(1), L = queries.size(2), E = queries.size(3),
                S = keys.size(2), M = values.size(3), k = top_idx.size(3);
  auto a = clusters.assignments;
  auto valid = a.ge(0);  // (N, H, L)
  auto a_safe = a.clamp_min(0);
  auto q_idx = top_idx.gather(2, a_safe.unsqueeze(-1).expand({N, H, L, k}));  // (N, H, L, k)
  auto rows = (torch::arange(N * H, a.options()).view({N, H, 1, 1}) * S + q_idx).reshape({-1});
  auto k_sel = keys.reshape({N * H * S, E}).index_select(0, rows).view({N, H, L, k, E});
  auto v_sel = values.reshape({N * H * S, M}).index_select(0, rows).view({N, H, L, k, M});
  // Batched (k, E) x (E, 1) products: measured faster here than elementwise
  // products and sums over (N, H, L, k, E).
  auto scores = torch::matmul(k_sel, queries.unsqueeze(-1)).squeeze(-1) * temp;  // (N,H,L,k)
  std::optional<Tensor> q_keep;
  if (key_lengths) {
    q_keep = q_idx.lt(key_lengths->to(keys.device(), torch::kLong).view({N, 1, 1, 1}));
  }
  auto q_mass = mass.gather(2, a_safe).unsqueeze(-1);  // (N, H, L, 1)
  auto weights = masked_softmax(scores, q_keep) * q_mass * valid.unsqueeze(-1);
  auto top_values = torch::matmul(maybe_dropout(weights, dropout).unsqueeze(-2), v_sel).squeeze(-2);
  return top_values;
}

}  // namespace

QueryClusters cluster_queries(const Tensor& queries, const std::optional<Tensor>& query_lengths,
                              int64_t clusters, int64_t iterations, int64_t bits, bool hash_bias,
                              at::Generator gen) {
  TORCH_CHECK(queries.dim() == 4, "cluster_queries: queries must have shape (N, H, L, E), got ",
              queries.sizes());
  TORCH_CHECK(bits >= 1 && bits <= 64, "cluster_queries: bits must be in [1, 64], got ", bits);
  const int64_t E = queries.size(3);
  Tensor planes;
  int64_t seed = 0;
  {
    // Drawn on the CPU from the caller's generator, then moved.
    torch::NoGradGuard no_grad;
    planes = torch::randn({bits, E + 1}, gen, torch::TensorOptions().dtype(torch::kDouble));
    if (!hash_bias) planes.select(1, E).zero_();
    seed = torch::randint(0, int64_t(1) << 62, {1}, gen, torch::kLong).item<int64_t>();
  }
  auto codes = hash_queries(queries.detach(), planes.to(queries.device(), queries.scalar_type()));
  auto [assignments, counts] = cluster_codes(codes, query_lengths, clusters, iterations, seed);
  return {assignments, counts};
}

Tensor cluster_centroids(const Tensor& queries, const QueryClusters& clusters) {
  check_clusters("cluster_centroids", queries, clusters);
  if (ops::cluster_members_supports(queries))
    return ops::cluster_means(queries, clusters.assignments, clusters.counts);
  const int64_t N = queries.size(0), H = queries.size(1), E = queries.size(3),
                C = clusters.counts.size(2);
  // The rows in memory order: the layers' (N, L, H, E) views are summed in place.
  const bool heads_in_rows = ops::heads_within_rows(queries);
  const auto rows = (heads_in_rows ? queries.transpose(1, 2) : queries).reshape({-1, E});
  auto sums = torch::zeros({N * H * C + 1, E}, queries.options())
                  .index_add(0, flat_cluster_index(clusters, heads_in_rows), rows);
  auto counts = clusters.counts.clamp_min(1).to(queries.scalar_type()).unsqueeze(-1);
  return sums.narrow(0, 0, N * H * C).view({N, H, C, E}) / counts;
}

namespace {

// The attention of the clusters' centroids over all keys: (N, H, C, M).
Tensor centroid_attention(const Tensor& queries, const Tensor& keys, const Tensor& values,
                          const QueryClusters& clusters, const std::optional<Tensor>& key_lengths,
                          std::optional<double> softmax_temp, double dropout) {
  auto centroids = cluster_centroids(queries, clusters);  // (N, H, C, E)
  Tensor centroid_values;                                 // (N, H, C, M)
  if (dropout > 0 && queries.device().is_cpu()) {
    // Fused in full attention's CPU kernels (the centroid rows' keep mask).
    centroid_values = full_attention(centroids, keys, values, std::nullopt, key_lengths,
                                     /*causal=*/false, softmax_temp, dropout);
  } else if (dropout > 0) {
    // Dropout acts on the weights, which the fused op never forms: (N,H,C,S).
    const double temp = temp_or_default(queries, softmax_temp);
    auto scores = torch::matmul(centroids, keys.transpose(-1, -2)) * temp;
    auto probs =
        masked_softmax(scores, key_keep(key_lengths, keys.size(0), keys.size(2), keys.device()));
    centroid_values = torch::matmul(maybe_dropout(probs, dropout), values);
  } else {
    ops::DenseAttentionSpec spec;
    spec.scale = temp_or_default(queries, softmax_temp);
    spec.key_lengths = to_c10(key_lengths);
    if (ops::types_use_dense_engine(centroids, values, spec))
      return ops::dense_attention(centroids, keys, values, spec);
    centroid_values = full_attention(centroids, keys, values, std::nullopt, key_lengths,
                                     /*causal=*/false, softmax_temp);
  }
  return centroid_values;
}

// Improved clustered attention composed on the dense-attention engine
// (issue 62): the centroids' pass over the keys (output, lse and top-k keys,
// fastattn's selecting kernel), the centroid's probabilities on its top-k keys
// P^c_T = exp(s_cT - lse_c), their mass m̂_c and the rest r_c = out_c -
// P^c_T V_T; the members' exact softmax over their cluster's top-k keys as
// packed variable-length sequences, one per (n, h, cluster), on the engine:
// out_i = m̂_c · softmax_T(q_i) V_T + r_c (eq. 9-11). Differentiable as
// composed (gathers, the engine's packed backward, the centroid pass's).
// Without key lengths (the top-k of a row with fewer valid keys than k holds
// masked keys, which the fused operator drops).
Tensor improved_clustered_on_engine(const Tensor& queries, const Tensor& keys, const Tensor& values,
                                    const QueryClusters& clusters, int64_t k, double temp) {
  const int64_t N = queries.size(0), H = queries.size(1), L = queries.size(2), E = queries.size(3),
                M = values.size(3), C = clusters.counts.size(2);
  auto centroids = cluster_centroids(queries, clusters);  // (N, H, C, E)
  auto [out_c, lse_c, top] =
      full_attention_lse_topk(centroids, keys, values, std::nullopt, temp, k);
  const auto gather_rows = [&](const Tensor& x) {  // (N, H, S, D) -> (N, H, C, k, D)
    const int64_t D = x.size(3);
    return x.gather(2, top.reshape({N, H, C * k, 1}).expand({N, H, C * k, D}))
        .view({N, H, C, k, D});
  };
  auto k_top = gather_rows(keys), v_top = gather_rows(values);
  auto p_top = ((centroids.unsqueeze(3) * k_top).sum(-1) * temp - lse_c.unsqueeze(-1)).exp();
  auto mass = p_top.sum(-1);                                 // (N, H, C)
  auto rest = out_c - (p_top.unsqueeze(-1) * v_top).sum(3);  // (N, H, C, M)
  // The members of each (n, h, c), in that order, one sequence each; the
  // padded queries (-1) last, one sequence without keys. Its sizes come from
  // the counts: nothing is read on the host.
  const auto& a = clusters.assignments;
  auto seq = (torch::arange(N * H, a.options()).view({N, H, 1}) * C + a).flatten();
  seq = seq.masked_fill(a.flatten().lt(0), N * H * C);
  auto order = std::get<1>(seq.sort(/*stable=*/true, 0, false));
  auto members = clusters.counts.flatten().to(torch::kLong);
  auto padded = (N * H * L - members.sum()).view({1});
  auto zero = torch::zeros({1}, members.options());
  ops::DenseAttentionSpec spec;
  spec.scale = temp;
  spec.cu_seqlens_q = torch::cat({zero, torch::cat({members, padded}).cumsum(0)});
  auto key_ends = torch::arange(N * H * C + 1, members.options()) * k;
  spec.cu_seqlens_k = torch::cat({key_ends, key_ends.narrow(0, N * H * C, 1)});
  spec.max_seqlen_q = L;
  spec.max_seqlen_k = k;
  auto q_sorted = queries.reshape({N * H * L, E}).index_select(0, order).view({N * H * L, 1, E});
  auto o_sorted = ops::dense_attention(q_sorted, k_top.reshape({N * H * C * k, 1, E}),
                                       v_top.reshape({N * H * C * k, 1, M}), spec);
  auto o_top = torch::zeros({N * H * L, M}, o_sorted.options())
                   .index_copy(0, order, o_sorted.view({N * H * L, M}))
                   .view({N, H, L, M});
  const auto per_query = [&](const Tensor& x) {  // (N, H, C, D) -> (N, H, L, D)
    return x.gather(2, a.clamp_min(0).unsqueeze(-1).expand({N, H, L, x.size(3)}));
  };
  auto valid = a.ge(0).unsqueeze(-1).to(o_top.scalar_type());
  return (per_query(mass.unsqueeze(-1)) * o_top + per_query(rest)) * valid;
}

}  // namespace

Tensor clustered_attention(const Tensor& queries, const Tensor& keys, const Tensor& values,
                           const QueryClusters& clusters, const std::optional<Tensor>& key_lengths,
                           std::optional<double> softmax_temp, double dropout) {
  return broadcast_to_queries(
      centroid_attention(queries, keys, values, clusters, key_lengths, softmax_temp, dropout),
      clusters, queries);
}

Tensor improved_clustered_attention(const Tensor& queries, const Tensor& keys, const Tensor& values,
                                    const QueryClusters& clusters, int64_t topk,
                                    const std::optional<Tensor>& key_lengths,
                                    std::optional<double> softmax_temp, double dropout) {
  TORCH_CHECK(topk >= 1, "improved_clustered_attention: topk must be >= 1, got ", topk);
  const int64_t N = queries.size(0), H = queries.size(1), L = queries.size(2), S = keys.size(2),
                M = values.size(3);
  if (S == 0) return torch::zeros({N, H, L, M}, queries.options());
  const int64_t k = std::min(topk, S);
  const double temp = temp_or_default(queries, softmax_temp);
  if (dropout > 0 && !queries.device().is_cpu()) {
    auto centroids = cluster_centroids(queries, clusters);  // (N, H, C, E)
    // Dropout acts on the centroid weights, so they are materialised:
    // A^c (N, H, C, S), its top-k keys and masses (eq. 9); the keys outside
    // the top-k keep the centroid's weights.
    const auto keep = key_keep(key_lengths, N, S, keys.device());  // (N, 1, 1, S)
    auto probs_c = masked_softmax(torch::matmul(centroids, keys.transpose(-1, -2)) * temp, keep);
    auto [top_p, top_idx] = probs_c.topk(k, -1);  // (N, H, C, k)
    auto mass = top_p.sum(-1);                    // (N, H, C): m̂_j
    auto rest = probs_c.scatter(-1, top_idx, 0.0);
    auto rest_values = torch::matmul(maybe_dropout(rest, dropout), values);  // (N, H, C, M)
    return top_part_with_dropout(queries, keys, values, clusters, top_idx, mass, key_lengths, temp,
                                 dropout) +
           broadcast_to_queries(rest_values, clusters, queries);
  }
  if (!key_lengths && dropout == 0) {
    ops::DenseAttentionSpec spec;
    spec.scale = temp;
    if (ops::types_use_dense_engine(queries, values, spec, /*pieces=*/true))
      return improved_clustered_on_engine(queries, keys, values, clusters, k, temp);
  }
  // The fused operator: one pass of the centroids over the keys (output,
  // log-sum-exp and top-k keys of each, never (N, H, C, S)), then per cluster
  // the members' exact top-k part plus the centroid's rest, one output and
  // one gradient buffer per input.
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("fastattn::improved_clustered_attention", "")
                       .typed<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                     const Tensor&, int64_t, const c10::optional<Tensor>&,
                                     c10::optional<double>, double, c10::optional<int64_t>)>();
  // With dropout (CPU), fused in it: the members' top-k weights and the
  // centroid's (its output and rest) drop, the seed drawn from torch's
  // generator; the masses stay undropped.
  return op.call(queries, keys, values, clusters.assignments, clusters.counts, k,
                 key_lengths ? c10::optional<Tensor>(*key_lengths) : c10::nullopt, temp, dropout,
                 c10::nullopt);
}

Tensor causal_improved_clustered_attention(const Tensor& queries,  // (N, H, L, E)
                                           const Tensor& keys,     // (N, H, S, E)
                                           const Tensor& values,   // (N, H, S, M)
                                           const QueryClusters& clusters, int64_t topk,
                                           int64_t local_context,
                                           const std::optional<Tensor>& key_lengths,
                                           std::optional<double> softmax_temp, double dropout) {
  const char* who = "causal_improved_clustered_attention";
  TORCH_CHECK(topk >= 1, who, ": topk must be >= 1, got ", topk);
  TORCH_CHECK(local_context >= 1, who, ": local_context must be >= 1, got ", local_context);
  check_clusters(who, queries, clusters);
  const int64_t N = queries.size(0), H = queries.size(1), L = queries.size(2), S = keys.size(2),
                M = values.size(3), C = clusters.counts.size(2);
  TORCH_CHECK(S == L, who,
              ": needs as many keys as queries (S == L) for causal masking, got L = ", L,
              " and S = ", S);
  if (L == 0) return torch::zeros({N, H, L, M}, queries.options());
  const int64_t k = std::min(topk, S), w = std::min(local_context, S), nb = (S + w - 1) / w;
  const double temp = temp_or_default(queries, softmax_temp);
  const auto lopt = queries.options().dtype(torch::kLong);

  // Prefix top-k per cluster and block: table[n, h, c, b] holds the k keys
  // j < b·w with the highest centroid scores (-1 where the prefix has fewer
  // than k keys). A running top-k over the blocks: block b's set is the top-k
  // of block b-1's set and the keys of block b-1. Selection only, no gradient.
  Tensor table = torch::full({N, H, C, nb, k}, -1, lopt);  // (N, H, C, nb, k)
  {
    torch::NoGradGuard no_grad;
    auto centroids = cluster_centroids(queries.detach(), clusters);           // (N, H, C, E)
    auto scores = torch::matmul(centroids, keys.detach().transpose(-1, -2));  // (N, H, C, S)
    const auto keep = key_keep(key_lengths, N, S, keys.device());             // (N, 1, 1, S)
    if (keep) scores.masked_fill_(keep->logical_not(), -std::numeric_limits<double>::infinity());
    if (scores.is_cpu()) {
      // float16 / bfloat16 scores rank the same widened (exactly) to float32.
      const Tensor ranked =
          (ops::is_reduced_float(scores) ? scores.to(torch::kFloat) : scores).contiguous();
      AT_DISPATCH_FLOATING_TYPES(ranked.scalar_type(), "causal_improved_clustered_table",
                                 [&] { prefix_topk_table<scalar_t>(ranked, k, w, table); });
    } else {  // a torch top-k per block
      auto key_idx = torch::arange(S, lopt).view({1, 1, 1, S}).expand({N, H, C, S});
      auto best_s =
          torch::full({N, H, C, k}, -std::numeric_limits<double>::infinity(), scores.options());
      auto best_i = torch::full({N, H, C, k}, -1, lopt);
      for (int64_t b = 1; b < nb; ++b) {
        auto cand_s = torch::cat({best_s, scores.narrow(3, (b - 1) * w, w)}, -1);  // (N,H,C,k+w)
        auto cand_i = torch::cat({best_i, key_idx.narrow(3, (b - 1) * w, w)}, -1);
        auto top = cand_s.topk(k, -1);
        best_s = std::get<0>(top);
        best_i = cand_i.gather(-1, std::get<1>(top));
        table.select(3, b).copy_(best_i);
      }
    }
  }

  // Per query i (block i / w): its cluster's prefix set, keeping j <= i - w
  // (the later keys are in the window), and the window i - w + 1 .. i; -1
  // marks an empty slot. Every index is in [0, i]: no key after i is read.
  auto a = clusters.assignments;      // (N, H, L)
  auto pos = torch::arange(L, lopt);  // (L,)
  auto row = a.clamp_min(0) * nb + torch::div(pos, w, "floor").view({1, 1, L});
  auto top = table.view({N, H, C * nb, k}).gather(2, row.unsqueeze(-1).expand({N, H, L, k}));
  top = top.masked_fill(top.gt((pos - w).view({1, 1, L, 1})), -1);
  auto win = (pos.view({L, 1}) - (w - 1) + torch::arange(w, lopt).view({1, w}))
                 .clamp_min(-1)
                 .view({1, 1, L, w})
                 .expand({N, H, L, w});
  auto idx = torch::cat({top, win}, -1);  // (N, H, L, k + w)
  // One set per query: the fused top-k operator with mass 1 reads the keys in
  // place (no (N, H, L, k + w, E) gather) and has its own backward. Padded
  // queries (cluster -1) get no set and output zeros.
  auto self = torch::arange(L, lopt).view({1, 1, L}).expand({N, H, L}).masked_fill(a.lt(0), -1);
  auto mass = torch::ones({N, H, L}, queries.options());
  return clustered_topk_attention(queries, keys, values, idx, mass, self.contiguous(), key_lengths,
                                  temp, dropout);
}

Tensor exact_topk_attention(const Tensor& queries, const Tensor& keys, const Tensor& values,
                            int64_t topk, const std::optional<Tensor>& key_lengths,
                            std::optional<double> softmax_temp, double dropout) {
  TORCH_CHECK(topk >= 1, "exact_topk_attention: topk must be >= 1, got ", topk);
  const int64_t N = queries.size(0), H = queries.size(1), L = queries.size(2), S = keys.size(2),
                M = values.size(3);
  if (S == 0 || L == 0) return torch::zeros({N, H, L, M}, queries.options());
  const int64_t k = std::min(topk, S);
  const double temp = temp_or_default(queries, softmax_temp);
  // Top-k key indices per query from exact scores, a chunk of queries at a
  // time so that at most about 2^22 scores exist at once.
  auto idx = torch::empty({N, H, L, k}, queries.options().dtype(torch::kLong));
  {
    torch::NoGradGuard no_grad;
    const auto keep = key_keep(key_lengths, N, S, keys.device());  // (N, 1, 1, S)
    const int64_t chunk =
        std::max<int64_t>(1, (int64_t(1) << 22) / std::max<int64_t>(1, N * H * S));
    auto kt = keys.detach().transpose(-1, -2);
    for (int64_t l0 = 0; l0 < L; l0 += chunk) {
      const int64_t n = std::min(chunk, L - l0);
      auto scores = torch::matmul(queries.detach().narrow(2, l0, n), kt);  // (N, H, n, S)
      if (keep) scores.masked_fill_(keep->logical_not(), -std::numeric_limits<double>::infinity());
      idx.narrow(2, l0, n).copy_(std::get<1>(scores.topk(k, -1)));
    }
  }
  // One cluster per query with mass 1: the sparse top-k kernel.
  auto self = torch::arange(L, idx.options()).view({1, 1, L}).expand({N, H, L}).contiguous();
  auto mass = torch::ones({N, H, L}, queries.options());
  return clustered_topk_attention(queries, keys, values, idx, mass, self, key_lengths, temp,
                                  dropout);
}

ExactTopkAttention::ExactTopkAttention(int64_t topk, std::optional<double> softmax_temp,
                                       double attention_dropout)
    : topk_(topk), softmax_temp_(softmax_temp), attention_dropout_(attention_dropout) {
  TORCH_CHECK(topk_ >= 1, "ExactTopkAttention: topk must be >= 1, got ", topk_);
  check_attention_dropout("ExactTopkAttention", attention_dropout);
  check_softmax_temp("ExactTopkAttention", softmax_temp_);
}

Tensor ExactTopkAttention::forward(const Tensor& queries,  // (N, H, L, E)
                                   const Tensor& keys,     // (N, H, S, E)
                                   const Tensor& values,   // (N, H, S, M)
                                   const Mask& mask) {
  check_attention_inputs(type_name(), queries, keys, values, mask);
  return exact_topk_attention(queries, keys, values, topk_, mask.key_lengths(), softmax_temp_,
                              is_training() ? attention_dropout_ : 0.0);
}

// ---- the attention types ------------------------------------------------------

namespace {
// Checks the options every clustered type shares, naming `who`; returns its seeded
// generator, or the global one without a seed.
at::Generator checked_clustered_generator(const char* who, const ClusteredOptions& o) {
  TORCH_CHECK(o.clusters >= 1, who, ": clusters must be >= 1, got ", o.clusters);
  TORCH_CHECK(o.iterations >= 0 && o.iterations <= kMaxClusterIterations, who,
              ": iterations must be in [0, ", kMaxClusterIterations, "], got ", o.iterations);
  TORCH_CHECK(o.bits >= 1 && o.bits <= 64, who, ": bits must be in [1, 64], got ", o.bits);
  TORCH_CHECK(o.topk >= 1, who, ": topk must be >= 1, got ", o.topk);
  check_softmax_temp(who, o.softmax_temp);
  check_attention_dropout(who, o.attention_dropout);
  return o.seed ? at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(*o.seed))
                : at::detail::getDefaultCPUGenerator();
}
}  // namespace

ClusteredAttention::ClusteredAttention(ClusteredOptions options, bool improved)
    : options_(std::move(options)), improved_(improved) {
  const char* who = improved ? "ImprovedClusteredAttention" : "ClusteredAttention";
  gen_ = checked_clustered_generator(who, options_);
}

Tensor ClusteredAttention::forward(const Tensor& queries,  // (N, H, L, E)
                                   const Tensor& keys,     // (N, H, S, E)
                                   const Tensor& values,   // (N, H, S, M)
                                   const Mask& mask) {
  check_attention_inputs(type_name(), queries, keys, values, mask);
  auto clusters = cluster_queries(queries, mask.query_lengths(), options_.clusters,
                                  options_.iterations, options_.bits, options_.hash_bias, gen_);
  const double dropout = is_training() ? options_.attention_dropout : 0.0;
  if (improved_) {
    return improved_clustered_attention(queries, keys, values, clusters, options_.topk,
                                        mask.key_lengths(), options_.softmax_temp, dropout);
  }
  auto centroid_values = centroid_attention(queries, keys, values, clusters, mask.key_lengths(),
                                            options_.softmax_temp, dropout);
  centroid_values_ = centroid_values.detach();  // without the graph
  return broadcast_to_queries(centroid_values, clusters, queries);
}

CausalImprovedClusteredAttention::CausalImprovedClusteredAttention(ClusteredOptions options)
    : options_(std::move(options)) {
  const char* who = "CausalImprovedClusteredAttention";
  TORCH_CHECK(options_.local_context >= 1, who, ": local_context must be >= 1, got ",
              options_.local_context);
  gen_ = checked_clustered_generator(who, options_);
}

Tensor CausalImprovedClusteredAttention::forward(const Tensor& queries,  // (N, H, L, E)
                                                 const Tensor& keys,     // (N, H, S, E)
                                                 const Tensor& values,   // (N, H, S, M)
                                                 const Mask& mask) {
  check_attention_inputs(type_name(), queries, keys, values, mask);
  TORCH_CHECK(keys.size(2) == queries.size(2),
              "causal-improved-clustered: needs as many keys as queries (S == L), got queries ",
              queries.sizes(), " and keys ", keys.sizes());
  auto clusters = cluster_queries(queries, mask.query_lengths(), options_.clusters,
                                  options_.iterations, options_.bits, options_.hash_bias, gen_);
  return causal_improved_clustered_attention(
      queries, keys, values, clusters, options_.topk, options_.local_context, mask.key_lengths(),
      options_.softmax_temp, is_training() ? options_.attention_dropout : 0.0);
}

// ---- registration ---------------------------------------------------------------

namespace {

// The hashing and clustering parameters of every clustered type, then the
// type's own (`own`), then softmax_temp, attention_dropout and seed.
std::vector<ParamSpec> clustered_specs(std::vector<ParamSpec> own) {
  std::vector<ParamSpec> specs = {
      ParamSpec::integer("clusters", 100,
                         "number of query clusters C (clamped to the valid queries)", 1),
      ParamSpec::integer("iterations", 10,
                         "Lloyd iterations of the Hamming K-means (fewer once nothing changes)", 0,
                         double(kMaxClusterIterations)),
      ParamSpec::integer("bits", 63, "bits B of the query hash", 1, 64),
      ParamSpec::boolean("hash_bias", true, "random bias in the hash planes")};
  specs.insert(specs.end(), own.begin(), own.end());
  specs.push_back(softmax_temp_spec());
  specs.push_back(attention_dropout_spec());
  specs.push_back(seed_spec("planes, K-means initialisation"));
  return specs;
}

// The options every clustered type reads (clustered_specs' shared ones).
ClusteredOptions clustered_options(const Params& p) {
  ClusteredOptions o;
  o.clusters = p.get_int("clusters");
  o.iterations = p.get_int("iterations");
  o.bits = p.get_int("bits");
  o.hash_bias = p.get_bool("hash_bias");
  o.softmax_temp = p.get_optional_float("softmax_temp");
  o.attention_dropout = p.get_float("attention_dropout");
  o.seed = p.get_optional_int("seed");
  return o;
}

AttentionPtr build_clustered(const Params& p, bool improved) {
  ClusteredOptions o = clustered_options(p);
  if (improved) o.topk = p.get_int("topk");
  return std::make_shared<ClusteredAttention>(o, improved);
}

AttentionPtr build_causal_improved_clustered(const Params& p) {
  ClusteredOptions o = clustered_options(p);
  o.topk = p.get_int("topk");
  o.local_context = p.get_int("local_context");
  return std::make_shared<CausalImprovedClusteredAttention>(o);
}

std::vector<ParamSpec> causal_improved_clustered_specs() {
  return clustered_specs(
      {ParamSpec::integer("topk", 32,
                          "keys per cluster and block, taken from the keys before the block "
                          "(clamped to S)",
                          1),
       ParamSpec::integer("local_context", 32,
                          "local causal window: every query also attends to its last "
                          "local_context keys (also the block length of the top-k sets)",
                          1)});
}

}  // namespace

void register_clustered_attention_types(AttentionRegistry& registry) {
  registry.add({"clustered",
                "queries hashed and clustered (Hamming K-means); attention once per centroid, "
                "broadcast to the members: O(L·C) (Vyas et al. 2020)",
                clustered_specs({}),
                [](const Params& p, const AttentionDims&) { return build_clustered(p, false); },
                Capabilities().bidirectional_only("causal-improved-clustered").selecting(),
                /*recurrent=*/nullptr});
  registry.add({"improved-clustered",
                "clustered attention with exact per-query weights on each cluster's top-k keys "
                "(Vyas et al. 2020, eq. 9-10)",
                clustered_specs({ParamSpec::integer(
                    "topk", 32,
                    "keys per cluster whose weights are recomputed per query (clamped to S)", 1)}),
                [](const Params& p, const AttentionDims&) { return build_clustered(p, true); },
                Capabilities().bidirectional_only("causal-improved-clustered").selecting(),
                /*recurrent=*/nullptr});
  registry.add(
      {"causal-improved-clustered",
       "causal improved clustered attention: exact softmax over the cluster's top-k "
       "keys chosen before the query's block plus a local causal window; no key after "
       "a query reaches its output",
       causal_improved_clustered_specs(),
       [](const Params& p, const AttentionDims&) { return build_causal_improved_clustered(p); },
       Capabilities().causal_only("improved-clustered").selecting(),
       /*recurrent=*/nullptr});
  registry.add({"exact-topk",
                "each query attends to its own top-k keys by exact score (softmax over those k); "
                "O(L·S) to select them, O(L·k) memory",
                {ParamSpec::integer("topk", 32, "keys per query (clamped to S)", 1),
                 softmax_temp_spec(), attention_dropout_spec()},
                [](const Params& p, const AttentionDims&) -> AttentionPtr {
                  return std::make_shared<ExactTopkAttention>(p.get_int("topk"),
                                                              p.get_optional_float("softmax_temp"),
                                                              p.get_float("attention_dropout"));
                },
                Capabilities().bidirectional_only("").as_oracle().selecting(),
                /*recurrent=*/nullptr});
}

}  // namespace fastattn
