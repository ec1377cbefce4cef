// Row helpers of the online-softmax kernels (full, block-sparse, reformer,
// hard retrieval): -inf of a type, rounding up to a tile multiple, the max of
// a score row and exp(row - shift) with its sum, vectorised (kernels/common/simd.h).
#pragma once

#include <cstdint>
#include <limits>

#include "kernels/common/isa_target.h"
#include "kernels/common/simd.h"

FASTATTN_ISA_BEGIN

template <typename T>
constexpr T neg_inf() {
  return -std::numeric_limits<T>::infinity();
}

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// max over row[0, width); width: a multiple of Simd<T>::W.
template <typename T>
inline T row_max(const T* row, int64_t width) {
  using S = Simd<T>;
  auto m = S::set1(neg_inf<T>());
  for (int64_t c = 0; c < width; c += S::W) m = S::max(m, S::load(row + c));
  return S::hmax(m);
}

// row = exp(row · scale - shift) in place; returns the sum. width: a
// multiple of W. With scale 1 (most callers) the fma is exactly row - shift.
template <typename T>
inline T exp_shift_sum(T* row, int64_t width, T shift, T scale = T(1)) {
  using S = Simd<T>;
  const auto sc = S::set1(scale), sh = S::set1(-shift);
  auto sum = S::zero();
  for (int64_t c = 0; c < width; c += S::W) {
    const auto e = S::exp(S::fma(S::load(row + c), sc, sh));
    S::store(row + c, e);
    sum = S::add(sum, e);
  }
  return S::hsum(sum);
}

FASTATTN_ISA_END
