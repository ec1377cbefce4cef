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

namespace reference {
// Plain-ATen oracle with the same contract (materialises L×S): for tests and
// benchmarks only.
torch::Tensor full_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                             const std::optional<torch::Tensor>& attn_mask = std::nullopt,
                             const std::optional<torch::Tensor>& key_lengths = std::nullopt,
                             bool causal = false,
                             std::optional<double> softmax_temp = std::nullopt);
}  // namespace reference

}  // namespace fastattn
