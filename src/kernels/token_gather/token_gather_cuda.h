// CUDA launchers of the token gather and its scatter-add adjoint (see
// token_gather.h and token_gather_cuda.cu).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/common/cuda_dtype.h"

namespace fastattn::cuda {

struct TokenGatherCudaArgs {
  const void* x = nullptr;         // forward: (N, H, L, E) contiguous, dtype
  const void* grad_out = nullptr;  // backward: (N, H, T, E) contiguous, dtype
  const int64_t* index = nullptr;  // (N, T) contiguous, each in [-1, L)
  void* out = nullptr;             // forward: (N, H, T, E), dtype, written
  // Backward: grad_x (N, H, L, E) float32, zeroed by the caller; the rows of
  // grad_out are added into it (atomicAdd: an index may repeat a token).
  float* grad_x = nullptr;
  int64_t N = 0, H = 0, L = 0, T_ = 0, E = 0;  // T_: gathered rows per (n, h)
  DType dtype = DType::kFloat32;
};

void token_gather_forward_cuda(const TokenGatherCudaArgs& a, cudaStream_t stream);
void token_gather_backward_cuda(const TokenGatherCudaArgs& a, cudaStream_t stream);

}  // namespace fastattn::cuda
