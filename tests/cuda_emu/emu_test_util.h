// Helpers of the linear attention emulation tests (tests/cuda_emu/): random
// inputs stored in a kernel dtype with their rounded values in float64, and an
// elementwise comparison. Tolerances (|got - ref| <= atol + rtol·|ref|,
// against the CPU kernels in float64 on the same rounded inputs): float32
// 1e-5 + 1e-5·|ref| (scaled by the magnitude of the sums), float16 2e-3,
// bfloat16 2e-2 (the outputs are rounded to the dtype; arithmetic is float32).
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "kernels/common/cuda_compat.cuh"

namespace fastattn::cuda::emutest {

// Storage of one tensor in a kernel dtype and its values as double.
template <typename T>
struct Buf {
  std::vector<T> dev;
  std::vector<double> ref;
};

template <typename T>
Buf<T> random_buf(int64_t n, std::mt19937& gen, double scale = 1.0) {
  std::normal_distribution<double> dist(0.0, scale);
  Buf<T> b;
  b.dev.resize(n);
  b.ref.resize(n);
  for (int64_t i = 0; i < n; ++i) {
    b.dev[i] = from_float<T>(static_cast<float>(dist(gen)));
    b.ref[i] = to_float(b.dev[i]);
  }
  return b;
}

template <typename T>
std::vector<T> filled(int64_t n, float x) {
  return std::vector<T>(n, from_float<T>(x));
}

template <typename T>
double rel_tol() {
  if (std::is_same<T, __half>::value) return 2e-3;
  if (std::is_same<T, __nv_bfloat16>::value) return 2e-2;
  return 1e-5;
}

template <typename T>
const char* dtype_name() {
  if (std::is_same<T, __half>::value) return "float16";
  if (std::is_same<T, __nv_bfloat16>::value) return "bfloat16";
  return "float32";
}

// got (dtype storage) against ref (float64): |got - ref| <= tol·(scale + |ref|)
// with scale the largest |ref| (sums of many terms lose absolute precision).
template <typename G>
void expect_close(const std::vector<G>& got, const std::vector<double>& ref, double tol,
                  const std::string& what) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  double scale = 1.0;
  for (double r : ref) scale = std::max(scale, std::fabs(r));
  int bad = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double g = to_float(got[i]);
    const double err = std::fabs(g - ref[i]);
    if (!(err <= tol * (0.1 * scale + std::fabs(ref[i]))) && bad++ < 5)
      ADD_FAILURE() << what << ": element " << i << " is " << g << ", want " << ref[i] << " (scale "
                    << scale << ")";
  }
}

}  // namespace fastattn::cuda::emutest
