// CUDA kernels of the causal linear product (see causal_product_cuda.cu):
// out_i = sum_{j<=i} (q_i·k_j) v_j and its gradients, float32 / float16 /
// bfloat16 storage, float32 arithmetic and state.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/common/cuda_dtype.h"

namespace fastattn::cuda {

struct CausalProductForwardCudaArgs {
  const void* q = nullptr;     // (N, H, L, F) contiguous, dtype
  const void* k = nullptr;     // (N, H, L, F) contiguous, dtype
  const void* v = nullptr;     // (N, H, L, M) contiguous, dtype
  void* out = nullptr;         // (N, H, L, M) contiguous, dtype: written
  float* workspace = nullptr;  // causal_product_cuda_workspace_floats(...) float32 scratch
  DType dtype = DType::kFloat32;
  int64_t N = 0, H = 0, L = 0, F = 0, M = 0;
  int64_t chunk = 64;  // rows per chunk: 16, 32 or 64
};

struct CausalProductBackwardCudaArgs {
  const void* q = nullptr;         // (N, H, L, F) contiguous, dtype
  const void* k = nullptr;         // (N, H, L, F) contiguous, dtype
  const void* v = nullptr;         // (N, H, L, M) contiguous, dtype
  const void* grad_out = nullptr;  // (N, H, L, M) contiguous, dtype
  void* grad_q = nullptr;          // (N, H, L, F) contiguous, dtype: written
  void* grad_k = nullptr;          // (N, H, L, F) contiguous, dtype: written
  void* grad_v = nullptr;          // (N, H, L, M) contiguous, dtype: written
  float* workspace = nullptr;      // causal_product_cuda_workspace_floats(...) float32 scratch
  DType dtype = DType::kFloat32;
  int64_t N = 0, H = 0, L = 0, F = 0, M = 0;
  int64_t chunk = 64;  // rows per chunk: 16, 32 or 64
};

// Float32 elements of the workspace of either launcher (the chunk states,
// N·H·ceil(L/chunk)·F·M; at least one slot per head).
inline int64_t causal_product_cuda_workspace_floats(int64_t N, int64_t H, int64_t L, int64_t F,
                                                    int64_t M, int64_t chunk) {
  const int64_t nc = (L + chunk - 1) / chunk;
  return N * H * (nc > 0 ? nc : 1) * F * M;
}

void causal_product_forward_cuda(const CausalProductForwardCudaArgs& a, cudaStream_t stream);
void causal_product_backward_cuda(const CausalProductBackwardCudaArgs& a, cudaStream_t stream);

}  // namespace fastattn::cuda
