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

// centroids = the mean of each cluster's queries (zeros for an empty
// cluster), summed in query order in float32: cluster_means_cpu's struct
// (clustered_topk.h), T = void.
using ClusterMeansCudaArgs = kernels::ClusterMeansArgs<void>;

// dst (float32) += table[n, h, a_l] / max(1, counts[n, h, a_l]) for every
// query with a cluster a_l >= 0 (the gradient through centroid = mean of
// its members): spread_centroids_cpu's struct, T = void, divide and
// accumulate.
using AddCentroidGradsCudaArgs = kernels::CentroidSpreadArgs<void>;

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
