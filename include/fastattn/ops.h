// C++ entry points of the fastattn operators. Each one calls the operator
// through the PyTorch dispatcher (torch.ops.fastattn.<op> in Python), so
// autograd and every registered backend apply.
//
// Layout: queries (N, H, L, E), keys (N, H, S, E), values (N, H, S, M),
// outputs (N, H, L, M).
#pragma once

#include <torch/torch.h>

#include <optional>
#include <tuple>

namespace fastattn {

// Exact softmax attention, fused: tiles of queries × keys with an online
// softmax, never an L×S matrix (extra memory O(N·H·L)).
//   attn_mask:   (L, S), (N, L, S) or (N, H, L, S); bool (true = keep) or additive.
//   key_lengths: (N,) integers in [0, S]; keys at positions >= length are ignored.
//   causal:      query i sees key j iff j <= i + (S - L).
//   softmax_temp: scale of the scores, default 1/sqrt(E).
// A query that sees no key outputs zeros. Gradients flow to q, k and v (not to
// an additive mask).
torch::Tensor full_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                             const std::optional<torch::Tensor>& attn_mask = std::nullopt,
                             const std::optional<torch::Tensor>& key_lengths = std::nullopt,
                             bool causal = false,
                             std::optional<double> softmax_temp = std::nullopt);

// Causal linear product (unnormalised causal linear attention, Katharopoulos
// et al. 2020): q, k already feature-mapped (N, H, L, F), v (N, H, L, M) ->
// (N, H, L, M) with out_i = sum_{j<=i} (q_i·k_j) v_j. Chunked kernels with a
// carried F×M state: O(N·H·L·F·M) time, O(L·(F+M)) memory, never L×F×M.
// Requires the same length L for q, k and v. Gradients flow to q, k and v.
torch::Tensor causal_linear_product(const torch::Tensor& q, const torch::Tensor& k,
                                    const torch::Tensor& v);

// elu(x) + 1 elementwise, the default feature map of linear attention
// (vectorised CPU kernels; ATen's elu runs scalar in Debian's build).
// float32 / float64, any shape; gradients flow to x.
torch::Tensor elu_feature_map(const torch::Tensor& x);

// Clustered attention, step 1: sign-of-random-projection hashing. Bit b of a
// query's code is 1 iff x·planes[b, :E] + planes[b, E] > 0.
//   x:      (N, H, L, E) float32 or float64
//   planes: (B, E + 1), 1 <= B <= 64, x's dtype; draw them from a seeded
//           torch::Generator (last column zero for hashing without bias).
// Returns (N, H, L) int64 codes (bit 63 included: the uint64 bit pattern).
torch::Tensor hash_queries(const torch::Tensor& x, const torch::Tensor& planes);

// Clustered attention, step 2: K-means in Hamming space, per (n, h).
//   codes:   (N, H, L) int64 from hash_queries
//   lengths: (N,) integers in [0, L]: queries at l >= lengths[n] are padding,
//            never assigned (-1) and never counted
//   clusters C >= 1, clamped per batch element to its valid queries (extra
//   clusters stay empty); iterations >= 0 Lloyd updates; seed: the
//   initialisation (farthest-first over distinct valid queries), same seed same result.
// Returns assignments (N, H, L) int64 in [0, C) or -1, counts (N, H, C) int64.
// Every cluster below min(C, valid queries) has >= 1 member (empty clusters
// are re-seeded with the farthest query; see kernels/clustering/clustering.h).
std::tuple<torch::Tensor, torch::Tensor> cluster_codes(const torch::Tensor& codes,
                                                       const std::optional<torch::Tensor>& lengths,
                                                       int64_t clusters, int64_t iterations,
                                                       int64_t seed);

// Improved clustered attention, the per-query sparse part (eq. 10): query l
// of cluster j = assignments[l] outputs
//   mass[j] · Σ_t softmax_t(softmax_temp · q_l·k_{topk[j,t]}) v_{topk[j,t]}
// over the keys before key_lengths[n]; padded queries (-1) output zeros.
//   topk: (N, H, C, K) int64 key indices in [0, S); mass: (N, H, C) (q's dtype);
//   assignments: (N, H, L) int64 in [-1, C).
// Reads keys and values in place: O(N·H·L·K·(E + M)). Gradients flow to q, k,
// v and mass.
torch::Tensor clustered_topk_attention(const torch::Tensor& q, const torch::Tensor& k,
                                       const torch::Tensor& v, const torch::Tensor& topk,
                                       const torch::Tensor& mass, const torch::Tensor& assignments,
                                       const std::optional<torch::Tensor>& key_lengths,
                                       double softmax_temp);

namespace reference {
// Plain-ATen hashing: (x·W^T + b > 0) packed into int64.
torch::Tensor hash_queries(const torch::Tensor& x, const torch::Tensor& planes);

// torch::elu(x) + 1: for tests and benchmarks only.
torch::Tensor elu_feature_map(const torch::Tensor& x);

// tril(q k^T) v in plain ATen (O(L²) memory): for tests and benchmarks only.
torch::Tensor causal_linear_product(const torch::Tensor& q, const torch::Tensor& k,
                                    const torch::Tensor& v);

// Plain-ATen oracle with the same contract (materialises L×S): for tests and
// benchmarks only.
torch::Tensor full_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                             const std::optional<torch::Tensor>& attn_mask = std::nullopt,
                             const std::optional<torch::Tensor>& key_lengths = std::nullopt,
                             bool causal = false,
                             std::optional<double> softmax_temp = std::nullopt);
}  // namespace reference

// ClusterFormer's sort / unsort: every (n, h) slice of x takes its rows in the
// order of a per-batch index shared by the heads.
//   x: (N, H, L, E) float32 / float64; index: (N, T) int64 in [-1, L)
// Returns (N, H, T, E): out[n, h, t] = x[n, h, index[n, t]], zero rows where
// index = -1. Indices may repeat; the gradient to x is a scatter-add.
// O(N·H·T·E).
torch::Tensor gather_tokens(const torch::Tensor& x, const torch::Tensor& index);

namespace reference {
// Plain-ATen gather_tokens (torch::gather): for tests only.
torch::Tensor gather_tokens(const torch::Tensor& x, const torch::Tensor& index);
}  // namespace reference

}  // namespace fastattn
