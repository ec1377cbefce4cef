// Backend comparison of hash_queries and cluster_codes: the CUDA ops against
// the CPU ops in float64 on the same (rounded) inputs. Hash codes must agree
// on every bit whose float64 projection is not within 1e-3 of 0 (float32
// codes: every bit); cluster assignments and counts must be identical.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "cuda_compare.h"
#include "fastattn/ops.h"

namespace {

using namespace fastattn::testing;

TEST(CudaClustering, HashQueriesMatchesCpu) {
  FASTATTN_SKIP_WITHOUT_CUDA();
  torch::manual_seed(0);
  for (auto dtype : cuda_dtypes()) {
    for (int64_t B : {1, 33, 64}) {
      for (int64_t E : {16, 64, 200}) {
        SCOPED_TRACE(std::string(c10::toString(dtype)) + " B " + std::to_string(B) + " E " +
                     std::to_string(E));
        auto x = random_pair({2, 3, 37, E}, dtype);
        auto planes = random_pair({B, E + 1}, dtype);
        const auto got = fastattn::hash_queries(x.gpu, planes.gpu).cpu();
        const auto want = fastattn::hash_queries(x.cpu64, planes.cpu64);
        const auto proj = torch::matmul(x.cpu64, planes.cpu64.narrow(1, 0, E).t()) +
                          planes.cpu64.select(1, E);  // (N, H, L, B)
        const auto shifts = torch::arange(B, torch::kLong);
        const auto bits_got = got.unsqueeze(-1).bitwise_right_shift(shifts).bitwise_and(1);
        const auto bits_want = want.unsqueeze(-1).bitwise_right_shift(shifts).bitwise_and(1);
        const auto clear = proj.abs().gt(1e-3);
        EXPECT_TRUE(bits_got.masked_select(clear).equal(bits_want.masked_select(clear)));
        EXPECT_EQ(
            got.bitwise_right_shift(B - 1).bitwise_right_shift(1).ne(0).sum().item<int64_t>() *
                (B < 64),
            0)
            << "bits beyond B set";
      }
    }
  }
}

TEST(CudaClustering, ClusterCodesIdenticalToCpu) {
  FASTATTN_SKIP_WITHOUT_CUDA();
  torch::manual_seed(1);
  struct Case {
    int64_t N, H, L, C, iterations;
    bool lengths;
  };
  for (const Case& c : {Case{2, 3, 100, 8, 10, false}, Case{3, 2, 1500, 25, 5, true},
                        Case{1, 2, 300, 200, 3, false}, Case{2, 1, 16384, 100, 10, true}}) {
    SCOPED_TRACE("L " + std::to_string(c.L) + " C " + std::to_string(c.C));
    // Codes of random queries (so nearby codes repeat, as in use).
    auto x = torch::randn({c.N, c.H, c.L, 16}, torch::kDouble);
    auto planes = torch::randn({63, 17}, torch::kDouble);
    const auto codes = fastattn::hash_queries(x, planes);
    std::optional<torch::Tensor> len;
    if (c.lengths) {
      len = torch::randint(0, c.L + 1, {c.N}, torch::kLong);
      len->index_put_({0}, c.L);
    }
    for (int64_t seed : {0, 7}) {
      const auto [a_cpu, n_cpu] = fastattn::cluster_codes(codes, len, c.C, c.iterations, seed);
      std::optional<torch::Tensor> len_gpu;
      if (len) len_gpu = len->cuda();
      const auto [a_gpu, n_gpu] =
          fastattn::cluster_codes(codes.cuda(), len_gpu, c.C, c.iterations, seed);
      EXPECT_TRUE(a_gpu.cpu().equal(a_cpu)) << "assignments, seed " << seed;
      EXPECT_TRUE(n_gpu.cpu().equal(n_cpu)) << "counts, seed " << seed;
    }
  }
}

}  // namespace
