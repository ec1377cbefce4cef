// CUDA launcher of sign-of-random-projection hashing (see hashing.h and
// hash_queries_cuda.cu).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/common/cuda_dtype.h"

namespace fastattn::cuda {

struct HashQueriesCudaArgs {
  const void* x = nullptr;  // (rows, E) contiguous, dtype: rows = N·H·L
  const void* planes =
      nullptr;  // (B, E + 1) contiguous, dtype: w_b = planes[b, :E], bias_b = planes[b, E]
  int64_t* codes = nullptr;  // (rows,) int64, written: bit b = x·w_b + bias_b > 0
  int64_t rows = 0, E = 0;
  int B = 0;  // bits, in [1, 64]
  DType dtype = DType::kFloat32;
};

void hash_queries_cuda(const HashQueriesCudaArgs& a, cudaStream_t stream);

}  // namespace fastattn::cuda
