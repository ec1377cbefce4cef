// Tests of fastattn::Mask: dense forms against hand-built masks, checks and
// their messages.
// Run: ./fastattn_tests --gtest_filter='Mask*'
#include <gtest/gtest.h>

#include <limits>

#include "expect_error.h"
#include "fastattn/mask.h"

using fastattn::Mask;

namespace {

const double kInf = std::numeric_limits<double>::infinity();

torch::Tensor bools(std::vector<std::vector<int>> rows) {  // (L, S) from 0/1 rows
  const int64_t L = rows.size(), S = rows[0].size();
  auto t = torch::zeros({L, S}, torch::kBool);
  for (int64_t i = 0; i < L; ++i)
    for (int64_t j = 0; j < S; ++j) t[i][j] = rows[i][j] != 0;
  return t;
}

}  // namespace

TEST(Mask, NoneIsAllOnes) {
  Mask m;
  EXPECT_TRUE(m.is_all_ones());
  EXPECT_FALSE(m.is_causal());
  auto d = m.dense_bool(2, 3, 4, 5);
  EXPECT_EQ(d.sizes(), (std::vector<int64_t>{2, 3, 4, 5}));
  EXPECT_TRUE(d.all().item<bool>());
  auto a = m.dense_additive(2, 3, 4, 5, torch::kFloat64);
  EXPECT_EQ(a.scalar_type(), torch::kFloat64);
  EXPECT_EQ(a.abs().max().item<double>(), 0.0);
  EXPECT_EQ(m.to_string(), "Mask(none)");
}

TEST(Mask, WithersLeaveTheOriginalAlone) {
  Mask m;
  auto c = m.with_causal();
  auto k = m.with_key_lengths(torch::tensor({1, 2}));
  EXPECT_TRUE(m.is_all_ones());
  EXPECT_TRUE(c.is_causal());
  EXPECT_FALSE(c.is_all_ones());
  EXPECT_FALSE(k.is_all_ones());
  EXPECT_TRUE(k.key_lengths().has_value());
  EXPECT_FALSE(m.key_lengths().has_value());
  EXPECT_FALSE(Mask().with_query_lengths(torch::tensor({3})).is_all_ones());
  EXPECT_TRUE(Mask::causal_mask().is_causal());
  EXPECT_FALSE(c.with_causal(false).is_causal());
}

TEST(Mask, CausalAlignsLastQueryWithLastKey) {
  // L = 3, S = 5: query i keeps key j iff j <= i + 2.
  auto expected = bools({{1, 1, 1, 0, 0}, {1, 1, 1, 1, 0}, {1, 1, 1, 1, 1}});
  auto d = Mask::causal_mask().dense_bool(2, 2, 3, 5);
  ASSERT_EQ(d.sizes(), (std::vector<int64_t>{2, 2, 3, 5}));
  for (int n = 0; n < 2; ++n)
    for (int h = 0; h < 2; ++h) EXPECT_TRUE(torch::equal(d[n][h], expected));

  // L = 4, S = 2: j <= i - 2, so the first two queries keep nothing.
  auto expected2 = bools({{0, 0}, {0, 0}, {1, 0}, {1, 1}});
  EXPECT_TRUE(torch::equal(Mask::causal_mask().dense_bool(1, 1, 4, 2)[0][0], expected2));

  // Square: lower triangle.
  EXPECT_TRUE(torch::equal(Mask::causal_mask().dense_bool(1, 1, 4, 4)[0][0],
                           torch::ones({4, 4}, torch::kBool).tril()));
}

TEST(Mask, KeyLengthsDropTrailingKeys) {
  auto m = Mask().with_key_lengths(torch::tensor({2, 4, 0}));
  auto d = m.dense_bool(3, 2, 3, 4);
  auto k0 = bools({{1, 1, 0, 0}, {1, 1, 0, 0}, {1, 1, 0, 0}});
  for (int h = 0; h < 2; ++h) {
    EXPECT_TRUE(torch::equal(d[0][h], k0));
    EXPECT_TRUE(d[1][h].all().item<bool>());
    EXPECT_FALSE(d[2][h].any().item<bool>());
  }
  auto kk = m.key_keep(3, 4);
  EXPECT_TRUE(torch::equal(kk, bools({{1, 1, 0, 0}, {1, 1, 1, 1}, {0, 0, 0, 0}})));
  // Without query lengths every query is kept.
  EXPECT_TRUE(m.query_keep(3, 3).all().item<bool>());
}

TEST(Mask, QueryLengthsOnlyEnterQueryKeep) {
  auto m = Mask().with_query_lengths(torch::tensor({1, 3}));
  EXPECT_TRUE(torch::equal(m.query_keep(2, 3), bools({{1, 0, 0}, {1, 1, 1}})));
  EXPECT_TRUE(m.dense_bool(2, 1, 3, 4).all().item<bool>());
  EXPECT_TRUE(m.key_keep(2, 4).all().item<bool>());
}

TEST(Mask, BoolMaskCombinesWithCausalAndLengths) {
  // (N, L, S) = (2, 3, 3) bool mask, broadcast over H = 2.
  auto am = torch::stack(
      {bools({{1, 0, 1}, {1, 1, 1}, {0, 1, 1}}), bools({{1, 1, 1}, {0, 1, 0}, {1, 1, 1}})});
  auto m = Mask().with_attn_mask(am).with_causal().with_key_lengths(torch::tensor({3, 2}));
  auto d = m.dense_bool(2, 2, 3, 3);
  auto e0 = bools({{1, 0, 0}, {1, 1, 0}, {0, 1, 1}});
  auto e1 = bools({{1, 0, 0}, {0, 1, 0}, {1, 1, 0}});
  for (int h = 0; h < 2; ++h) {
    EXPECT_TRUE(torch::equal(d[0][h], e0));
    EXPECT_TRUE(torch::equal(d[1][h], e1));
  }
  // Additive form of a bool mask: 0 kept, -inf dropped.
  auto a = m.dense_additive(2, 2, 3, 3, torch::kFloat32);
  EXPECT_EQ(a.scalar_type(), torch::kFloat32);
  EXPECT_TRUE(torch::equal(torch::isneginf(a), d.logical_not()));
  EXPECT_EQ(a.masked_select(d).abs().max().item<float>(), 0.0f);
}

TEST(Mask, PerHeadMask) {
  auto am = torch::stack({bools({{1, 0}, {1, 1}}), bools({{0, 1}, {1, 0}})}).unsqueeze(0);
  auto d = Mask().with_attn_mask(am).dense_bool(1, 2, 2, 2);  // (1, 2, 2, 2)
  EXPECT_TRUE(torch::equal(d, am));
}

TEST(Mask, AdditiveMaskKeepsItsValues) {
  auto am = torch::tensor({{0.5, -kInf, 2.0}, {-1.0, 0.0, -kInf}}, torch::kFloat64);  // (L, S)
  auto m = Mask().with_attn_mask(am).with_key_lengths(torch::tensor({2}));
  auto a = m.dense_additive(1, 1, 2, 3, torch::kFloat64)[0][0];
  auto expected = torch::tensor({{0.5, -kInf, -kInf}, {-1.0, 0.0, -kInf}}, torch::kFloat64);
  EXPECT_TRUE(torch::equal(a, expected));
  // -inf entries of an additive mask count as dropped in the bool form.
  EXPECT_TRUE(torch::equal(m.dense_bool(1, 1, 2, 3)[0][0], bools({{1, 0, 0}, {1, 1, 0}})));
  // The additive form converts to the requested dtype.
  EXPECT_EQ(m.dense_additive(1, 1, 2, 3, torch::kFloat32).scalar_type(), torch::kFloat32);
}

TEST(Mask, CheckAcceptsMatchingShapes) {
  auto m = Mask()
               .with_attn_mask(torch::ones({2, 3, 4}, torch::kBool))
               .with_key_lengths(torch::tensor({4, 0}))
               .with_query_lengths(torch::tensor({3, 1}))
               .with_causal();
  EXPECT_NO_THROW(m.check(2, 5, 3, 4));
  EXPECT_NO_THROW(Mask().with_attn_mask(torch::ones({1, 5, 3, 4})).check(2, 5, 3, 4));
}

TEST(Mask, BadInputsNameTheArgument) {
  EXPECT_ERROR_CONTAINS(Mask().with_attn_mask(torch::ones({3, 4}, torch::kInt)), "attn_mask",
                        "bool", "Int");
  EXPECT_ERROR_CONTAINS(Mask().with_attn_mask(torch::ones({4}, torch::kBool)), "attn_mask",
                        "(L, S)", "[4]");
  EXPECT_ERROR_CONTAINS(Mask().with_attn_mask(torch::ones({1, 1, 1, 3, 4})), "attn_mask");
  EXPECT_ERROR_CONTAINS(Mask().with_key_lengths(torch::tensor({1.0, 2.0})), "key_lengths",
                        "integer", "Float");
  EXPECT_ERROR_CONTAINS(Mask().with_key_lengths(torch::ones({2, 1}, torch::kLong)), "key_lengths",
                        "(N,)", "[2, 1]");
  EXPECT_ERROR_CONTAINS(Mask().with_key_lengths(torch::tensor({3, -1})), "key_lengths", ">= 0",
                        "-1");
  EXPECT_ERROR_CONTAINS(Mask().with_query_lengths(torch::tensor({true})), "query_lengths",
                        "integer");

  // Against the call's shapes.
  EXPECT_ERROR_CONTAINS(Mask().with_attn_mask(torch::ones({3, 5})).check(2, 1, 3, 4), "attn_mask",
                        "(3, 4)", "[3, 5]");
  EXPECT_ERROR_CONTAINS(Mask().with_attn_mask(torch::ones({3, 3, 4})).check(2, 1, 3, 4),
                        "attn_mask", "[3, 3, 4]");
  EXPECT_ERROR_CONTAINS(Mask().with_key_lengths(torch::tensor({1, 2, 3})).check(2, 1, 3, 4),
                        "key_lengths", "(2)", "[3]");
  EXPECT_ERROR_CONTAINS(Mask().with_key_lengths(torch::tensor({1, 5})).check(2, 1, 3, 4),
                        "key_lengths", "[0, 4]", "5");
  EXPECT_ERROR_CONTAINS(Mask().with_query_lengths(torch::tensor({4, 1})).check(2, 1, 3, 4),
                        "query_lengths", "[0, 3]", "4");
  EXPECT_ERROR_CONTAINS(Mask().with_query_lengths(torch::tensor({1})).check(2, 1, 3, 4),
                        "query_lengths", "(2)");
}

TEST(Mask, ToStringListsItsParts) {
  auto s = Mask().with_causal().with_key_lengths(torch::tensor({1, 2})).to_string();
  EXPECT_NE(s.find("causal"), std::string::npos) << s;
  EXPECT_NE(s.find("key_lengths"), std::string::npos) << s;
  EXPECT_EQ(s.find("attn_mask"), std::string::npos) << s;
}
