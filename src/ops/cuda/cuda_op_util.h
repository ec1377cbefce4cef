// Helpers of the CUDA operator registrations (src/ops/cuda/*.cpp; built only
// with a CUDA-enabled LibTorch): the kernels' dtype tag of a tensor, the
// current stream, and the device guard every entry point opens.
#pragma once

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/torch.h>

#include "kernels/common/cuda_dtype.h"

namespace fastattn::ops::cuda {

// float32 / float16 / bfloat16 -> the kernels' tag; other dtypes: an error
// naming `op` and `name`.
inline fastattn::cuda::DType kernel_dtype(const char* op, const char* name,
                                          const torch::Tensor& t) {
  switch (t.scalar_type()) {
    case torch::kFloat:
      return fastattn::cuda::DType::kFloat32;
    case torch::kHalf:
      return fastattn::cuda::DType::kFloat16;
    case torch::kBFloat16:
      return fastattn::cuda::DType::kBFloat16;
    default:
      TORCH_CHECK(false, op, ": ", name, " must be float32, float16 or bfloat16 on CUDA, got ",
                  t.scalar_type());
  }
}

inline cudaStream_t current_stream() { return at::cuda::getCurrentCUDAStream().stream(); }

// Every tensor argument on one CUDA device: `t` named `name` on `device`.
inline void check_same_device(const char* op, const char* name, const torch::Tensor& t,
                              const torch::Device& device) {
  TORCH_CHECK(t.device() == device, op, ": ", name, " must be on ", device, " like q, got ",
              t.device());
}

}  // namespace fastattn::ops::cuda
