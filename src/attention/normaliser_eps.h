// The eps of linear attention's normaliser as it is added in a dtype
// (internal; linear.cpp, recurrent.cpp, recurrent_cross.cpp).
#pragma once

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

}  // namespace fastattn
