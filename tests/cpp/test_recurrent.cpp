// Recurrent (token-by-token) attention: every step of the recurrent
// causal-linear form equals the batch causal-linear output at that position
// (float64; elu and relu maps exactly, every random map within 1e-10
// relative, the exponential maps through their running key offset); the recurrent full form with a
// key/value cache equals batch full attention under a causal mask; state shapes; the state is an
// input, not modified; the fixed-size state stepped in place gives the same outputs and refuses a
// step past its capacity; bad inputs and names give errors naming the argument. RecurrentEncoder
// with a batch encoder's weights (copied by name) reproduces the causal batch encoder at every
// position (full and causal-linear, pre- and post-norm).
//
//   build/fastattn_tests --gtest_filter='*Recurrent*'
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <string>

#include "expect_error.h"
#include "fastattn/attention.h"
#include "fastattn/feature_maps.h"
#include "fastattn/recurrent.h"
#include "fastattn/recurrent_transformer.h"
#include "fastattn/transformer.h"
#include "fastattn/registry.h"

namespace fastattn {
namespace {

using torch::Tensor;

struct Shape {
  int64_t N, H, L, E, M;
};

std::string shape_name(const Shape& s) {
  return "N" + std::to_string(s.N) + "H" + std::to_string(s.H) + "L" + std::to_string(s.L) + "E" +
         std::to_string(s.E) + "M" + std::to_string(s.M);
}

const std::vector<Shape> kShapes = {
    {1, 1, 1, 4, 4}, {2, 3, 7, 5, 3}, {3, 2, 17, 8, 6}, {1, 4, 33, 3, 7}};

struct Qkv {
  Tensor q, k, v;  // (N, H, L, E), (N, H, L, E), (N, H, L, M)
};

Qkv random_qkv(const Shape& s, uint64_t seed) {
  torch::manual_seed(seed);
  return {torch::randn({s.N, s.H, s.L, s.E}, torch::kDouble),
          torch::randn({s.N, s.H, s.L, s.E}, torch::kDouble),
          torch::randn({s.N, s.H, s.L, s.M}, torch::kDouble)};
}

// Runs `attn` over positions 0..L-1 from an empty state: (N, H, L, M), and the
// final state in *final_state.
Tensor run_steps(RecurrentAttentionBase& attn, const Qkv& x, RecurrentState* final_state) {
  RecurrentState state;
  std::vector<Tensor> outs;
  for (int64_t i = 0; i < x.q.size(2); ++i) {
    auto [out, next] = attn.step(x.q.select(2, i), x.k.select(2, i), x.v.select(2, i), state);
    outs.push_back(out);
    state = std::move(next);
  }
  if (final_state) *final_state = state;
  return torch::stack(outs, 2);
}

// Largest |a - b| at each position l of (N, H, L, M), as a message on failure.
void expect_close_every_position(const Tensor& batch, const Tensor& steps, double tol) {
  ASSERT_EQ(batch.sizes(), steps.sizes());
  for (int64_t l = 0; l < batch.size(2); ++l) {
    const double err = (batch.select(2, l) - steps.select(2, l)).abs().max().item<double>();
    EXPECT_LE(err, tol) << "position " << l;
  }
}

// ---- causal-linear ----------------------------------------------------------

class RecurrentLinearCases : public ::testing::TestWithParam<std::tuple<std::string, Shape>> {};

TEST_P(RecurrentLinearCases, EveryStepEqualsBatchCausalLinear) {
  const auto& [map, s] = GetParam();
  auto batch = std::dynamic_pointer_cast<CausalLinearAttention>(
      make_attention("causal-linear", {{"feature_map", map}}, {s.H, s.E, s.M}));
  ASSERT_TRUE(batch);
  batch->eval();
  const auto x = random_qkv(s, 11);
  const auto expected = batch->forward(x.q, x.k, x.v, Mask::causal_mask());

  // Sharing the batch module's feature map, and built by name.
  RecurrentLinearAttention shared(batch->feature_map());
  auto by_name = make_recurrent_attention("causal-linear", {{"feature_map", map}}, {s.H, s.E, s.M});
  RecurrentState state;
  // float64: both forms sum the same L products, in different orders.
  expect_close_every_position(expected, run_steps(shared, x, &state), 1e-11);
  expect_close_every_position(expected, run_steps(*by_name, x, nullptr), 1e-11);

  ASSERT_EQ(state.tensors.size(), 2u);
  EXPECT_EQ(state.tensors[0].sizes(), (std::vector<int64_t>{s.N, s.H, s.E, s.M}));  // S, F = E
  EXPECT_EQ(state.tensors[1].sizes(), (std::vector<int64_t>{s.N, s.H, s.E}));       // Z
}

INSTANTIATE_TEST_SUITE_P(Maps, RecurrentLinearCases,
                         ::testing::Combine(::testing::Values(std::string("elu"),
                                                              std::string("relu")),
                                            ::testing::ValuesIn(kShapes)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_" +
                                  shape_name(std::get<1>(info.param));
                         });

// Every random feature map (issue 66): steps equal the batch form within 1e-6
// relative in float64, at a scale where the exponential maps' key offsets
// differ a lot between the prefix and the whole sequence (the batch form
// stabilises with the offset over all keys, the steps with a running one).
struct RandomMapCase {
  std::string name;
  ParamMap params;
};

std::vector<RandomMapCase> random_map_cases() {
  std::vector<RandomMapCase> cases;
  for (const std::string map : {"favor", "rff", "smoothed-rff"})
    cases.push_back({map, {{"feature_map", map}}});
  for (const auto& fn : kernel_function_names())
    cases.push_back(
        {"generalized_" + fn, {{"feature_map", std::string("generalized")}, {"kernel_fn", fn}}});
  for (auto& c : cases) {
    c.params["n_features"] = int64_t{c.name == "rff" || c.name == "smoothed-rff" ? 16 : 24};
    c.params["seed"] = int64_t{3};
    std::replace(c.name.begin(), c.name.end(), '-', '_');
  }
  return cases;
}

void PrintTo(const RandomMapCase& c, std::ostream* os) { *os << c.name; }

class RecurrentRandomMaps : public ::testing::TestWithParam<RandomMapCase> {};

// Steps against the batch form in `dtype`: max |step - batch| / (1 + max |batch|).
double step_batch_error(const ParamMap& params, torch::ScalarType dtype, double scale,
                        RecurrentState* final_state) {
  const Shape s{2, 3, 24, 6, 4};
  auto batch = make_attention("causal-linear", params, {s.H, s.E, s.M});
  batch->eval();
  auto rec = make_recurrent_attention("causal-linear", params, {s.H, s.E, s.M});
  rec->eval();
  auto x = random_qkv(s, 5);
  // Keys that grow along the sequence: the running offset is passed again
  // and again, so S and Z are rescaled many times.
  x.k = x.k * torch::linspace(0.2, 1.0, s.L, torch::kDouble).view({1, 1, s.L, 1}) * scale;
  x.q = x.q * scale;
  const Qkv in{x.q.to(dtype), x.k.to(dtype), x.v.to(dtype)};
  const auto want = batch->forward(in.q, in.k, in.v, Mask::causal_mask()).to(torch::kDouble);
  const auto got = run_steps(*rec, in, final_state).to(torch::kDouble);
  return (got - want).abs().max().item<double>() / (1.0 + want.abs().max().item<double>());
}

TEST_P(RecurrentRandomMaps, StepsEqualTheBatchForm) {
  const auto& c = GetParam();
  RecurrentState state;
  for (double scale : {1.0, 3.0}) {
    EXPECT_LE(step_batch_error(c.params, torch::kDouble, scale, &state), 1e-10)
        << "float64, scale " << scale;
    // Plain rff's normaliser comes near 0 (features of both signs): its
    // outputs are ill-conditioned, and only float64 compares meaningfully.
    if (c.name == "rff") continue;
    EXPECT_LE(step_batch_error(c.params, torch::kFloat, scale, nullptr), 2e-5)
        << "float32, scale " << scale;
    EXPECT_LE(step_batch_error(c.params, torch::kBFloat16, scale, nullptr), 5e-2)
        << "bfloat16, scale " << scale;
  }
  const int64_t F = c.name == "smoothed_rff" ? 17 : c.name == "rff" ? 16 : 24;
  const bool shifted = c.name == "favor" || c.name == "generalized_exp";
  ASSERT_EQ(state.tensors.size(), shifted ? 3u : 2u);
  EXPECT_EQ(state.tensors[0].sizes(), (std::vector<int64_t>{2, 3, F, 4}));
  EXPECT_EQ(state.tensors[1].sizes(), (std::vector<int64_t>{2, 3, F}));
  if (shifted) EXPECT_EQ(state.tensors[2].sizes(), (std::vector<int64_t>{2, 3}));
}

INSTANTIATE_TEST_SUITE_P(Maps, RecurrentRandomMaps, ::testing::ValuesIn(random_map_cases()),
                         [](const auto& info) { return info.param.name; });

TEST(RecurrentLinear, FavorOffsetIsTheRunningMaxAndRescalesTheSums) {
  // A key whose exponents dwarf the first's: the sums are rescaled to its
  // offset, and the first key's contribution survives (relative to it).
  const ParamMap params = {
      {"feature_map", std::string("favor")}, {"n_features", int64_t{8}}, {"seed", int64_t{1}}};
  auto rec = make_recurrent_attention("causal-linear", params, {1, 4, 2});
  rec->eval();
  auto fm = std::dynamic_pointer_cast<RecurrentLinearAttention>(rec)->feature_map();
  torch::manual_seed(2);
  auto q = torch::randn({1, 1, 4}, torch::kDouble), v0 = torch::randn({1, 1, 2}, torch::kDouble),
       v1 = torch::randn({1, 1, 2}, torch::kDouble);
  auto k0 = torch::randn({1, 1, 4}, torch::kDouble), k1 = 6 * k0 + 1;
  auto [o0, s0] = rec->step(q, k0, v0, RecurrentState{});
  auto [o1, s1] = rec->step(q, k1, v1, s0);
  const auto c0 = fm->map_keys(k0.unsqueeze(2)).offset.view({1, 1});
  const auto c1 = fm->map_keys(k1.unsqueeze(2)).offset.view({1, 1});
  EXPECT_TRUE(torch::allclose(s0.tensors[2], c0));
  EXPECT_TRUE(torch::allclose(s1.tensors[2], torch::maximum(c0, c1)));
  // The plain (unshifted) sums, times exp(-offset).
  auto phi = [&](const Tensor& k) { return fm->forward(k.unsqueeze(2)).squeeze(2); };
  auto Z = (phi(k0) + phi(k1)) * (-s1.tensors[2]).exp().unsqueeze(-1);
  EXPECT_LE((s1.tensors[1] - Z).abs().max().item<double>(),
            1e-12 * (1 + Z.abs().max().item<double>()));
  // The in-place state: three tensors, the offset -inf before the first key.
  auto st = rec->make_state(1, 1, 4, 2, 0, torch::kDouble);
  ASSERT_EQ(st.size(), 3u);
  EXPECT_TRUE(torch::isinf(st[2]).all().item<bool>());
  EXPECT_TRUE(torch::allclose(rec->step_in_place(q, k0, v0, st), o0, 0, 1e-14));
  EXPECT_TRUE(torch::allclose(rec->step_in_place(q, k1, v1, st), o1, 0, 1e-14));
  EXPECT_TRUE(torch::equal(st[2], s1.tensors[2]));
  // A state of the wrong size is named.
  EXPECT_ERROR_CONTAINS(rec->step(q, k1, v1, RecurrentState{{s0.tensors[0], s0.tensors[1]}}),
                        "offset (N, H)");
}

TEST(RecurrentLinear, StateIsAnInputNotModified) {
  const Shape s{2, 2, 3, 4, 5};
  auto rec = make_recurrent_attention("causal-linear", {}, {s.H, s.E, s.M});
  const auto x = random_qkv(s, 2);
  auto [o0, s1] = rec->step(x.q.select(2, 0), x.k.select(2, 0), x.v.select(2, 0), {});
  const auto S1 = s1.tensors[0].clone(), Z1 = s1.tensors[1].clone();
  auto [a, s2a] = rec->step(x.q.select(2, 1), x.k.select(2, 1), x.v.select(2, 1), s1);
  auto [b, s2b] = rec->step(x.q.select(2, 1), x.k.select(2, 1), x.v.select(2, 1), s1);
  EXPECT_TRUE(torch::equal(a, b));
  EXPECT_TRUE(torch::equal(s1.tensors[0], S1));
  EXPECT_TRUE(torch::equal(s1.tensors[1], Z1));
  EXPECT_EQ(rec->type_name(), "causal-linear");
}

// ---- full -------------------------------------------------------------------

class RecurrentFullCases : public ::testing::TestWithParam<Shape> {};

TEST_P(RecurrentFullCases, EveryStepEqualsBatchCausalFull) {
  const auto s = GetParam();
  for (const ParamMap& params : {ParamMap{}, ParamMap{{"softmax_temp", 0.3}}}) {
    auto batch = make_attention("full", params, {s.H, s.E, s.M});
    batch->eval();
    auto rec = make_recurrent_attention("full", params, {s.H, s.E, s.M});
    const auto x = random_qkv(s, 7);
    RecurrentState state;
    const auto steps = run_steps(*rec, x, &state);
    expect_close_every_position(batch->forward(x.q, x.k, x.v, Mask::causal_mask()), steps, 1e-12);
    // {K, V, K buffer, V buffer, filled}: K and V are views of the first L rows.
    ASSERT_EQ(state.tensors.size(), 5u);
    EXPECT_EQ(state.tensors[0].sizes(), (std::vector<int64_t>{s.N, s.H, s.L, s.E}));  // K
    EXPECT_EQ(state.tensors[1].sizes(), (std::vector<int64_t>{s.N, s.H, s.L, s.M}));  // V
    EXPECT_GE(state.tensors[2].size(2), s.L);
    EXPECT_EQ(state.tensors[4].item<int64_t>(), s.L);
  }
}

TEST(RecurrentFull, CacheGrowsInPlaceAndBranchesCopy) {
  const Shape s{2, 3, 40, 5, 4};
  auto rec = make_recurrent_attention("full", {}, {s.H, s.E, s.M});
  auto batch = make_attention("full", {}, {s.H, s.E, s.M});
  const auto x = random_qkv(s, 9);
  // 40 steps from an empty state: the buffer doubles (16, 34, 70 rows), the
  // outputs are the batch causal rows.
  RecurrentState state;
  const auto steps = run_steps(*rec, x, &state);
  expect_close_every_position(batch->forward(x.q, x.k, x.v, Mask::causal_mask()), steps, 1e-12);
  EXPECT_EQ(state.tensors[2].size(2), 70);

  // Branching: two different next tokens from the same state. The second
  // must not overwrite the row the first appended.
  auto step_at = [&](const RecurrentState& st, int64_t i) {
    return rec->step(x.q.select(2, i), x.k.select(2, i), x.v.select(2, i), st);
  };
  RecurrentState s10;
  for (int64_t i = 0; i < 10; ++i) s10 = step_at(s10, i).second;
  auto [a11, sa] = step_at(s10, 10);  // appends row 10 in place
  auto [b11, sb] = step_at(s10, 20);  // row 10 already taken: copies
  EXPECT_NE(sa.tensors[2].data_ptr(), sb.tensors[2].data_ptr());
  EXPECT_TRUE(torch::equal(sa.tensors[0].select(2, 10), x.k.select(2, 10)));
  EXPECT_TRUE(torch::equal(sb.tensors[0].select(2, 10), x.k.select(2, 20)));
  EXPECT_TRUE(torch::equal(s10.tensors[0], x.k.narrow(2, 0, 10)));
  // Continuing the first branch still sees its own row 10.
  auto [a12, sa2] = step_at(sa, 11);
  auto ref = batch->forward(x.q.narrow(2, 0, 12), x.k.narrow(2, 0, 12), x.v.narrow(2, 0, 12),
                            Mask::causal_mask());
  EXPECT_LE((a12 - ref.select(2, 11)).abs().max().item<double>(), 1e-12);

  // A cache the caller built ({K, V} only, e.g. a prefill) is copied once,
  // into buffers of exactly one more row (the attention_step operator's
  // compact state), which share nothing with it.
  RecurrentState prefill{{x.k.narrow(2, 0, 30), x.v.narrow(2, 0, 30)}};
  auto [o30, s31] = step_at(prefill, 30);
  EXPECT_LE((o30 - steps.select(2, 30)).abs().max().item<double>(), 1e-12);
  ASSERT_EQ(s31.tensors.size(), 5u);
  EXPECT_EQ(s31.tensors[2].size(2), 31);
  EXPECT_FALSE(s31.tensors[2].is_alias_of(x.k));
  EXPECT_TRUE(torch::equal(prefill.tensors[0], x.k.narrow(2, 0, 30)));
}

// ---- fixed-size state, stepped in place -------------------------------------

class RecurrentInPlaceCases : public ::testing::TestWithParam<std::string> {};

TEST_P(RecurrentInPlaceCases, EqualsStepAndUpdatesTheSameTensors) {
  const Shape s{2, 3, 11, 5, 4};
  const std::string type = GetParam();
  auto rec = make_recurrent_attention(type, {}, {s.H, s.E, s.M});
  const auto x = random_qkv(s, 21);
  const auto steps = run_steps(*rec, x, nullptr);
  auto state = rec->make_state(s.N, s.H, s.E, s.M, s.L, torch::kDouble);
  std::vector<void*> where;
  for (const auto& t : state) where.push_back(t.data_ptr());
  for (int64_t i = 0; i < s.L; ++i) {
    auto out = rec->step_in_place(x.q.select(2, i), x.k.select(2, i), x.v.select(2, i), state);
    EXPECT_LE((out - steps.select(2, i)).abs().max().item<double>(), 1e-12) << "position " << i;
  }
  for (size_t j = 0; j < state.size(); ++j) EXPECT_EQ(state[j].data_ptr(), where[j]);
  if (type == "causal-linear") return;  // constant size: no capacity
  EXPECT_EQ(state[2].item<int64_t>(), s.L);
  // Full: the error names the capacity; nothing is written.
  const auto before = state[0].clone();
  EXPECT_ERROR_CONTAINS(
      rec->step_in_place(x.q.select(2, 0), x.k.select(2, 0), x.v.select(2, 0), state),
      "the state is full: it holds 11 positions");
  EXPECT_TRUE(torch::equal(state[0], before));
  // Reset: the fill count back to 0 starts a new sequence in the same buffers.
  state[2].fill_(0);
  auto out = rec->step_in_place(x.q.select(2, 0), x.k.select(2, 0), x.v.select(2, 0), state);
  EXPECT_LE((out - steps.select(2, 0)).abs().max().item<double>(), 1e-12);
  EXPECT_THROW(rec->make_state(1, 1, s.E, s.M, 0, torch::kDouble), c10::Error);
}

INSTANTIATE_TEST_SUITE_P(Types, RecurrentInPlaceCases,
                         ::testing::Values("causal-linear", "full", "hard-retrieval"),
                         [](const auto& info) {
                           std::string n = info.param;
                           std::replace(n.begin(), n.end(), '-', '_');
                           return n;
                         });

INSTANTIATE_TEST_SUITE_P(Shapes, RecurrentFullCases, ::testing::ValuesIn(kShapes),
                         [](const auto& info) { return shape_name(info.param); });

// ---- errors -----------------------------------------------------------------

TEST(RecurrentErrors, BadInputsNameTheArgument) {
  auto lin = make_recurrent_attention("causal-linear", {}, {2, 4, 3});
  auto full = make_recurrent_attention("full", {}, {2, 4, 3});
  const auto q = torch::randn({2, 2, 4}, torch::kDouble);
  const auto v = torch::randn({2, 2, 3}, torch::kDouble);
  for (auto* a : {lin.get(), full.get()}) {
    EXPECT_ERROR_CONTAINS(a->step(q.unsqueeze(2), q, v, {}), "query must have shape (N, H, E)",
                          "[2, 2, 1, 4]");
    EXPECT_ERROR_CONTAINS(a->step(q, q.narrow(2, 0, 3), v, {}), "key must have shape", "(2, 2, 4)",
                          "[2, 2, 3]");
    EXPECT_ERROR_CONTAINS(a->step(q, q, v.narrow(0, 0, 1), {}), "value must have shape",
                          "[1, 2, 3]");
    EXPECT_ERROR_CONTAINS(a->step(q, q.to(torch::kFloat), v, {}), "key must be Double",
                          "got Float");
    EXPECT_ERROR_CONTAINS(a->step(q, q, v, RecurrentState{{v}}), "state must be empty or hold",
                          "got 1 tensors");
  }
  auto [o, state] = lin->step(q, q, v, {});
  EXPECT_ERROR_CONTAINS(
      lin->step(q, q, v, RecurrentState{{state.tensors[0].narrow(2, 0, 2), state.tensors[1]}}),
      "state S must have shape", "[2, 2, 4, 3]", "[2, 2, 2, 3]");
  EXPECT_ERROR_CONTAINS(
      lin->step(q, q, v, RecurrentState{{state.tensors[0], state.tensors[1].to(torch::kFloat)}}),
      "state Z must be Double", "got Float");
  auto [o2, cache] = full->step(q, q, v, {});
  EXPECT_ERROR_CONTAINS(
      full->step(q, q, v, RecurrentState{{cache.tensors[0], cache.tensors[1].narrow(3, 0, 2)}}),
      "state V must have shape", "[2, 2, 1, 3]", "[2, 2, 1, 2]");
}

TEST(RecurrentErrors, UnsupportedNameListsTheSupported) {
  EXPECT_ERROR_CONTAINS(make_recurrent_attention("linear"), "make_recurrent_attention",
                        "causal-linear, full", "got 'linear'");
  // Parameters are validated against the batch type's specs.
  EXPECT_ERROR_CONTAINS(make_recurrent_attention("full", {{"bogus", 1.0}}), "bogus");
  EXPECT_ERROR_CONTAINS(make_recurrent_attention("causal-linear", {{"eps", -1.0}}), "eps");
}

// ---- RecurrentEncoder -------------------------------------------------------

TEST(RecurrentEncoder, TokenByTokenEqualsCausalBatchEncoder) {
  const int64_t L = 7, D = 8;
  // N = 1 takes the matrix-vector path of the step's linear layers.
  for (const int64_t N : {int64_t{1}, int64_t{2}}) {
    for (const std::string type : {"full", "causal-linear"}) {
      for (const bool norm_first : {false, true}) {
        SCOPED_TRACE(type + (norm_first ? " pre-norm" : " post-norm") + " N=" + std::to_string(N));
        const auto builder = EncoderBuilder()
                                 .layers(2)
                                 .heads(2)
                                 .d_model(D)
                                 .feed_forward_dimensions(16)
                                 .dropout(0.0)
                                 .norm_first(norm_first)
                                 .attention(type);
        torch::manual_seed(1);
        auto batch = builder.build();
        batch->to(torch::kDouble);
        batch->eval();
        auto rnn = make_recurrent_encoder(builder);
        rnn->to(torch::kDouble);
        rnn->eval();
        // Same parameter names, so the batch weights load by name.
        EXPECT_EQ(rnn->named_parameters().keys(), batch->named_parameters().keys());
        copy_parameters(*rnn, *batch);

        const auto x = torch::randn({N, L, D}, torch::kDouble);
        const auto expected = batch->forward(x, Mask::causal_mask());  // (N, L, D)
        std::vector<RecurrentState> state;
        for (int64_t i = 0; i < L; ++i) {
          auto [y, next] = rnn->step(x.select(1, i), state);
          state = std::move(next);
          const double err = (y - expected.select(1, i)).abs().max().item<double>();
          EXPECT_LE(err, 1e-10) << "position " << i;
        }
        EXPECT_EQ(static_cast<int64_t>(state.size()), rnn->num_layers());
      }
    }
  }
}

TEST(RecurrentEncoder, Errors) {
  const auto builder = EncoderBuilder().layers(1).heads(2).d_model(8).attention("linear");
  EXPECT_ERROR_CONTAINS(make_recurrent_encoder(builder), "causal-linear, full", "'linear'");
  auto rnn = make_recurrent_encoder(EncoderBuilder().layers(2).heads(2).d_model(8));
  EXPECT_ERROR_CONTAINS(rnn->step(torch::randn({2, 7}), {}), "x must have shape (N, 8)", "[2, 7]");
  EXPECT_ERROR_CONTAINS(rnn->step(torch::randn({2, 8}), std::vector<RecurrentState>(1)),
                        "one state per layer (2)", "got 1");
  auto small = make_recurrent_encoder(EncoderBuilder().layers(1).heads(2).d_model(8));
  EXPECT_ERROR_CONTAINS(copy_parameters(*small, *rnn), "copy_parameters");
}

}  // namespace
}  // namespace fastattn
