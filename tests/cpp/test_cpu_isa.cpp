// The CPU kernels' instruction-set levels (src/kernels/common/cpu_isa.h): the
// names and errors of the choice, and every registered attention type run at
// every level this CPU supports against the portable (default) level: forward
// and gradients, causal or not, with key lengths, on shapes that leave vector
// tails (L, S not multiples of 16; E = 40, M = 24). The other tests run at the
// best level; this one proves the lower ones, so one binary serves AVX2-only
// and AVX-512 machines (the kernel helpers: test_kernel_helpers_<level>.cpp).
//   build/fastattn_tests --gtest_filter='CpuIsa*'
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <string>
#include <vector>

#include "attention_cases.h"
#include "expect_error.h"
#include "fastattn/mask.h"
#include "fastattn/ops.h"
#include "fastattn/registry.h"
#include "kernels/common/cpu_isa.h"

namespace fastattn {
namespace {

using kernels::CpuIsa;
using torch::Tensor;

// Restores the level in use when a test ends.
struct LevelGuard {
  CpuIsa saved = kernels::cpu_isa();
  ~LevelGuard() { kernels::set_cpu_isa(saved); }
};

TEST(CpuIsa, NamesAndChoices) {
  LevelGuard guard;
  EXPECT_EQ(kernels::parse_cpu_isa("AVX2"), CpuIsa::kAvx2);
  EXPECT_EQ(kernels::parse_cpu_isa("default"), CpuIsa::kDefault);
  EXPECT_STREQ(kernels::cpu_isa_name(CpuIsa::kAvx512), "avx512");
  try {
    kernels::parse_cpu_isa("sse9", "--cpu-capability");
    ADD_FAILURE() << "parse_cpu_isa accepted 'sse9'";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("--cpu-capability: expected one of default, avx2, "
                                         "avx512; got 'sse9'"),
              std::string::npos)
        << e.what();
  }
  const auto levels = supported_cpu_capabilities();
  ASSERT_FALSE(levels.empty());
  EXPECT_EQ(levels.front(), "default");  // every CPU runs the portable level
  for (const auto& level : levels) {
    set_cpu_capability(level);
    EXPECT_EQ(cpu_capability(), level);
  }
  EXPECT_ERROR_CONTAINS(set_cpu_capability("avx1024"), "expected one of default, avx2, avx512");
  // A level past the build's or the CPU's: refused, naming what is supported.
  if (levels.size() < 3) {
    EXPECT_ERROR_CONTAINS(set_cpu_capability("avx512"), "supported: default");
  }
#if defined(__x86_64__)
  EXPECT_EQ(kernels::kCompiledIsaMax, 2);
  EXPECT_EQ(kernels::cpu_isa_supported(CpuIsa::kAvx2),
            __builtin_cpu_supports("avx2") != 0 && __builtin_cpu_supports("fma") != 0);
#endif
}

struct Result {
  std::vector<Tensor> tensors;  // out, then grad q, k, v where the type has them
};

// One forward and backward of `name` (seeded defaults, small clusters / top-k
// / windows so that every path is taken) at the level in use.
Result run_type(const std::string& name, torch::ScalarType dtype) {
  const auto& type = AttentionRegistry::global().get(name);
  ParamMap params;
  const ParamMap small = {
      {"clusters", int64_t{5}}, {"topk", int64_t{7}},       {"window", int64_t{9}},
      {"bits", int64_t{31}},    {"chunk_size", int64_t{8}}, {"n_buckets", int64_t{4}},
      {"stride", int64_t{6}},   {"seed", int64_t{3}},       {"length_limit", int64_t{8}}};
  for (const auto& spec : type.params)
    if (auto it = small.find(spec.name); it != small.end()) params.emplace(*it);
  const int64_t N = 2, H = 3, L = 45, E = 40, M = 24;
  auto attn = cases::build_type(name, cases::dims(H, E, M), params);
  attn->to(dtype);
  torch::manual_seed(11);
  auto opts = torch::TensorOptions().dtype(dtype);
  Tensor q = torch::randn({N, H, L, E}, opts).requires_grad_(),
         k = torch::randn({N, H, L, E}, opts).requires_grad_(),
         v = torch::randn({N, H, L, M}, opts).requires_grad_();
  const Tensor w = torch::randn({N, H, L, M}, opts);
  Mask mask = type.capabilities.bidirectional ? Mask::none() : Mask::causal_mask();
  mask = mask.with_key_lengths(torch::tensor({L, L - 13}));
  Result r;
  Tensor out = attn->forward(q, k, v, mask);
  r.tensors.push_back(out.detach().clone());
  (out * w).sum().backward();
  for (const Tensor& x : {q, k, v})
    r.tensors.push_back(x.grad().defined() ? x.grad().clone() : torch::zeros_like(x));
  return r;
}

class EveryLevel : public ::testing::TestWithParam<std::string> {};

TEST_P(EveryLevel, MatchesTheDefaultLevel) {
  LevelGuard guard;
  const auto levels = kernels::supported_cpu_isas();
  if (levels.size() < 2) GTEST_SKIP() << "only the default level runs here";
  for (auto dtype : {torch::kFloat64, torch::kFloat32}) {
    kernels::set_cpu_isa(CpuIsa::kDefault);
    const Result want = run_type(GetParam(), dtype);
    // Sums in another order and the vector exp's few ulp: seen here, at most
    // 2.5e-7 of the largest value in float32 and 1e-12 was never reached in
    // float64. A wrong exp coefficient (relative error 1e-4) fails.
    const double tol = dtype == torch::kFloat64 ? 1e-12 : 2e-6;
    for (CpuIsa isa : levels) {
      if (isa == CpuIsa::kDefault) continue;
      kernels::set_cpu_isa(isa);
      const Result got = run_type(GetParam(), dtype);
      const char* what[] = {"out", "grad q", "grad k", "grad v"};
      for (size_t i = 0; i < want.tensors.size(); ++i) {
        const double scale = 1.0 + want.tensors[i].abs().max().item<double>();
        const double err = (got.tensors[i] - want.tensors[i]).abs().max().item<double>();
        EXPECT_LE(err, tol * scale) << GetParam() << " " << what[i] << " at "
                                    << kernels::cpu_isa_name(isa) << ", " << torch::toString(dtype);
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Types, EveryLevel, ::testing::ValuesIn(cases::registered_types()),
                         [](const auto& info) {
                           std::string s = info.param;
                           for (char& c : s)
                             if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
                           return s;
                         });

}  // namespace
}  // namespace fastattn
