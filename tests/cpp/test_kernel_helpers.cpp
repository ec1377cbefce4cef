// The kernels' shared helpers (src/kernels/common/) against plain loops:
// transpose (8x8 AVX2 blocks plus scalar edges), simd_dot, and the
// register-blocked products, on awkward shapes in float32 and float64,
// and parallel_items' exception handling.
//   build/fastattn_tests --gtest_filter='KernelHelpers*'
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <new>
#include <random>
#include <stdexcept>
#include <thread>
#include <vector>

#include "kernels/common/gemm.h"
#include "kernels/common/parallel.h"
#include "kernels/common/simd.h"

namespace fastattn::kernels {
namespace {

template <typename T>
std::vector<T> random_values(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> d;
  std::vector<T> v(n);
  for (auto& x : v) x = static_cast<T>(d(rng));
  return v;
}

template <typename T>
void check_transpose() {
  for (auto [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{
           {8, 8}, {16, 24}, {13, 21}, {1, 9}, {9, 1}, {33, 16}, {7, 7}}) {
    const int64_t ldx = cols + 3, ldo = rows + 5;  // strides wider than the block
    auto x = random_values<T>(rows * ldx, rows * 100 + cols);
    std::vector<T> out(cols * ldo, T(-1));
    transpose(x.data(), rows, cols, ldx, out.data(), ldo);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c)
        ASSERT_EQ(out[c * ldo + r], x[r * ldx + c])
            << rows << "x" << cols << " at " << r << "," << c;
    // Nothing outside the (cols x rows) block is written.
    for (int64_t c = 0; c < cols; ++c)
      for (int64_t r = rows; r < ldo; ++r) ASSERT_EQ(out[c * ldo + r], T(-1));
  }
}

TEST(KernelHelpers, TransposeMatchesLoops) {
  check_transpose<float>();
  check_transpose<double>();
}

TEST(KernelHelpers, SimdDotMatchesFloat64Sum) {
  for (int64_t n : {0, 1, 7, 8, 9, 64, 67}) {
    auto a = random_values<float>(n, 1 + n), b = random_values<float>(n, 2 + n);
    double ref = 0;
    for (int64_t i = 0; i < n; ++i) ref += double(a[i]) * double(b[i]);
    EXPECT_NEAR(simd_dot(a.data(), b.data(), n), ref, 1e-5 * (1 + std::abs(ref))) << "n=" << n;
  }
}

TEST(KernelHelpers, GemmMatchesFloat64Loops) {
  for (auto [M, N, K] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{
           {6, 16, 64}, {13, 37, 5}, {1, 1, 1}, {17, 8, 33}, {96, 64, 16}}) {
    auto a = random_values<double>(M * K, M), b = random_values<double>(K * N, N);
    std::vector<double> c(M * N, 0.5), ref(M * N, 0.5);
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j)
        for (int64_t k = 0; k < K; ++k) ref[i * N + j] += a[i * K + k] * b[k * N + j];
    gemm(M, N, K, a.data(), K, b.data(), N, c.data(), N, /*accumulate=*/true);
    for (int64_t i = 0; i < M * N; ++i)
      ASSERT_NEAR(c[i], ref[i], 1e-12) << M << "x" << N << "x" << K;
  }
}

// An exception in a worker (a scratch buffer's std::bad_alloc, a failed
// check) reaches the caller instead of ending the process in std::terminate,
// and the remaining items are skipped.
TEST(KernelHelpers, ParallelItemsRethrowsOnTheCaller) {
  struct Scratch {
    std::vector<double> buf;
  };
  for (int threads : {1, 2, 4}) {
    std::atomic<int64_t> ran{0};
    EXPECT_THROW(parallel_items<Scratch>(
                     1000, threads, [](Scratch&) {},
                     [&](int64_t i, Scratch&) {
                       ++ran;
                       if (i == 3) throw std::runtime_error("item 3");
                       // Slow items: the thread that took item 3 has run long
                       // before the other threads could finish all 1000.
                       std::this_thread::sleep_for(std::chrono::microseconds(200));
                     }),
                 std::runtime_error);
    EXPECT_LT(ran.load(), 1000) << threads << " threads";
    EXPECT_THROW(
        parallel_items<Scratch>(
            8, threads, [](Scratch&) { throw std::bad_alloc(); }, [](int64_t, Scratch&) {}),
        std::bad_alloc);
    // Without failures every item runs once.
    std::vector<int> seen(100, 0);
    parallel_items<Scratch>(
        100, threads, [](Scratch&) {}, [&](int64_t i, Scratch&) { ++seen[i]; });
    for (int x : seen) ASSERT_EQ(x, 1);
  }
}

}  // namespace
}  // namespace fastattn::kernels
