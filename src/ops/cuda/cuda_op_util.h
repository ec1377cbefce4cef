// Helpers of the CUDA operator registrations (src/ops/cuda/*.cpp; built only
// with a CUDA-enabled LibTorch): the current stream and the device checks
// (the kernels' dtype tag of a tensor is ops::kernel_dtype, op_util.h).
#pragma once

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/torch.h>

#include "ops/op_util.h"

namespace fastattn::ops::cuda {

inline cudaStream_t current_stream() { return at::cuda::getCurrentCUDAStream().stream(); }

// Every tensor argument on one CUDA device: `t` named `name` on `device`.
inline void check_same_device(const char* op, const char* name, const torch::Tensor& t,
                              const torch::Device& device) {
  TORCH_CHECK(t.device() == device, op, ": ", name, " must be on ", device, " like q, got ",
              t.device());
}

}  // namespace fastattn::ops::cuda
