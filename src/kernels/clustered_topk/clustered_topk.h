// Per-query attention on each cluster's top-k keys, the sparse part of
// improved clustered attention (Vyas et al. 2020, eq. 10-11, supplementary
// eq. 16): for query l of cluster j = assignments[l],
//   out_l = mass[j] · Σ_t softmax_t(scale · q_l·k_{idx[j,t]}) v_{idx[j,t]},
// keys at idx >= key_lengths[n] dropped; padded queries (j = -1) and
// queries that keep no key output zeros. Reads the keys and values in place
// (no (L, k, E) gather).
//
// Cost: forward 2·N·H·L·K·(E + M) flops, backward about twice that; extra
// memory O(K) per thread. Parallel over N·H (each item writes only its own
// head's gradients, so no atomics).
// Tested through improved_clustered_attention in
// tests/cpp/test_clustered_attention.cpp (forward, autograd, finite
// differences); timed by bench/bench_clustered_attention.cpp.
#pragma once

#include <cstdint>

#include "kernels/common/kernel_args.h"

namespace fastattn::kernels {

// The arguments of both backends (kernels/common/kernel_args.h): T = float or
// double for the CPU kernels below, void for the CUDA launchers
// (clustered_topk_cuda.h), whose masses, lse and gradients are float32.
template <typename T>
struct ClusteredTopkParams : QKVParams<T> {
  const int64_t* topk = nullptr;          // (N, H, C, K) key indices in [0, S), -1: empty slot
  const KernelScalar<T>* mass = nullptr;  // (N, H, C): centroid mass on its top-k keys
  const int64_t* assignments = nullptr;   // (N, H, L): cluster in [0, C) or -1
  int64_t C = 0, K = 0;
  KernelScalar<T> scale = 1;
  // Improved-clustered form (centroids set; mass then unused): the centroid
  // weights of the cluster's top keys are p_t = exp(scale·c·k_t - lse_c) on
  // the kept keys, mass = Σ p_t, and every member's output also gets the rest
  // of the centroid's output, out_c - Σ p_t v_t (Vyas et al. eq. 9-11 in
  // one pass).
  const T* centroids = nullptr;          // (N, H, C, E)
  const KernelScalar<T>* lse = nullptr;  // (N, H, C): log-sum-exp of the centroid's scaled scores
  const T* out_c = nullptr;              // (N, H, C, M): the centroid's full attention output
  // CUDA: clustered_topk_cuda_workspace_bytes(N, H, L, C, K, M) bytes, no
  // initialisation needed; `grouped`: it already holds these assignments'
  // grouping (cluster_means_cuda ran on it), the forward skips its own.
  void* workspace = nullptr;
  bool grouped = false;
  // Attention dropout, fused (CPU, improved form): member l's weight on key
  // j is kept iff dropout_bits(dropout_row_key(dropout_seed, nh, l), j) >=
  // dropout_threshold (kernels/common/dropout.h; 0: no dropout), then scaled
  // by dropout_scale; the centroid's weights in its rest use the rows of
  // centroid_seed = dropout_stream_seed(dropout_seed, kDropoutCentroidStream),
  // the mask out_c was computed with. mass stays the undropped one.
  uint32_t dropout_threshold = 0;
  uint64_t dropout_seed = 0;
  KernelScalar<T> dropout_scale = 1;
};

template <typename T>
struct ClusteredTopkForwardArgs : ClusteredTopkParams<T> {
  T* out = nullptr;     // (N, H, L, M), rows at out_rows, written (zeros for padded queries)
  RowStrides out_rows;  // CPU
};

// Gradients: of T on the CPU (written); float32 on CUDA (grad_q written,
// grad_k and grad_v zeroed by the caller and added to).
template <typename T>
struct ClusteredTopkBackwardArgs : ClusteredTopkParams<T> {
  const T* grad_out = nullptr;        // (N, H, L, M), rows at grad_out_rows
  KernelScalar<T>* grad_q = nullptr;  // (N, H, L, E)
  KernelScalar<T>* grad_k = nullptr;  // (N, H, S, E)
  KernelScalar<T>* grad_v = nullptr;  // (N, H, S, M)
  RowStrides grad_out_rows, grad_q_rows, grad_k_rows, grad_v_rows;  // CPU; default: contiguous
  KernelScalar<T>* grad_mass = nullptr;  // (N, H, C), written (plain form)
  // Improved form: written instead of grad_mass.
  KernelScalar<T>* grad_centroids = nullptr;  // (N, H, C, E)
  KernelScalar<T>* grad_lse = nullptr;        // (N, H, C)
  KernelScalar<T>* grad_out_c = nullptr;      // (N, H, C, M)
};

// centroids (N, H, C, E) = the mean of each cluster's queries (zeros for an
// empty cluster); assignments a_l in [-1, C), -1 for padding. mean = false:
// the sums instead (the adjoint of spread_centroids_cpu without divide).
// Both backends: T = float or double for cluster_means_cpu, void for
// cluster_means_cuda (clustered_topk_cuda.h: contiguous q, sums in float32).
template <typename T>
struct ClusterMeansArgs {
  const T* q = nullptr;                  // (NH, L, E), rows at q_rows
  const int64_t* assignments = nullptr;  // (NH, L)
  const int64_t* counts = nullptr;       // (NH, C): members of each cluster
  T* centroids = nullptr;                // (NH, C, E), written
  int64_t NH = 0, L = 0, C = 0, E = 0;
  int num_threads = 1;
  RowStrides q_rows;  // CPU: of H heads (NH = N·H); default: contiguous
  int64_t H = 1;
  bool mean = true;               // CUDA: means only
  DType dtype = DType::kFloat32;  // CUDA: the element type of the void pointers
  // CUDA: clustered_topk_cuda_workspace_bytes(N, H, L, C, 0, 0) bytes.
  void* workspace = nullptr;
};
template <typename T>
void cluster_means_cpu(const ClusterMeansArgs<T>& args);

// Each member row from its centroid's row: dst_l (+)= table[n, h, a_l]
// (/ counts[n, h, a_l] when divide) for every l with a_l >= 0; rows with
// a_l = -1 are set to zero (accumulate = false) or left alone. divide and
// accumulate: the members' gradient of centroid = mean of the members
// (improved clustered); neither: the centroids' outputs broadcast to their
// members (clustered); divide alone: that gradient written.
// Both backends: T = float or double for spread_centroids_cpu, void for
// add_centroid_grads_cuda (clustered_topk_cuda.h: float32 dst and table,
// contiguous; divide and accumulate only).
template <typename T>
struct CentroidSpreadArgs {
  KernelScalar<T>* dst = nullptr;          // (NH, L, E), rows at dst_rows
  const KernelScalar<T>* table = nullptr;  // (NH, C, E): one row per centroid
  const int64_t* assignments = nullptr;    // (NH, L)
  const int64_t* counts = nullptr;         // (NH, C): read when divide
  int64_t NH = 0, L = 0, C = 0, E = 0;
  int num_threads = 1;
  RowStrides dst_rows;  // CPU: of H heads (NH = N·H); default: contiguous
  int64_t H = 1;
  bool divide = true, accumulate = true;
};
template <typename T>
void spread_centroids_cpu(const CentroidSpreadArgs<T>& args);

template <typename T>
void clustered_topk_forward_cpu(const ClusteredTopkForwardArgs<T>& a);
template <typename T>
void clustered_topk_backward_cpu(const ClusteredTopkBackwardArgs<T>& a);

}  // namespace fastattn::kernels
