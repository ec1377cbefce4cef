// Recurrent cross-attention and RecurrentDecoder: every step of the
// cross-attention step form equals the batch type's output for that query
// over the same (padded) memory, float64: linear (elu, favor), full, and the
// generic form (exact-topk over all queries; clustered, which groups queries,
// against the batch type on the one query); the generic form keeps the batch
// module's parameter names. A RecurrentDecoder loaded with a batch
// TransformerDecoder's weights reproduces it at every position (full and
// causal-linear self-attention, full / linear / exact-topk cross-attention,
// pre- and post-norm, padded memory of another width). Bad inputs name the
// argument.
//
//   build/fastattn_tests --gtest_filter='RecurrentCross*:RecurrentDecoder*'
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>

#include "expect_error.h"
#include "fastattn/attention.h"
#include "fastattn/recurrent.h"
#include "fastattn/recurrent_transformer.h"
#include "fastattn/registry.h"
#include "fastattn/transformer.h"

namespace fastattn {
namespace {

using torch::Tensor;

struct CrossCase {
  std::string label, type;
  ParamMap params;
  bool per_query = false;  // batch rows depend on the other queries: compare with L = 1
};

std::vector<CrossCase> cross_cases() {
  return {
      {"linear_elu", "linear", {}},
      {"linear_favor", "linear", {{"feature_map", std::string("favor")}, {"seed", int64_t{4}}}},
      {"full", "full", {}},
      {"full_temp", "full", {{"softmax_temp", 0.4}}},
      {"exact_topk", "exact-topk", {{"topk", int64_t{3}}}},
      {"hard_retrieval", "hard-retrieval", {}},
      {"clustered",
       "clustered",
       {{"clusters", int64_t{2}}, {"bits", int64_t{16}}, {"seed", int64_t{1}}},
       true},
      {"conditional_full", "conditional-full:linear", {{"length_limit", int64_t{4}}}},
  };
}

class RecurrentCrossCases : public ::testing::TestWithParam<CrossCase> {};

TEST_P(RecurrentCrossCases, EveryStepEqualsTheBatchRow) {
  const auto c = GetParam();
  const int64_t N = 3, H = 2, L = 7, S = 13, E = 5, M = 3;
  torch::manual_seed(3);
  const auto q = torch::randn({N, H, L, E}, torch::kDouble);
  const auto k = torch::randn({N, H, S, E}, torch::kDouble);
  const auto v = torch::randn({N, H, S, M}, torch::kDouble);
  auto batch = make_attention(c.type, c.params, {H, E, M});
  batch->eval();
  auto rec = make_recurrent_cross_attention(c.type, c.params, {H, E, M});
  rec->eval();
  EXPECT_EQ(rec->type_name(), batch->type_name());
  for (const bool padded : {false, true}) {
    SCOPED_TRACE(padded ? "padded memory" : "full memory");
    std::optional<Tensor> lengths;
    Mask mask;
    if (padded) {
      lengths = torch::tensor({S, int64_t{6}, int64_t{1}});
      mask = mask.with_key_lengths(*lengths);
    }
    const auto memory = rec->prepare(k, v, lengths);
    const auto expected = c.per_query ? Tensor() : batch->forward(q, k, v, mask);  // (N, H, L, M)
    for (int64_t i = 0; i < L; ++i) {
      const auto row = c.per_query ? batch->forward(q.narrow(2, i, 1), k, v, mask).squeeze(2)
                                   : expected.select(2, i);
      const auto out = rec->step(q.select(2, i), memory);  // (N, H, M)
      ASSERT_EQ(out.sizes(), row.sizes());
      // float64; the linear forms sum the same S products in another order.
      EXPECT_LE((out - row).abs().max().item<double>(), 1e-11) << "query " << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Types, RecurrentCrossCases, ::testing::ValuesIn(cross_cases()),
                         [](const auto& info) { return info.param.label; });

// A memory without kept keys retrieves nothing (zeros, as the batch type).
TEST(RecurrentCross, HardRetrievalOverAnEmptyMemoryGivesZeros) {
  const int64_t N = 2, H = 2, S = 5, E = 3, M = 4;
  torch::manual_seed(8);
  const auto q = torch::randn({N, H, 1, E}), k = torch::randn({N, H, S, E}),
             v = torch::randn({N, H, S, M});
  const auto lengths = torch::tensor({int64_t{0}, int64_t{2}});
  auto batch = make_attention("hard-retrieval", {}, {H, E, M});
  batch->eval();
  const auto expected = batch->forward(q, k, v, Mask().with_key_lengths(lengths)).squeeze(2);
  auto rec = make_recurrent_cross_attention("hard-retrieval", {}, {H, E, M});
  const auto out = rec->step(q.squeeze(2), rec->prepare(k, v, lengths));
  EXPECT_TRUE(torch::equal(out, expected));
  EXPECT_TRUE(torch::equal(out[0], torch::zeros({H, M})));
  EXPECT_FALSE(torch::equal(out[1], torch::zeros({H, M})));
}

TEST(RecurrentCross, LinearStateShapesAndMemoryNotModified) {
  const int64_t N = 2, H = 3, S = 9, E = 4, M = 6;
  auto rec = make_recurrent_cross_attention("linear", {}, {H, E, M});
  const auto k = torch::randn({N, H, S, E}, torch::kDouble);
  const auto v = torch::randn({N, H, S, M}, torch::kDouble);
  const auto memory = rec->prepare(k, v, torch::tensor({9, 4}));
  ASSERT_EQ(memory.tensors.size(), 2u);
  EXPECT_EQ(memory.tensors[0].sizes(), (std::vector<int64_t>{N, H, E, M}));  // S, F = E (elu)
  EXPECT_EQ(memory.tensors[1].sizes(), (std::vector<int64_t>{N, H, E}));     // Z
  const auto S0 = memory.tensors[0].clone();
  const auto q = torch::randn({N, H, E}, torch::kDouble);
  EXPECT_TRUE(torch::equal(rec->step(q, memory), rec->step(q, memory)));
  EXPECT_TRUE(torch::equal(memory.tensors[0], S0));
}

TEST(RecurrentCross, GenericKeepsTheBatchParameterNames) {
  // A batch module with buffers (FAVOR+'s random matrix): the generic wrapper
  // registers them under the batch names, sharing the tensors.
  const ParamMap favor = {{"feature_map", std::string("favor")}, {"seed", int64_t{2}}};
  auto batch = make_attention("linear", favor, {2, 4, 4});
  RecurrentCrossGenericAttention generic(batch);
  auto names = [](const torch::OrderedDict<std::string, Tensor>& d) { return d.keys(); };
  EXPECT_FALSE(batch->named_buffers().is_empty());
  EXPECT_EQ(names(generic.named_buffers()), names(batch->named_buffers()));
  EXPECT_EQ(names(generic.named_parameters()), names(batch->named_parameters()));
  // The dedicated linear form has the same names too.
  auto dedicated = make_recurrent_cross_attention("linear", favor, {2, 4, 4});
  EXPECT_EQ(names(dedicated->named_buffers()), names(batch->named_buffers()));
  // The training flag follows the wrapper.
  generic.eval();
  const auto k = torch::randn({1, 2, 5, 4});
  auto mem = generic.prepare(k, k, std::nullopt);
  generic.step(torch::randn({1, 2, 4}), mem);
  EXPECT_FALSE(batch->is_training());
}

TEST(RecurrentCross, DedicatedStepFormsAreDeclaredInTheRegistry) {
  const auto& registry = AttentionRegistry::global();
  std::vector<std::string> dedicated;
  for (const auto& name : registry.names()) {
    const auto type = registry.get(name);
    if (!type.capabilities.bidirectional) continue;
    auto rec = make_recurrent_cross_attention(name, {}, {2, 4, 3});
    const bool generic = std::dynamic_pointer_cast<RecurrentCrossGenericAttention>(rec) != nullptr;
    EXPECT_EQ(generic, !type.recurrent_cross) << name;
    if (!generic) dedicated.push_back(name);
  }
  EXPECT_EQ(dedicated, (std::vector<std::string>{"full", "hard-retrieval", "linear"}));
  EXPECT_NE(std::dynamic_pointer_cast<RecurrentCrossLinearAttention>(
                make_recurrent_cross_attention("linear", {}, {2, 4, 3})),
            nullptr);
}

TEST(RecurrentCross, Errors) {
  auto lin = make_recurrent_cross_attention("linear", {}, {2, 4, 3});
  auto full = make_recurrent_cross_attention("full", {}, {2, 4, 3});
  auto topk = make_recurrent_cross_attention("exact-topk", {}, {2, 4, 3});
  const auto k = torch::randn({2, 2, 5, 4}, torch::kDouble);
  const auto v = torch::randn({2, 2, 5, 3}, torch::kDouble);
  for (auto* a : {lin.get(), full.get(), topk.get()}) {
    EXPECT_ERROR_CONTAINS(a->prepare(k.select(2, 0), v, std::nullopt),
                          "keys must have shape (N, H, S, E)", "[2, 2, 4]");
    EXPECT_ERROR_CONTAINS(a->prepare(k, v.narrow(2, 0, 4), std::nullopt),
                          "values must have shape (N, H, S, M) = (2, 2, 5, M)", "[2, 2, 4, 3]");
    EXPECT_ERROR_CONTAINS(a->prepare(k, v, torch::tensor({5, 6})),
                          "key_lengths must be in [0, S = 5]", "[5, 6]");
    EXPECT_ERROR_CONTAINS(a->prepare(k, v, torch::tensor({5})), "key_lengths must have shape (N,)");
    const auto memory = a->prepare(k, v, std::nullopt);
    EXPECT_ERROR_CONTAINS(a->step(torch::randn({2, 2, 4}, torch::kDouble).unsqueeze(2), memory),
                          "query must have shape (N, H, E)");
    EXPECT_ERROR_CONTAINS(a->step(torch::randn({2, 2, 4}), memory), "query must be Double",
                          "got Float");
  }
  EXPECT_ERROR_CONTAINS(make_recurrent_cross_attention("causal-linear"),
                        "make_recurrent_cross_attention", "causal type 'causal-linear'",
                        "use 'linear'");
  EXPECT_ERROR_CONTAINS(make_recurrent_cross_attention("nope"), "unknown attention type 'nope'");
  EXPECT_ERROR_CONTAINS(make_recurrent_cross_attention("full", {{"bogus", 1.0}}), "bogus");
}

// ---- RecurrentDecoder -------------------------------------------------------

struct DecoderCase {
  std::string self, cross;
};

class RecurrentDecoderCases : public ::testing::TestWithParam<DecoderCase> {};

TEST_P(RecurrentDecoderCases, TokenByTokenEqualsBatchDecoder) {
  const auto c = GetParam();
  const int64_t N = 3, L = 6, S = 9, D = 8, Dm = 6;
  for (const bool norm_first : {false, true}) {
    SCOPED_TRACE(c.self + " / " + c.cross + (norm_first ? " pre-norm" : " post-norm"));
    const auto builder = DecoderBuilder()
                             .layers(2)
                             .heads(2)
                             .d_model(D)
                             .memory_dimensions(Dm)
                             .feed_forward_dimensions(16)
                             .dropout(0.0)
                             .norm_first(norm_first)
                             .self_attention(c.self)
                             .cross_attention(c.cross);
    torch::manual_seed(2);
    auto batch = builder.build();
    batch->to(torch::kDouble);
    batch->eval();
    auto rnn = make_recurrent_decoder(builder);
    rnn->to(torch::kDouble);
    rnn->eval();
    EXPECT_EQ(rnn->named_parameters().keys(), batch->named_parameters().keys());
    copy_parameters(*rnn, *batch);

    const auto x = torch::randn({N, L, D}, torch::kDouble);
    const auto memory = torch::randn({N, S, Dm}, torch::kDouble);
    for (const bool padded : {false, true}) {
      const Mask memory_mask =
          padded ? Mask().with_key_lengths(torch::tensor({S, int64_t{5}, int64_t{2}})) : Mask();
      const auto expected = batch->forward(x, memory, Mask(), memory_mask);  // (N, L, D)
      auto state = rnn->prepare(memory, memory_mask);
      for (int64_t i = 0; i < L; ++i) {
        auto [y, next] = rnn->step(x.select(1, i), state);
        state = std::move(next);
        const double err = (y - expected.select(1, i)).abs().max().item<double>();
        EXPECT_LE(err, 1e-10) << "position " << i << (padded ? " (padded memory)" : "");
      }
      EXPECT_EQ(static_cast<int64_t>(state.self.size()), rnn->num_layers());
    }
    // One sequence (N = 1: the matrix-vector path of the step's linear layers).
    const auto expected1 = batch->forward(x.narrow(0, 1, 1), memory.narrow(0, 1, 1));
    auto state1 = rnn->prepare(memory.narrow(0, 1, 1), Mask());
    for (int64_t i = 0; i < L; ++i) {
      auto [y, next] = rnn->step(x.narrow(0, 1, 1).select(1, i), state1);
      state1 = std::move(next);
      EXPECT_LE((y - expected1.select(1, i)).abs().max().item<double>(), 1e-10)
          << "N = 1, position " << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Types, RecurrentDecoderCases,
                         ::testing::Values(DecoderCase{"full", "full"},
                                           DecoderCase{"full", "linear"},
                                           DecoderCase{"causal-linear", "full"},
                                           DecoderCase{"causal-linear", "linear"},
                                           DecoderCase{"causal-linear", "exact-topk"}),
                         [](const auto& info) {
                           std::string name = info.param.self + "_" + info.param.cross;
                           for (auto& ch : name) {
                             if (ch == '-') ch = '_';
                           }
                           return name;
                         });

TEST(RecurrentDecoder, Errors) {
  const auto base = DecoderBuilder().layers(2).heads(2).d_model(8).memory_dimensions(6);
  EXPECT_ERROR_CONTAINS(make_recurrent_decoder(DecoderBuilder(base).self_attention("linear")),
                        "causal-linear, full", "'linear'");
  EXPECT_ERROR_CONTAINS(
      make_recurrent_decoder(DecoderBuilder(base).cross_attention("causal-linear")), "causal type");
  auto rnn = make_recurrent_decoder(base);
  const auto memory = torch::randn({2, 5, 6});
  EXPECT_ERROR_CONTAINS(rnn->prepare(torch::randn({2, 5, 8})), "memory must have shape (N, S, 6)",
                        "[2, 5, 8]");
  EXPECT_ERROR_CONTAINS(rnn->prepare(memory, Mask::causal_mask()), "key_lengths only", "causal");
  EXPECT_ERROR_CONTAINS(
      rnn->prepare(memory, Mask().with_attn_mask(torch::ones({1, 5}, torch::kBool))),
      "key_lengths only", "attn_mask");
  auto state = rnn->prepare(memory);
  EXPECT_ERROR_CONTAINS(rnn->step(torch::randn({2, 7}), state), "x must have shape (N, 8)",
                        "[2, 7]");
  EXPECT_ERROR_CONTAINS(rnn->step(torch::randn({2, 8}), RecurrentDecoderState{}),
                        "state must come from prepare");
}

}  // namespace
}  // namespace fastattn
