// Fused softmax attention on CUDA (FlashAttention-2 style): forward with an
// online softmax over key tiles, backward recomputing the probabilities from
// the saved row log-sum-exp. Never materialises the L×S matrix. See
// full_attention_cuda.cu for the design, cost and tests.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/common/cuda_dtype.h"

namespace fastattn::cuda {

// Largest head dimension (E and M) of the CUDA kernels; the op layer checks it.
constexpr int64_t kFullAttentionCudaMaxHeadDim = 128;

// Shapes, masks and scale shared by forward and backward. Data pointers are of
// `dtype` unless stated otherwise; every tensor is contiguous.
struct FullAttentionCudaParams {
  const void* q = nullptr;  // (N, H, L, E)
  const void* k = nullptr;  // (N, H, S, E)
  const void* v = nullptr;  // (N, H, S, M)
  // Additive mask (dtype) or nullptr: element (n, h, l, s) at
  // mask[n·mask_sn + h·mask_sh + l·mask_sl + s] (stride 0 on broadcast dims).
  const void* mask = nullptr;
  int64_t mask_sn = 0, mask_sh = 0, mask_sl = 0;
  const int64_t* key_lengths = nullptr;  // (N,) int64 in [0, S] on the device, or nullptr for S
  int64_t N = 0, H = 0, L = 0, S = 0;
  int64_t E = 0, M = 0;  // head dims, each in [1, kFullAttentionCudaMaxHeadDim]
  bool causal = false;   // query i sees key j iff j <= i + (S - L)
  float scale = 1.f;     // softmax temperature applied to q·k
  DType dtype = DType::kFloat32;
};

struct FullAttentionForwardCudaArgs : FullAttentionCudaParams {
  void* out = nullptr;   // (N, H, L, M), written; zeros for rows without a kept key
  float* lse = nullptr;  // (N, H, L) float32: log-sum-exp of the kept scaled scores, -inf if none
};

struct FullAttentionBackwardCudaArgs : FullAttentionCudaParams {
  const void* grad_out = nullptr;  // (N, H, L, M)
  const float* lse = nullptr;      // (N, H, L) float32, from the forward
  // (N, H, L) float32: rowsum(grad_out ∘ out), minus the gradient with
  // respect to lse where that is an output too.
  const float* delta = nullptr;
  void* grad_q = nullptr;         // (N, H, L, E), written (or added to)
  void* grad_k = nullptr;         // (N, H, S, E), written (or added to)
  void* grad_v = nullptr;         // (N, H, S, M), written (or added to)
  float* dq_workspace = nullptr;  // (N, H, L, E) float32 scratch (dQ is accumulated atomically)
  bool accumulate = false;        // add to grad_q, grad_k and grad_v instead of overwriting them
};

void full_attention_forward_cuda(const FullAttentionForwardCudaArgs& a, cudaStream_t stream);
void full_attention_backward_cuda(const FullAttentionBackwardCudaArgs& a, cudaStream_t stream);

}  // namespace fastattn::cuda
