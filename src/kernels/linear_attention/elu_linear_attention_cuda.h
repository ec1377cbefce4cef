// CUDA kernels of the fused elu linear attention (see
// elu_linear_attention_cuda.cu): phi(x) = elu(x) + 1,
// out_i = phi(q_i)^T sum_j phi(k_j) v_j^T / den_i, den_i = phi(q_i)^T sum_j
// phi(k_j) + eps over the keys j < key_lengths[n] (and j <= i when causal).
// float32 / float16 / bfloat16 storage; den, arithmetic and states float32.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/common/cuda_dtype.h"

namespace fastattn::cuda {

struct EluLinearForwardCudaArgs {
  const void* q = nullptr;               // (N, H, L, E) contiguous, dtype
  const void* k = nullptr;               // (N, H, S, E) contiguous, dtype
  const void* v = nullptr;               // (N, H, S, M) contiguous, dtype
  const int64_t* key_lengths = nullptr;  // (N,) in [0, S] (device), or null: all S keys
  void* out = nullptr;                   // (N, H, L, M) contiguous, dtype: written
  float* den = nullptr;                  // (N, H, L) float32: written, the normaliser incl. eps
  float* workspace = nullptr;            // elu_linear_attention_cuda_workspace_floats(...)
  DType dtype = DType::kFloat32;
  int64_t N = 0, H = 0, L = 0, S = 0, E = 0, M = 0;
  bool causal = false;  // needs S == L
  float eps = 1e-6f;
  int64_t chunk = 64;  // rows per chunk: 16, 32 or 64
};

struct EluLinearBackwardCudaArgs {
  const void* q = nullptr;               // (N, H, L, E) contiguous, dtype
  const void* k = nullptr;               // (N, H, S, E) contiguous, dtype
  const void* v = nullptr;               // (N, H, S, M) contiguous, dtype
  const int64_t* key_lengths = nullptr;  // (N,) in [0, S] (device), or null: all S keys
  const void* grad_out = nullptr;        // (N, H, L, M) contiguous, dtype
  const void* out = nullptr;             // (N, H, L, M) contiguous, dtype: from the forward
  const float* den = nullptr;            // (N, H, L) float32: from the forward
  void* grad_q = nullptr;                // (N, H, L, E) contiguous, dtype: written
  void* grad_k = nullptr;                // (N, H, S, E) contiguous, dtype: written
  void* grad_v = nullptr;                // (N, H, S, M) contiguous, dtype: written
  float* workspace = nullptr;            // elu_linear_attention_cuda_workspace_floats(...)
  DType dtype = DType::kFloat32;
  int64_t N = 0, H = 0, L = 0, S = 0, E = 0, M = 0;
  bool causal = false;  // needs S == L
  float eps = 1e-6f;    // unused by the backward (den carries it); kept for symmetry
  int64_t chunk = 64;   // rows per chunk: 16, 32 or 64
};

// Float32 elements of the workspace of either launcher: an (N, H, L, M + 1)
// row buffer (numerator and normaliser, or the scaled output gradient) and
// the chunk states, N·H·max(1, ceil(max(L, S)/chunk))·E·(M + 1).
inline int64_t elu_linear_attention_cuda_workspace_floats(int64_t N, int64_t H, int64_t L,
                                                          int64_t S, int64_t E, int64_t M,
                                                          int64_t chunk) {
  const int64_t rows = L > S ? L : S;
  const int64_t nc = (rows + chunk - 1) / chunk;
  return N * H * L * (M + 1) + N * H * (nc > 0 ? nc : 1) * E * (M + 1);
}

void elu_linear_attention_forward_cuda(const EluLinearForwardCudaArgs& a, cudaStream_t stream);
void elu_linear_attention_backward_cuda(const EluLinearBackwardCudaArgs& a, cudaStream_t stream);

}  // namespace fastattn::cuda
