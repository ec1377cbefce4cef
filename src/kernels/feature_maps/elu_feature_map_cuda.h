// CUDA kernels of the elu feature map phi(x) = elu(x) + 1 and its backward
// grad_out·phi'(x) (see elu_feature_map_cuda.cu); float32 / float16 /
// bfloat16 storage, float32 arithmetic.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/feature_maps/elu_feature_map.h"

namespace fastattn::cuda {

// The arguments shared with the CPU kernels (elu_feature_map.h), T = void.
using EluFeatureMapCudaArgs = kernels::EluFeatureMapArgs<void>;

void elu_feature_map_forward_cuda(const EluFeatureMapCudaArgs& a, cudaStream_t stream);
void elu_feature_map_backward_cuda(const EluFeatureMapCudaArgs& a, cudaStream_t stream);

}  // namespace fastattn::cuda
