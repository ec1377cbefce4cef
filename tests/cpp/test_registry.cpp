// Tests of the attention registry (specs, validation and its messages, JSON),
// the common attention input checks, FullAttention against the reference
// (fused and dropout paths) and the conditional-full:<type> decorator.
// Run: ./fastattn_tests --gtest_filter='Registry*:AttentionInputs*:FullAttention*:ConditionalFull*'
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "expect_error.h"
#include "fastattn/ops.h"
#include "fastattn/registry.h"

using namespace fastattn;

namespace {

// A tiny attention type for the tests: every query gets scale · mean of the
// values over S. Easy to tell apart from softmax attention.
class MeanAttention : public AttentionBase {
 public:
  explicit MeanAttention(double scale) : scale_(scale) {}
  torch::Tensor forward(const torch::Tensor& q, const torch::Tensor&, const torch::Tensor& v,
                        const Mask&) override {
    return (scale_ * v.mean(2, /*keepdim=*/true)).expand({-1, -1, q.size(2), -1});
  }
  std::string type_name() const override { return "test-mean"; }

 private:
  double scale_;
};

void register_test_mean(AttentionRegistry& r) {
  if (r.contains("test-mean")) return;
  r.add({"test-mean",
         "scale times the mean of the values (tests only)",
         {ParamSpec::real("scale", 1.0, "output scale", 0.0),
          ParamSpec::integer("unused_int", 3, "an int parameter", 1, 10),
          ParamSpec::choice("mode", "a", {"a", "b"}, "a choice")},
         [](const Params& p, const AttentionDims&) -> AttentionPtr {
           return std::make_shared<MeanAttention>(p.get_float("scale"));
         }});
}

AttentionRegistry& test_registry() {
  auto& r = AttentionRegistry::global();
  register_test_mean(r);
  return r;
}

bool has_param(const AttentionType& t, const std::string& name) {
  for (const auto& s : t.params)
    if (s.name == name) return true;
  return false;
}

torch::Tensor randn64(std::vector<int64_t> shape) { return torch::randn(shape, torch::kFloat64); }

}  // namespace

// ---- registry --------------------------------------------------------------------

TEST(Registry, GlobalHasFull) {
  auto& r = AttentionRegistry::global();
  EXPECT_TRUE(r.contains("full"));
  EXPECT_TRUE(r.contains("conditional-full:full"));
  EXPECT_FALSE(r.contains("nope"));
  EXPECT_FALSE(r.contains("conditional-full:nope"));
  EXPECT_FALSE(r.contains("conditional-full:conditional-full:full"));
  auto names = r.names();
  EXPECT_TRUE(std::is_sorted(names.begin(), names.end()));
  EXPECT_NE(std::find(names.begin(), names.end(), "full"), names.end());
  auto attn = make_attention("full", {{"softmax_temp", 0.125}});
  EXPECT_EQ(attn->type_name(), "full");
  EXPECT_NE(std::dynamic_pointer_cast<FullAttention>(attn), nullptr);
}

TEST(Registry, DefaultsAreFilledIn) {
  auto p = AttentionRegistry::global().validate("full", {});
  EXPECT_FALSE(p.has("softmax_temp"));
  EXPECT_EQ(p.get_optional_float("softmax_temp"), std::nullopt);
  EXPECT_EQ(p.get_float("attention_dropout"), 0.0);
  auto q = test_registry().validate("test-mean", {{"mode", std::string("b")}});
  EXPECT_EQ(q.get_float("scale"), 1.0);
  EXPECT_EQ(q.get_int("unused_int"), 3);
  EXPECT_EQ(q.get_string("mode"), "b");
}

TEST(Registry, FloatSpecTakesAnInt) {
  auto p = AttentionRegistry::global().validate("full", {{"softmax_temp", int64_t{2}}});
  EXPECT_TRUE(std::holds_alternative<double>(p.values().at("softmax_temp")));
  EXPECT_EQ(p.get_float("softmax_temp"), 2.0);
}

TEST(Registry, UnknownTypeListsValidTypes) {
  EXPECT_ERROR_CONTAINS(make_attention("fulll"), "unknown attention type 'fulll'", "full",
                        "conditional-full:<type>");
  EXPECT_ERROR_CONTAINS(make_attention("conditional-full:nope"), "'nope'", "full");
  EXPECT_ERROR_CONTAINS(make_attention("conditional-full:conditional-full:full"),
                        "conditional-full cannot wrap");
}

TEST(Registry, UnknownParameterListsTheTypesParameters) {
  EXPECT_ERROR_CONTAINS(make_attention("full", {{"softmax_tmp", 0.1}}), "'full'", "'softmax_tmp'",
                        "softmax_temp", "attention_dropout");
}

TEST(Registry, WrongKindNamesParamTypeAndValue) {
  EXPECT_ERROR_CONTAINS(make_attention("full", {{"softmax_temp", std::string("abc")}}),
                        "softmax_temp", "float", "\"abc\"");
  EXPECT_ERROR_CONTAINS(make_attention("full", {{"attention_dropout", true}}), "attention_dropout",
                        "float", "bool true");
  auto& r = test_registry();
  // An Int spec rejects a float, integral or not, and a bool.
  EXPECT_ERROR_CONTAINS(r.validate("test-mean", {{"unused_int", 2.5}}), "unused_int",
                        "must be an int", "2.5");
  EXPECT_ERROR_CONTAINS(r.validate("test-mean", {{"unused_int", 2.0}}), "unused_int",
                        "must be an int");
  EXPECT_ERROR_CONTAINS(r.validate("test-mean", {{"unused_int", false}}), "unused_int", "int");
  EXPECT_ERROR_CONTAINS(r.validate("test-mean", {{"mode", int64_t{1}}}), "mode", "a, b");
}

TEST(Registry, OutOfRangeGivesTheRange) {
  EXPECT_ERROR_CONTAINS(make_attention("full", {{"attention_dropout", 1.0}}), "attention_dropout",
                        "[0, 1)", "1.0");
  EXPECT_ERROR_CONTAINS(make_attention("full", {{"attention_dropout", -0.1}}), "[0, 1)");
  EXPECT_ERROR_CONTAINS(make_attention("full", {{"softmax_temp", 0.0}}), "softmax_temp", "> 0");
  EXPECT_ERROR_CONTAINS(make_attention("full", {{"softmax_temp", -1.0}}), "> 0");
  EXPECT_ERROR_CONTAINS(make_attention("full", {{"softmax_temp", std::nan("")}}), "softmax_temp",
                        "finite");
  auto& r = test_registry();
  EXPECT_ERROR_CONTAINS(r.validate("test-mean", {{"unused_int", int64_t{11}}}), "unused_int",
                        "[1, 10]", "11");
  EXPECT_NO_THROW(r.validate("test-mean", {{"unused_int", int64_t{10}}}));
  EXPECT_NO_THROW(make_attention("full", {{"attention_dropout", 0.0}}));
}

TEST(Registry, ChoiceNotInChoicesListsThem) {
  EXPECT_ERROR_CONTAINS(test_registry().validate("test-mean", {{"mode", std::string("c")}}), "mode",
                        "one of a, b", "\"c\"");
}

TEST(Registry, ParamsGettersNameTheParameter) {
  Params p({{"i", int64_t{3}}, {"f", 0.5}, {"b", true}, {"s", std::string("x")}});
  EXPECT_EQ(p.get_int("i"), 3);
  EXPECT_EQ(p.get_float("i"), 3.0);
  EXPECT_EQ(p.get_float("f"), 0.5);
  EXPECT_TRUE(p.get_bool("b"));
  EXPECT_EQ(p.get_string("s"), "x");
  EXPECT_EQ(p.get_optional_int("missing"), std::nullopt);
  EXPECT_EQ(p.get_optional_int("i"), 3);
  EXPECT_ERROR_CONTAINS(p.get_int("f"), "'f'", "not an int", "0.5");
  EXPECT_ERROR_CONTAINS(p.get_float("s"), "'s'", "not a float");
  EXPECT_ERROR_CONTAINS(p.get_bool("i"), "'i'", "not a bool");
  EXPECT_ERROR_CONTAINS(p.get_string("b"), "'b'", "not a string");
  EXPECT_ERROR_CONTAINS(p.get_int("missing"), "'missing'", "b, f, i, s");
}

TEST(Registry, AddRejectsBadTypes) {
  AttentionRegistry r;
  auto factory = [](const Params&, const AttentionDims&) -> AttentionPtr {
    return std::make_shared<FullAttention>();
  };
  r.add({"a", "", {}, factory});
  EXPECT_TRUE(r.contains("a"));
  EXPECT_FALSE(r.contains("conditional-full:a"));  // no 'full' in this registry
  EXPECT_ERROR_CONTAINS(r.add({"a", "", {}, factory}), "'a'", "already registered");
  EXPECT_ERROR_CONTAINS(r.add({"x:y", "", {}, factory}), "'x:y'", "':'");
  EXPECT_ERROR_CONTAINS(r.add({"b", "", {}, nullptr}), "'b'", "factory");
  EXPECT_ERROR_CONTAINS(r.add({"c", "", {ParamSpec::real("p", 2.0, "", 0.0, 1.0)}, factory}),
                        "default", "'p'", "[0, 1]");
  EXPECT_ERROR_CONTAINS(
      r.add({"d",
             "",
             {ParamSpec::boolean("p", true, ""), ParamSpec::boolean("p", true, "")},
             factory}),
      "'p'", "twice");
  EXPECT_ERROR_CONTAINS(r.build("conditional-full:a"), "'full'");
  EXPECT_EQ(r.names(), std::vector<std::string>{"a"});
}

TEST(Registry, DescribeListsTypesAndSpecs) {
  auto j = test_registry().describe();
  ASSERT_TRUE(j.contains("types"));
  const nlohmann::json* full = nullptr;
  for (const auto& t : j["types"])
    if (t["name"] == "full") full = &t;
  ASSERT_NE(full, nullptr);
  EXPECT_FALSE((*full)["description"].get<std::string>().empty());
  const auto& params = (*full)["params"];
  ASSERT_EQ(params.size(), 2u);
  EXPECT_EQ(params[0]["name"], "softmax_temp");
  EXPECT_EQ(params[0]["type"], "float");
  EXPECT_TRUE(params[0]["default"].is_null());
  EXPECT_EQ(params[0]["min"], 0.0);
  EXPECT_EQ(params[0]["min_exclusive"], true);
  EXPECT_FALSE(params[0]["help"].get<std::string>().empty());
  EXPECT_EQ(params[1]["name"], "attention_dropout");
  EXPECT_EQ(params[1]["default"], 0.0);
  EXPECT_EQ(params[1]["max"], 1.0);
  EXPECT_EQ(params[1]["max_exclusive"], true);
  for (const auto& t : j["types"]) {
    if (t["name"] != "test-mean") continue;
    EXPECT_EQ(t["params"][2]["choices"], nlohmann::json({"a", "b"}));
    EXPECT_EQ(t["params"][2]["default"], "a");
    EXPECT_EQ(t["params"][1]["default"], 3);
  }
  ASSERT_EQ(j["decorators"].size(), 1u);
  EXPECT_EQ(j["decorators"][0]["name"], "conditional-full:<type>");
  EXPECT_EQ(j["decorators"][0]["params"][0]["name"], "length_limit");
  EXPECT_EQ(j["decorators"][0]["params"][0]["default"], 512);
}

TEST(Registry, ParamsFromJsonKeepsKinds) {
  auto p = params_from_json(
      nlohmann::json::parse(R"({"i": 3, "f": 0.5, "g": 2.0, "b": true, "s": "x"})"));
  EXPECT_EQ(std::get<int64_t>(p.at("i")), 3);
  EXPECT_EQ(std::get<double>(p.at("f")), 0.5);
  EXPECT_EQ(std::get<double>(p.at("g")), 2.0);
  EXPECT_EQ(std::get<bool>(p.at("b")), true);
  EXPECT_EQ(std::get<std::string>(p.at("s")), "x");
  EXPECT_ERROR_CONTAINS(params_from_json(nlohmann::json::parse(R"({"a": [1]})")), "'a'", "array");
  EXPECT_ERROR_CONTAINS(params_from_json(nlohmann::json::parse("[1]")), "object");
  // Through validation: a JSON integer for a float parameter works.
  auto v = AttentionRegistry::global().validate(
      "full", params_from_json(nlohmann::json::parse(R"({"softmax_temp": 1})")));
  EXPECT_EQ(v.get_float("softmax_temp"), 1.0);
}

TEST(Registry, ParamValueToString) {
  EXPECT_EQ(param_value_to_string(int64_t{3}), "3");
  EXPECT_EQ(param_value_to_string(0.125), "0.125");
  EXPECT_EQ(param_value_to_string(true), "true");
  EXPECT_EQ(param_value_to_string(std::string("gelu")), "\"gelu\"");
  EXPECT_STREQ(param_type_name(ParamType::Choice), "choice");
}

// ---- input checks ---------------------------------------------------------------

TEST(AttentionInputs, AcceptsTheContract) {
  auto q = torch::zeros({2, 3, 4, 5}), k = torch::zeros({2, 3, 6, 5}),
       v = torch::zeros({2, 3, 6, 7});
  EXPECT_NO_THROW(fastattn::check_attention_inputs(q, k, v, Mask()));
  EXPECT_NO_THROW(fastattn::check_attention_inputs(
      q, k, v, Mask::causal_mask().with_key_lengths(torch::tensor({6, 1}))));
}

TEST(AttentionInputs, BadInputsNameTheArgument) {
  using fastattn::check_attention_inputs;
  auto q = torch::zeros({2, 3, 4, 5}), k = torch::zeros({2, 3, 6, 5}),
       v = torch::zeros({2, 3, 6, 7});
  EXPECT_ERROR_CONTAINS(check_attention_inputs(q[0], k, v, Mask()), "queries", "(N, H, L, E)");
  EXPECT_ERROR_CONTAINS(check_attention_inputs(q, torch::zeros({2, 3, 6, 4}), v, Mask()), "keys",
                        "(2, 3, S, 5)", "[2, 3, 6, 4]");
  EXPECT_ERROR_CONTAINS(check_attention_inputs(q, torch::zeros({1, 3, 6, 5}), v, Mask()), "keys");
  EXPECT_ERROR_CONTAINS(check_attention_inputs(q, k, torch::zeros({2, 3, 5, 7}), Mask()), "values",
                        "(2, 3, 6, M)", "[2, 3, 5, 7]");
  EXPECT_ERROR_CONTAINS(check_attention_inputs(q, k.to(torch::kFloat64), v, Mask()), "keys",
                        "Float", "Double");
  EXPECT_ERROR_CONTAINS(check_attention_inputs(q, k, v.to(torch::kFloat64), Mask()), "values",
                        "Double");
  EXPECT_ERROR_CONTAINS(
      check_attention_inputs(q.to(torch::kLong), k.to(torch::kLong), v.to(torch::kLong), Mask()),
      "queries", "float32, float64 or bfloat16 on the CPU", "Long");
  EXPECT_ERROR_CONTAINS(
      check_attention_inputs(q.to(torch::kHalf), k.to(torch::kHalf), v.to(torch::kHalf), Mask()),
      "queries", "float32, float64 or bfloat16 on the CPU", "Half");
  EXPECT_ERROR_CONTAINS(
      check_attention_inputs(q, k, v, Mask().with_key_lengths(torch::tensor({7, 1}))),
      "key_lengths", "[0, 6]");
  EXPECT_ERROR_CONTAINS(
      check_attention_inputs(q, k, v, Mask().with_attn_mask(torch::ones({6, 4}, torch::kBool))),
      "attn_mask", "(4, 6)");
}

// ---- full -------------------------------------------------------------------------

TEST(FullAttention, MatchesTheReference) {
  torch::manual_seed(0);
  auto q = randn64({2, 3, 5, 4}), k = randn64({2, 3, 7, 4}), v = randn64({2, 3, 7, 6});
  auto mask = Mask::causal_mask().with_key_lengths(torch::tensor({7, 4}));
  auto attn = make_attention("full", {{"softmax_temp", 0.3}});
  auto out = attn->forward(q, k, v, mask);
  auto expected =
      reference::full_attention(q, k, v, std::nullopt, torch::tensor({7, 4}), true, 0.3);
  EXPECT_TRUE(torch::allclose(out, expected, 1e-10, 1e-12));
  // softmax_temp reaches the operator.
  auto out_default = make_attention("full")->forward(q, k, v, mask);
  EXPECT_FALSE(torch::allclose(out, out_default));
  EXPECT_ERROR_CONTAINS(attn->forward(q, k.transpose(2, 3), v, mask), "keys");
}

TEST(FullAttention, DropoutPathMatchesTheReferenceWithTheSameDropout) {
  torch::manual_seed(1);
  const int64_t N = 2, H = 2, L = 4, S = 5;
  auto q = randn64({N, H, L, 3}), k = randn64({N, H, S, 3}), v = randn64({N, H, S, 2});
  // Query 0 of batch 1 keeps no key: its output must be zeros, not NaN.
  auto am = torch::ones({N, L, S}, torch::kBool);
  am[1][0] = false;
  auto mask = Mask().with_attn_mask(am).with_key_lengths(torch::tensor({5, 3}));
  const double p = 0.4, temp = 0.7;
  auto attn = make_attention("full", {{"softmax_temp", temp}, {"attention_dropout", p}});

  // Eval mode: no dropout, the fused operator.
  attn->eval();
  auto eval_out = attn->forward(q, k, v, mask);
  auto ref = reference::full_attention(q, k, v, am, torch::tensor({5, 3}), false, temp);
  EXPECT_TRUE(torch::allclose(eval_out, ref, 1e-10, 1e-12));

  // Training: the operator's fused dropout, its seed drawn from torch's
  // generator (tests/cpp/test_attention_dropout.cpp in depth).
  attn->train();
  auto qg = q.clone().requires_grad_(true);
  torch::manual_seed(7);
  auto out = attn->forward(qg, k, v, mask);
  torch::manual_seed(7);
  const int64_t seed =
      torch::randint(0, int64_t{1} << 62, {1}, torch::TensorOptions().dtype(torch::kLong))
          .item<int64_t>();
  auto expected = reference::full_attention(q, k, v, am, torch::tensor({5, 3}), false, temp,
                                            reference::attention_dropout_keep(seed, p, N, H, L, S));
  EXPECT_TRUE(torch::allclose(out, expected, 1e-10, 1e-12));
  EXPECT_FALSE(torch::allclose(out, ref));
  EXPECT_EQ(out[1].select(1, 0).abs().max().item<double>(), 0.0);
  out.sum().backward();
  EXPECT_FALSE(torch::isnan(qg.grad()).any().item<bool>());
}

// ---- conditional-full ---------------------------------------------------------------

TEST(ConditionalFull, ParamsAreInnerPlusLengthLimitWithSharedTemp) {
  auto& r = test_registry();
  auto t = r.get("conditional-full:test-mean");
  for (const char* name :
       {"scale", "unused_int", "mode", "softmax_temp", "attention_dropout", "length_limit"})
    EXPECT_TRUE(has_param(t, name)) << name;
  EXPECT_EQ(t.params.size(), 6u);
  // Full wrapping full: softmax_temp and attention_dropout appear once (shared).
  auto tf = r.get("conditional-full:full");
  EXPECT_EQ(tf.params.size(), 3u);
  auto p = r.validate("conditional-full:full", {});
  EXPECT_EQ(p.get_int("length_limit"), 512);
  EXPECT_ERROR_CONTAINS(r.validate("conditional-full:test-mean", {{"length_limit", int64_t{0}}}),
                        "length_limit", ">= 1", "0");
  EXPECT_ERROR_CONTAINS(r.validate("conditional-full:test-mean", {{"nope", int64_t{0}}}), "'nope'",
                        "scale", "softmax_temp", "length_limit");
}

TEST(ConditionalFull, FullUpToTheLimitInnerBeyond) {
  auto& r = test_registry();
  auto attn = r.build("conditional-full:test-mean",
                      {{"length_limit", int64_t{8}}, {"softmax_temp", 0.3}, {"scale", 2.0}});
  EXPECT_EQ(attn->type_name(), "conditional-full:test-mean");
  torch::manual_seed(2);
  auto q = randn64({1, 2, 3, 4});
  auto mask = Mask().with_causal();
  for (int64_t S : {3, 8}) {
    auto k = randn64({1, 2, S, 4}), v = randn64({1, 2, S, 5});
    auto expected = reference::full_attention(q, k, v, std::nullopt, std::nullopt, true, 0.3);
    EXPECT_TRUE(torch::allclose(attn->forward(q, k, v, mask), expected, 1e-10, 1e-12)) << S;
  }
  for (int64_t S : {9, 20}) {
    auto k = randn64({1, 2, S, 4}), v = randn64({1, 2, S, 5});
    auto expected = (2.0 * v.mean(2, true)).expand({1, 2, 3, 5});
    EXPECT_TRUE(torch::allclose(attn->forward(q, k, v, mask), expected, 1e-12, 1e-12)) << S;
  }
  {  // A query side past the limit also switches, whatever S is.
    auto q_long = randn64({1, 2, 9, 4}), k = randn64({1, 2, 3, 4}), v = randn64({1, 2, 3, 5});
    auto expected = (2.0 * v.mean(2, true)).expand({1, 2, 9, 5});
    EXPECT_TRUE(torch::allclose(attn->forward(q_long, k, v, Mask()), expected, 1e-12, 1e-12));
  }
  // Both parts are submodules (training mode reaches them, weights save).
  EXPECT_EQ(attn->children().size(), 2u);
}
