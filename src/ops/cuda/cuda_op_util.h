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

// Gradients to q, k and v accumulated in float32 by a CUDA backward (zeroed:
// the kernels add into them), returned in the inputs' dtype and row layouts
// (as the CPU operators write them and the fakes promise).
struct Float32QkvGrads {
  Float32QkvGrads(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v)
      : q(zeros_like_f32(q)), k(zeros_like_f32(k)), v(zeros_like_f32(v)) {}
  template <typename Args>
  void set(Args& a) const {
    set_qkv_grads<float>(a, q, k, v);
  }
  std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> in_layouts_of(
      const torch::Tensor& q_in, const torch::Tensor& k_in, const torch::Tensor& v_in) const {
    const auto dt = q_in.scalar_type();
    return in_rows_layouts_of({q.to(dt), k.to(dt), v.to(dt)}, q_in, k_in, v_in);
  }
  torch::Tensor q, k, v;

 private:
  static torch::Tensor zeros_like_f32(const torch::Tensor& t) {
    return torch::zeros(t.sizes(), t.options().dtype(torch::kFloat));
  }
};

}  // namespace fastattn::ops::cuda
