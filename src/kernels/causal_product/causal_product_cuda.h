// CUDA kernels of the causal linear product (see causal_product_cuda.cu):
// out_i = sum_{j<=i} (q_i·k_j) v_j and its gradients, float32 / float16 /
// bfloat16 storage, float32 arithmetic and state.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/causal_product/causal_product.h"

namespace fastattn::cuda {

// The arguments shared with the CPU kernels (causal_product.h) with T = void:
// q, k, v, out, grad_* contiguous of `dtype`; `workspace` required.
using CausalProductForwardCudaArgs = kernels::CausalProductForwardArgs<void>;
using CausalProductBackwardCudaArgs = kernels::CausalProductBackwardArgs<void>;

inline int64_t causal_product_cuda_workspace_floats(int64_t N, int64_t H, int64_t L, int64_t F,
                                                    int64_t M, int64_t chunk) {
  const int64_t nc = (L + chunk - 1) / chunk;
  return N * H * (nc > 0 ? nc : 1) * F * M;
}

void causal_product_forward_cuda(const CausalProductForwardCudaArgs& a, cudaStream_t stream);
void causal_product_backward_cuda(const CausalProductBackwardCudaArgs& a, cudaStream_t stream);

}  // namespace fastattn::cuda
