// The arguments of clustered_topk_attention and improved_clustered_attention,
// shared by their CPU (src/ops/clustered_topk_attention.cpp) and CUDA
// (src/ops/cuda/clustered_topk_cuda.cpp) registrations: input checks and the
// kernels' struct (kernels/common/kernel_args.h) (internal).
#pragma once

#include <torch/torch.h>

#include "kernels/clustered_topk/clustered_topk.h"
#include "ops/op_util.h"

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

// The struct's operands (qkv_inputs), the clusters' top-k keys (N, H, C, K)
// and the queries' assignments (N, H, L), int64 contiguous, and the scale;
// the caller sets the masses (plain form) or the centroid pass's results
// (improved form).
template <typename T>
void fill_clustered_topk_args(kernels::ClusteredTopkParams<T>& a, const char* op,
                              const QKVInputs& in, const torch::Tensor& topk,
                              const torch::Tensor& assignments, double temp) {
  set_qkv_args(a, op, in);
  a.topk = topk.data_ptr<int64_t>();
  a.assignments = assignments.data_ptr<int64_t>();
  a.C = topk.size(2);
  a.K = topk.size(3);
  a.scale = static_cast<kernels::KernelScalar<T>>(temp);
}

}  // namespace fastattn::ops
