// Input checks of hash_queries and cluster_codes, shared by their CPU
// (src/ops/clustering_ops.cpp) and CUDA (src/ops/cuda/clustering_cuda.cpp)
// registrations (internal).
#pragma once

#include <torch/torch.h>

namespace fastattn::ops {

// x (N, H, L, E) floating, planes (B, E + 1) with 1 <= B <= 64, x's dtype and device.
void check_hash_inputs(const torch::Tensor& x, const torch::Tensor& planes);

// codes (N, H, L) int64, lengths (N,) integer in [0, L] on codes' device,
// clusters >= 1, iterations in [0, kMaxClusterIterations]. Returns the lengths as contiguous int64
// (undefined without lengths).
torch::Tensor check_cluster_codes_inputs(const torch::Tensor& codes,
                                         const c10::optional<torch::Tensor>& lengths,
                                         int64_t clusters, int64_t iterations);

// The number of clusters the operator returns counts for: `clusters`
// clamped to L (at least 1). Clusters past a sequence's valid queries stay
// empty, so this changes no assignment; it keeps a huge `clusters` from
// sizing buffers.
inline int64_t effective_clusters(int64_t clusters, int64_t L) {
  return clusters < L ? clusters : (L > 1 ? L : 1);
}

}  // namespace fastattn::ops
