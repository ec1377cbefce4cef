// Attention masks as one object that answers every form a kernel needs.
//
// Convention (as in fast-transformers): "true means keep". A boolean mask
// keeps the positions that are true; an additive (floating) mask is added to
// the scores (0 keeps, -inf drops). Key lengths mark keys at positions >=
// length as padding; query lengths mark padded queries (their outputs are
// computed but never used by well-behaved callers; clustering methods keep
// them out of clusters).
//
// Causal masking with S != L aligns the last query with the last key: query i
// keeps key j when j <= i + (S - L). A query that keeps no key at all outputs
// zeros (and gets zero gradients), never NaN.
//
// Query lengths never drop keys: they enter no dense form below (padded
// queries still attend); query_keep() reports them.
#pragma once

#include <torch/torch.h>

#include <optional>
#include <string>

namespace fastattn {

class Mask {
 public:
  // Attend everywhere.
  Mask() = default;
  static Mask none() { return Mask(); }
  static Mask causal_mask() { return Mask().with_causal(true); }

  // attn_mask: (L, S), (N, L, S) or (N, H, L, S); bool (true = keep) or
  // floating (additive). Broadcast over the missing leading dimensions.
  Mask with_attn_mask(const torch::Tensor& attn_mask) const;
  // key_lengths / query_lengths: (N,) integer tensor, each in [0, S] / [0, L].
  Mask with_key_lengths(const torch::Tensor& key_lengths) const;
  Mask with_query_lengths(const torch::Tensor& query_lengths) const;
  Mask with_causal(bool causal = true) const;

  bool is_causal() const { return causal_; }
  // True when nothing is masked at all (no attn mask, no lengths, not causal).
  bool is_all_ones() const;
  const std::optional<torch::Tensor>& attn_mask() const { return attn_mask_; }
  const std::optional<torch::Tensor>& key_lengths() const { return key_lengths_; }
  const std::optional<torch::Tensor>& query_lengths() const { return query_lengths_; }

  // Checks the mask against the shapes of an attention call and throws a
  // message naming the argument when they disagree.
  void check(int64_t N, int64_t H, int64_t L, int64_t S) const;

  // Dense forms, O(N·H·L·S) memory: for references, tests and the few types
  // that need a dense mask. (N, H, L, S) with broadcast (stride-0) dims where
  // possible.
  torch::Tensor dense_bool(int64_t N, int64_t H, int64_t L, int64_t S,
                           const torch::Device& device = torch::kCPU) const;
  // 0 where kept, -inf where dropped (plus the additive mask's own values).
  torch::Tensor dense_additive(int64_t N, int64_t H, int64_t L, int64_t S, torch::ScalarType dtype,
                               const torch::Device& device = torch::kCPU) const;
  // (N, S) bool: true for keys before each key length (all true without lengths).
  torch::Tensor key_keep(int64_t N, int64_t S, const torch::Device& device = torch::kCPU) const;
  // (N, L) bool: true for queries before each query length.
  torch::Tensor query_keep(int64_t N, int64_t L, const torch::Device& device = torch::kCPU) const;

  std::string to_string() const;

 private:
  std::optional<torch::Tensor> attn_mask_;
  std::optional<torch::Tensor> key_lengths_;
  std::optional<torch::Tensor> query_lengths_;
  bool causal_ = false;
};

}  // namespace fastattn
