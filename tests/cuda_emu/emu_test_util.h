// Helpers of the emulation tests (tests/cuda_emu/): random inputs stored in a
// kernel dtype together with the same rounded values in float64 for the CPU
// reference kernels, and tolerant comparisons.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "kernels/common/cuda_compat.cuh"

namespace fastattn::emu_test {

using fastattn::cuda::DType;

template <typename T>
constexpr DType dtype_of() {
  if constexpr (std::is_same_v<T, float>) return DType::kFloat32;
  if constexpr (std::is_same_v<T, __half>) return DType::kFloat16;
  return DType::kBFloat16;
}

template <typename T>
const char* dtype_name() {
  if constexpr (std::is_same_v<T, float>) return "float32";
  if constexpr (std::is_same_v<T, __half>) return "float16";
  return "bfloat16";
}

// Values in the kernel dtype and the same (rounded) values in float64.
template <typename T>
struct Buffer {
  std::vector<T> dev;
  std::vector<double> ref;
};

template <typename T>
Buffer<T> random_buffer(size_t n, std::mt19937& rng, double scale = 1.0) {
  std::normal_distribution<double> d(0.0, scale);
  Buffer<T> b;
  b.dev.resize(n);
  b.ref.resize(n);
  for (size_t i = 0; i < n; ++i) {
    b.dev[i] = fastattn::cuda::from_float<T>(static_cast<float>(d(rng)));
    b.ref[i] = fastattn::cuda::to_float(b.dev[i]);
  }
  return b;
}

template <typename T>
Buffer<T> buffer_from(const std::vector<double>& x) {
  Buffer<T> b;
  b.dev.resize(x.size());
  b.ref.resize(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    b.dev[i] = fastattn::cuda::from_float<T>(static_cast<float>(x[i]));
    b.ref[i] = fastattn::cuda::to_float(b.dev[i]);
  }
  return b;
}

template <typename T>
std::vector<double> to_double(const std::vector<T>& x) {
  std::vector<double> r(x.size());
  for (size_t i = 0; i < x.size(); ++i) r[i] = fastattn::cuda::to_float(x[i]);
  return r;
}

// |got - want| <= atol + rtol·|want|: float32 results (computed in float32,
// atomics in any order) against float64: 1e-5 + 1e-4 relative; results
// stored in float16: 2e-3 + 4e-3 relative (output rounding 2^-11);
// bfloat16: 1.6e-2 + 3e-2 relative (2^-8).
struct Tol {
  double atol, rtol;
};
template <typename T>
Tol tol_for() {
  if constexpr (std::is_same_v<T, float>) return {1e-5, 1e-4};
  if constexpr (std::is_same_v<T, __half>) return {2e-3, 4e-3};
  return {1.6e-2, 3e-2};
}

inline void expect_close(const std::vector<double>& got, const std::vector<double>& want, Tol tol,
                         const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  size_t bad = 0, worst = 0;
  double worst_excess = -1e300;
  for (size_t i = 0; i < got.size(); ++i) {
    const double excess = std::fabs(got[i] - want[i]) - (tol.atol + tol.rtol * std::fabs(want[i]));
    if (!(excess <= 0) || std::isnan(got[i]) != std::isnan(want[i])) ++bad;
    if (excess > worst_excess || std::isnan(got[i])) {
      worst_excess = excess;
      worst = i;
    }
  }
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << got.size() << " elements off; worst at "
                     << worst << ": got " << got[worst] << ", want " << want[worst];
}

template <typename T>
std::vector<T> filled(int64_t n, float x) {
  return std::vector<T>(n, fastattn::cuda::from_float<T>(x));
}

// One relative tolerance per dtype for sums of many terms (expect_close_scaled):
// float32 1e-5, float16 2e-3, bfloat16 2e-2 (outputs rounded to the dtype,
// arithmetic in float32).
template <typename T>
double rel_tol() {
  if (std::is_same<T, __half>::value) return 2e-3;
  if (std::is_same<T, __nv_bfloat16>::value) return 2e-2;
  return 1e-5;
}

// got (dtype storage) against ref (float64): |got - ref| <= tol·(0.1·scale +
// |ref|) with scale the largest |ref| (sums of many terms lose absolute
// precision).
template <typename G>
void expect_close_scaled(const std::vector<G>& got, const std::vector<double>& ref, double tol,
                         const std::string& what) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  double scale = 1.0;
  for (double r : ref) scale = std::max(scale, std::fabs(r));
  int bad = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double g = fastattn::cuda::to_float(got[i]);
    const double err = std::fabs(g - ref[i]);
    if (!(err <= tol * (0.1 * scale + std::fabs(ref[i]))) && bad++ < 5)
      ADD_FAILURE() << what << ": element " << i << " is " << g << ", want " << ref[i] << " (scale "
                    << scale << ")";
  }
}

}  // namespace fastattn::emu_test
