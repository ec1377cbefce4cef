// hash_queries_cuda (src/kernels/hashing/hash_queries_cuda.cu) under the
// emulator against the plain reference (hashing_reference.h): every dtype,
// each bit equal to the sign of the reference's float64 projection of the
// same rounded inputs wherever that projection is not within 1e-3 of 0. Sizes: B in {1, 17, 32, 33,
// 64}, E in {1, 16, 24, 64} (shared planes) and 200 (planes read from global memory), rows not a
// multiple of the block's 8 warps.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "emu_test_util.h"
#include "kernels/hashing/hash_queries_cuda.h"
#include "kernels/hashing/hashing.h"
#include "kernels/hashing/hashing_reference.h"

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

  // The plain reference (hashing_reference.h) on the same rounded inputs.
  fastattn::kernels::HashParams<double> ref;
  ref.x = x.ref.data();
  ref.planes = planes.ref.data();
  ref.rows = rows;
  ref.E = E;
  ref.B = B;
  int64_t checked = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const auto code = static_cast<uint64_t>(codes[r]);
    for (int b = 0; b < 64; ++b) {
      if (b >= B) {
        EXPECT_EQ((code >> b) & 1u, 0u) << "row " << r << " bit " << b << " beyond B";
        continue;
      }
      const double proj = fastattn::kernels::hash_projection_reference(ref, r, b);
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
