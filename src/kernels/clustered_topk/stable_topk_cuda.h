// CUDA launcher of the stable top-k column selection (stable_topk_cuda.cu):
// the k largest entries of each row of a float32 matrix as a stable
// descending sort would rank them (ties: lower column first), returned in
// increasing column order. Used by ops::stable_topk_indices on CUDA tensors
// (the centroids' top-k keys of improved-clustered attention).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace fastattn::cuda {

struct StableTopkCudaArgs {
  const float* scores = nullptr;   // (rows, S) contiguous
  int64_t* out = nullptr;          // (rows, k), written: the selected columns, increasing
  int64_t rows = 0, S = 0, k = 0;  // 1 <= k <= S
};

void stable_topk_select_cuda(const StableTopkCudaArgs& a, cudaStream_t stream);

}  // namespace fastattn::cuda
