// C++ entry points of the fastattn operators. Each one calls the operator
// through the PyTorch dispatcher (torch.ops.fastattn.<op> in Python), so
// autograd and every registered backend apply.
//
// Layout: queries (N, H, L, E), keys (N, H, S, E), values (N, H, S, M),
// outputs (N, H, L, M).
#pragma once

#include <torch/torch.h>

#include <optional>

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

namespace reference {
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

}  // namespace fastattn
