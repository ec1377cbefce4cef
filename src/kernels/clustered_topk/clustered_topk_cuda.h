// CUDA launchers of the per-cluster top-k attention of (improved) clustered
// attention and its helpers (see clustered_topk.h and clustered_topk_cuda.cu).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/common/cuda_dtype.h"

namespace fastattn::cuda {

// Inputs shared by the forward and the backward. Plain form: mass given,
// centroids == nullptr. Improved form (centroids set, mass unused): the
// centroid weights of the cluster's top keys p_t = exp(scale·c·k_t - lse_c)
// on the kept keys give the mass Σ p_t, and every member's output also gets
// the rest out_c - Σ p_t v_t (Vyas et al. eq. 9-11).
struct ClusteredTopkCudaArgs {
  const void* q = nullptr;        // (N, H, L, E) contiguous, dtype
  const void* k = nullptr;        // (N, H, S, E) contiguous, dtype
  const void* v = nullptr;        // (N, H, S, M) contiguous, dtype
  const int64_t* topk = nullptr;  // (N, H, C, K) key indices (dropped unless in [0, key length))
  const int64_t* assignments = nullptr;  // (N, H, L): cluster in [0, C) or -1 (padding)
  const int64_t* key_lengths = nullptr;  // (N,) or nullptr for S
  const float* mass = nullptr;           // plain form: (N, H, C) float32
  const void* centroids = nullptr;       // improved form: (N, H, C, E), dtype
  const float* lse = nullptr;            // improved form: (N, H, C) float32, the centroids' lse
  const void* out_c = nullptr;  // improved form: (N, H, C, M), dtype, the centroids' output
  int64_t N = 0, H = 0, L = 0, S = 0, E = 0, M = 0, C = 0, K = 0;
  float scale = 1.f;  // softmax_temp
  DType dtype = DType::kFloat32;
  // clustered_topk_cuda_workspace_bytes(N, H, L, C, K, M) bytes, no initialisation needed.
  void* workspace = nullptr;
  // The workspace already holds these assignments' grouping (cluster_means_cuda
  // ran on it): the forward skips its own.
  bool grouped = false;
};

struct ClusteredTopkForwardCudaArgs : ClusteredTopkCudaArgs {
  void* out = nullptr;  // (N, H, L, M), dtype, written (zeros for padded queries)
};

struct ClusteredTopkBackwardCudaArgs : ClusteredTopkCudaArgs {
  const void* grad_out = nullptr;   // (N, H, L, M), dtype
  float* grad_q = nullptr;          // (N, H, L, E) float32, written (zeros for padded queries)
  float* grad_k = nullptr;          // (N, H, S, E) float32, zeroed by the caller, added to
  float* grad_v = nullptr;          // (N, H, S, M) float32, zeroed by the caller, added to
  float* grad_mass = nullptr;       // plain form: (N, H, C) float32, written
  float* grad_centroids = nullptr;  // improved form: (N, H, C, E) float32, written
  float* grad_lse = nullptr;        // improved form: (N, H, C) float32, written
  float* grad_out_c = nullptr;      // improved form: (N, H, C, M) float32, written
};

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
