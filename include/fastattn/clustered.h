// Clustered and improved clustered attention (Vyas, Katharopoulos, Fleuret
// 2020, "Fast Transformers with Clustered Attention", sec. 3.2-3.3).
//
//   clustered:          hash the queries (B-bit sign of random projections),
//                       K-means in Hamming space (C clusters, Lloyd iterations),
//                       centroid = mean of its member queries, softmax attention
//                       of the C centroids over all keys, each query takes its
//                       centroid's output. O(N·H·(L·B·E + iters·L·C + C·S·(E+M))).
//   improved-clustered: as clustered, plus per cluster the top-k keys of the
//                       centroid attention; each query computes exact scores on
//                       those k keys, softmaxes them and scales them by the
//                       centroid's probability mass on them (eq. 9-10); the
//                       other keys keep the centroid's weights. Adds
//                       O(N·H·L·k·(E+M)).
//
// Gradients reach the queries through the centroids (and, for improved,
// through the exact top-k scores), and the keys and values. Padded queries
// (query lengths) join no cluster and output zeros. See
// docs/clustered-attention.md.
#pragma once

#include <ATen/core/Generator.h>
#include <torch/torch.h>

#include <optional>
#include <utility>

#include "fastattn/attention.h"

namespace fastattn {

// A clustering of the queries of every (n, h).
struct QueryClusters {
  torch::Tensor assignments;  // (N, H, L) int64: cluster in [0, C) or -1 (padded query)
  torch::Tensor counts;       // (N, H, C) int64: members per cluster (0: empty)
};

// Hashes `queries` (N, H, L, E) with `bits` random planes (biased when
// hash_bias) drawn from `gen`, then clusters the codes (fastattn::hash_queries,
// fastattn::cluster_codes; the K-means seed is drawn from `gen` too).
// query_lengths (N,): queries at l >= length are padding.
QueryClusters cluster_queries(const torch::Tensor& queries,
                              const std::optional<torch::Tensor>& query_lengths, int64_t clusters,
                              int64_t iterations, int64_t bits, bool hash_bias, at::Generator gen);

// Mean of each cluster's member queries: (N, H, C, E); zero for empty clusters.
// Differentiable with respect to `queries`.
torch::Tensor cluster_centroids(const torch::Tensor& queries, const QueryClusters& clusters);

// Attention of the centroids over all keys (fused full attention; with
// dropout > 0 in training, a composite path holding the (N, H, C, S)
// weights), broadcast to the members: (N, H, L, M).
torch::Tensor clustered_attention(const torch::Tensor& queries, const torch::Tensor& keys,
                                  const torch::Tensor& values, const QueryClusters& clusters,
                                  const std::optional<torch::Tensor>& key_lengths = std::nullopt,
                                  std::optional<double> softmax_temp = std::nullopt,
                                  double dropout = 0.0);

// Improved clustered attention (eq. 9-10) with topk keys per cluster
// (clamped to S): (N, H, L, M). With topk >= S it equals full attention.
torch::Tensor improved_clustered_attention(
    const torch::Tensor& queries, const torch::Tensor& keys, const torch::Tensor& values,
    const QueryClusters& clusters, int64_t topk,
    const std::optional<torch::Tensor>& key_lengths = std::nullopt,
    std::optional<double> softmax_temp = std::nullopt, double dropout = 0.0);

// exact-topk (the "oracle top-k" of the paper's comparisons): each query
// attends only to its own top-k keys by exact score (softmax over those k):
// O(N·H·L·S·E) to find them (scores in chunks of queries, O(chunk·S) memory),
// O(N·H·L·k·(E+M)) for the attention (fastattn::clustered_topk_attention with
// one "cluster" per query). topk is clamped to S; with topk >= S it equals
// full attention. Gradients flow to q, k, v (the selection is piecewise
// constant). dropout: attention dropout on the k weights, fused (CPU; the
// mask full attention would draw for them, the seed from torch's generator).
torch::Tensor exact_topk_attention(const torch::Tensor& queries, const torch::Tensor& keys,
                                   const torch::Tensor& values, int64_t topk,
                                   const std::optional<torch::Tensor>& key_lengths = std::nullopt,
                                   std::optional<double> softmax_temp = std::nullopt,
                                   double dropout = 0.0);

// causal-improved-clustered: exact softmax attention of query i over the
// union of
//   (a) the keys j <= i - local_context of its cluster's *prefix* top-k set
//       for i's block: blocks of local_context positions; for block b (the
//       positions [b·w, (b+1)·w), w = local_context) the set holds the topk
//       keys j < b·w with the highest centroid score (centroid · k_j), and
//   (b) the local causal window of keys i - w + 1 .. i.
// The key selection for query i reads only keys j < b·w <= i and the keys
// entering its softmax are all <= i, so keys and values after position i
// never change out_i (and d out_i / d(k_j, v_j) = 0 for j > i). With
// topk >= S the union is every key j <= i: exact causal attention. Needs
// S == L. Key lengths: padded keys are never attended; padded queries (-1)
// output zeros. Cost O(N·H·(C·S·E + (S/w)·C·(k + w) + L·(k + w)·(E + M)));
// extra memory O(N·H·(C·S + C·(S/w)·k + L·(k + w)·(E + M))).
torch::Tensor causal_improved_clustered_attention(
    const torch::Tensor& queries, const torch::Tensor& keys, const torch::Tensor& values,
    const QueryClusters& clusters, int64_t topk, int64_t local_context,
    const std::optional<torch::Tensor>& key_lengths = std::nullopt,
    std::optional<double> softmax_temp = std::nullopt, double dropout = 0.0);

struct ClusteredOptions {
  int64_t clusters = 100;
  int64_t iterations = 10;
  int64_t bits = 63;
  bool hash_bias = true;
  std::optional<double> softmax_temp;
  double attention_dropout = 0.0;
  // Seeds the module's own generator; without it the default CPU generator
  // (torch::manual_seed) is used. Each forward draws fresh planes.
  std::optional<int64_t> seed;
  int64_t topk = 32;           // improved-clustered and causal-improved-clustered
  int64_t local_context = 32;  // causal-improved-clustered only
};

// `clustered` (improved = false) and `improved-clustered` (improved = true).
// Masks: key lengths and query lengths; an attention mask or causal masking
// is an error (use full attention, or a causal clustered type).
class ClusteredAttention : public AttentionBase {
 public:
  explicit ClusteredAttention(ClusteredOptions options = {}, bool improved = false);
  torch::Tensor forward(const torch::Tensor& queries, const torch::Tensor& keys,
                        const torch::Tensor& values, const Mask& mask) override;
  std::string type_name() const override { return improved_ ? "improved-clustered" : "clustered"; }
  const ClusteredOptions& options() const { return options_; }
  // Plain clustered attention: the last forward's centroid values.
  torch::Tensor take_finite_witness() override { return std::exchange(centroid_values_, {}); }

 private:
  ClusteredOptions options_;
  bool improved_;
  at::Generator gen_;
  torch::Tensor centroid_values_;
};

// `causal-improved-clustered` (see causal_improved_clustered_attention).
// Needs a causal mask and S == L; masks: key and query lengths; an attention
// mask is an error. attention_dropout is not used.
class CausalImprovedClusteredAttention : public AttentionBase {
 public:
  explicit CausalImprovedClusteredAttention(ClusteredOptions options = {});
  torch::Tensor forward(const torch::Tensor& queries, const torch::Tensor& keys,
                        const torch::Tensor& values, const Mask& mask) override;
  std::string type_name() const override { return "causal-improved-clustered"; }
  const ClusteredOptions& options() const { return options_; }

 private:
  ClusteredOptions options_;
  at::Generator gen_;
};

// `exact-topk`. Masks: key lengths (query lengths are ignored: padded
// queries still attend, as in full); an attention mask or causal masking is
// an error.
class ExactTopkAttention : public AttentionBase {
 public:
  explicit ExactTopkAttention(int64_t topk = 32, std::optional<double> softmax_temp = std::nullopt,
                              double attention_dropout = 0.0);
  torch::Tensor forward(const torch::Tensor& queries, const torch::Tensor& keys,
                        const torch::Tensor& values, const Mask& mask) override;
  std::string type_name() const override { return "exact-topk"; }

 private:
  int64_t topk_;
  std::optional<double> softmax_temp_;
  double attention_dropout_;  // in training mode
};

}  // namespace fastattn
