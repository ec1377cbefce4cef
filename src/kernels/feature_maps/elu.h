// phi(x) = elu(x) + 1 and phi'(x) over contiguous runs, vectorised (AVX2 exp
// of kernels/common/simd.h) with a scalar tail; shared by the elu_feature_map
// kernels and the fused elu linear attention kernels.
//   phi(x)  = max(x, 0) + exp(min(x, 0))     (x + 1 for x > 0, exp(x) otherwise)
//   phi'(x) = exp(min(x, 0))                 (1 for x > 0, exp(x) otherwise)
// NaN inputs give NaN outputs.
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/common/isa_target.h"
#include "kernels/common/simd.h"

FASTATTN_ISA_BEGIN

// exp(min(x, 0)), NaN kept by min's second operand.
template <typename T>
inline typename Simd<T>::V exp_nonpositive(typename Simd<T>::V x) {
  using S = Simd<T>;
  return S::exp_nonpositive(S::min(S::zero(), x));
}

// out[i] = phi(x[i]) for i < n (out may alias x).
template <typename T>
inline void elu_plus_one(const T* x, T* out, int64_t n) {
  using S = Simd<T>;
  constexpr int W = S::W;
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    const auto v = S::load(x + i);
    S::store(out + i, S::add(S::max(S::zero(), v), exp_nonpositive<T>(v)));
  }
  for (; i < n; ++i) {
    const T v = x[i];
    out[i] = v > T(0) ? v + T(1) : (v != v ? v : std::exp(v));
  }
}

// out[i] = g[i] · phi'(x[i]) for i < n (out may alias g).
template <typename T>
inline void elu_plus_one_backward(const T* x, const T* g, T* out, int64_t n) {
  using S = Simd<T>;
  constexpr int W = S::W;
  int64_t i = 0;
  for (; i + W <= n; i += W)
    S::store(out + i, S::mul(S::load(g + i), exp_nonpositive<T>(S::load(x + i))));
  for (; i < n; ++i) {
    const T v = x[i];
    out[i] = g[i] * (v != v ? v : std::exp(v < T(0) ? v : T(0)));
  }
}

FASTATTN_ISA_END
