// CUDA kernels of the elu feature map phi(x) = elu(x) + 1 and its backward
// grad_out·phi'(x) (see elu_feature_map_cuda.cu); float32 / float16 /
// bfloat16 storage, float32 arithmetic.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/common/cuda_dtype.h"

namespace fastattn::cuda {

struct EluFeatureMapCudaArgs {
  const void* x = nullptr;         // (n,) contiguous, dtype
  const void* grad_out = nullptr;  // (n,) contiguous, dtype; backward only
  void* out = nullptr;             // (n,) dtype: phi(x) forward, grad_out·phi'(x) backward
  DType dtype = DType::kFloat32;
  int64_t n = 0;
};

void elu_feature_map_forward_cuda(const EluFeatureMapCudaArgs& a, cudaStream_t stream);
void elu_feature_map_backward_cuda(const EluFeatureMapCudaArgs& a, cudaStream_t stream);

}  // namespace fastattn::cuda
