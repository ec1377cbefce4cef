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

// Attention dropout is fused in the CPU kernels only so far.
inline void check_no_dropout(const char* op, double dropout_p) {
  TORCH_CHECK(dropout_p == 0, op, ": attention dropout (dropout_p = ", dropout_p,
              ") is not in the CUDA kernels yet; on CUDA float16 / bfloat16 the dense-attention "
              "engine's route is to take it (issue 64)");
}

}  // namespace fastattn::ops::cuda
