// CUDA launchers of the per-cluster top-k attention of (improved) clustered
// attention and its helpers (see clustered_topk.h and clustered_topk_cuda.cu).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/clustered_topk/clustered_topk.h"

namespace fastattn::cuda {

// The arguments shared with the CPU kernels (clustered_topk.h), T = void:
// q, k, v, centroids, out_c, out, grad_out contiguous of `dtype`; mass, lse
// and the gradients float32; `workspace` required.
using ClusteredTopkCudaArgs = kernels::ClusteredTopkParams<void>;
using ClusteredTopkForwardCudaArgs = kernels::ClusteredTopkForwardArgs<void>;
using ClusteredTopkBackwardCudaArgs = kernels::ClusteredTopkBackwardArgs<void>;

// centroids (N, H, C, E) = the mean of each cluster's queries (zeros for an
// empty cluster), summed in query order in float32.
struct ClusterMeansCudaArgs {
  const void* q = nullptr;               // (N, H, L, E), dtype
  const int64_t* assignments = nullptr;  // (N, H, L) in [-1, C)
  const int64_t* counts = nullptr;       // (N, H, C): the assignments' histogram
  void* centroids = nullptr;             // (N, H, C, E), dtype, written
  int64_t N = 0, H = 0, L = 0, C = 0, E = 0;
  DType dtype = DType::kFloat32;
  void* workspace = nullptr;  // clustered_topk_cuda_workspace_bytes(N, H, L, C, 0, 0) bytes
};

// grad_q (N, H, L, E) float32 += table[n, h, a_l] / max(1, counts[n, h, a_l])
// for every query with a cluster a_l >= 0 (the gradient through centroid =
// mean of its members).
struct AddCentroidGradsCudaArgs {
  float* grad_q = nullptr;               // (N, H, L, E) float32, added to
  const float* table = nullptr;          // (N, H, C, E) float32
  const int64_t* assignments = nullptr;  // (N, H, L)
  const int64_t* counts = nullptr;       // (N, H, C)
  int64_t N = 0, H = 0, L = 0, C = 0, E = 0;
};

int64_t clustered_topk_cuda_workspace_bytes(int64_t N, int64_t H, int64_t L, int64_t C, int64_t K,
                                            int64_t M);
// Dynamic shared memory the backward needs for head dims E and M (bytes); the
// launchers throw above the device's 227 KiB.
int64_t clustered_topk_cuda_shared_bytes(int64_t E, int64_t M, bool backward);

void clustered_topk_forward_cuda(const ClusteredTopkForwardCudaArgs& a, cudaStream_t stream);
void clustered_topk_backward_cuda(const ClusteredTopkBackwardCudaArgs& a, cudaStream_t stream);
void cluster_means_cuda(const ClusterMeansCudaArgs& a, cudaStream_t stream);
void add_centroid_grads_cuda(const AddCentroidGradsCudaArgs& a, cudaStream_t stream);

}  // namespace fastattn::cuda
