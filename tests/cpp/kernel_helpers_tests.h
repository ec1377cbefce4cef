// The kernels' shared helpers (src/kernels/common/) against plain loops:
// transpose (16x16 AVX-512 and 8x8 AVX2 blocks plus scalar edges), simd_dot, the vector exp,
// the elu feature map's vector code (feature_maps/elu.h), and the register-blocked products, on
// awkward shapes in float32 and float64, and parallel_items' exception handling. Included by
// test_kernel_helpers_<level>.cpp once per instruction-set level, with
// FASTATTN_ISA_LEVEL set; a level this CPU does not run is skipped.
//   build/fastattn_tests --gtest_filter='KernelHelpers*'
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <new>
#include <random>
#include <stdexcept>
#include <thread>
#include <vector>

#include "kernels/common/bf16.h"
#include "kernels/common/cpu_isa.h"
#include "kernels/common/gemm.h"
#include "kernels/common/parallel.h"
#include "kernels/common/simd.h"
#include "kernels/feature_maps/elu.h"

#define FASTATTN_KH_CAT2_(a, b) a##b
#define FASTATTN_KH_CAT_(a, b) FASTATTN_KH_CAT2_(a, b)
// KernelHelpers_isa_default, KernelHelpers_isa_avx2, KernelHelpers_isa_avx512.
#define FASTATTN_KH_SUITE FASTATTN_KH_CAT_(KernelHelpers_, FASTATTN_ISA_NS)
// The level's code runs only where the CPU runs it.
#define FASTATTN_KH_REQUIRE_LEVEL()                                \
  if (!cpu_isa_supported(static_cast<CpuIsa>(FASTATTN_ISA_LEVEL))) \
  GTEST_SKIP() << "this CPU does not run " << cpu_isa_name(static_cast<CpuIsa>(FASTATTN_ISA_LEVEL))

// y = exp(x) through the level's vectors (std::exp for a tail shorter than a
// vector), compiled in the level's target region: vector values cross no call
// between it and the tests.
FASTATTN_ISA_BEGIN
template <typename T>
void simd_exp_for_test(const T* x, T* y, int64_t n) {
  using S = Simd<T>;
  int64_t i = 0;
  for (; i + S::W <= n; i += S::W) S::store(y + i, S::exp(S::load(x + i)));
  for (; i < n; ++i) y[i] = std::exp(x[i]);
}
FASTATTN_ISA_END

namespace fastattn::kernels {
namespace {

using namespace FASTATTN_ISA_NS;  // the level's helpers

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
  for (auto [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{{8, 8},
                                                                    {16, 24},
                                                                    {13, 21},
                                                                    {1, 9},
                                                                    {9, 1},
                                                                    {33, 16},
                                                                    {7, 7},
                                                                    {16, 16},
                                                                    {64, 64},
                                                                    {48, 100},
                                                                    {35, 50},
                                                                    {17, 40},
                                                                    {40, 17}}) {
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

TEST(FASTATTN_KH_SUITE, TransposeMatchesLoops) {
  FASTATTN_KH_REQUIRE_LEVEL();
  check_transpose<float>();
  check_transpose<double>();
}

TEST(FASTATTN_KH_SUITE, SimdDotMatchesFloat64Sum) {
  FASTATTN_KH_REQUIRE_LEVEL();
  for (int64_t n : {0, 1, 7, 8, 9, 15, 16, 17, 64, 67}) {
    auto a = random_values<float>(n, 1 + n), b = random_values<float>(n, 2 + n);
    double ref = 0;
    for (int64_t i = 0; i < n; ++i) ref += double(a[i]) * double(b[i]);
    EXPECT_NEAR(simd_dot(a.data(), b.data(), n), ref, 1e-5 * (1 + std::abs(ref))) << "n=" << n;
  }
}

// bfloat16 rounding by an independent rule: the nearer of f's two bfloat16
// neighbours (its truncation and the next one out), the even one on a tie,
// past the largest finite value inf (the next one out, as if at 2^128).
uint16_t bf16_reference(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const auto lo = static_cast<uint16_t>(u >> 16), hi = static_cast<uint16_t>(lo + 1);
  if ((u & 0xffffu) == 0) return lo;
  auto value = [](uint16_t b) {
    const double sign = (b & 0x8000) ? -1.0 : 1.0;
    if ((b & 0x7fff) == 0x7f80) return sign * std::ldexp(1.0, 128);
    const uint32_t w = static_cast<uint32_t>(b) << 16;
    float x;
    std::memcpy(&x, &w, sizeof x);
    return static_cast<double>(x);
  };
  const double dl = std::abs(value(lo) - f), dh = std::abs(value(hi) - f);
  if (dl != dh) return dl < dh ? lo : hi;
  return (lo & 1) ? hi : lo;
}

// widen_bf16 exact for every bit pattern; narrow_bf16 against bf16_reference
// on random bit patterns, exact ties, the largest values and signed zeros,
// and NaN kept NaN of its sign (also one whose payload lies in the low bits
// only, which truncation would turn into inf); every length 0..40 from
// several offsets, so the vector loops and their tails both run.
TEST(FASTATTN_KH_SUITE, Bfloat16ConversionsRoundToNearestEven) {
  FASTATTN_KH_REQUIRE_LEVEL();
  std::vector<Bf16> all(65536);
  for (int b = 0; b < 65536; ++b) all[b].bits = static_cast<uint16_t>(b);
  std::vector<float> wide(all.size());
  widen_bf16(all.data(), wide.data(), static_cast<int64_t>(all.size()));
  for (int b = 0; b < 65536; ++b) {
    uint32_t u;
    std::memcpy(&u, &wide[b], sizeof u);
    ASSERT_EQ(u, static_cast<uint32_t>(b) << 16) << "bits " << b;
  }
  std::mt19937_64 rng(17);
  std::vector<uint32_t> bits;
  for (int i = 0; i < 20000; ++i) bits.push_back(static_cast<uint32_t>(rng()));
  for (int i = 0; i < 2000; ++i)
    bits.push_back((static_cast<uint32_t>(rng()) & 0xffff0000u) | 0x8000u);
  for (uint32_t b :
       {0x00000000u, 0x80000000u, 0x7f7fffffu, 0xff7fffffu, 0x7f7f8000u, 0x7f7f7fffu, 0x7f800000u,
        0xff800000u, 0x00008000u, 0x00018000u, 0x7f800001u, 0xff800001u, 0x7fc00000u, 0xffffffffu})
    bits.push_back(b);
  std::vector<float> x(bits.size());
  std::memcpy(x.data(), bits.data(), bits.size() * sizeof(float));
  auto check = [&](size_t i, uint16_t got) {
    if (std::isnan(x[i])) {
      ASSERT_EQ(got & 0x7f80, 0x7f80) << "NaN " << std::hex << bits[i] << " -> " << got;
      ASSERT_NE(got & 0x7f, 0) << "NaN " << std::hex << bits[i] << " -> " << got;
      ASSERT_EQ(got & 0x8000, (bits[i] >> 16) & 0x8000) << std::hex << bits[i];
    } else {
      ASSERT_EQ(got, bf16_reference(x[i])) << std::hex << bits[i];
    }
  };
  std::vector<Bf16> out(x.size());
  narrow_bf16(x.data(), out.data(), static_cast<int64_t>(x.size()));
  for (size_t i = 0; i < x.size(); ++i) check(i, out[i].bits);
  for (int64_t n = 0; n <= 40; ++n) {
    for (size_t offset : {0, 3, 13}) {
      std::vector<Bf16> part(n + 1, Bf16{0x1234});
      narrow_bf16(x.data() + offset, part.data(), n);
      for (int64_t i = 0; i < n; ++i) check(offset + i, part[i].bits);
      ASSERT_EQ(part[n].bits, 0x1234) << "wrote past n = " << n;
      std::vector<float> back(n + 1, 7.0f);
      widen_bf16(all.data() + offset * 101, back.data(), n);
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(back[i], wide[offset * 101 + i]);
      ASSERT_EQ(back[n], 7.0f) << "wrote past n = " << n;
    }
  }
}

// exp(x) to within a few float32 ulp over the whole range, and no more than
// a denormal below the underflow limit and for -inf.
TEST(FASTATTN_KH_SUITE, SimdExpMatchesStdExp) {
  FASTATTN_KH_REQUIRE_LEVEL();
  std::vector<float> x;
  for (float t = -87.0f; t <= 88.5f; t += 0.173f) x.push_back(t);
  for (float t : {0.0f, -0.0f, 1e-8f, -1e-8f, -87.3f, 88.7f}) x.push_back(t);
  const size_t finite = x.size();
  for (float t : {-88.0f, -100.0f, -std::numeric_limits<float>::infinity()}) x.push_back(t);
  std::vector<float> y(x.size());
  simd_exp_for_test(x.data(), y.data(), static_cast<int64_t>(x.size()));
  for (size_t i = 0; i < finite; ++i) {
    const double ref = std::exp(double(x[i]));
    ASSERT_NEAR(y[i], ref, 4e-7 * ref) << "exp(" << x[i] << ")";
  }
  // Below the underflow limit: 0 (the scalar level's std::exp: a denormal).
  for (size_t i = finite; i < x.size(); ++i) {
    ASSERT_GE(y[i], 0.0f) << "exp(" << x[i] << ")";
    ASSERT_LT(y[i], std::numeric_limits<float>::min()) << "exp(" << x[i] << ")";
  }
  std::vector<double> xd(x.begin(), x.begin() + finite), yd(finite);
  simd_exp_for_test(xd.data(), yd.data(), static_cast<int64_t>(finite));
  for (size_t i = 0; i < finite; ++i)
    ASSERT_NEAR(yd[i], std::exp(xd[i]), 1e-15 * std::exp(xd[i])) << "exp(" << xd[i] << ")";
}

// phi(x) = elu(x) + 1 and phi'(x) (feature_maps/elu.h: exp_nonpositive, no clamp from above)
// against float64 on whole vectors: both signs, 0, the underflow edge, +-inf and NaN in every
// lane position (n a multiple of 16: no scalar tail at any level).
TEST(FASTATTN_KH_SUITE, EluFeatureMapVectorsMatchFloat64) {
  FASTATTN_KH_REQUIRE_LEVEL();
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> x;
  for (float t = -90.0f; t <= 30.0f; t += 0.0937f) x.push_back(t);
  for (float t : {0.0f, -0.0f, 1e-30f, -1e-30f, -87.3f, -87.4f, -103.0f, -inf, inf, 88.8f, 1e30f})
    x.push_back(t);
  for (int i = 0; i < 16; ++i) x.push_back(i % 3 ? 0.5f * i - 4 : std::nanf(""));
  while (x.size() % 16) x.push_back(-1.0f);
  const int64_t n = static_cast<int64_t>(x.size());
  std::vector<float> g(n, 1.5f), phi(n), dphi(n);
  elu_plus_one(x.data(), phi.data(), n);
  elu_plus_one_backward(x.data(), g.data(), dphi.data(), n);
  for (int64_t i = 0; i < n; ++i) {
    const double v = x[i];
    if (std::isnan(v)) {
      ASSERT_TRUE(std::isnan(phi[i])) << "phi(NaN) at " << i;
      continue;
    }
    const double ref = v > 0 ? v + 1 : std::exp(v), dref = 1.5 * (v > 0 ? 1.0 : std::exp(v));
    ASSERT_EQ(dphi[i], dphi[i]) << "phi'(" << v << ") is NaN";
    if (std::isinf(ref)) {
      ASSERT_EQ(phi[i], ref) << "phi(" << v << ")";
      ASSERT_EQ(dphi[i], dref) << "phi'(" << v << ")";
      continue;
    }
    // exp(x) within a few ulp, 0 or a denormal below the float32 normal range.
    const double tol = v > 0 ? 6e-8 * ref : std::max(4e-7 * ref, 1.2e-38);
    ASSERT_NEAR(phi[i], ref, tol) << "phi(" << v << ")";
    ASSERT_NEAR(dphi[i], dref, 1.5 * tol) << "phi'(" << v << ")";
  }
}

TEST(FASTATTN_KH_SUITE, GemmMatchesFloat64Loops) {
  FASTATTN_KH_REQUIRE_LEVEL();
  for (auto [M, N, K] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{{6, 16, 64},
                                                                           {13, 37, 5},
                                                                           {1, 1, 1},
                                                                           {17, 8, 33},
                                                                           {96, 64, 16},
                                                                           {7, 48, 9},
                                                                           {12, 33, 64},
                                                                           {7, 100, 20}}) {
    auto a = random_values<double>(M * K, M), b = random_values<double>(K * N, N);
    std::vector<double> c(M * N, 0.5), ref(M * N, 0.5);
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j)
        for (int64_t k = 0; k < K; ++k) ref[i * N + j] += a[i * K + k] * b[k * N + j];
    gemm(M, N, K, a.data(), K, b.data(), N, c.data(), N, /*accumulate=*/true);
    for (int64_t i = 0; i < M * N; ++i)
      ASSERT_NEAR(c[i], ref[i], 1e-12) << M << "x" << N << "x" << K;
    // gemm_tn: the same A stored transposed (K x M, rows M + 3 apart), into a
    // C not accumulated (its old values must not leak into the result).
    const int64_t ldt = M + 3;
    std::vector<double> at(K * ldt, 1e300), ct(M * N, -7.0);
    for (int64_t i = 0; i < M; ++i)
      for (int64_t k = 0; k < K; ++k) at[k * ldt + i] = a[i * K + k];
    gemm_tn(M, N, K, at.data(), ldt, b.data(), N, ct.data(), N, /*accumulate=*/false);
    for (int64_t i = 0; i < M * N; ++i)
      ASSERT_NEAR(ct[i], ref[i] - 0.5, 1e-12) << "gemm_tn " << M << "x" << N << "x" << K;
  }
}

// pack_transposed_panels: panel p holds X's rows [p·NR, p·NR + NR) column by
// column, zeros past the last row (a whole zero panel when padded_rows asks
// for one more).
template <typename T, int NV = 2>
void check_pack_panels() {
  constexpr int64_t NR = panel_width<T, NV>();
  for (int64_t rows : {1, 7, 8, 13, 33, 64})
    for (int64_t cols : {1, 9, 64}) {
      const int64_t ldx = cols + 3;
      const int64_t padded = (rows + NR - 1) / NR * NR + NR;
      auto x = random_values<T>(rows * ldx, rows * 1000 + cols);
      std::vector<T> out(cols * padded, T(-1));
      pack_transposed_panels<T, NV>(x.data(), rows, cols, ldx, padded, out.data());
      for (int64_t p = 0; p < padded; p += NR)
        for (int64_t c = 0; c < cols; ++c)
          for (int64_t r = 0; r < NR; ++r)
            ASSERT_EQ(out[p * cols + c * NR + r], p + r < rows ? x[(p + r) * ldx + c] : T(0))
                << rows << "x" << cols << " panel " << p << " at " << r << "," << c;
    }
}

TEST(FASTATTN_KH_SUITE, PackTransposedPanelsMatchesLoops) {
  FASTATTN_KH_REQUIRE_LEVEL();
  check_pack_panels<float>();
  check_pack_panels<double>();
  check_pack_panels<float, kWideBlock>();
  check_pack_panels<double, kWideBlock>();
}

// gemm_packed over panels of 2 and of kWideBlock vectors: C = A · X^T with X
// packed by pack_transposed_panels (full attention's Q · K^T).
template <int NV>
void check_gemm_packed() {
  constexpr int64_t NR = panel_width<double, NV>();
  for (auto [M, N, K] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{
           {13, 2 * NR, 64}, {6, NR, 3}, {25, 3 * NR, 17}}) {
    auto a = random_values<double>(M * K, M + N), x = random_values<double>(N * K, K);
    std::vector<double> xp(N * K), c(M * N, -7.0);
    pack_transposed_panels<double, NV>(x.data(), N, K, K, N, xp.data());
    gemm_packed<double, NV>(M, N, K, a.data(), K, xp.data(), c.data(), N, /*accumulate=*/false);
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) {
        double ref = 0;
        for (int64_t k = 0; k < K; ++k) ref += a[i * K + k] * x[j * K + k];
        ASSERT_NEAR(c[i * N + j], ref, 1e-12) << NV << ": " << M << "x" << N << "x" << K;
      }
  }
}

TEST(FASTATTN_KH_SUITE, GemmPackedMatchesFloat64Loops) {
  FASTATTN_KH_REQUIRE_LEVEL();
  check_gemm_packed<2>();
  check_gemm_packed<kWideBlock>();
}

// zero_all_rows_parallel zeroes each head's rows and nothing between them,
// on one thread and several, below and above its serial size.
TEST(FASTATTN_KH_SUITE, ZeroAllRowsParallelZeroesOnlyTheRows) {
  FASTATTN_KH_REQUIRE_LEVEL();
  for (int threads : {1, 2, 3})
    for (int64_t rows : {5, 1000}) {
      const int64_t N = 2, H = 3, cols = 70;
      // (N, rows, H, cols + 2): heads interleaved in each row, 2 values of gap.
      RowStrides s;
      s.sr = H * (cols + 2);
      s.sh = cols + 2;
      s.sn = rows * s.sr;
      std::vector<float> x(N * s.sn, -1.0f);
      zero_all_rows_parallel(x.data(), s, N * H, H, rows, cols, threads);
      for (int64_t i = 0; i < N * s.sn; ++i) {
        const bool in_rows = i % s.sh < cols;
        ASSERT_EQ(x[i], in_rows ? 0.0f : -1.0f)
            << threads << " threads, " << rows << " rows, at " << i;
      }
    }
}

// An exception in a worker (a scratch buffer's std::bad_alloc, a failed
// check) reaches the caller instead of ending the process in std::terminate,
// and the remaining items are skipped.
TEST(FASTATTN_KH_SUITE, ParallelItemsRethrowsOnTheCaller) {
  FASTATTN_KH_REQUIRE_LEVEL();
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
