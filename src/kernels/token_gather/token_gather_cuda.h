// CUDA launchers of the token gather and its scatter-add adjoint (see
// token_gather.h and token_gather_cuda.cu).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/token_gather/token_gather.h"

namespace fastattn::cuda {

// The arguments shared with the CPU kernels (token_gather.h), T = void.
using TokenGatherCudaArgs = kernels::TokenGatherArgs<void>;

void token_gather_forward_cuda(const TokenGatherCudaArgs& a, cudaStream_t stream);
void token_gather_backward_cuda(const TokenGatherCudaArgs& a, cudaStream_t stream);

}  // namespace fastattn::cuda
