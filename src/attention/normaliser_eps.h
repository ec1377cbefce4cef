// The eps of linear attention's normaliser as it is added in a dtype
// (internal; linear.cpp, recurrent.cpp, recurrent_cross.cpp).
#pragma once

#include <ATen/ATen.h>
#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <limits>

namespace fastattn {

// eps, but at least the smallest normal number of `dtype`: an eps below it
// (1e-300 in float32) would round to 0, and a query whose features are all 0
// (relu) would divide 0 by 0.
inline double eps_in(double eps, c10::ScalarType dtype) {
  double tiny = std::numeric_limits<double>::min();
  switch (dtype) {
    case c10::ScalarType::Float:
      tiny = std::numeric_limits<float>::min();
      break;
    case c10::ScalarType::Half:
      tiny = static_cast<float>(std::numeric_limits<c10::Half>::min());
      break;
    case c10::ScalarType::BFloat16:
      tiny = static_cast<float>(std::numeric_limits<c10::BFloat16>::min());
      break;
    default:
      break;
  }
  return std::max(eps, tiny);
}

// The normaliser's eps for key features shifted by exp(-offset) (the
// exponential feature maps' stabilisation, FeatureMap::map_keys): eps ·
// exp(-offset) in `dtype`, at least its smallest normal number (as eps_in),
// so that the normalised output is that of the unshifted features whatever
// the offset (the batch form's offset over all keys, the recurrent form's
// running one). offset (N, H, 1, 1) or (N, H, 1); undefined: eps_in as a
// scalar tensor.
inline at::Tensor shifted_eps(double eps, const at::Tensor& offset, c10::ScalarType dtype,
                              const at::TensorOptions& options) {
  const double floor = eps_in(0.0, dtype);
  if (!offset.defined()) return at::scalar_tensor(eps_in(eps, dtype), options.dtype(dtype));
  const auto wide = at::promote_types(offset.scalar_type(), at::kFloat);
  return (offset.to(wide).neg().exp() * eps).clamp_min(floor).to(dtype);
}

}  // namespace fastattn
