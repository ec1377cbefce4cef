// hash_queries_cuda (src/kernels/hashing/hash_queries_cuda.cu) under the
// emulator against the CPU kernel: float32 codes bit-identical to
// hash_queries_cpu<float>; every dtype: each bit equal to the sign of the
// float64 projection of the same rounded inputs wherever that projection is
// not within 1e-3 of 0. Sizes: B in {1, 17, 32, 33, 64}, E in {1, 16, 24,
// 64} (shared planes) and 200 (planes read from global memory), rows not a
// multiple of the block's 8 warps.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "emu_test_util.h"
#include "kernels/hashing/hash_queries_cuda.h"
#include "kernels/hashing/hashing.h"

namespace {

using namespace fastattn::emu_test;

template <typename T>
void check_hash(int64_t rows, int64_t E, int B, uint32_t seed) {
  SCOPED_TRACE(std::string(dtype_name<T>()) + " rows " + std::to_string(rows) + " E " +
               std::to_string(E) + " B " + std::to_string(B));
  std::mt19937 rng(seed);
  auto x = random_buffer<T>(rows * E, rng);
  auto planes = random_buffer<T>(B * (E + 1), rng);
  std::vector<int64_t> codes(rows, -7);
  fastattn::cuda::HashQueriesCudaArgs a;
  a.x = x.dev.data();
  a.planes = planes.dev.data();
  a.codes = codes.data();
  a.rows = rows;
  a.E = E;
  a.B = B;
  a.dtype = dtype_of<T>();
  fastattn::cuda::hash_queries_cuda(a, nullptr);

  if constexpr (std::is_same_v<T, float>) {
    std::vector<int64_t> want(rows);
    fastattn::kernels::HashParams<float> p;
    p.x = x.dev.data();
    p.planes = planes.dev.data();
    p.codes = want.data();
    p.rows = rows;
    p.E = E;
    p.B = B;
    fastattn::kernels::hash_queries_cpu(p);
    for (int64_t r = 0; r < rows; ++r) EXPECT_EQ(codes[r], want[r]) << "row " << r;
  }
  int64_t checked = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const auto code = static_cast<uint64_t>(codes[r]);
    for (int b = 0; b < 64; ++b) {
      if (b >= B) {
        EXPECT_EQ((code >> b) & 1u, 0u) << "row " << r << " bit " << b << " beyond B";
        continue;
      }
      double proj = planes.ref[b * (E + 1) + E];
      for (int64_t e = 0; e < E; ++e) proj += x.ref[r * E + e] * planes.ref[b * (E + 1) + e];
      if (std::fabs(proj) < 1e-3) continue;
      ++checked;
      EXPECT_EQ((code >> b) & 1u, proj > 0 ? 1u : 0u) << "row " << r << " bit " << b;
    }
  }
  EXPECT_GT(checked, 0);
}

template <typename T>
void sweep() {
  uint32_t seed = 1;
  for (int B : {1, 17, 32, 33, 64})
    for (int64_t E : {1, 16, 24, 64}) check_hash<T>(37, E, B, seed++);
  check_hash<T>(19, 200, 64, seed++);  // planes too large for shared memory
  check_hash<T>(1, 33, 40, seed++);
}

TEST(ClusteredEmuHashQueries, Float32) { sweep<float>(); }
TEST(ClusteredEmuHashQueries, Float16) { sweep<__half>(); }
TEST(ClusteredEmuHashQueries, BFloat16) { sweep<__nv_bfloat16>(); }

}  // namespace
