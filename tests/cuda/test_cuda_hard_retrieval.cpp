// hard_retrieval_attention on CUDA against the CPU op in float64 on the same
// (dtype-rounded) inputs, per dtype: argmax and sampling (the same seed gives
// the same indices on both backends: the CUDA kernel reproduces the CPU's
// counter-based draws), bool keep masks, key lengths, causal with S != L; the
// outputs, the forward op's lse, and the straight-through gradients of q, k, v
// through autograd. Skipped without a GPU.
//   ./build/fastattn_tests --gtest_filter='CudaHardRetrieval*'
#include <ATen/core/dispatch/Dispatcher.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "cuda_compare.h"
#include "fastattn/ops.h"

namespace fastattn {
namespace {

using testing::cuda_dtypes;
using testing::expect_close;
using testing::random_pair;
using testing::tolerance_for;

struct Cfg {
  std::string name;
  int64_t N, H, L, S, E, M;
  bool causal, mask, sample;
  std::vector<int64_t> lengths;
};

std::vector<Cfg> configs() {
  return {
      {"argmax", 2, 2, 50, 97, 64, 64, false, false, false, {}},
      {"argmax_mask_lengths", 2, 2, 33, 300, 32, 48, false, true, false, {300, 0}},
      {"sample_causal_S_gt_L", 1, 4, 40, 260, 64, 64, true, false, true, {}},
      {"sample_mask_causal_lengths", 2, 1, 97, 97, 16, 24, true, true, true, {97, 40}},
  };
}

TEST(CudaHardRetrieval, MatchesCpuIndicesOutputsAndGradients) {
  FASTATTN_SKIP_WITHOUT_CUDA();
  for (const auto& c : configs()) {
    for (auto dtype : cuda_dtypes()) {
      const std::string what = c.name + " " + std::string(c10::toString(dtype));
      SCOPED_TRACE(what);
      torch::manual_seed(5);
      auto q = random_pair({c.N, c.H, c.L, c.E}, dtype);
      auto k = random_pair({c.N, c.H, c.S, c.E}, dtype);
      auto v = random_pair({c.N, c.H, c.S, c.M}, dtype);
      auto go = random_pair({c.N, c.H, c.L, c.M}, dtype);
      std::optional<torch::Tensor> mask_cpu, mask_gpu, len_cpu, len_gpu;
      if (c.mask) {
        mask_cpu = torch::rand({c.N, 1, c.L, c.S}) < 0.7;
        mask_gpu = mask_cpu->to(torch::kCUDA);
      }
      if (!c.lengths.empty()) {
        len_cpu = torch::tensor(c.lengths, torch::kLong);
        len_gpu = len_cpu->to(torch::kCUDA);
      }
      const auto tol = tolerance_for(dtype);
      const int64_t seed = 2024;

      auto qg = q.gpu.clone().requires_grad_(true), kg = k.gpu.clone().requires_grad_(true),
           vg = v.gpu.clone().requires_grad_(true);
      auto qc = q.cpu64.clone().requires_grad_(true), kc = k.cpu64.clone().requires_grad_(true),
           vc = v.cpu64.clone().requires_grad_(true);
      auto [out_g, idx_g] = hard_retrieval_attention(qg, kg, vg, mask_gpu, len_gpu, c.causal,
                                                     c.sample, std::nullopt, seed);
      auto [out_c, idx_c] = hard_retrieval_attention(qc, kc, vc, mask_cpu, len_cpu, c.causal,
                                                     c.sample, std::nullopt, seed);
      // Indices: identical (a draw or argmax within float32 rounding of a
      // boundary could differ; with these inputs none does).
      const auto differ = (idx_g.cpu() != idx_c).sum().item<int64_t>();
      ASSERT_EQ(differ, 0) << what << ": " << differ << " indices differ";
      expect_close(out_g, out_c.detach(), {0, 0}, what + " out (a copy of v rows)");
      out_g.backward(go.gpu);
      out_c.backward(go.cpu64);
      expect_close(qg.grad(), qc.grad(), tol, what + " grad_q");
      expect_close(kg.grad(), kc.grad(), tol, what + " grad_k");
      expect_close(vg.grad(), vc.grad(), tol, what + " grad_v");
    }
  }
}

TEST(CudaHardRetrieval, ForwardLseMatchesCpu) {
  FASTATTN_SKIP_WITHOUT_CUDA();
  static auto fwd =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("fastattn::hard_retrieval_attention_forward", "")
          .typed<std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor>(
              const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
              const c10::optional<torch::Tensor>&, const c10::optional<torch::Tensor>&, bool, bool,
              double, int64_t, bool)>();
  for (auto dtype : cuda_dtypes()) {
    torch::manual_seed(3);
    auto q = random_pair({1, 2, 30, 200}, dtype);  // S = 200: two reservoir tiles of keys
    auto k = random_pair({1, 2, 200, 200}, dtype);
    auto v = random_pair({1, 2, 200, 8}, dtype);
    auto mask = torch::rand({30, 200}) < 0.5;
    auto [o1, i1, lse_g, soft_g] = fwd.call(q.gpu, k.gpu, v.gpu, mask.to(torch::kCUDA),
                                            c10::nullopt, true, false, 0.3, 0, true);
    auto [o2, i2, lse_c, soft_c] =
        fwd.call(q.cpu64, k.cpu64, v.cpu64, mask, c10::nullopt, true, false, 0.3, 0, true);
    EXPECT_EQ(lse_g.scalar_type(), torch::kFloat);
    // The softmax output for the backward: the CPU kernel's; CUDA recomputes delta instead.
    EXPECT_EQ(soft_g.numel(), 0);
    EXPECT_EQ(soft_c.sizes(), o2.sizes());
    const auto finite = torch::isfinite(lse_c);
    EXPECT_TRUE(torch::equal(torch::isfinite(lse_g.cpu()), finite));
    expect_close(lse_g.cpu().masked_fill(finite.logical_not(), 0),
                 lse_c.masked_fill(finite.logical_not(), 0), {1e-4, 1e-5}, "lse");
  }
}

}  // namespace
}  // namespace fastattn
