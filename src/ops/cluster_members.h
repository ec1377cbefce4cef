// Centroids from their members and back, on the CPU with autograd: the two
// steps around clustered attention's centroid pass (src/attention/clustered.cpp),
// as kernels (src/kernels/clustered_topk/: cluster_means_cpu,
// spread_centroids_cpu) instead of ATen's index_add and index_select, whose
// fresh (N, H, L, E) tensors were a large share of clustered attention's
// forward+backward (git show 5f604de:docs/benchmarks.md, "Prefetch, cluster
// members, hashing, scratch buffers").
// Internal: the callers have checked the clusters (assignments (N, H, L)
// int64 in [-1, C), counts (N, H, C) int64); float32 / float64 on the CPU
// (supports() says when).
// Tested by tests/cpp/test_clustered_attention.cpp (ClusterMembers.*).
#pragma once

#include <torch/types.h>

namespace fastattn::ops {

// Whether the two functions below take x (a CPU float32 / float64 tensor).
bool cluster_members_supports(const torch::Tensor& x);

// (N, H, C, E), contiguous, no autograd: the mean of each cluster's rows of
// x (N, H, L, E, any row layout; zeros for an empty cluster, rows with
// assignment -1 left out), C = counts.size(2).
torch::Tensor cluster_means_no_grad(const torch::Tensor& x, const torch::Tensor& assignments,
                                    const torch::Tensor& counts);

// (N, H, C, E): the mean of each cluster's rows of x (N, H, L, E, any row
// layout; zeros for an empty cluster, padded rows with assignment -1 left
// out). Differentiable in x.
torch::Tensor cluster_means(const torch::Tensor& x, const torch::Tensor& assignments,
                            const torch::Tensor& counts);

// (N, H, L, M): row l of head (n, h) is table[n, h, assignments[n, h, l]]
// (zeros where -1), laid out like empty_rows_like(like, M) (the layers'
// transpose back is a view). Differentiable in table (the backward sums
// each cluster's rows).
torch::Tensor spread_to_members(const torch::Tensor& table, const torch::Tensor& assignments,
                                const torch::Tensor& like);

}  // namespace fastattn::ops
