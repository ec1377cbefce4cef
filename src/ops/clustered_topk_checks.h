// Input checks of clustered_topk_attention and improved_clustered_attention,
// shared by their CPU (src/ops/clustered_topk_attention.cpp) and CUDA
// (src/ops/cuda/clustered_topk_cuda.cpp) registrations (internal).
#pragma once

#include <torch/torch.h>

namespace fastattn::ops {

constexpr const char* kClusteredTopkOp = "fastattn::clustered_topk_attention";
constexpr const char* kImprovedClusteredOp = "fastattn::improved_clustered_attention";

// q, k, v, key_lengths (check_qkv, check_masks), topk (N, H, C, K) int64 in
// [0, S) or -1 (an empty slot), mass (N, H, C) of q's dtype, assignments (N, H, L) int64 in [-1,
// C).
void check_clustered_topk_inputs(const torch::Tensor& q, const torch::Tensor& k,
                                 const torch::Tensor& v, const torch::Tensor& topk,
                                 const torch::Tensor& mass, const torch::Tensor& assignments,
                                 const c10::optional<torch::Tensor>& key_lengths);

// assignments (N, H, L) int64 in [-1, C), counts (N, H, C) int64 equal to the
// assignments' histogram.
void check_improved_clusters(const torch::Tensor& q, const torch::Tensor& assignments,
                             const torch::Tensor& counts);

}  // namespace fastattn::ops
