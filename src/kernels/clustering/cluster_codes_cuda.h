// CUDA launcher of Hamming K-means over hash codes (see clustering.h and
// cluster_codes_cuda.cu).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/clustering/clustering.h"

namespace fastattn::cuda {

// The arguments shared with the CPU kernel (clustering.h); `workspace`
// required.
using ClusterCodesCudaArgs = kernels::ClusterParams;

int64_t cluster_codes_cuda_workspace_bytes(int64_t N, int64_t H, int64_t L, int64_t C);

void cluster_codes_cuda(const ClusterCodesCudaArgs& a, cudaStream_t stream);

}  // namespace fastattn::cuda
