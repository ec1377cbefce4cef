// CUDA kernels of the fused elu linear attention (see
// elu_linear_attention_cuda.cu): phi(x) = elu(x) + 1,
// out_i = phi(q_i)^T sum_j phi(k_j) v_j^T / den_i, den_i = phi(q_i)^T sum_j
// phi(k_j) + eps over the keys j < key_lengths[n] (and j <= i when causal).
// float32 / float16 / bfloat16 storage; den, arithmetic and states float32.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/linear_attention/elu_linear_attention.h"

namespace fastattn::cuda {

// The arguments shared with the CPU kernels (elu_linear_attention.h) with
// T = void: q, k, v, out, grad_* contiguous of `dtype`; den float32;
// `workspace` required; `eps` unused by the backward (den carries it).
using EluLinearForwardCudaArgs = kernels::EluLinearForwardArgs<void>;
using EluLinearBackwardCudaArgs = kernels::EluLinearBackwardArgs<void>;

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
