// Tests of the transformer modules and builders: shapes and parameter names,
// the attention layer against a hand computation, pre- vs post-norm, padding
// and causality (float64), builder validation and JSON, gradients.
// Run: ./fastattn_tests --gtest_filter='AttentionLayer*:Encoder*:Decoder*'
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <utility>

#include "expect_error.h"
#include "fastattn/ops.h"
#include "fastattn/transformer.h"

using namespace fastattn;

namespace {

std::vector<std::string> param_names(const torch::nn::Module& m) {
  std::vector<std::string> out;
  for (const auto& p : m.named_parameters()) out.push_back(p.key());
  return out;
}

bool contains(const std::vector<std::string>& v, const std::string& s) {
  return std::find(v.begin(), v.end(), s) != v.end();
}

// Same names, same values.
void expect_same_parameters(const torch::nn::Module& a, const torch::nn::Module& b) {
  auto pa = a.named_parameters(), pb = b.named_parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (const auto& p : pa) {
    ASSERT_TRUE(pb.contains(p.key())) << p.key();
    EXPECT_TRUE(torch::equal(p.value(), pb[p.key()])) << p.key();
  }
}

torch::Tensor randn64(std::vector<int64_t> shape) { return torch::randn(shape, torch::kFloat64); }

// Every parameter gets a finite gradient, non-zero except the key projection's
// bias: adding a constant to every key shifts each score row by a constant,
// which softmax ignores, so that gradient is zero in exact arithmetic.
void expect_gradients_everywhere(const torch::nn::Module& m) {
  for (const auto& p : m.named_parameters()) {
    const auto& g = p.value().grad();
    ASSERT_TRUE(g.defined()) << p.key();
    EXPECT_FALSE(torch::isnan(g).any().item<bool>()) << p.key();
    const auto& k = p.key();
    const std::string key_bias = "key_projection.bias";
    if (k.size() >= key_bias.size() &&
        k.compare(k.size() - key_bias.size(), key_bias.size(), key_bias) == 0) {
      EXPECT_LT(g.abs().max().item<double>(), 1e-10) << k;
    } else {
      EXPECT_GT(g.abs().sum().item<double>(), 0.0) << k;
    }
  }
}

}  // namespace

// ---- attention layer --------------------------------------------------------------

TEST(AttentionLayer, ShapesAndNames) {
  AttentionLayer layer(make_attention("full"),
                       AttentionLayerOptions(12, 3).d_values(5).d_model_keys(7));
  auto names = param_names(*layer);
  for (const char* n : {"query_projection.weight", "key_projection.weight",
                        "value_projection.weight", "out_projection.weight", "out_projection.bias"})
    EXPECT_TRUE(contains(names, n)) << n;
  EXPECT_EQ(layer->named_parameters()["query_projection.weight"].sizes(),
            (std::vector<int64_t>{12, 12}));  // H·E = 3·4
  EXPECT_EQ(layer->named_parameters()["key_projection.weight"].sizes(),
            (std::vector<int64_t>{12, 7}));
  EXPECT_EQ(layer->named_parameters()["value_projection.weight"].sizes(),
            (std::vector<int64_t>{15, 7}));  // H·M = 3·5
  EXPECT_EQ(layer->named_parameters()["out_projection.weight"].sizes(),
            (std::vector<int64_t>{12, 15}));
  EXPECT_TRUE(layer->named_children().contains("inner_attention"));
  auto out = layer(torch::randn({2, 4, 12}), torch::randn({2, 6, 7}), torch::randn({2, 6, 7}));
  EXPECT_EQ(out.sizes(), (std::vector<int64_t>{2, 4, 12}));
}

TEST(AttentionLayer, MatchesAHandComputation) {
  torch::manual_seed(3);
  const int64_t N = 2, L = 3, S = 5, D = 6, H = 2, E = 3;
  AttentionLayer layer(make_attention("full"), AttentionLayerOptions(D, H));
  layer->to(torch::kFloat64);
  auto x = randn64({N, L, D}), mem = randn64({N, S, D});
  auto lengths = torch::tensor({5, 2});
  auto out = layer(x, mem, mem, Mask().with_key_lengths(lengths));
  auto p = layer->named_parameters();
  auto proj = [&](const std::string& name, const torch::Tensor& t, int64_t len) {
    return torch::linear(t, p[name + ".weight"], p[name + ".bias"])
        .view({N, len, H, E})
        .permute({0, 2, 1, 3});
  };
  auto heads =
      reference::full_attention(proj("query_projection", x, L), proj("key_projection", mem, S),
                                proj("value_projection", mem, S), std::nullopt, lengths);
  auto expected = torch::linear(heads.permute({0, 2, 1, 3}).reshape({N, L, H * E}),
                                p["out_projection.weight"], p["out_projection.bias"]);
  EXPECT_TRUE(torch::allclose(out, expected, 1e-10, 1e-12));
}

TEST(AttentionLayer, BadSettingsAndInputsNameThem) {
  EXPECT_ERROR_CONTAINS(AttentionLayer(make_attention("full"), AttentionLayerOptions(10, 3)),
                        "d_model (10)", "n_heads (3)", "d_keys");
  EXPECT_ERROR_CONTAINS(AttentionLayer(make_attention("full"), AttentionLayerOptions(10, 0)),
                        "n_heads", ">= 1");
  EXPECT_NO_THROW(AttentionLayer(make_attention("full"), AttentionLayerOptions(10, 3).d_keys(4)));
  AttentionLayer layer(make_attention("full"), AttentionLayerOptions(8, 2));
  auto x = torch::randn({1, 3, 8});
  EXPECT_ERROR_CONTAINS(layer(torch::randn({1, 3, 9}), x, x), "queries", "(N, L, 8)", "[1, 3, 9]");
  EXPECT_ERROR_CONTAINS(layer(x, torch::randn({1, 3, 7}), x), "keys", "(N, S, 8)");
  EXPECT_ERROR_CONTAINS(layer(x, x, torch::randn({1, 4, 8})), "values");
}

// ---- encoder ----------------------------------------------------------------------

TEST(Encoder, ShapesAndParameterNames) {
  auto enc = EncoderBuilder().layers(2).heads(2).d_model(8).build();
  auto y = enc(torch::randn({3, 5, 8}));
  EXPECT_EQ(y.sizes(), (std::vector<int64_t>{3, 5, 8}));
  auto names = param_names(*enc);
  for (const char* n :
       {"layers.0.attention.query_projection.weight", "layers.0.attention.key_projection.bias",
        "layers.0.attention.value_projection.weight", "layers.1.attention.out_projection.weight",
        "layers.1.linear1.weight", "layers.1.linear2.bias", "layers.0.norm1.weight",
        "layers.0.norm2.bias", "norm.weight", "norm.bias"})
    EXPECT_TRUE(contains(names, n)) << n;
  EXPECT_EQ(enc->named_parameters()["layers.0.linear1.weight"].sizes(),
            (std::vector<int64_t>{32, 8}));  // d_ff defaults to 4·d_model
  EXPECT_EQ(enc->layers().size(), 2u);

  auto bare = EncoderBuilder().layers(1).heads(2).d_model(8).final_normalization(false).build();
  EXPECT_FALSE(contains(param_names(*bare), "norm.weight"));
}

TEST(Encoder, QueryAndValueDimensionsSetTheWidths) {
  auto enc = EncoderBuilder()
                 .layers(1)
                 .heads(2)
                 .query_dimensions(3)
                 .value_dimensions(5)
                 .feed_forward_dimensions(7)
                 .build();
  auto p = enc->named_parameters();
  EXPECT_EQ(p["layers.0.attention.query_projection.weight"].sizes(),
            (std::vector<int64_t>{6, 6}));  // d_model = heads · query_dimensions
  EXPECT_EQ(p["layers.0.attention.value_projection.weight"].sizes(), (std::vector<int64_t>{10, 6}));
  EXPECT_EQ(p["layers.0.attention.out_projection.weight"].sizes(), (std::vector<int64_t>{6, 10}));
  EXPECT_EQ(p["layers.0.linear1.weight"].sizes(), (std::vector<int64_t>{7, 6}));
  EXPECT_EQ(enc(torch::randn({1, 4, 6})).sizes(), (std::vector<int64_t>{1, 4, 6}));
}

TEST(Encoder, PreNormAndPostNormDiffer) {
  auto build = [](bool norm_first) {
    torch::manual_seed(5);
    auto enc = EncoderBuilder()
                   .layers(2)
                   .heads(2)
                   .d_model(8)
                   .dropout(0.0)
                   .norm_first(norm_first)
                   .final_normalization(false)
                   .build();
    enc->to(torch::kFloat64);
    return enc;
  };
  auto post = build(false), pre = build(true);
  expect_same_parameters(*post, *pre);
  torch::manual_seed(6);
  auto x = 3.0 * randn64({2, 5, 8}) + 1.0;
  auto y_post = post(x), y_pre = pre(x);
  EXPECT_FALSE(torch::allclose(y_post, y_pre, 1e-3, 1e-3));
  // Post-norm ends in a LayerNorm (unit weight, zero bias at init): every
  // position has zero mean and unit variance; pre-norm ends in a residual.
  EXPECT_TRUE(torch::allclose(y_post.mean(-1), torch::zeros({2, 5}, torch::kFloat64), 0, 1e-9));
  EXPECT_TRUE(torch::allclose(y_post.var(-1, /*unbiased=*/false),
                              torch::ones({2, 5}, torch::kFloat64), 1e-4, 1e-4));
  EXPECT_GT((y_pre.mean(-1)).abs().max().item<double>(), 1e-3);
}

TEST(Encoder, PaddedKeysDoNotChangeValidOutputs) {
  for (bool norm_first : {false, true}) {
    torch::manual_seed(7);
    auto enc = EncoderBuilder().layers(2).heads(2).d_model(8).norm_first(norm_first).build();
    enc->to(torch::kFloat64);
    enc->eval();
    auto x = randn64({2, 6, 8});
    auto mask = Mask().with_key_lengths(torch::tensor({6, 3}));
    auto x2 = x.clone();
    x2[1].slice(0, 3) = randn64({3, 8});  // new values at batch 1's padded positions
    auto y = enc(x, mask), y2 = enc(x2, mask);
    EXPECT_TRUE(torch::allclose(y[0], y2[0], 0, 1e-12));
    EXPECT_TRUE(torch::allclose(y[1].slice(0, 0, 3), y2[1].slice(0, 0, 3), 0, 1e-12));
    // Without the mask the change reaches the valid positions.
    EXPECT_FALSE(torch::allclose(enc(x)[1].slice(0, 0, 3), enc(x2)[1].slice(0, 0, 3)));
  }
}

TEST(Encoder, DropoutOnlyInTraining) {
  torch::manual_seed(8);
  auto enc = EncoderBuilder().layers(1).heads(2).d_model(8).dropout(0.5).build();
  auto x = torch::randn({2, 4, 8});
  enc->train();
  EXPECT_FALSE(torch::allclose(enc(x), enc(x)));
  enc->eval();
  EXPECT_TRUE(torch::equal(enc(x), enc(x)));
}

TEST(Encoder, GradientsReachEveryParameter) {
  torch::manual_seed(9);
  auto enc = EncoderBuilder()
                 .layers(2)
                 .heads(2)
                 .d_model(8)
                 .activation("gelu")
                 .attention("full", {{"attention_dropout", 0.1}})
                 .build();
  enc->to(torch::kFloat64);
  auto y = enc(randn64({2, 5, 8}), Mask().with_key_lengths(torch::tensor({5, 2})));
  (y * randn64({2, 5, 8})).sum().backward();
  expect_gradients_everywhere(*enc);
}

// ---- decoder ----------------------------------------------------------------------

TEST(Decoder, ShapesAndParameterNames) {
  auto dec = DecoderBuilder().layers(2).heads(2).d_model(8).memory_dimensions(6).build();
  auto y = dec(torch::randn({3, 5, 8}), torch::randn({3, 7, 6}));
  EXPECT_EQ(y.sizes(), (std::vector<int64_t>{3, 5, 8}));
  auto names = param_names(*dec);
  for (const char* n : {"layers.0.self_attention.query_projection.weight",
                        "layers.0.cross_attention.key_projection.weight",
                        "layers.1.cross_attention.out_projection.bias", "layers.1.linear1.weight",
                        "layers.0.norm1.weight", "layers.0.norm3.bias", "norm.weight"})
    EXPECT_TRUE(contains(names, n)) << n;
  EXPECT_EQ(dec->named_parameters()["layers.0.cross_attention.key_projection.weight"].sizes(),
            (std::vector<int64_t>{8, 6}));
  EXPECT_EQ(dec->named_parameters()["layers.0.self_attention.key_projection.weight"].sizes(),
            (std::vector<int64_t>{8, 8}));
}

TEST(Decoder, OutputsDoNotDependOnLaterInputs) {
  for (bool norm_first : {false, true}) {
    torch::manual_seed(10);
    auto dec = DecoderBuilder().layers(2).heads(2).d_model(8).norm_first(norm_first).build();
    dec->to(torch::kFloat64);
    dec->eval();
    auto x = randn64({2, 6, 8}), memory = randn64({2, 4, 8});
    const int64_t t = 3;
    auto x2 = x.clone();
    x2.slice(1, t) = randn64({2, 6 - t, 8});
    auto y = dec(x, memory), y2 = dec(x2, memory);
    EXPECT_TRUE(torch::allclose(y.slice(1, 0, t), y2.slice(1, 0, t), 0, 1e-12));
    EXPECT_FALSE(torch::allclose(y.slice(1, t), y2.slice(1, t)));
    // Every position sees the whole memory.
    auto y3 = dec(x, memory + 1.0);
    EXPECT_FALSE(torch::allclose(y.select(1, 0), y3.select(1, 0)));
  }
}

TEST(Decoder, MemoryPaddingIsIgnored) {
  torch::manual_seed(11);
  auto dec = DecoderBuilder().layers(1).heads(2).d_model(8).build();
  dec->to(torch::kFloat64);
  dec->eval();
  auto x = randn64({2, 3, 8}), memory = randn64({2, 5, 8});
  auto memory_mask = Mask().with_key_lengths(torch::tensor({2, 5}));
  auto memory2 = memory.clone();
  memory2[0].slice(0, 2) = randn64({3, 8});
  EXPECT_TRUE(torch::allclose(dec(x, memory, Mask(), memory_mask),
                              dec(x, memory2, Mask(), memory_mask), 0, 1e-12));
}

TEST(Decoder, GradientsReachEveryParameter) {
  torch::manual_seed(12);
  auto dec =
      DecoderBuilder().layers(2).heads(2).d_model(8).norm_first(true).memory_dimensions(5).build();
  dec->to(torch::kFloat64);
  auto memory = randn64({2, 4, 5}).requires_grad_(true);
  auto y = dec(randn64({2, 3, 8}), memory);
  (y * randn64({2, 3, 8})).sum().backward();
  expect_gradients_everywhere(*dec);
  EXPECT_GT(memory.grad().abs().sum().item<double>(), 0.0);
}

// ---- builders ---------------------------------------------------------------------

TEST(Builder, EncoderFromJsonEqualsSetters) {
  auto j = nlohmann::json::parse(R"({
    "layers": 2, "heads": 2, "d_model": 8, "feed_forward_dimensions": 12, "dropout": 0,
    "activation": "gelu", "norm_first": true, "final_normalization": false,
    "attention": {"type": "full", "softmax_temp": 0.125}})");
  torch::manual_seed(13);
  auto a = EncoderBuilder::from_json(j).build();
  torch::manual_seed(13);
  auto b = EncoderBuilder()
               .layers(2)
               .heads(2)
               .d_model(8)
               .feed_forward_dimensions(12)
               .dropout(0.0)
               .activation("gelu")
               .norm_first(true)
               .final_normalization(false)
               .attention("full", {{"softmax_temp", 0.125}})
               .build();
  expect_same_parameters(*a, *b);
  auto x = torch::randn({2, 4, 8});
  EXPECT_TRUE(torch::equal(a(x), b(x)));
  // The attention parameters arrive: another temperature gives another output.
  torch::manual_seed(13);
  auto c = EncoderBuilder::from_json(j).attention("full").build();
  expect_same_parameters(*a, *c);
  EXPECT_FALSE(torch::allclose(a(x), c(x)));
  // A bare type name is accepted too.
  auto d = EncoderBuilder::from_json(nlohmann::json::parse(R"({"attention": "full"})"));
  EXPECT_EQ(d.attention_spec().type, "full");
  EXPECT_TRUE(d.attention_spec().params.empty());
}

TEST(Builder, DecoderFromJsonEqualsSetters) {
  auto j = nlohmann::json::parse(R"({
    "layers": 1, "heads": 2, "query_dimensions": 3, "value_dimensions": 2,
    "memory_dimensions": 5, "dropout": 0.0,
    "self_attention": {"type": "full", "softmax_temp": 0.5},
    "cross_attention": {"type": "conditional-full:full", "length_limit": 4}})");
  torch::manual_seed(14);
  auto a = DecoderBuilder::from_json(j).build();
  torch::manual_seed(14);
  auto b = DecoderBuilder()
               .layers(1)
               .heads(2)
               .query_dimensions(3)
               .value_dimensions(2)
               .memory_dimensions(5)
               .dropout(0.0)
               .self_attention("full", {{"softmax_temp", 0.5}})
               .cross_attention("conditional-full:full", {{"length_limit", int64_t{4}}})
               .build();
  expect_same_parameters(*a, *b);
  auto x = torch::randn({2, 3, 6}), memory = torch::randn({2, 7, 5});
  EXPECT_TRUE(torch::equal(a(x, memory), b(x, memory)));
  auto inner =
      a->layers()[0]->named_children()["cross_attention"]->named_children()["inner_attention"];
  EXPECT_NE(std::dynamic_pointer_cast<ConditionalFullAttention>(inner), nullptr);
}

TEST(Builder, FromJsonRejectsUnknownKeysAndWrongTypes) {
  EXPECT_ERROR_CONTAINS(EncoderBuilder::from_json(nlohmann::json::parse(R"({"layer": 2})")),
                        "unknown key 'layer'", "layers", "heads", "attention");
  EXPECT_ERROR_CONTAINS(
      DecoderBuilder::from_json(nlohmann::json::parse(R"({"attention": "full"})")),
      "unknown key 'attention'", "self_attention", "cross_attention", "memory_dimensions");
  EXPECT_ERROR_CONTAINS(EncoderBuilder::from_json(nlohmann::json::parse(R"({"heads": "8"})")),
                        "'heads'", "integer", "\"8\"");
  EXPECT_ERROR_CONTAINS(EncoderBuilder::from_json(nlohmann::json::parse(R"({"heads": 2.5})")),
                        "'heads'", "integer");
  EXPECT_ERROR_CONTAINS(EncoderBuilder::from_json(nlohmann::json::parse(R"({"norm_first": 1})")),
                        "'norm_first'");
  EXPECT_ERROR_CONTAINS(
      EncoderBuilder::from_json(nlohmann::json::parse(R"({"attention": {"softmax_temp": 1}})")),
      "'attention'", "\"type\"");
  EXPECT_ERROR_CONTAINS(EncoderBuilder::from_json(nlohmann::json::parse("[]")), "JSON object");
}

TEST(Builder, ValidationNamesTheSetting) {
  EXPECT_ERROR_CONTAINS(EncoderBuilder().heads(3).d_model(10).build(), "EncoderBuilder",
                        "d_model (10)", "heads (3)", "query_dimensions");
  EXPECT_NO_THROW(EncoderBuilder().layers(1).heads(3).d_model(10).query_dimensions(4).build());
  EXPECT_ERROR_CONTAINS(EncoderBuilder().layers(0).build(), "layers", ">= 1", "0");
  EXPECT_ERROR_CONTAINS(EncoderBuilder().heads(-1).build(), "heads", ">= 1");
  EXPECT_ERROR_CONTAINS(EncoderBuilder().query_dimensions(0).build(), "query_dimensions");
  EXPECT_ERROR_CONTAINS(EncoderBuilder().feed_forward_dimensions(0).build(),
                        "feed_forward_dimensions");
  EXPECT_ERROR_CONTAINS(EncoderBuilder().dropout(1.0).build(), "dropout", "[0, 1)");
  EXPECT_ERROR_CONTAINS(EncoderBuilder().activation("tanh").build(), "activation", "relu, gelu",
                        "tanh");
  EXPECT_ERROR_CONTAINS(EncoderBuilder().attention("full", {{"softmax_tmp", 0.1}}).build(),
                        "EncoderBuilder: attention", "softmax_tmp", "softmax_temp");
  EXPECT_ERROR_CONTAINS(EncoderBuilder().attention("nope").build(), "attention", "'nope'");
  EXPECT_ERROR_CONTAINS(
      DecoderBuilder().cross_attention("full", {{"attention_dropout", 2.0}}).build(),
      "DecoderBuilder: cross_attention", "attention_dropout", "[0, 1)");
  EXPECT_ERROR_CONTAINS(DecoderBuilder().memory_dimensions(0).build(), "memory_dimensions");
}

// ---- auxiliary losses ---------------------------------------------------------------

namespace {

// Full attention that reports the mean of its output as an auxiliary loss.
class LossyAttention : public FullAttention {
 public:
  torch::Tensor forward(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const Mask& mask) override {
    auto out = FullAttention::forward(q, k, v, mask);
    loss_ = out.mean();
    return out;
  }
  torch::Tensor take_auxiliary_loss() override { return std::exchange(loss_, torch::Tensor()); }

 private:
  torch::Tensor loss_;
};

}  // namespace

TEST(AuxiliaryLosses, SummedOverLayersAndTakenOnce) {
  auto a = std::make_shared<LossyAttention>();
  auto b = std::make_shared<LossyAttention>();
  std::vector<TransformerEncoderLayer> layers{
      TransformerEncoderLayer(AttentionLayer(a, AttentionLayerOptions(16, 2)),
                              TransformerLayerOptions(16).dropout(0.0)),
      TransformerEncoderLayer(AttentionLayer(b, AttentionLayerOptions(16, 2)),
                              TransformerLayerOptions(16).dropout(0.0))};
  TransformerEncoder encoder(layers);
  EXPECT_FALSE(take_auxiliary_losses(*encoder).defined());  // no forward yet
  encoder->forward(randn64({2, 5, 16}).to(torch::kFloat32));
  // What each layer would report, read before taking: the sum of both.
  auto x = randn64({2, 5, 16}).to(torch::kFloat32);
  encoder->forward(x);
  auto expected = a->take_auxiliary_loss() + b->take_auxiliary_loss();
  EXPECT_FALSE(take_auxiliary_losses(*encoder).defined());  // taken above
  encoder->forward(x);
  auto total = take_auxiliary_losses(*encoder);
  ASSERT_TRUE(total.defined());
  EXPECT_NEAR(total.item<double>(), expected.item<double>(), 1e-6);
  EXPECT_FALSE(take_auxiliary_losses(*encoder).defined());  // cleared

  // Types without losses contribute nothing.
  auto plain = EncoderBuilder().layers(1).heads(2).d_model(16).attention("full", {}).build();
  plain->forward(x);
  EXPECT_FALSE(take_auxiliary_losses(*plain).defined());
}
