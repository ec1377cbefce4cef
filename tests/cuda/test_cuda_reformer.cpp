// Reformer LSH operators on CUDA against the CPU op in float64 on the same
// (rounded) inputs, per dtype: lsh_hash (equal buckets except at near-ties of
// the projections), reformer_attention's output and float64 stats
// (reformer_attention_forward), and the gradients to q and v through autograd
// of fastattn::reformer_attention; key_lengths (0 included), causal,
// mask_self, chunks smaller and larger than L, awkward sizes. Tolerance:
// tolerance_for(dtype), the absolute part scaled by max(1, max |ref|) for
// the stats and gradients (whose magnitudes exceed 1).
//   ./build/fastattn_tests --gtest_filter='CudaReformer*'
#include <ATen/core/dispatch/Dispatcher.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "cuda_compare.h"
#include "expect_error.h"
#include "fastattn/ops.h"

namespace fastattn {
namespace {

using testing::cuda_dtypes;
using testing::expect_close;
using testing::random_pair;
using testing::Tolerance;
using testing::tolerance_for;

Tolerance scaled(Tolerance t, const torch::Tensor& ref) {
  const auto finite = ref.masked_select(ref.isfinite());
  const double m = finite.numel() ? finite.abs().max().item<double>() : 0.0;
  return {t.atol * std::max(1.0, m), t.rtol};
}

TEST(CudaReformer, LshHashMatchesCpu) {
  FASTATTN_SKIP_WITHOUT_CUDA();
  torch::manual_seed(11);
  for (auto dtype : cuda_dtypes()) {
    for (int64_t b2 : {0, 1, 5, 32, 40}) {
      const std::string what =
          std::string("lsh_hash ") + c10::toString(dtype) + " B2=" + std::to_string(b2);
      auto x = random_pair({2, 3, 37, 24}, dtype);
      auto rot = random_pair({3, 24, b2}, dtype);
      auto got = lsh_hash(x.gpu, rot.gpu);
      ASSERT_TRUE(got.is_cuda()) << what;
      ASSERT_EQ(got.scalar_type(), torch::kLong) << what;
      auto want = lsh_hash(x.cpu64, rot.cpu64);
      auto g = got.cpu();
      ASSERT_EQ(g.sizes(), want.sizes()) << what;
      const auto differ = g.ne(want);
      if (b2 == 0) {
        EXPECT_FALSE(differ.any().item<bool>()) << what;
        continue;
      }
      // Only near-ties may differ: compare the chosen values of [p ; -p].
      auto proj = torch::matmul(x.cpu64.unsqueeze(2), rot.cpu64);  // (N, H, R, L, B2)
      auto vals = torch::cat({proj, -proj}, -1);
      auto vg = vals.gather(-1, g.unsqueeze(-1)), vw = vals.gather(-1, want.unsqueeze(-1));
      EXPECT_LE((vg - vw).abs().max().item<double>(), 1e-4) << what;
      EXPECT_LE(differ.sum().item<int64_t>(), 3) << what << ": more near-ties than expected";
    }
  }
}

struct Cfg {
  int64_t N, H, L, E, M, R, n_buckets, chunk;
  bool causal, mask_self;
  std::vector<int64_t> lengths;  // empty: none
};

std::string describe(const Cfg& c, torch::ScalarType dtype) {
  std::string s = std::string(c10::toString(dtype)) + " N=" + std::to_string(c.N) +
                  " H=" + std::to_string(c.H) + " L=" + std::to_string(c.L) +
                  " E=" + std::to_string(c.E) + " M=" + std::to_string(c.M) +
                  " R=" + std::to_string(c.R) + " chunk=" + std::to_string(c.chunk) +
                  (c.causal ? " causal" : "") + (c.mask_self ? " mask_self" : "") + " lengths=";
  for (auto l : c.lengths) s += std::to_string(l) + ",";
  return s;
}

std::vector<Cfg> configs() {
  return {
      {2, 2, 37, 24, 16, 2, 6, 8, false, true, {}},
      {2, 1, 53, 16, 24, 3, 4, 8, true, true, {53, 20}},
      {2, 1, 29, 32, 32, 2, 3, 4, false, true, {0, 29}},
      {1, 2, 100, 64, 64, 2, 8, 32, true, false, {}},
      {1, 1, 20, 16, 16, 1, 2, 64, false, true, {}},    // chunk > L
      {1, 1, 1, 8, 8, 2, 1, 32, false, true, {}},       // L = 1
      {1, 1, 40, 256, 128, 1, 2, 16, false, true, {}},  // the largest E
  };
}

TEST(CudaReformer, ForwardAndStatsMatchCpu) {
  FASTATTN_SKIP_WITHOUT_CUDA();
  static auto fwd =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("fastattn::reformer_attention_forward", "")
          .typed<std::tuple<torch::Tensor, torch::Tensor>(
              const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
              const c10::optional<torch::Tensor>&, int64_t, bool, bool, double, double, int64_t)>();
  torch::manual_seed(12);
  for (auto dtype : cuda_dtypes()) {
    for (const auto& c : configs()) {
      const std::string what = describe(c, dtype);
      auto q = random_pair({c.N, c.H, c.L, c.E}, dtype);
      auto v = random_pair({c.N, c.H, c.L, c.M}, dtype);
      auto buckets = torch::randint(c.n_buckets, {c.N, c.H, c.R, c.L}, torch::kLong);
      c10::optional<torch::Tensor> kl_cpu, kl_gpu;
      if (!c.lengths.empty()) {
        kl_cpu = torch::tensor(c.lengths, torch::kLong);
        kl_gpu = kl_cpu->to(torch::kCUDA);
      }
      const double temp = 0.3;
      auto [out, stats] = fwd.call(q.gpu, v.gpu, buckets.to(torch::kCUDA), kl_gpu, c.chunk,
                                   c.causal, c.mask_self, temp, 0.0, int64_t{0});
      auto [out_ref, stats_ref] = fwd.call(q.cpu64, v.cpu64, buckets, kl_cpu, c.chunk, c.causal,
                                           c.mask_self, temp, 0.0, int64_t{0});
      ASSERT_TRUE(out.is_cuda()) << what;
      EXPECT_EQ(out.scalar_type(), dtype) << what;
      EXPECT_EQ(stats.scalar_type(), torch::kDouble) << what;
      expect_close(out, out_ref, tolerance_for(dtype), what + " out");
      // Padding: [-inf, 0] exactly.
      auto s = stats.cpu();
      EXPECT_TRUE(s.select(-1, 0).isinf().equal(stats_ref.select(-1, 0).isinf())) << what;
      auto fin = stats_ref.select(-1, 0).isfinite();
      auto s0 = s.select(-1, 0).masked_select(fin), r0 = stats_ref.select(-1, 0).masked_select(fin);
      auto s1 = s.select(-1, 1), r1 = stats_ref.select(-1, 1);
      // (float16/bfloat16 on tensor cores: the normalised keys rounded to the dtype.)
      expect_close(s0, r0, scaled(tolerance_for(dtype), r0), what + " stats max");
      expect_close(s1, r1, scaled(tolerance_for(dtype), r1), what + " stats log sum");
      // The public entry (no grad) gives the forward's output.
      torch::NoGradGuard no_grad;
      auto pub = reformer_attention(q.gpu, v.gpu, buckets.to(torch::kCUDA),
                                    kl_gpu ? std::optional<torch::Tensor>(*kl_gpu) : std::nullopt,
                                    c.chunk, c.causal, c.mask_self, temp);
      EXPECT_TRUE(pub.equal(out)) << what << " public entry";
    }
  }
}

TEST(CudaReformer, GradientsMatchCpu) {
  FASTATTN_SKIP_WITHOUT_CUDA();
  torch::manual_seed(13);
  for (auto dtype : cuda_dtypes()) {
    for (const auto& c : configs()) {
      const std::string what = describe(c, dtype);
      auto q = random_pair({c.N, c.H, c.L, c.E}, dtype);
      auto v = random_pair({c.N, c.H, c.L, c.M}, dtype);
      auto go = random_pair({c.N, c.H, c.L, c.M}, dtype);
      auto buckets = torch::randint(c.n_buckets, {c.N, c.H, c.R, c.L}, torch::kLong);
      std::optional<torch::Tensor> kl_cpu, kl_gpu;
      if (!c.lengths.empty()) {
        kl_cpu = torch::tensor(c.lengths, torch::kLong);
        kl_gpu = kl_cpu->to(torch::kCUDA);
      }
      auto qg = q.gpu.clone().requires_grad_(true), vg = v.gpu.clone().requires_grad_(true);
      auto qc = q.cpu64.clone().requires_grad_(true), vc = v.cpu64.clone().requires_grad_(true);
      auto out = reformer_attention(qg, vg, buckets.to(torch::kCUDA), kl_gpu, c.chunk, c.causal,
                                    c.mask_self, std::nullopt);
      (out * go.gpu).sum().backward();
      auto out_ref =
          reformer_attention(qc, vc, buckets, kl_cpu, c.chunk, c.causal, c.mask_self, std::nullopt);
      (out_ref * go.cpu64).sum().backward();
      ASSERT_TRUE(qg.grad().defined() && vg.grad().defined()) << what;
      EXPECT_EQ(qg.grad().scalar_type(), dtype) << what;
      expect_close(out.detach(), out_ref.detach(), tolerance_for(dtype), what + " out");
      expect_close(qg.grad(), qc.grad(), scaled(tolerance_for(dtype), qc.grad()), what + " grad_q");
      expect_close(vg.grad(), vc.grad(), scaled(tolerance_for(dtype), vc.grad()), what + " grad_v");
    }
  }
}

TEST(CudaReformer, BadInputsNamed) {
  FASTATTN_SKIP_WITHOUT_CUDA();
  auto q = torch::randn({1, 1, 8, 300}, torch::kCUDA);
  auto v = torch::randn({1, 1, 8, 16}, torch::kCUDA);
  auto b = torch::zeros({1, 1, 1, 8}, torch::TensorOptions(torch::kCUDA).dtype(torch::kLong));
  EXPECT_ERROR_CONTAINS(reformer_attention(q, v, b), "fastattn::reformer_attention", "E and M",
                        "256");
  auto qd = torch::randn({1, 1, 8, 16}, torch::TensorOptions(torch::kCUDA).dtype(torch::kDouble));
  EXPECT_ERROR_CONTAINS(reformer_attention(qd, qd, b), "q", "float32, float16 or bfloat16");
  EXPECT_ERROR_CONTAINS(lsh_hash(qd, torch::randn({1, 16, 4}, qd.options())), "x",
                        "float32, float16 or bfloat16");
  EXPECT_ERROR_CONTAINS(reformer_attention(v, v, b.cpu()), "one device");
  EXPECT_ERROR_CONTAINS(reformer_attention(v.cpu(), v.cpu(), b), "one device");  // CUDA dispatch
  EXPECT_ERROR_CONTAINS(lsh_hash(v.cpu(), torch::randn({1, 16, 4}, torch::kCUDA)), "rotations",
                        "like x");
}

}  // namespace
}  // namespace fastattn
