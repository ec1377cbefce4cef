// mma_m16n8k16's fragment layouts (src/kernels/common/mma_m16n8k16.cuh) on
// the GPU: the probe kernel's product against float64 on small integers,
// exact, so an element that a lane holds elsewhere than the header says
// shows here. The emulator runs the same probe (tests/cuda_emu/test_mma.cpp).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "cuda_compare.h"
#include "kernels/common/mma_probe_cuda.h"

namespace {

int device_arch() {
  int device = 0, major = 0, minor = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  return 10 * major + minor;
}

TEST(CudaMma, ProbeMatchesFloat64Product) {
  FASTATTN_SKIP_WITHOUT_CUDA();
  if (device_arch() < 80) GTEST_SKIP() << "mma.sync m16n8k16 needs compute capability 8.0";
  for (auto [dtype, cuda_dtype] : {std::pair{torch::kHalf, fastattn::cuda::DType::kFloat16},
                                   std::pair{torch::kBFloat16, fastattn::cuda::DType::kBFloat16}}) {
    SCOPED_TRACE(c10::toString(dtype));
    const auto a = torch::randint(-5, 6, {16, 16}, torch::kDouble);
    const auto b = torch::randint(-3, 4, {16, 8}, torch::kDouble);
    const auto c = torch::randint(-6, 7, {16, 8}, torch::kDouble);
    const auto ag = a.to(dtype).cuda().contiguous(), bg = b.to(dtype).cuda().contiguous();
    const auto cg = c.to(torch::kFloat).cuda().contiguous();
    auto dg = torch::full({16, 8}, -1.f, cg.options());
    fastattn::cuda::mma_m16n8k16_probe_cuda(cuda_dtype, ag.data_ptr(), bg.data_ptr(),
                                            cg.data_ptr<float>(), dg.data_ptr<float>(), nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const auto want = torch::mm(a, b) + c;
    const auto got = dg.cpu().to(torch::kDouble);
    EXPECT_TRUE(torch::equal(got, want)) << "got\n" << got << "\nwant\n" << want;
  }
}

}  // namespace
