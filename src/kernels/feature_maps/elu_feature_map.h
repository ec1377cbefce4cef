// The elu feature map of linear attention, phi(x) = elu(x) + 1, and its
// backward, vectorised (AVX2 exp of kernels/common/simd.h): ATen's elu runs
// scalar in Debian's LibTorch build and was the largest cost of the linear
// attention types. Elementwise, O(n), parallel over blocks.
//   phi(x)  = max(x, 0) + exp(min(x, 0))     (x + 1 for x > 0, exp(x) otherwise)
//   phi'(x) = exp(min(x, 0))                 (1 for x > 0, exp(x) otherwise)
// NaN inputs give NaN outputs. Tested by tests/cpp/test_linear_attention.cpp.
#pragma once

#include <cstdint>

#include "kernels/common/kernel_args.h"

namespace fastattn::kernels {

// The arguments of both backends (kernels/common/kernel_args.h): T = float or
// double for the CPU kernels below, void for the CUDA launchers
// (elu_feature_map_cuda.h).
template <typename T>
struct EluFeatureMapArgs {
  const T* x = nullptr;         // (n,) contiguous
  const T* grad_out = nullptr;  // (n,) contiguous; backward only
  T* out = nullptr;             // (n,): phi(x) forward, grad_out·phi'(x) backward
  int64_t n = 0;
  int num_threads = 1;            // CPU
  DType dtype = DType::kFloat32;  // CUDA: the element type of the void pointers
};

template <typename T>
void elu_feature_map_forward_cpu(const EluFeatureMapArgs<T>& args);
template <typename T>
void elu_feature_map_backward_cpu(const EluFeatureMapArgs<T>& args);

}  // namespace fastattn::kernels
