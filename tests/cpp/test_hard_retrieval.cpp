// Hard retrieval attention (op, attention type, recurrent step, transformer
// use): argmax against a dense reference, sampling reproducibility and
// frequencies, straight-through gradients, masks, awkward shapes, bad input.
//   ./build/fastattn_tests --gtest_filter='HardRetrieval*'
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ATen/core/dispatch/Dispatcher.h>

#include <cmath>

#include "expect_error.h"
#include "fastattn/hard_retrieval.h"
#include "fastattn/ops.h"
#include "fastattn/recurrent.h"
#include "fastattn/registry.h"
#include "fastattn/transformer.h"
#include "op_harness.h"

namespace fastattn {
namespace {

using testing::Inputs;
using testing::OpCase;

struct HardCfg {
  std::string name;
  int64_t N, H, L, S, E, M;
  bool causal = false;
  std::vector<int64_t> lengths;  // empty: no key lengths
  int mask_dims = 0;             // 0: no attn_mask; 2: (L, S); 3: (N, L, S); 4: (N, H, L, S)
  bool sample = false;
  std::optional<double> temp;
};

std::string cfg_name(const ::testing::TestParamInfo<HardCfg>& info) { return info.param.name; }

std::optional<torch::Tensor> make_mask(const HardCfg& c) {
  if (c.mask_dims == 0) return std::nullopt;
  torch::manual_seed(4321);
  std::vector<int64_t> shape = {c.L, c.S};
  if (c.mask_dims == 3) shape = {c.N, c.L, c.S};
  if (c.mask_dims == 4) shape = {c.N, c.H, c.L, c.S};
  return torch::rand(shape, torch::kDouble) > 0.4;  // some rows may end up empty
}

std::optional<torch::Tensor> make_lengths(const HardCfg& c) {
  if (c.lengths.empty()) return std::nullopt;
  return torch::tensor(c.lengths, torch::kLong);
}

Inputs make_qkv(const HardCfg& c, uint64_t seed) {
  torch::manual_seed(seed);
  return {torch::randn({c.N, c.H, c.L, c.E}, torch::kDouble),
          torch::randn({c.N, c.H, c.S, c.E}, torch::kDouble),
          torch::randn({c.N, c.H, c.S, c.M}, torch::kDouble)};
}

const std::vector<HardCfg> kCases = {
    {"tiny", 1, 1, 1, 1, 1, 1},
    {"b2_h3_97", 2, 3, 97, 97, 16, 8},
    {"decode_rows_S_ne_L", 1, 2, 3, 300, 7, 5},  // L < 6: the unpacked path; 3 key tiles
    {"odd_S_gt_L", 2, 2, 40, 261, 33, 3},
    {"causal_97", 2, 2, 97, 97, 8, 8, true},
    {"causal_L_gt_S", 1, 2, 50, 29, 8, 5, true},  // the first 21 queries see no key
    {"causal_L_lt_S", 1, 2, 29, 150, 8, 5, true},
    {"lengths", 3, 2, 33, 70, 9, 4, false, {70, 17, 0}},
    {"causal_lengths", 2, 1, 60, 60, 5, 6, true, {60, 25}},
    {"mask2", 2, 2, 20, 45, 8, 4, false, {}, 2},
    {"mask3_causal", 2, 2, 20, 45, 8, 4, true, {}, 3},
    {"mask4_lengths", 2, 3, 20, 45, 8, 4, false, {45, 30}, 4},
    {"sample", 2, 3, 97, 97, 16, 8, false, {}, 0, true},
    {"sample_tiles", 1, 2, 9, 300, 7, 5, false, {}, 0, true, 0.7},
    {"sample_causal_lengths", 2, 2, 61, 140, 8, 4, true, {140, 50}, 0, true},
    {"sample_mask3", 2, 2, 20, 45, 8, 4, false, {}, 3, true},
};

// The op's (out, index) on inputs x, cast to x's dtype where needed.
std::tuple<torch::Tensor, torch::Tensor> run_op(const HardCfg& c, const Inputs& x,
                                                int64_t seed = 11) {
  return hard_retrieval_attention(x[0], x[1], x[2], make_mask(c), make_lengths(c), c.causal,
                                  c.sample, c.temp, seed);
}

class HardRetrievalOpCases : public ::testing::TestWithParam<HardCfg> {};

// Forward: the output is exactly v at the index, the index is the dense
// reference's argmax (argmax mode) and always a kept key.
TEST_P(HardRetrievalOpCases, ForwardIsAGatherAtTheReferenceIndex) {
  const auto& c = GetParam();
  const auto x = make_qkv(c, 3);
  for (auto dtype : {torch::kDouble, torch::kFloat}) {
    Inputs xd = {x[0].to(dtype), x[1].to(dtype), x[2].to(dtype)};
    auto [out, index] = run_op(c, xd);
    ASSERT_EQ(index.scalar_type(), torch::kLong);
    ASSERT_EQ(index.sizes(), (std::vector<int64_t>{c.N, c.H, c.L}));
    auto [ref_out, ref_index] = reference::hard_retrieval_attention(
        x[0], x[1], x[2], make_mask(c), make_lengths(c), c.causal, c.temp,
        c.sample ? std::optional(index) : std::nullopt);
    EXPECT_TRUE(torch::equal(index, ref_index)) << c.name << " " << dtype;
    // A gather: bit-exact in the inputs' dtype.
    EXPECT_TRUE(torch::equal(out, ref_out.to(dtype))) << c.name << " " << dtype;
    // Dropped keys are never retrieved; rows without a kept key get -1.
    auto dense = torch::ones({c.N, 1, c.L, c.S}, torch::kBool);
    if (c.causal) {
      auto i = torch::arange(c.L).view({c.L, 1}), j = torch::arange(c.S).view({1, c.S});
      dense = dense & (j <= i + (c.S - c.L));
    }
    if (auto len = make_lengths(c))
      dense = dense & (torch::arange(c.S) < len->view({c.N, 1, 1, 1}));
    if (auto m = make_mask(c)) {
      auto mm = m->dim() == 2 ? m->view({1, 1, c.L, c.S}) : (m->dim() == 3 ? m->unsqueeze(1) : *m);
      dense = dense & mm;
    }
    dense = dense.expand({c.N, c.H, c.L, c.S});
    auto any = dense.any(-1);
    EXPECT_TRUE(torch::equal(index >= 0, any)) << c.name;
    auto kept = dense.gather(-1, index.clamp_min(0).unsqueeze(-1)).squeeze(-1);
    EXPECT_TRUE((kept | index.lt(0)).all().item<bool>()) << c.name << ": a dropped key retrieved";
  }
}

// Gradients: straight-through rule against autograd through the dense
// reference with the same indices (float64); finite differences for v (q and
// k get a surrogate gradient, which finite differences cannot see).
TEST_P(HardRetrievalOpCases, StraightThroughGradientsMatchReference) {
  const auto& c = GetParam();
  OpCase oc;
  oc.name = c.name;
  oc.make_inputs = [c](uint64_t seed) { return make_qkv(c, seed); };
  oc.op = [c](const Inputs& x) { return std::get<0>(run_op(c, x)); };
  oc.reference = [c](const Inputs& x) {
    torch::Tensor index;
    {
      torch::NoGradGuard ng;
      index = std::get<1>(run_op(c, x));
    }
    return std::get<0>(reference::hard_retrieval_attention(
        x[0], x[1], x[2], make_mask(c), make_lengths(c), c.causal, c.temp, index));
  };
  oc.f64_tol = 0;  // a gather
  oc.f32_tol = 0;
  testing::check_gradients_vs_reference(oc, 5, 1e-10);
  oc.grad_inputs = {2};
  testing::check_finite_differences(oc, 6);
}

// The forward's soft output (what the backward's delta is read from) is the
// softmax attention output P V with the same masks (float64 reference), and
// the backward from it equals the backward without it (a delta pass of its own,
// what the CUDA op does).
TEST_P(HardRetrievalOpCases, SoftOutputIsTheSoftmaxOutput) {
  using torch::Tensor;
  const auto& c = GetParam();
  const auto x = make_qkv(c, 7);
  static auto fwd =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("fastattn::hard_retrieval_attention_forward", "")
          .typed<std::tuple<Tensor, Tensor, Tensor, Tensor>(
              const Tensor&, const Tensor&, const Tensor&, const c10::optional<Tensor>&,
              const c10::optional<Tensor>&, bool, bool, double, int64_t, bool)>();
  static auto bwd =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("fastattn::hard_retrieval_attention_backward", "")
          .typed<std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                    const Tensor&, const Tensor&, const Tensor&,
                                                    const Tensor&, const c10::optional<Tensor>&,
                                                    const c10::optional<Tensor>&, bool, double)>();
  const auto mask = make_mask(c), lengths = make_lengths(c);
  const c10::optional<Tensor> m = mask ? c10::optional<Tensor>(*mask) : c10::nullopt;
  const c10::optional<Tensor> l = lengths ? c10::optional<Tensor>(*lengths) : c10::nullopt;
  const double temp = c.temp.value_or(1.0 / std::sqrt(static_cast<double>(c.E)));
  auto [out, index, lse, soft] =
      fwd.call(x[0], x[1], x[2], m, l, c.causal, c.sample, temp, 5, true);
  ASSERT_EQ(soft.sizes(), out.sizes()) << c.name;
  auto ref = reference::full_attention(x[0], x[1], x[2], mask, lengths, c.causal, temp);
  EXPECT_LE(testing::max_abs_diff(soft, ref), 1e-12) << c.name;
  auto [o2, i2, lse2, none] = fwd.call(x[0], x[1], x[2], m, l, c.causal, c.sample, temp, 5, false);
  EXPECT_EQ(none.numel(), 0) << c.name;
  EXPECT_TRUE(torch::equal(i2, index)) << c.name;
  auto go = torch::randn(out.sizes(), torch::kDouble);
  auto with_soft = bwd.call(go, x[0], x[1], x[2], index, lse, soft, m, l, c.causal, temp);
  auto with_pass = bwd.call(go, x[0], x[1], x[2], index, lse, torch::empty({0}, torch::kDouble), m,
                            l, c.causal, temp);
  EXPECT_LE(testing::max_abs_diff(std::get<0>(with_soft), std::get<0>(with_pass)), 1e-11) << c.name;
  EXPECT_LE(testing::max_abs_diff(std::get<1>(with_soft), std::get<1>(with_pass)), 1e-11) << c.name;
  EXPECT_TRUE(torch::equal(std::get<2>(with_soft), std::get<2>(with_pass))) << c.name;
}

INSTANTIATE_TEST_SUITE_P(HardRetrievalShapes, HardRetrievalOpCases, ::testing::ValuesIn(kCases),
                         cfg_name);

// The layers' (N, L, H, E) views, padded rows and heads broadcast with
// stride 0 are read and written in place (the kernels take row strides), as
// the contiguous copies give: argmax and sample mode, causal with key
// lengths, several key tiles, the unpacked path for fewer than six queries;
// gradients through the soft output, the full-attention backward and the
// index-add of the values.
TEST(HardRetrievalOp, ReadsAndWritesRowLayoutsInPlace) {
  using torch::Tensor;
  const auto lengths = torch::tensor({int64_t(300), int64_t(170)}, torch::kLong);
  for (bool sample : {false, true}) {
    for (int64_t L : {int64_t(130), int64_t(3)}) {
      SCOPED_TRACE(std::string(sample ? "sample" : "argmax") + " L=" + std::to_string(L));
      testing::check_row_layouts(
          [&](const Tensor& q, const Tensor& k, const Tensor& v) {
            return std::get<0>(hard_retrieval_attention(q, k, v, std::nullopt, lengths,
                                                        /*causal=*/true, sample, 0.4, 9));
          },
          2, 3, L, 300, 8, 6);
    }
  }
}

TEST(HardRetrievalOp, TiesGoToTheLowestIndex) {
  // Keys 2, 5 and 9 score the same maximum; key 0 scores less.
  auto q = torch::ones({1, 1, 1, 4}, torch::kDouble);
  auto k = torch::zeros({1, 1, 12, 4}, torch::kDouble);
  for (int64_t j : {2, 5, 9}) k[0][0][j].fill_(1.0);
  k[0][0][0].fill_(0.5);
  auto v = torch::arange(12, torch::kDouble).view({1, 1, 12, 1});
  for (int64_t L : {1, 7}) {  // the unpacked and the packed score paths
    auto [out, index] = hard_retrieval_attention(q.expand({1, 1, L, 4}).contiguous(), k, v);
    EXPECT_TRUE((index == 2).all().item<bool>()) << index;
    EXPECT_TRUE((out == 2.0).all().item<bool>());
  }
  // Causal with S == L: query 4 cannot see key 5 or 9 but sees 2.
  auto [out, index] = hard_retrieval_attention(q.expand({1, 1, 12, 4}).contiguous(), k, v,
                                               std::nullopt, std::nullopt, /*causal=*/true);
  EXPECT_EQ(index[0][0][0].item<int64_t>(), 0);
  EXPECT_EQ(index[0][0][1].item<int64_t>(), 0);
  EXPECT_EQ(index[0][0][4].item<int64_t>(), 2);
  EXPECT_EQ(index[0][0][11].item<int64_t>(), 2);
}

TEST(HardRetrievalOp, ArgmaxIgnoresTheTemperature) {
  HardCfg c{"t", 2, 2, 30, 50, 8, 4};
  auto x = make_qkv(c, 1);
  auto a = std::get<1>(
      hard_retrieval_attention(x[0], x[1], x[2], std::nullopt, std::nullopt, false, false, 0.01));
  auto b = std::get<1>(
      hard_retrieval_attention(x[0], x[1], x[2], std::nullopt, std::nullopt, false, false, 50.0));
  EXPECT_TRUE(torch::equal(a, b));
}

TEST(HardRetrievalOp, SamplingIsReproducibleAndSeedDependent) {
  HardCfg c{"s", 2, 4, 100, 200, 8, 4};
  c.sample = true;
  for (auto dtype : {torch::kDouble, torch::kFloat}) {
    auto x = make_qkv(c, 2);
    Inputs xd = {x[0].to(dtype), x[1].to(dtype), x[2].to(dtype)};
    auto i1 = std::get<1>(run_op(c, xd, 7));
    auto i2 = std::get<1>(run_op(c, xd, 7));
    auto i3 = std::get<1>(run_op(c, xd, 8));
    EXPECT_TRUE(torch::equal(i1, i2));
    // Different seeds give different draws (scores are O(1): the softmax is spread).
    EXPECT_GT((i1 != i3).sum().item<int64_t>(), 100);
    // The same with another thread count (draws are keyed by (seed, n, h, i)).
    const int threads = at::get_num_threads();
    at::set_num_threads(threads == 1 ? 2 : 1);
    auto i4 = std::get<1>(run_op(c, xd, 7));
    at::set_num_threads(threads);
    EXPECT_TRUE(torch::equal(i1, i4));
  }
}

// Many independent draws from one distribution: every query row is the same,
// each row draws with its own counter. The key counts must follow the softmax
// (Pearson chi-square, 259 degrees of freedom: mean 259, sd 22.8; the bound
// 420 is 7 sd out), and the mass of each key tile must be right.
TEST(HardRetrievalOp, SampleFrequenciesMatchTheSoftmax) {
  const int64_t L = 20000, S = 260, E = 4;
  torch::manual_seed(9);
  auto q = torch::randn({1, 1, 1, E}, torch::kDouble);
  auto k = torch::randn({1, 1, S, E}, torch::kDouble);
  // Scores spread over about 2 nats: every expected count is >= ~10.
  auto raw = torch::matmul(q, k.transpose(-1, -2));
  const double temp = 2.0 / (raw.max() - raw.min()).item<double>();
  auto probs = torch::softmax(raw * temp, -1).flatten();  // (S,)
  auto v = torch::zeros({1, 1, S, 1}, torch::kDouble);
  for (auto dtype : {torch::kDouble, torch::kFloat}) {
    auto qq = q.expand({1, 1, L, E}).contiguous().to(dtype);
    auto [out, index] = hard_retrieval_attention(qq, k.to(dtype), v.to(dtype), std::nullopt,
                                                 std::nullopt, false, true, temp, 12345);
    auto counts = torch::bincount(index.flatten(), {}, S).to(torch::kDouble);
    auto expected = probs * L;
    ASSERT_GT(expected.min().item<double>(), 5.0);
    const double chi2 = ((counts - expected).pow(2) / expected).sum().item<double>();
    EXPECT_LT(chi2, 420.0) << dtype;
    EXPECT_GT(chi2, 130.0) << dtype << ": suspiciously perfect";
    for (int64_t t = 0; t * 128 < S; ++t) {
      const int64_t a = t * 128, b = std::min<int64_t>(S, a + 128);
      const double p = probs.slice(0, a, b).sum().item<double>();
      const double got = counts.slice(0, a, b).sum().item<double>() / L;
      EXPECT_NEAR(got, p, 6 * std::sqrt(p * (1 - p) / L)) << "key tile " << t;
    }
  }
}

// The straight-through gradients of q and k are those soft attention gets for
// the same grad_out (the rule passes dA to P); v gets an index-add.
TEST(HardRetrievalOp, QueryKeyGradientsAreSoftAttentionGradients) {
  HardCfg c{"g", 2, 2, 70, 150, 12, 6, true, {150, 90}};
  c.sample = true;
  auto x = make_qkv(c, 4);
  auto go = torch::randn({c.N, c.H, c.L, c.M}, torch::kDouble);
  Inputs a = {x[0].clone().requires_grad_(), x[1].clone().requires_grad_(),
              x[2].clone().requires_grad_()};
  auto [out, index] = run_op(c, a);
  auto ga = torch::autograd::grad({out}, {a[0], a[1], a[2]}, {go});
  Inputs b = {x[0].clone().requires_grad_(), x[1].clone().requires_grad_(),
              x[2].clone().requires_grad_()};
  auto soft = reference::full_attention(b[0], b[1], b[2], std::nullopt, make_lengths(c), true);
  auto gb = torch::autograd::grad({soft}, {b[0], b[1]}, {go});
  EXPECT_LE(testing::max_abs_diff(ga[0], gb[0]), 1e-11);
  EXPECT_LE(testing::max_abs_diff(ga[1], gb[1]), 1e-11);
  auto gv = torch::zeros_like(x[2]);
  for (int64_t n = 0; n < c.N; ++n)
    for (int64_t h = 0; h < c.H; ++h)
      for (int64_t i = 0; i < c.L; ++i) {
        const int64_t j = index[n][h][i].item<int64_t>();
        if (j >= 0) gv[n][h][j] += go[n][h][i];
      }
  EXPECT_LE(testing::max_abs_diff(ga[2], gv), 1e-12);
}

TEST(HardRetrievalOp, EmptyRowsGetZerosAndZeroGradients) {
  // Batch 1 has no keys at all; causal with L > S leaves the first rows empty.
  auto q = torch::randn({2, 2, 9, 4}, torch::kDouble).requires_grad_();
  auto k = torch::randn({2, 2, 5, 4}, torch::kDouble).requires_grad_();
  auto v = torch::randn({2, 2, 5, 3}, torch::kDouble).requires_grad_();
  for (bool sample : {false, true}) {
    auto [out, index] = hard_retrieval_attention(q, k, v, std::nullopt, torch::tensor({5, 0}), true,
                                                 sample, std::nullopt, 3);
    EXPECT_TRUE((index[1] == -1).all().item<bool>());
    EXPECT_TRUE((index[0].slice(1, 0, 4) == -1).all().item<bool>());
    EXPECT_TRUE((index[0].slice(1, 4) >= 0).all().item<bool>());
    EXPECT_TRUE((out[1] == 0).all().item<bool>());
    auto g = torch::autograd::grad({out.sum()}, {q, k, v});
    for (const auto& t : g) EXPECT_TRUE(torch::isfinite(t).all().item<bool>());
    EXPECT_TRUE((g[0][1] == 0).all().item<bool>());
    EXPECT_TRUE((g[0][0].slice(1, 0, 4) == 0).all().item<bool>());
    EXPECT_TRUE((g[1][1] == 0).all().item<bool>());
    EXPECT_TRUE((g[2][1] == 0).all().item<bool>());
  }
}

TEST(HardRetrievalOp, OnlyValueGradientWhenOnlyValuesRequireIt) {
  HardCfg c{"v", 1, 2, 10, 20, 4, 3};
  auto x = make_qkv(c, 1);
  auto v = x[2].clone().requires_grad_();
  auto [out, index] = hard_retrieval_attention(x[0], x[1], v);
  auto g = torch::autograd::grad({(out * out).sum()}, {v})[0];
  auto gv = torch::zeros_like(x[2]);
  for (int64_t h = 0; h < 2; ++h)
    for (int64_t i = 0; i < 10; ++i) {
      const int64_t j = index[0][h][i].item<int64_t>();
      gv[0][h][j] += 2 * out[0][h][i].detach();
    }
  EXPECT_LE(testing::max_abs_diff(g, gv), 1e-12);
}

TEST(HardRetrievalOp, BadInputsNameTheArgument) {
  auto q = torch::randn({1, 2, 5, 4}), k = torch::randn({1, 2, 6, 4}),
       v = torch::randn({1, 2, 6, 3});
  EXPECT_ERROR_CONTAINS(hard_retrieval_attention(q, k, v, torch::zeros({5, 6})), "attn_mask",
                        "bool keep mask");
  EXPECT_ERROR_CONTAINS(hard_retrieval_attention(q, k, v, torch::ones({5, 7}, torch::kBool)),
                        "attn_mask", "shape");
  EXPECT_ERROR_CONTAINS(hard_retrieval_attention(q, k, v, std::nullopt, torch::tensor({7})),
                        "key_lengths", "[0, S]");
  EXPECT_ERROR_CONTAINS(
      hard_retrieval_attention(q, k, v, std::nullopt, std::nullopt, false, true, -1.0),
      "softmax_temp", "> 0");
  EXPECT_ERROR_CONTAINS(hard_retrieval_attention(q, torch::randn({1, 2, 6, 5}), v), "k",
                        "agree with q");
  EXPECT_ERROR_CONTAINS(hard_retrieval_attention(q.to(torch::kInt), k, v), "q", "float32");
}

// ---- attention type -----------------------------------------------------------

TEST(HardRetrievalAttentionType, TrainingSamplesEvaluationTakesTheArgmax) {
  HardCfg c{"t", 2, 3, 40, 40, 8, 5};
  auto x = make_qkv(c, 8);
  auto mask = Mask::causal_mask().with_key_lengths(torch::tensor({40, 31}));
  auto a = std::dynamic_pointer_cast<HardRetrievalAttention>(
      make_attention("hard-retrieval", {{"seed", int64_t{5}}}));
  auto b = std::dynamic_pointer_cast<HardRetrievalAttention>(
      make_attention("hard-retrieval", {{"seed", int64_t{5}}}));
  ASSERT_TRUE(a && b);
  EXPECT_EQ(a->type_name(), "hard-retrieval");
  a->eval();
  auto [eval_out, eval_index] = a->forward_with_indices(x[0], x[1], x[2], mask);
  auto ref = std::get<1>(reference::hard_retrieval_attention(
      x[0], x[1], x[2], std::nullopt, torch::tensor({40, 31}), true, std::nullopt));
  EXPECT_TRUE(torch::equal(eval_index, ref));
  a->train();
  b->train();
  auto [o1, i1] = a->forward_with_indices(x[0], x[1], x[2], mask);
  auto [o2, i2] = a->forward_with_indices(x[0], x[1], x[2], mask);
  auto [o3, i3] = b->forward_with_indices(x[0], x[1], x[2], mask);
  EXPECT_TRUE(torch::equal(i1, i3));   // same seed, same draws
  EXPECT_FALSE(torch::equal(i1, i2));  // the generator moves on
  EXPECT_FALSE(torch::equal(i1, eval_index));
  EXPECT_EQ(a->forward(x[0], x[1], x[2], mask).sizes(), o1.sizes());
  // train_mode=argmax: training takes the argmax too.
  auto c2 = std::dynamic_pointer_cast<HardRetrievalAttention>(
      make_attention("hard-retrieval", {{"train_mode", std::string("argmax")}}));
  c2->train();
  EXPECT_TRUE(torch::equal(c2->forward_with_indices(x[0], x[1], x[2], mask).second, eval_index));
}

TEST(HardRetrievalAttentionType, RegistryValidatesParameters) {
  EXPECT_TRUE(AttentionRegistry::global().contains("hard-retrieval"));
  EXPECT_ERROR_CONTAINS(make_attention("hard-retrieval", {{"train_mode", std::string("soft")}}),
                        "train_mode", "sample", "argmax");
  EXPECT_ERROR_CONTAINS(make_attention("hard-retrieval", {{"softmax_temp", 0.0}}), "softmax_temp");
  EXPECT_ERROR_CONTAINS(make_attention("hard-retrieval", {{"seed", int64_t{-1}}}), "seed");
  auto attn = make_attention("hard-retrieval");
  auto q = torch::randn({1, 1, 3, 4});
  EXPECT_ERROR_CONTAINS(attn->forward(q, q, q, Mask().with_attn_mask(torch::zeros({3, 3}))),
                        "hard-retrieval", "attn_mask", "bool");
}

// ---- recurrent step -------------------------------------------------------------

TEST(HardRetrievalRecurrent, EveryStepEqualsBatchCausalArgmax) {
  for (auto shape :
       {std::vector<int64_t>{2, 3, 37, 8, 5}, std::vector<int64_t>{1, 1, 150, 17, 3}}) {
    const int64_t N = shape[0], H = shape[1], L = shape[2], E = shape[3], M = shape[4];
    torch::manual_seed(L);
    auto q = torch::randn({N, H, L, E}, torch::kDouble),
         k = torch::randn({N, H, L, E}, torch::kDouble),
         v = torch::randn({N, H, L, M}, torch::kDouble);
    auto batch = make_attention("hard-retrieval", {}, {H, E, M});
    batch->eval();
    auto expected = batch->forward(q, k, v, Mask::causal_mask());
    auto [ref_out, ref_index] = reference::hard_retrieval_attention(
        q, k, v, std::nullopt, std::nullopt, true, std::nullopt);
    auto rnn = make_recurrent_attention("hard-retrieval", {{"seed", int64_t{1}}}, {H, E, M});
    EXPECT_EQ(rnn->type_name(), "hard-retrieval");
    RecurrentState state;
    for (int64_t i = 0; i < L; ++i) {
      auto [out, next] = rnn->step(q.select(2, i), k.select(2, i), v.select(2, i), state);
      ASSERT_TRUE(torch::equal(out, expected.select(2, i))) << "step " << i;
      auto idx = RecurrentHardRetrievalAttention::retrieve(q.select(2, i), next.tensors[0]);
      ASSERT_TRUE(torch::equal(idx, ref_index.select(2, i))) << "step " << i;
      state = std::move(next);
    }
    EXPECT_EQ(state.tensors[0].size(2), L);
  }
}

TEST(HardRetrievalRecurrent, BadStateNamesIt) {
  auto rnn = make_recurrent_attention("hard-retrieval");
  auto q = torch::randn({1, 2, 4}), v = torch::randn({1, 2, 3});
  RecurrentState bad{{torch::randn({1, 2, 5, 4})}};
  EXPECT_ERROR_CONTAINS(rnn->step(q, q, v, bad), "hard-retrieval", "state");
  RecurrentState bad_v{{torch::randn({1, 2, 5, 4}), torch::randn({1, 2, 4, 3})}};
  EXPECT_ERROR_CONTAINS(rnn->step(q, q, v, bad_v), "state V", "shape");
  EXPECT_ERROR_CONTAINS(
      make_recurrent_attention("hard-retrieval", {{"train_mode", std::string("x")}}), "train_mode");
}

// ---- in transformers ------------------------------------------------------------

TEST(HardRetrievalTransformer, DecoderSelfAndCrossAttentionAndEncoder) {
  auto dec = DecoderBuilder()
                 .layers(2)
                 .heads(2)
                 .d_model(8)
                 .dropout(0.0)
                 .self_attention("hard-retrieval", {{"seed", int64_t{3}}})
                 .cross_attention("full")
                 .build();
  auto dec2 = DecoderBuilder()
                  .layers(1)
                  .heads(2)
                  .d_model(8)
                  .self_attention("full")
                  .cross_attention("hard-retrieval", {{"train_mode", std::string("argmax")}})
                  .build();
  auto enc = EncoderBuilder().layers(1).heads(2).d_model(8).attention("hard-retrieval").build();
  auto x = torch::randn({2, 6, 8}), memory = torch::randn({2, 5, 8});
  auto memory_mask = Mask().with_key_lengths(torch::tensor({5, 3}));
  dec->eval();
  auto y1 = dec(x, memory, Mask(), memory_mask), y2 = dec(x, memory, Mask(), memory_mask);
  EXPECT_TRUE(torch::equal(y1, y2));  // evaluation is deterministic
  // Causal: changing later positions leaves earlier outputs alone.
  auto x2 = x.clone();
  x2.slice(1, 3) = torch::randn({2, 3, 8});
  EXPECT_TRUE(
      torch::allclose(dec(x2, memory, Mask(), memory_mask).slice(1, 0, 3), y1.slice(1, 0, 3)));
  dec->train();
  auto y = dec(x, memory, Mask(), memory_mask);
  y.pow(2).sum().backward();
  for (const auto& p : dec->named_parameters()) {
    ASSERT_TRUE(p.value().grad().defined()) << p.key();
    EXPECT_TRUE(torch::isfinite(p.value().grad()).all().item<bool>()) << p.key();
  }
  EXPECT_GT(dec->named_parameters()["layers.0.self_attention.query_projection.weight"]
                .grad()
                .abs()
                .sum()
                .item<double>(),
            0.0);
  dec2->train();
  EXPECT_EQ(dec2(x, memory, Mask(), memory_mask).sizes(), x.sizes());
  enc->train();
  EXPECT_EQ(enc(x).sizes(), x.sizes());
}

}  // namespace
}  // namespace fastattn
