// CUDA launcher of Hamming K-means over hash codes (see clustering.h and
// cluster_codes_cuda.cu).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/common/cuda_dtype.h"

namespace fastattn::cuda {

struct ClusterCodesCudaArgs {
  const int64_t* codes = nullptr;    // (N, H, L) int64, bit patterns of uint64 codes
  const int64_t* lengths = nullptr;  // (N,) valid queries per batch element in [0, L], or nullptr
  int64_t* assignments = nullptr;    // (N, H, L), written: cluster in [0, C_eff) or -1 (padding)
  int64_t* counts = nullptr;         // (N, H, C), written: members per cluster
  // Workspace of cluster_codes_cuda_workspace_bytes(N, H, L, C) bytes (no
  // initialisation needed).
  void* workspace = nullptr;
  int64_t N = 0, H = 0, L = 0, C = 0;
  int64_t iterations = 0;  // centroid updates (Lloyd iterations), >= 0
  uint64_t seed = 0;       // the CPU kernel's seeding: same seed, same result
};

int64_t cluster_codes_cuda_workspace_bytes(int64_t N, int64_t H, int64_t L, int64_t C);

void cluster_codes_cuda(const ClusterCodesCudaArgs& a, cudaStream_t stream);

}  // namespace fastattn::cuda
