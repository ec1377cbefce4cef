// ClusterFormer: neural clustering attention (Wang et al. 2022).
//
// Given token states X (N, L, D) and centroids C (k, D):
//   1. U = softmax over tokens j of C_i · (X_j W_C)            (N, k, L)
//   2. C' = U (X W_C)                                           (N, k, D)
//   3. I_j = argmax_i U_ij; tokens are sorted by (I_j, j)       (the order is kept)
//   4. the sorted q, k, v are cut into k blocks of w = ceil(L/k) tokens (the
//      last padded); query block b attends to key blocks b-1 and b (2w keys;
//      block 0 sees only itself, no wrap-around); softmax attention per head
//   5. outputs go back to the original token order
//   6. L1 = -(1/L) sum_j X_j · C'_{I_j}  (clustering loss),
//      L2 = -(1/k)(sum_{i=2..k} C'_i · C'_{i-1} + C'_1 · C'_k)  (sorting loss),
//      both averaged over the batch; training adds w1·L1 + w2·L2 to the task
//      loss (AttentionBase::take_auxiliary_loss).
// Cost O(N·(L·k·D + H·L·w·E)) time, O(N·(k·L + H·L·(E+M) + L·w)) memory.
//
// Where it sits: attention types receive projected queries (N, H, L, E). The
// type clusters X = the queries with the heads concatenated (D = H·E), so the
// clustering projection W_C (D × D, owned by the type) acts on X W_Q. Since
// q, k, v are row-wise projections of the hidden states, sorting q, k, v by
// the cluster order is exactly "sort X, then project". See
// docs/attention-types.md (ClusterFormer) and docs/architecture.md.
#pragma once

#include <ATen/core/Generator.h>
#include <torch/torch.h>

#include <memory>
#include <optional>
#include <string>

#include "fastattn/attention.h"

namespace fastattn {

// The clustering step (1-3 and 6) for token states x.
struct ClusterFormerClustering {
  torch::Tensor assignments;        // (N, L) int64: cluster in [0, k), k for padded tokens
  torch::Tensor order;              // (N, L) int64: order[n, t] = original position of slot t
  torch::Tensor updated_centroids;  // (N, k, D): C' (differentiable)
  torch::Tensor clustering_loss;    // scalar L1, mean over the batch (differentiable)
  torch::Tensor sorting_loss;       // scalar L2, mean over the batch (differentiable)
};

// x: (N, L, D) token states; centroids: (k, D) or (N, k, D); projection: W_C
// as a (D, D) matrix (x W_C = x.matmul(projection)); lengths (N,): tokens at
// positions >= lengths[n] are padding: they take no part in U, C' or L1, get
// cluster k and sort last. Gradients reach x, centroids and projection through
// U, C' and the losses (the assignment itself is piecewise constant).
ClusterFormerClustering clusterformer_cluster(
    const torch::Tensor& x, const torch::Tensor& centroids, const torch::Tensor& projection,
    const std::optional<torch::Tensor>& lengths = std::nullopt);

// Steps 4-5 for a given order (N, L) (a permutation of 0..L-1 per batch
// element, e.g. ClusterFormerClustering::order): q (N,H,L,E), k (N,H,L,E),
// v (N,H,L,M) -> (N,H,L,M) in the original order. Needs S == L.
//   key_lengths (N,): keys at original positions >= length are never attended;
//   causal: a query only attends to keys whose original position is <= its
//   own (in the sorted order a later token may sit before it).
// A query that keeps no key outputs zeros. Built on the fused full_attention
// operator over an (N·k, H, w, E) × (N·k, H, 2w, E) block view with a
// (N·k, w, 2w) keep mask, and gather_tokens for sort / unsort.
//   dropout_p, dropout_seed: attention dropout (CPU), full_attention's on the
//   block view (each weight of a query over its window on its own).
torch::Tensor clusterformer_block_attention(
    const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
    const torch::Tensor& order, int64_t clusters,
    const std::optional<torch::Tensor>& key_lengths = std::nullopt, bool causal = false,
    std::optional<double> softmax_temp = std::nullopt, double dropout_p = 0.0,
    std::optional<int64_t> dropout_seed = std::nullopt);

// Bound on ClusterFormer's k: the centroids are learned parameters (k × H·E)
// and clustering scores every token against each of them (N × L × k), so k
// is a model size, not something the inputs can clamp.
constexpr int64_t kMaxClusterFormerClusters = 65536;

struct ClusterFormerOptions {
  int64_t clusters = 8;                  // k, in [1, kMaxClusterFormerClusters]
  double clustering_loss_weight = 0.01;  // w1 of L1
  double sorting_loss_weight = 0.01;     // w2 of L2
  // "handed": inside a TransformerEncoder/Decoder stack a layer clusters with
  // the previous layer's updated centroids C' (the paper); the first layer (or
  // a type used alone) with its own learned centroids. "per-layer": every
  // layer with its own learned centroids.
  std::string centroid_mode = "handed";
  std::optional<double> softmax_temp;  // default 1/sqrt(E)
  // Seeds the initialisation of the centroids and W_C; without it the global
  // CPU generator (torch::manual_seed).
  std::optional<int64_t> seed;
  double attention_dropout = 0.0;  // in training mode, fused (CPU)
};

// `clusterformer`. Self-attention only: needs S == L (the tokens are the
// keys). Masks: key lengths and query lengths (a token past either is padding
// for the clustering; keys past key_lengths are never attended), causal (see
// clusterformer_block_attention; the clustering itself sees every valid
// token). An attention mask is an error.
// Parameters: "centroids" (k, D) and "centroid_projection" (D, D), D = H·E.
class ClusterFormerAttention : public AttentionBase {
 public:
  ClusterFormerAttention(ClusterFormerOptions options, const AttentionDims& dims);
  torch::Tensor forward(const torch::Tensor& queries, const torch::Tensor& keys,
                        const torch::Tensor& values, const Mask& mask) override;
  std::string type_name() const override { return "clusterformer"; }
  // w1·L1 + w2·L2 summed over the forward calls since the last take.
  torch::Tensor take_auxiliary_loss() override;

  const ClusterFormerOptions& options() const { return options_; }
  const torch::Tensor& centroids() const { return centroids_; }
  const torch::Tensor& projection() const { return projection_; }
  // The clustering of the last forward call (for inspection and tests).
  const ClusterFormerClustering& last_clustering() const { return last_; }

  // "handed" mode: this layer clusters with `previous`'s C' of the same
  // forward pass (link_clusterformer_centroids sets this up).
  void follow(const std::shared_ptr<ClusterFormerAttention>& previous);

 private:
  torch::Tensor take_handed_centroids(int64_t batch);

  ClusterFormerOptions options_;
  int64_t dim_;
  torch::Tensor centroids_, projection_;
  torch::Tensor aux_loss_;
  ClusterFormerClustering last_;
  std::weak_ptr<ClusterFormerAttention> previous_;
  bool hands_on_ = false;
  torch::Tensor handed_;
};

// Links the "handed"-mode ClusterFormer types of a stack: within `model`,
// types at the same place of consecutive layers ("layers.<i>.<path>") are
// chained in layer order, so layer i+1 clusters with layer i's C'. Called by
// the TransformerEncoder and TransformerDecoder constructors; a no-op for
// stacks without ClusterFormer. Layers of different widths are not linked.
void link_clusterformer_centroids(torch::nn::Module& model);

}  // namespace fastattn
