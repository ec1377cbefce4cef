// Fused softmax attention on CUDA (FlashAttention-2 style): forward with an
// online softmax over key tiles, backward recomputing the probabilities from
// the saved row log-sum-exp. Never materialises the L×S matrix. Kernels in
// full_attention_forward_cuda.cu and full_attention_backward_cuda.cu; see
// full_attention_cuda_common.cuh for the design, cost and tests.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/full/full_attention.h"

namespace fastattn::cuda {

// Largest head dimension (E and M) of the CUDA kernels; the op layer checks it.
constexpr int64_t kFullAttentionCudaMaxHeadDim = 128;

// The arguments shared with the CPU kernels (full_attention.h), T = void:
// q, k, v, mask, out, grad_* contiguous of `dtype`; lse and delta float32;
// the backward's dq_workspace required.
using FullAttentionCudaParams = kernels::FullAttentionParams<void>;
using FullAttentionForwardCudaArgs = kernels::FullAttentionForwardArgs<void>;
using FullAttentionBackwardCudaArgs = kernels::FullAttentionBackwardArgs<void>;

void full_attention_forward_cuda(const FullAttentionForwardCudaArgs& a, cudaStream_t stream);
void full_attention_backward_cuda(const FullAttentionBackwardCudaArgs& a, cudaStream_t stream);

}  // namespace fastattn::cuda
