// The CPU output cache (src/ops/op_util.cpp, fastattn::empty_cpu_cache):
// outputs of 4 MiB and more reuse the buffers of freed ones, whose old
// contents never show through; smaller outputs are not cached; a cached
// output can be resized; empty_cpu_cache gives the free buffers back.
// FASTATTN_CPU_CACHE_MB (0, invalid values) is tested from Python
// (tests/python/test_ops.py), in fresh processes.
//   build/fastattn_tests --gtest_filter='OutputCache.*'
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "fastattn/ops.h"
#include "ops/op_util.h"

namespace fastattn {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;

// elu(x) + 1 in float64, the reference of elu_feature_map.
torch::Tensor elu_plus_one(const torch::Tensor& x) {
  auto d = x.to(torch::kDouble);
  return torch::where(d > 0, d + 1, torch::exp(d));
}

TEST(OutputCache, FreedOutputsAreReusedAndOverwritten) {
  empty_cpu_cache();
  ASSERT_EQ(cpu_cache_bytes(), 0);
  torch::manual_seed(0);
  // (1, 8, 4096, 64) float32: 8 MiB.
  auto x1 = torch::randn({1, 8, 4096, 64});
  auto x2 = torch::randn({1, 8, 4096, 64});
  auto out1 = elu_feature_map(x1);
  EXPECT_TRUE(torch::allclose(out1.to(torch::kDouble), elu_plus_one(x1), 1e-6, 1e-6));
  const void* first = out1.data_ptr();
  out1 = torch::Tensor();  // back to the cache
  EXPECT_EQ(cpu_cache_bytes(), 8 * kMiB);
  auto out2 = elu_feature_map(x2);
  EXPECT_EQ(out2.data_ptr(), first) << "the freed buffer was not reused";
  EXPECT_EQ(cpu_cache_bytes(), 0);
  EXPECT_TRUE(torch::allclose(out2.to(torch::kDouble), elu_plus_one(x2), 1e-6, 1e-6));
  // An output of another size (rounded to 2 MiB) takes a buffer of its own.
  auto x3 = torch::randn({1, 8, 5000, 64});  // 9.8 MiB -> 10 MiB
  auto out3 = elu_feature_map(x3);
  EXPECT_NE(out3.data_ptr(), first);
  out2 = torch::Tensor();
  out3 = torch::Tensor();
  EXPECT_EQ(cpu_cache_bytes(), 18 * kMiB);
  empty_cpu_cache();
  EXPECT_EQ(cpu_cache_bytes(), 0);
}

// The kernels' large scratch arrays (kernels/common/scratch.h) come from
// the cache too and go back to it: local attention's forward packs K into
// panels (8 MiB here), freed before the call returns; a second call takes
// that buffer again and computes the same output in it.
TEST(OutputCache, KernelScratchArraysComeFromTheCache) {
  empty_cpu_cache();
  torch::manual_seed(1);
  auto q = torch::randn({1, 8, 4096, 64}), k = torch::randn({1, 8, 4096, 64}),
       v = torch::randn({1, 8, 4096, 64});
  torch::NoGradGuard no_grad;
  auto out1 = block_sparse_attention(q, k, v, "local", {64});
  // The output (8 MiB) is alive; the panels were given back.
  EXPECT_EQ(cpu_cache_bytes(), 8 * kMiB);
  auto out2 = block_sparse_attention(q, k, v, "local", {64});
  EXPECT_EQ(cpu_cache_bytes(), 8 * kMiB);  // taken and given back again
  EXPECT_TRUE(torch::equal(out1, out2));
  empty_cpu_cache();
}

// bfloat16 operators run the float32 kernel on widened copies
// (ops::in_float32 through ops::converted): the copies have their inputs'
// strides and come from the cache, so a second call takes the first one's
// buffer instead of faulting in fresh pages. Here the input is the layers'
// (N, L, H, E) memory viewed as (N, H, L, E): 4 MiB in bfloat16.
TEST(OutputCache, WidenedCopiesComeFromTheCacheInTheInputsStrides) {
  empty_cpu_cache();
  torch::manual_seed(2);
  auto x = torch::randn({1, 4096, 8, 64}).to(torch::kBFloat16).transpose(1, 2);
  auto wide = ops::converted(x, torch::kFloat);
  EXPECT_EQ(wide.scalar_type(), torch::kFloat);
  EXPECT_EQ(wide.strides(), x.strides());
  EXPECT_TRUE(torch::equal(wide, x.to(torch::kFloat)));
  const void* first = wide.data_ptr();
  wide = torch::Tensor();
  EXPECT_EQ(cpu_cache_bytes(), 8 * kMiB);
  wide = ops::converted(x, torch::kFloat);
  EXPECT_EQ(wide.data_ptr(), first) << "the freed copy's buffer was not reused";
  // Rounded back in the same strides (4 MiB, cached too).
  auto narrow = ops::converted(wide, torch::kBFloat16);
  EXPECT_EQ(narrow.strides(), x.strides());
  EXPECT_TRUE(torch::equal(narrow, x));
  narrow = torch::Tensor();
  EXPECT_EQ(cpu_cache_bytes(), 4 * kMiB);
  // A bfloat16 operator on that input: its float32 result rounded once.
  wide = torch::Tensor();
  auto out = elu_feature_map(x);
  EXPECT_EQ(out.scalar_type(), torch::kBFloat16);
  EXPECT_TRUE(torch::equal(out, elu_feature_map(x.to(torch::kFloat)).to(torch::kBFloat16)));
  empty_cpu_cache();
}

TEST(OutputCache, SmallOutputsAreNotCached) {
  empty_cpu_cache();
  auto x = torch::randn({1, 8, 1024, 64});  // 2 MiB
  { auto out = elu_feature_map(x); }
  EXPECT_EQ(cpu_cache_bytes(), 0);
}

TEST(OutputCache, CachedOutputsResizeAndBehaveAsTensors) {
  empty_cpu_cache();
  auto x = torch::randn({1, 8, 4096, 64});
  auto out = elu_feature_map(x);
  const auto want = out.clone();
  // Views, in-place arithmetic and autograd leaves work as on any tensor.
  auto view = out.transpose(1, 2);
  view.mul_(2);
  EXPECT_TRUE(torch::equal(out, want * 2));
  auto leaf = out.detach().requires_grad_();
  (leaf * 3).sum().backward();
  EXPECT_TRUE(torch::equal(leaf.grad(), torch::full_like(want, 3)));
  // Growing past the buffer takes new memory and returns the old buffer.
  out.resize_({1, 8, 8192, 64});
  EXPECT_EQ(out.numel(), 8 * 8192 * 64);
  out.fill_(1);
  EXPECT_EQ(out.sum().item<double>(), 8.0 * 8192 * 64);
  view = torch::Tensor();
  leaf = torch::Tensor();
  EXPECT_EQ(cpu_cache_bytes(), 8 * kMiB);
  empty_cpu_cache();
}

}  // namespace
}  // namespace fastattn
