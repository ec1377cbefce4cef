// CUDA launcher of sign-of-random-projection hashing (see hashing.h and
// hash_queries_cuda.cu).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/hashing/hashing.h"

namespace fastattn::cuda {

// The arguments shared with the CPU kernel (hashing.h), T = void: x
// contiguous (rows one after another).
using HashQueriesCudaArgs = kernels::HashParams<void>;

void hash_queries_cuda(const HashQueriesCudaArgs& a, cudaStream_t stream);

}  // namespace fastattn::cuda
