// The arguments of hash_queries and cluster_codes, shared by their CPU
// (src/ops/clustering_ops.cpp) and CUDA (src/ops/cuda/clustering_cuda.cpp)
// registrations: input checks and the kernels' structs
// (kernels/common/kernel_args.h) (internal).
#pragma once

#include <torch/torch.h>

#include "kernels/clustering/clustering.h"
#include "kernels/hashing/hashing.h"
#include "ops/op_util.h"

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

// hash_queries' struct from x (N, H, L, E) (CPU: any row layout; CUDA:
// contiguous), planes (B, E + 1) contiguous and codes (N, H, L) int64.
template <typename T>
void fill_hash_args(kernels::HashParams<T>& a, const torch::Tensor& x, const torch::Tensor& planes,
                    torch::Tensor& codes) {
  a.x = kernel_data<T>(x);
  a.planes = kernel_data<T>(planes);
  a.codes = codes.data_ptr<int64_t>();
  a.rows = x.size(0) * x.size(1) * x.size(2);
  a.E = x.size(3);
  a.B = static_cast<int>(planes.size(0));
  if constexpr (std::is_void_v<T>) {
    a.dtype = kernel_dtype("fastattn::hash_queries", "x", x);
  } else {
    a.x_rows = row_strides(x);
    a.H = x.size(1);
    a.L = x.size(2);
    a.num_threads = at::get_num_threads();
  }
}

// cluster_codes' struct from codes (N, H, L) int64 contiguous, the checked
// lengths (undefined: none), the outputs and the settings.
inline kernels::ClusterParams cluster_args(const torch::Tensor& codes, const torch::Tensor& lengths,
                                           torch::Tensor& assignments, torch::Tensor& counts,
                                           int64_t iterations, int64_t seed) {
  kernels::ClusterParams a;
  a.codes = codes.data_ptr<int64_t>();
  a.lengths = lengths.defined() ? lengths.data_ptr<int64_t>() : nullptr;
  a.assignments = assignments.data_ptr<int64_t>();
  a.counts = counts.data_ptr<int64_t>();
  a.N = codes.size(0);
  a.H = codes.size(1);
  a.L = codes.size(2);
  a.C = counts.size(2);
  a.iterations = iterations;
  a.seed = static_cast<uint64_t>(seed);
  a.num_threads = at::get_num_threads();
  return a;
}

}  // namespace fastattn::ops
