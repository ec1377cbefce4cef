// CausalLanguageModel and generation: the sinusoidal encoding against its
// formula; the recurrent model with the batch model's weights gives the batch
// logits at every position (causal-linear and full, float64); greedy
// generation equals the argmax of the batch model run on the growing
// sequence; sampling with a seed is reproducible, top_k = 1 is greedy; stop
// tokens end and pad sequences; bad inputs name the argument.
//
//   build/fastattn_tests --gtest_filter='Generation*:LanguageModel*'
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <string>

#include "expect_error.h"
#include "fastattn/generation.h"

namespace fastattn {
namespace {

using torch::Tensor;

CausalLanguageModel small_model(const std::string& type, int64_t vocab, bool norm_first = false) {
  torch::manual_seed(5);
  CausalLanguageModel model(vocab, EncoderBuilder()
                                       .layers(2)
                                       .heads(2)
                                       .d_model(8)
                                       .feed_forward_dimensions(16)
                                       .dropout(0.0)
                                       .norm_first(norm_first)
                                       .attention(type));
  model->to(torch::kDouble);
  model->eval();
  return model;
}

TEST(LanguageModel, SinusoidalPositionsFollowTheFormula) {
  const int64_t D = 6;
  const auto pe = sinusoidal_positions(0, 10, D, torch::kDouble);
  ASSERT_EQ(pe.sizes(), (std::vector<int64_t>{10, D}));
  for (int64_t p : {0, 3, 9}) {
    for (int64_t i = 0; i < D; ++i) {
      const double angle = p / std::pow(10000.0, 2.0 * (i / 2) / D);
      const double want = i % 2 == 0 ? std::sin(angle) : std::cos(angle);
      EXPECT_NEAR(pe[p][i].item<double>(), want, 1e-12) << "p " << p << " i " << i;
    }
  }
  EXPECT_TRUE(torch::allclose(sinusoidal_positions(4, 3, D, torch::kDouble), pe.narrow(0, 4, 3)));
  EXPECT_EQ(sinusoidal_positions(0, 2, D).scalar_type(), torch::kFloat);
}

TEST(LanguageModel, RecurrentStepsEqualBatchLogits) {
  const int64_t N = 2, L = 9, V = 13;
  for (const std::string type : {"causal-linear", "full"}) {
    for (const bool norm_first : {false, true}) {
      SCOPED_TRACE(type + (norm_first ? " pre-norm" : " post-norm"));
      auto model = small_model(type, V, norm_first);
      auto rnn = model->recurrent();
      EXPECT_EQ(rnn->named_parameters().keys(), model->named_parameters().keys());
      EXPECT_FALSE(rnn->is_training());
      const auto tokens = torch::randint(0, V, {N, L}, torch::kLong);
      const auto expected = model->forward(tokens);  // (N, L, V)
      ASSERT_EQ(expected.sizes(), (std::vector<int64_t>{N, L, V}));
      LanguageModelState state;
      for (int64_t i = 0; i < L; ++i) {
        auto [logits, next] = rnn->step(tokens.select(1, i), state);
        state = std::move(next);
        EXPECT_LE((logits - expected.select(1, i)).abs().max().item<double>(), 1e-10)
            << "position " << i;
      }
      EXPECT_EQ(state.position, L);
    }
  }
}

TEST(Generation, GreedyEqualsArgmaxOfTheBatchModel) {
  const int64_t V = 11, P = 3, T = 6;
  for (const std::string type : {"causal-linear", "full"}) {
    SCOPED_TRACE(type);
    auto model = small_model(type, V);
    auto rnn = model->recurrent();
    const auto prefix = torch::randint(0, V, {2, P}, torch::kLong);
    GenerationOptions o;
    o.greedy = true;
    o.max_new_tokens = T;
    const auto result = generate(*rnn, prefix, o);
    ASSERT_EQ(result.tokens.sizes(), (std::vector<int64_t>{2, P + T}));
    EXPECT_TRUE(torch::equal(result.tokens.narrow(1, 0, P), prefix));
    EXPECT_TRUE(torch::equal(result.lengths, torch::full({2}, P + T, torch::kLong)));
    for (int64_t t = 0; t < T; ++t) {
      const auto logits = model->forward(result.tokens.narrow(1, 0, P + t));  // (2, P + t, V)
      EXPECT_TRUE(
          torch::equal(logits.select(1, P + t - 1).argmax(-1), result.tokens.select(1, P + t)))
          << "new token " << t;
    }
  }
}

TEST(Generation, SamplingIsReproducibleAndTopOneIsGreedy) {
  const int64_t V = 50;
  auto model = small_model("causal-linear", V);
  auto rnn = model->recurrent();
  const auto prefix = torch::randint(0, V, {3, 2}, torch::kLong);
  GenerationOptions o;
  o.max_new_tokens = 20;
  o.temperature = 3.0;  // flat distributions: different seeds differ
  o.seed = 7;
  const auto a = generate(*rnn, prefix, o).tokens;
  const auto b = generate(*rnn, prefix, o).tokens;
  EXPECT_TRUE(torch::equal(a, b));
  o.seed = 8;
  EXPECT_FALSE(torch::equal(a, generate(*rnn, prefix, o).tokens));
  o.top_k = 1;
  GenerationOptions g;
  g.greedy = true;
  g.max_new_tokens = 20;
  EXPECT_TRUE(torch::equal(generate(*rnn, prefix, o).tokens, generate(*rnn, prefix, g).tokens));
  // top_k = 3: every sampled token is among the 3 most likely at its step.
  o.top_k = 3;
  const auto r = generate(*rnn, prefix, o).tokens;
  const auto logits = model->forward(r);  // (3, 22, V)
  for (int64_t t = 2; t < r.size(1); ++t) {
    const auto top = std::get<1>(logits.select(1, t - 1).topk(3, -1));  // (3, 3)
    EXPECT_TRUE((top == r.select(1, t).unsqueeze(1)).any(1).all().item<bool>()) << "step " << t;
  }
}

TEST(Generation, StopTokenEndsAndPadsSequences) {
  const int64_t V = 7, P = 2, T = 12;
  auto model = small_model("full", V);
  auto rnn = model->recurrent();
  const auto prefix = torch::randint(0, V, {4, P}, torch::kLong);
  GenerationOptions o;
  o.max_new_tokens = T;
  o.seed = 3;
  const auto free_run = generate(*rnn, prefix, o).tokens;
  const int64_t stop = free_run[0][P + 1].item<int64_t>();  // sequence 0 stops by its 2nd token
  o.stop_token = stop;
  const auto result = generate(*rnn, prefix, o);
  const auto& tok = result.tokens;
  ASSERT_LE(tok.size(1), P + T);
  for (int64_t n = 0; n < 4; ++n) {
    int64_t len = tok.size(1);
    for (int64_t j = P; j < tok.size(1); ++j) {
      if (tok[n][j].item<int64_t>() == stop) {
        len = j + 1;
        break;
      }
    }
    EXPECT_EQ(result.lengths[n].item<int64_t>(), len) << "sequence " << n;
    // Up to the stop: the free run (same seed, same draws); after it: padding.
    EXPECT_TRUE(torch::equal(tok[n].narrow(0, 0, len), free_run[n].narrow(0, 0, len)));
    for (int64_t j = len; j < tok.size(1); ++j) EXPECT_EQ(tok[n][j].item<int64_t>(), stop);
  }
  EXPECT_LE(result.lengths[0].item<int64_t>(), P + 2);
  // Generation ends once every sequence has stopped.
  const bool all_stopped =
      (result.lengths < tok.size(1)).logical_or(tok.select(1, -1) == stop).all().item<bool>();
  EXPECT_TRUE(all_stopped);
}

TEST(Generation, Errors) {
  auto model = small_model("causal-linear", 5);
  auto rnn = model->recurrent();
  const auto prefix = torch::randint(0, 5, {2, 3}, torch::kLong);
  GenerationOptions o;
  EXPECT_ERROR_CONTAINS(generate(*rnn, prefix.to(torch::kFloat), o),
                        "prefix must be an integer tensor", "Float");
  EXPECT_ERROR_CONTAINS(generate(*rnn, prefix + 5, o), "prefix must be token ids in [0, 5)");
  EXPECT_ERROR_CONTAINS(generate(*rnn, prefix.narrow(1, 0, 0), o), "at least one token");
  EXPECT_ERROR_CONTAINS(generate(*rnn, prefix.select(1, 0), o), "prefix must have shape (N, P)");
  o.temperature = 0;
  EXPECT_ERROR_CONTAINS(generate(*rnn, prefix, o), "temperature must be a finite number > 0");
  o = GenerationOptions();
  o.top_k = 6;
  EXPECT_ERROR_CONTAINS(generate(*rnn, prefix, o), "top_k must be in [1, 5]", "got 6");
  o = GenerationOptions();
  o.max_new_tokens = -1;
  EXPECT_ERROR_CONTAINS(generate(*rnn, prefix, o), "max_new_tokens must be >= 0");
  o = GenerationOptions();
  o.stop_token = 9;
  EXPECT_ERROR_CONTAINS(generate(*rnn, prefix, o), "stop_token must be a token id in [0, 5)");
  EXPECT_ERROR_CONTAINS(CausalLanguageModel(0, EncoderBuilder()), "vocab_size must be >= 1");
  EXPECT_ERROR_CONTAINS(
      RecurrentCausalLanguageModel(5, EncoderBuilder().heads(2).d_model(8).attention("linear")),
      "causal-linear, full");
  // max_new_tokens = 0 returns the prefix.
  o = GenerationOptions();
  o.max_new_tokens = 0;
  EXPECT_TRUE(torch::equal(generate(*rnn, prefix, o).tokens, prefix));
}

}  // namespace
}  // namespace fastattn
