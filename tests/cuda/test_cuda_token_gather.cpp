// Backend comparison of gather_tokens (forward and its scatter-add gradient
// through autograd): the CUDA op per dtype against the CPU op in float64 on
// the same rounded inputs, with repeated and -1 indices.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "cuda_compare.h"
#include "fastattn/ops.h"

namespace {

using namespace fastattn::testing;

TEST(CudaTokenGather, ForwardAndGradientMatchCpu) {
  FASTATTN_SKIP_WITHOUT_CUDA();
  torch::manual_seed(2);
  for (auto dtype : cuda_dtypes()) {
    for (int64_t T : {9, 80}) {
      SCOPED_TRACE(std::string(c10::toString(dtype)) + " T " + std::to_string(T));
      const int64_t N = 2, H = 3, L = 33, E = 24;
      auto x = random_pair({N, H, L, E}, dtype);
      auto g = random_pair({N, H, T, E}, dtype);
      const auto index = torch::randint(-1, L, {N, T}, torch::kLong);  // repeats and -1
      auto xg = x.gpu.clone().requires_grad_(true);
      auto xc = x.cpu64.clone().requires_grad_(true);
      auto out_g = fastattn::gather_tokens(xg, index.cuda());
      auto out_c = fastattn::gather_tokens(xc, index);
      expect_close(out_g, out_c.detach(), {0.0, 0.0}, "out");
      out_g.backward(g.gpu);
      out_c.backward(g.cpu64);
      expect_close(xg.grad(), xc.grad(), tolerance_for(dtype), "grad x");
    }
  }
}

}  // namespace
