// Mask checks and dense forms shared by the operators' entry points and
// references (internal).
#pragma once

#include <torch/torch.h>

#include <optional>

namespace fastattn::ops {

// Validates attn_mask ((L,S), (N,L,S) or (N,H,L,S); bool or floating) and
// key_lengths ((N,) integer, values in [0, S]) for an op named `op`.
void check_masks(const char* op, const torch::Tensor& q, int64_t S,
                 const std::optional<torch::Tensor>& attn_mask,
                 const std::optional<torch::Tensor>& key_lengths);

// attn_mask viewed as (N, H, L, S) (stride 0 on broadcast dims).
torch::Tensor broadcast_mask(const torch::Tensor& attn_mask, int64_t N, int64_t H, int64_t L,
                             int64_t S);

// (N, 1 or H, L, S) bool: true where a query keeps a key (boolean mask,
// key lengths, causal; an additive mask's -inf entries count as dropped).
torch::Tensor dense_keep(int64_t N, int64_t L, int64_t S,
                         const std::optional<torch::Tensor>& attn_mask,
                         const std::optional<torch::Tensor>& key_lengths, bool causal,
                         const torch::Device& device);

}  // namespace fastattn::ops
