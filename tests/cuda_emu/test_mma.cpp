// mma_m16n8k16 (src/kernels/common/mma_m16n8k16.cuh) in the emulator: the
// product through the documented fragment layouts, by the same probe kernel
// that tests/cuda/test_cuda_mma.cpp runs on a GPU, and the misuse checks.
#include <gtest/gtest.h>

#include <stdexcept>
#include <vector>

#include "cuda_emulator.h"
#include "kernels/common/mma_m16n8k16.cuh"
#include "kernels/common/mma_probe_cuda.h"

namespace {

using fastattn::cuda::DType;
using fastattn::cuda::from_float;
using fastattn::cuda::to_float;

// Small integers: every product and sum is exact in float, so the result must
// equal the reference exactly, and an element read from the wrong place shows.
template <typename T>
void check_probe(DType dtype) {
  std::vector<T> a(16 * 16), b(16 * 8);
  std::vector<float> c(16 * 8), d(16 * 8, -1.f);
  for (int i = 0; i < 16 * 16; ++i) a[i] = from_float<T>(static_cast<float>((i * 37) % 11) - 5.f);
  for (int i = 0; i < 16 * 8; ++i) {
    b[i] = from_float<T>(static_cast<float>((i * 23) % 7) - 3.f);
    c[i] = static_cast<float>((i * 5) % 13) - 6.f;
  }
  fastattn::cuda::mma_m16n8k16_probe_cuda(dtype, a.data(), b.data(), c.data(), d.data(), nullptr);
  for (int r = 0; r < 16; ++r)
    for (int n = 0; n < 8; ++n) {
      double want = c[r * 8 + n];
      for (int k = 0; k < 16; ++k)
        want += static_cast<double>(to_float(a[r * 16 + k])) * to_float(b[k * 8 + n]);
      EXPECT_EQ(d[r * 8 + n], static_cast<float>(want)) << "row " << r << ", column " << n;
    }
}

TEST(CudaEmuMma, ProbeMatchesFloat64Product) {
  check_probe<__half>(DType::kFloat16);
  check_probe<__nv_bfloat16>(DType::kBFloat16);
}

// Every lane's fragment positions together cover each matrix exactly once.
TEST(CudaEmuMma, FragmentsPartitionTheMatrices) {
  namespace c = fastattn::cuda;
  std::vector<int> a(16 * 16, 0), b(16 * 8, 0), acc(16 * 8, 0);
  for (int lane = 0; lane < 32; ++lane) {
    for (int i = 0; i < 8; ++i) ++a[c::mma_a_row(lane, i) * 16 + c::mma_a_col(lane, i)];
    for (int i = 0; i < 4; ++i) ++b[c::mma_b_row(lane, i) * 8 + c::mma_b_col(lane, i)];
    for (int i = 0; i < 4; ++i) ++acc[c::mma_c_row(lane, i) * 8 + c::mma_c_col(lane, i)];
  }
  for (int v : a) EXPECT_EQ(v, 1);
  for (int v : b) EXPECT_EQ(v, 1);
  for (int v : acc) EXPECT_EQ(v, 1);
}

TEST(CudaEmuMma, OlderArchitecturesAndFloat32AreErrors) {
  std::vector<__half> a(256), b(128);
  std::vector<float> c(128), d(128);
  {
    fastattn::cuda::emu::ScopedArchitecture sm75(75, 75);
    try {
      fastattn::cuda::mma_m16n8k16_probe_cuda(DType::kFloat16, a.data(), b.data(), c.data(),
                                              d.data(), nullptr);
      ADD_FAILURE() << "no error on compute capability 7.5";
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find("needs compute capability 8.0"), std::string::npos)
          << e.what();
      EXPECT_NE(std::string(e.what()).find("7.5"), std::string::npos) << e.what();
    }
  }
  EXPECT_THROW(fastattn::cuda::mma_m16n8k16_probe_cuda(DType::kFloat32, a.data(), b.data(),
                                                       c.data(), d.data(), nullptr),
               std::invalid_argument);
}

__global__ void half_warp_mma_kernel(float* d) {
  fastattn::cuda::MmaA<__half> a{};
  fastattn::cuda::MmaB<__half> b{};
  fastattn::cuda::MmaC c{};
  fastattn::cuda::mma_m16n8k16(c, a, b, c);
  d[threadIdx.x] = c.x[0];
}

TEST(CudaEmuMma, PartialWarpIsAnError) {
  std::vector<float> d(16);
  EXPECT_DEATH(FA_LAUNCH(dim3(1), dim3(16), 0, nullptr, half_warp_mma_kernel)(d.data()),
               "partial warps");
}

}  // namespace
