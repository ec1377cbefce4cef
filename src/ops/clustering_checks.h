// Input checks of hash_queries and cluster_codes, shared by their CPU
// (src/ops/clustering_ops.cpp) and CUDA (src/ops/cuda/clustering_cuda.cpp)
// registrations (internal).
#pragma once

#include <torch/torch.h>

namespace fastattn::ops {

// x (N, H, L, E) floating, planes (B, E + 1) with 1 <= B <= 64, x's dtype and device.
void check_hash_inputs(const torch::Tensor& x, const torch::Tensor& planes);

// codes (N, H, L) int64, lengths (N,) integer in [0, L] on codes' device,
// clusters >= 1, iterations >= 0. Returns the lengths as contiguous int64
// (undefined without lengths).
torch::Tensor check_cluster_codes_inputs(const torch::Tensor& codes,
                                         const c10::optional<torch::Tensor>& lengths,
                                         int64_t clusters, int64_t iterations);

}  // namespace fastattn::ops
