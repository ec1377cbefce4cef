// The backend-comparison harness of the CUDA operators (tests/cuda/, built
// only with a CUDA-enabled LibTorch): every op runs on the GPU per dtype and
// is compared with the CPU op in float64 on the same inputs. Tests skip
// cleanly where no GPU is present.
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

namespace fastattn::testing {

#define FASTATTN_SKIP_WITHOUT_CUDA()                                    \
  do {                                                                  \
    if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device"; \
  } while (0)

// The dtypes every CUDA kernel takes.
inline std::vector<torch::ScalarType> cuda_dtypes() {
  return {torch::kFloat, torch::kHalf, torch::kBFloat16};
}

// Allowed error of a result in `dtype` against the float64 CPU result:
// |got - ref| <= atol + rtol·|ref| elementwise. float32 accumulates like the
// CPU kernels; float16 and bfloat16 round the inputs (the comparison feeds
// both backends the same rounded inputs) and the outputs (2^-11, 2^-8 relative)
// and, on tensor cores, the probabilities before the value product.
struct Tolerance {
  double atol, rtol;
};
inline Tolerance tolerance_for(torch::ScalarType dtype) {
  switch (dtype) {
    case torch::kHalf:
      return {2e-3, 4e-3};
    case torch::kBFloat16:
      return {1.6e-2, 3e-2};
    default:
      return {2e-5, 2e-4};
  }
}

// Random input on the GPU in `dtype`, and the same values (after rounding to
// dtype) as float64 on the CPU.
struct Pair {
  torch::Tensor gpu, cpu64;
};
inline Pair random_pair(torch::IntArrayRef shape, torch::ScalarType dtype, double scale = 1.0) {
  auto x = (torch::randn(shape, torch::kDouble) * scale).to(dtype);
  return {x.to(torch::kCUDA), x.to(torch::kDouble)};
}

// Elementwise check of `got` (any device, any floating dtype) against `ref`
// (float64, CPU); the message names `what` and the worst element.
inline void expect_close(const torch::Tensor& got, const torch::Tensor& ref, Tolerance tol,
                         const std::string& what) {
  ASSERT_EQ(got.sizes(), ref.sizes()) << what;
  const auto g = got.to(torch::kCPU, torch::kDouble);
  const auto err = (g - ref).abs();
  const auto bound = tol.atol + tol.rtol * ref.abs();
  const auto excess = err - bound;
  const auto worst = excess.flatten().argmax().item<int64_t>();
  EXPECT_LE(excess.flatten()[worst].item<double>(), 0.0)
      << what << ": element " << worst << " is " << g.flatten()[worst].item<double>()
      << ", the CPU float64 op gives " << ref.flatten()[worst].item<double>() << " (max abs error "
      << err.max().item<double>() << ", tolerance " << tol.atol << " + " << tol.rtol << "·|ref|)";
  EXPECT_FALSE(g.isnan().any().item<bool>() && !ref.isnan().any().item<bool>()) << what;
}

}  // namespace fastattn::testing
