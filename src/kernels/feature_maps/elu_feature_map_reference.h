// The plain reference of the elu feature map kernels (elu_feature_map.h):
// scalar loops over the same argument struct, in float64, with std::exp.
// tests/cpp/test_kernel_references.cpp holds the CPU kernels at every
// instruction-set level to it, tests/cuda_emu/test_feature_maps.cpp the CUDA
// kernels.
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/feature_maps/elu_feature_map.h"

namespace fastattn::kernels {

// phi(x) = elu(x) + 1: x + 1 for x > 0, exp(x) otherwise.
inline double elu_feature_reference(double x) { return x > 0 ? x + 1 : std::exp(x); }
// phi'(x): 1 for x > 0, exp(x) otherwise.
inline double elu_feature_slope_reference(double x) { return x > 0 ? 1.0 : std::exp(x); }

inline void elu_feature_map_forward_reference(const EluFeatureMapArgs<double>& a) {
  for (int64_t i = 0; i < a.n; ++i) a.out[i] = elu_feature_reference(a.x[i]);
}

inline void elu_feature_map_backward_reference(const EluFeatureMapArgs<double>& a) {
  for (int64_t i = 0; i < a.n; ++i) a.out[i] = a.grad_out[i] * elu_feature_slope_reference(a.x[i]);
}

}  // namespace fastattn::kernels
