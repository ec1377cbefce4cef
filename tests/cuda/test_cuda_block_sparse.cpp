// block_sparse_attention on CUDA against the CPU op in float64 on the same
// (dtype-rounded) inputs: forward (out, and the forward op's lse) and the
// gradients of q, k, v through autograd, per dtype, for each pattern family
// and mode with causal, S != L and key lengths. Skipped without a GPU.
//   ./build/fastattn_tests --gtest_filter='CudaBlockSparse*'
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
  std::string name, pattern;
  std::vector<int64_t> params;
  int64_t N, H, L, S, E, M;
  bool causal;
  std::vector<int64_t> lengths;
};

std::vector<Cfg> configs() {
  return {
      {"local_causal", "local", {24}, 2, 2, 97, 97, 64, 64, true, {}},
      {"local_bidir_S_gt_L", "local", {17}, 1, 3, 70, 130, 32, 48, false, {130}},
      {"strided_merged_causal", "strided", {10, 0}, 2, 2, 150, 150, 64, 64, true, {150, 61}},
      {"strided_split_bidir", "strided", {7, 3}, 1, 4, 97, 97, 16, 24, false, {}},
      {"fixed_merged_per_head", "fixed", {16, 4, 0, 1}, 1, 4, 130, 130, 64, 64, true, {}},
      {"fixed_A2_S_lt_L", "fixed", {12, 3, 2, 0}, 2, 2, 90, 60, 128, 128, true, {60, 0}},
  };
}

TEST(CudaBlockSparse, MatchesCpuForwardAndGradients) {
  FASTATTN_SKIP_WITHOUT_CUDA();
  static auto fwd = c10::Dispatcher::singleton()
                        .findSchemaOrThrow("fastattn::block_sparse_attention_forward", "")
                        .typed<std::tuple<torch::Tensor, torch::Tensor>(
                            const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                            c10::string_view, c10::IntArrayRef, const c10::optional<torch::Tensor>&,
                            bool, double, double, int64_t)>();
  for (const auto& c : configs()) {
    for (auto dtype : cuda_dtypes()) {
      const std::string what = c.name + " " + std::string(c10::toString(dtype));
      SCOPED_TRACE(what);
      torch::manual_seed(11);
      auto q = random_pair({c.N, c.H, c.L, c.E}, dtype);
      auto k = random_pair({c.N, c.H, c.S, c.E}, dtype);
      auto v = random_pair({c.N, c.H, c.S, c.M}, dtype);
      auto go = random_pair({c.N, c.H, c.L, c.M}, dtype);
      std::optional<torch::Tensor> len_cpu, len_gpu;
      if (!c.lengths.empty()) {
        len_cpu = torch::tensor(c.lengths, torch::kLong);
        len_gpu = len_cpu->to(torch::kCUDA);
      }
      const auto tol = tolerance_for(dtype);

      auto qg = q.gpu.clone().requires_grad_(true), kg = k.gpu.clone().requires_grad_(true),
           vg = v.gpu.clone().requires_grad_(true);
      auto qc = q.cpu64.clone().requires_grad_(true), kc = k.cpu64.clone().requires_grad_(true),
           vc = v.cpu64.clone().requires_grad_(true);
      auto out_g = block_sparse_attention(qg, kg, vg, c.pattern, c.params, len_gpu, c.causal);
      auto out_c = block_sparse_attention(qc, kc, vc, c.pattern, c.params, len_cpu, c.causal);
      expect_close(out_g, out_c.detach(), tol, what + " out");
      out_g.backward(go.gpu);
      out_c.backward(go.cpu64);
      expect_close(qg.grad(), qc.grad(), tol, what + " grad_q");
      expect_close(kg.grad(), kc.grad(), tol, what + " grad_k");
      expect_close(vg.grad(), vc.grad(), tol, what + " grad_v");

      const double temp = 1.0 / std::sqrt(static_cast<double>(c.E));
      auto [o2, lse_g] = fwd.call(q.gpu, k.gpu, v.gpu, c.pattern, c.params,
                                  len_gpu ? c10::optional<torch::Tensor>(*len_gpu) : c10::nullopt,
                                  c.causal, temp, 0.0, 0);
      auto [o3, lse_c] = fwd.call(q.cpu64, k.cpu64, v.cpu64, c.pattern, c.params,
                                  len_cpu ? c10::optional<torch::Tensor>(*len_cpu) : c10::nullopt,
                                  c.causal, temp, 0.0, 0);
      EXPECT_EQ(lse_g.scalar_type(), torch::kFloat) << what;
      const auto finite = torch::isfinite(lse_c);
      EXPECT_TRUE(torch::equal(torch::isfinite(lse_g.cpu()), finite)) << what << " lse -inf rows";
      expect_close(lse_g.cpu().masked_fill(finite.logical_not(), 0),
                   lse_c.masked_fill(finite.logical_not(), 0), {tol.atol, 1e-5}, what + " lse");
    }
  }
}

TEST(CudaBlockSparse, RejectsHeadDimsAboveTheKernelLimit) {
  FASTATTN_SKIP_WITHOUT_CUDA();
  auto q = torch::randn({1, 1, 8, 300}, torch::kCUDA);
  EXPECT_THROW(block_sparse_attention(q, q, q, "local", {4}), c10::Error);
}

}  // namespace
}  // namespace fastattn
