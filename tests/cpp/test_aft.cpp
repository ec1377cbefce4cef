// AFT attention (op, attention types): forward and gradients against the
// dense float64 reference (AFT-simple's scans, AFT-full's matrix products),
// causal, key lengths, fewer queries than keys, rows without keys, values
// whose exponents underflow the split form, and bad input.
//   ./build/fastattn_tests --gtest_filter='Aft*'
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>

#include "expect_error.h"
#include "fastattn/aft.h"
#include "fastattn/mask.h"
#include "fastattn/ops.h"
#include "fastattn/recurrent.h"
#include "fastattn/registry.h"
#include "op_harness.h"

namespace fastattn {
namespace {

using testing::Inputs;
using testing::OpCase;

struct AftCfg {
  std::string name;
  int64_t N, H, L, S, E;
  bool causal = false;
  int bias_dims = 0;             // 0: AFT-simple; 2: (L, S); 3: (H, L, S)
  std::vector<int64_t> lengths;  // empty: none
  double spread = 1.0;           // scale of k and the bias (large: the exact recomputation)
};

std::optional<torch::Tensor> lengths_of(const AftCfg& c) {
  if (c.lengths.empty()) return std::nullopt;
  return torch::tensor(c.lengths, torch::kLong);
}

OpCase aft_case(const AftCfg& c) {
  OpCase oc;
  oc.name = c.name;
  oc.make_inputs = [c](uint64_t seed) {
    torch::manual_seed(seed + 11);
    Inputs in = {torch::randn({c.N, c.H, c.L, c.E}, torch::kDouble),
                 torch::randn({c.N, c.H, c.S, c.E}, torch::kDouble) * c.spread,
                 torch::randn({c.N, c.H, c.S, c.E}, torch::kDouble)};
    if (c.bias_dims == 2) in.push_back(torch::randn({c.L, c.S}, torch::kDouble) * c.spread);
    if (c.bias_dims == 3) in.push_back(torch::randn({c.H, c.L, c.S}, torch::kDouble) * c.spread);
    return in;
  };
  auto bias = [](const Inputs& in) {
    return in.size() > 3 ? std::optional<torch::Tensor>(in[3]) : std::nullopt;
  };
  oc.op = [c, bias](const Inputs& in) {
    return aft_attention(in[0], in[1], in[2], bias(in), lengths_of(c), c.causal);
  };
  oc.reference = [c, bias](const Inputs& in) {
    return reference::aft_attention(in[0], in[1], in[2], bias(in), lengths_of(c), c.causal);
  };
  // float32: sums of S exponentials, relative error ~1e-6 of values O(1);
  // with a large spread the exponents themselves are O(100).
  oc.f32_tol = c.spread > 10 ? 1e-3 : 2e-5;
  oc.f32_grad_tol = c.spread > 10 ? 1e-2 : 1e-4;
  return oc;
}

class AftOp : public ::testing::TestWithParam<AftCfg> {};

TEST_P(AftOp, MatchesReference) { testing::check_op(aft_case(GetParam())); }

const std::vector<AftCfg> kCases = {
    {"simple", 2, 3, 7, 7, 5},
    {"simple_causal", 2, 3, 7, 7, 5, true},
    {"simple_lengths", 3, 2, 6, 6, 4, false, 0, {6, 2, 0}},
    {"simple_causal_lengths", 3, 2, 6, 6, 4, true, 0, {6, 2, 0}},
    {"simple_causal_fewer_queries", 2, 2, 3, 8, 4, true},
    {"simple_causal_more_queries", 1, 2, 8, 3, 4, true},  // the first rows see no key
    {"simple_cross", 2, 2, 5, 9, 3, false, 0, {9, 4}},
    {"full_shared", 2, 3, 7, 7, 5, false, 2},
    {"full_per_head", 2, 3, 7, 9, 5, false, 3},
    {"full_causal", 2, 3, 7, 7, 5, true, 2},
    {"full_causal_lengths", 3, 2, 6, 6, 4, true, 3, {6, 2, 0}},
    {"full_causal_fewer_queries", 2, 2, 3, 8, 4, true, 2, {8, 5}},
    {"full_causal_more_queries", 1, 2, 8, 3, 4, true, 2},
    {"one_key", 1, 1, 1, 1, 1, false, 2},
    // Causal products by row blocks (64 rows and more): each block over its keys.
    {"full_causal_blocks", 1, 2, 150, 150, 4, true, 2},
    {"full_causal_blocks_fewer_queries", 2, 2, 100, 170, 3, true, 3, {170, 90}},
    {"full_causal_blocks_more_queries", 1, 2, 130, 70, 3, true, 2},
    // Exponents far apart: products of the split underflow (float32 below
    // 2^-60) and those elements are recomputed exactly.
    {"full_wide_exponents", 2, 2, 6, 6, 4, false, 2, {}, 60.0},
    {"full_causal_wide_exponents", 2, 2, 6, 6, 4, true, 3, {6, 4}, 60.0},
    {"simple_wide_exponents", 2, 2, 6, 6, 4, true, 0, {}, 60.0},
};

INSTANTIATE_TEST_SUITE_P(Cases, AftOp, ::testing::ValuesIn(kCases),
                         [](const ::testing::TestParamInfo<AftCfg>& i) { return i.param.name; });

// In float64 the split form's threshold is 2^-800: exponents 600 apart.
TEST(AftOp, Float64WideExponentsAreRecomputed) {
  auto c = aft_case({"f64_wide", 2, 2, 5, 5, 3, true, 2, {}, 400.0});
  testing::check_forward(c);
  testing::check_gradients_vs_reference(c);
}

TEST(AftOp, BFloat16ComputesInFloat32) {
  auto c = aft_case({"bf16", 2, 2, 6, 6, 4, true, 2});
  auto in = c.make_inputs(3);
  auto ref = c.reference(in);
  Inputs low;
  for (const auto& t : in) low.push_back(t.to(torch::kBFloat16));
  auto out = c.op(low);
  EXPECT_EQ(out.scalar_type(), torch::kBFloat16);
  EXPECT_LT(testing::max_abs_diff(out.to(torch::kDouble), ref), 0.05);
}

TEST(AftOp, RefusesBadInput) {
  auto q = torch::randn({1, 2, 4, 3}), k = torch::randn({1, 2, 5, 3});
  EXPECT_ERROR_CONTAINS(aft_attention(q, k, torch::randn({1, 2, 5, 4})), "v must have the width",
                        "E = 3", "got 4");
  EXPECT_ERROR_CONTAINS(aft_attention(q, k, k, torch::randn({5, 4})), "position_bias",
                        "(L, S) = (4, 5)", "got [5, 4]");
  EXPECT_ERROR_CONTAINS(aft_attention(q, k, k, torch::randn({4, 5}, torch::kDouble)),
                        "position_bias must have q's dtype");
  EXPECT_ERROR_CONTAINS(aft_attention(q, k, k, std::nullopt, torch::tensor({6})), "key_lengths");
}

TEST(AftType, FullIsTheOperatorWithTheModulesBias) {
  torch::manual_seed(5);
  auto attn = make_attention("aft-full", {{"max_sequence_length", int64_t{16}},
                                          {"aft_parameterization", int64_t{4}},
                                          {"seed", int64_t{3}}});
  auto* aft = dynamic_cast<AftAttention*>(attn.get());
  ASSERT_NE(aft, nullptr);
  auto q = torch::randn({2, 2, 6, 4}, torch::kDouble),
       k = torch::randn({2, 2, 6, 4}, torch::kDouble),
       v = torch::randn({2, 2, 6, 4}, torch::kDouble);
  auto lengths = torch::tensor({6, 3}, torch::kLong);
  auto out = attn->forward(q, k, v, Mask::causal_mask().with_key_lengths(lengths));
  auto w = aft->position_bias(6, 6, true).to(torch::kDouble);
  auto ref = reference::aft_attention(q, k, v, w, lengths, true);
  EXPECT_LT(testing::max_abs_diff(out, ref), 1e-12);

  // The last 2 queries over all 6 keys are the last 2 rows of the whole.
  auto rows = attn->forward(q.narrow(2, 4, 2), k, v, Mask::causal_mask().with_key_lengths(lengths));
  EXPECT_LT(testing::max_abs_diff(rows, out.narrow(2, 4, 2)), 1e-12);

  // The bias is learned: u and v get gradients.
  attn->forward(q, k, v, Mask::causal_mask()).sum().backward();
  for (const auto& p : attn->parameters()) {
    ASSERT_TRUE(p.grad().defined());
    EXPECT_GT(p.grad().abs().sum().item<double>(), 0);
  }
  EXPECT_ERROR_CONTAINS(attn->forward(torch::randn({1, 1, 17, 4}), torch::randn({1, 1, 17, 4}),
                                      torch::randn({1, 1, 17, 4}), Mask()),
                        "max_sequence_length = 16", "L = 17");
}

TEST(AftType, SimpleStepsGiveTheCausalRows) {
  torch::manual_seed(8);
  auto q = torch::randn({2, 3, 7, 4}, torch::kDouble),
       k = torch::randn({2, 3, 7, 4}, torch::kDouble),
       v = torch::randn({2, 3, 7, 4}, torch::kDouble);
  k[0][1][3] = -std::numeric_limits<double>::infinity();  // counts as the lowest finite key
  auto batch = make_attention("aft-simple")->forward(q, k, v, Mask::causal_mask());
  auto step = make_recurrent_attention("aft-simple");
  RecurrentState state;
  auto fixed = step->make_state(2, 3, 4, 4, 0, q.options());
  for (int64_t t = 0; t < 7; ++t) {
    auto [out, next] = step->step(q.select(2, t), k.select(2, t), v.select(2, t), state);
    state = next;
    EXPECT_LT(testing::max_abs_diff(out, batch.select(2, t)), 1e-12) << t;
    auto in_place = step->step_in_place(q.select(2, t), k.select(2, t), v.select(2, t), fixed);
    EXPECT_LT(testing::max_abs_diff(in_place, out), 1e-15) << t;
  }
  EXPECT_ERROR_CONTAINS(
      step->step(q.select(2, 0), k.select(2, 0), v.select(2, 0).narrow(2, 0, 3), RecurrentState{}),
      "value must have the width E = 4");
}

TEST(AftType, SimpleRefusesAnAttentionMask) {
  auto attn = make_attention("aft-simple");
  auto q = torch::randn({1, 1, 3, 2});
  EXPECT_ERROR_CONTAINS(
      attn->forward(q, q, q, Mask().with_attn_mask(torch::ones({3, 3}).to(torch::kBool))),
      "aft-simple: attn_mask: got a boolean attn_mask of shape [3, 3], which aft-simple does not "
      "take (it takes only the causal mask and key_lengths)");
}

}  // namespace
}  // namespace fastattn
