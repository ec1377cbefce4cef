// Every registered type does what its registry entry declares, and nothing it
// does not: causal / bidirectional, attn_mask kinds, value width,
// incremental rows (L < S causal = the rows of the whole computation), step
// form, learned
// parameters, and the named twin of the other direction. A refusal counts
// only when its message names the refused argument (an error for another
// reason fails). A new type is held to its declaration here without a line
// of this file changing.
//
//   build/fastattn_tests --gtest_filter='*Capabilities*'
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <cctype>
#include <functional>
#include <string>

#include "fastattn/attention.h"
#include "fastattn/mask.h"
#include "fastattn/recurrent.h"
#include "fastattn/registry.h"

namespace fastattn {
namespace {

using torch::Tensor;

// Small parameters where the defaults are sized for long sequences.
ParamMap small_params(const AttentionType& type) {
  const ParamMap small = {{"clusters", int64_t{3}},
                          {"topk", int64_t{4}},
                          {"window", int64_t{4}},
                          {"bits", int64_t{16}},
                          {"chunk_size", int64_t{4}},
                          {"n_buckets", int64_t{2}},
                          {"stride", int64_t{4}},
                          {"seed", int64_t{0}},
                          // conditional-full: the inner type past 4 positions
                          {"length_limit", int64_t{4}}};
  ParamMap out;
  for (const auto& spec : type.params) {
    auto it = small.find(spec.name);
    if (it != small.end()) out.emplace(*it);
  }
  return out;
}

// Whether fn runs. A refusal must be the one expected: its message names
// `what` (the refused argument); an error for any other reason fails the
// test instead of passing for a refusal.
bool runs(const std::function<void()>& fn, const std::string& what) {
  try {
    fn();
    return true;
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    EXPECT_NE(msg.find(what), std::string::npos)
        << "refused, but not for \"" << what << "\": " << msg;
    return false;
  }
}

// Whether fn runs; a refusal must come from the declaration (check_declared):
// "<type>: <argument>: got ..., which <type> does not take (...)".
bool runs_as_declared(const std::function<void()>& fn, const std::string& type,
                      const std::string& argument) {
  try {
    fn();
    return true;
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    EXPECT_NE(msg.find(type + ": " + argument + ": got "), std::string::npos)
        << "not the declared refusal of \"" << argument << "\": " << msg;
    EXPECT_NE(msg.find("which " + type + " does not take ("), std::string::npos) << msg;
    return false;
  }
}

std::vector<std::string> every_type() {
  auto names = AttentionRegistry::global().names();
  names.push_back("conditional-full:linear");
  names.push_back("conditional-full:local");
  return names;
}

class DeclaredCapabilities : public ::testing::TestWithParam<std::string> {};

TEST_P(DeclaredCapabilities, AreWhatTheTypeDoes) {
  const std::string name = GetParam();
  const auto& registry = AttentionRegistry::global();
  const AttentionType type = registry.get(name);
  const auto& caps = type.capabilities;
  const ParamMap params = small_params(type);
  torch::manual_seed(0);
  const int64_t N = 2, H = 2, L = 12, E = 8;
  const Tensor q = torch::randn({N, H, L, E}), k = torch::randn({N, H, L, E}),
               v = torch::randn({N, H, L, E});
  auto attn = registry.build(name, params, {H, E, E});
  attn->eval();
  // A decorated type's refusals come from its inner type (past length_limit).
  const std::string refuser = name.substr(name.rfind(':') + 1);
  auto run = [&](const Tensor& qq, const Tensor& kk, const Tensor& vv, const Mask& mask) {
    return attn->forward(qq, kk, vv, mask);
  };

  EXPECT_EQ(runs_as_declared([&] { run(q, k, v, Mask::causal_mask()); }, refuser, "causal"),
            caps.causal)
      << "causal";
  EXPECT_EQ(runs_as_declared([&] { run(q, k, v, Mask::none()); }, refuser, "causal"),
            caps.bidirectional)
      << "bidirectional";
  const Mask base = caps.causal ? Mask::causal_mask() : Mask::none();
  const Tensor bool_mask = torch::rand({N, 1, L, L}) > 0.3;
  const Tensor float_mask = torch::randn({N, H, L, L});
  EXPECT_EQ(
      runs_as_declared([&] { run(q, k, v, base.with_attn_mask(bool_mask)); }, refuser, "attn_mask"),
      caps.attn_mask >= MaskKinds::Bool)
      << "bool attn_mask";
  EXPECT_EQ(runs_as_declared([&] { run(q, k, v, base.with_attn_mask(float_mask)); }, refuser,
                             "attn_mask"),
            caps.attn_mask == MaskKinds::Any)
      << "float attn_mask";
  EXPECT_TRUE(runs(
      [&] {
        run(q, k, v, base.with_key_lengths(torch::tensor({L, L - 4})));
      },
      "key_lengths"))
      << "key lengths";

  // Value width: the channelwise types (AFT) refuse values of another width.
  EXPECT_EQ(runs_as_declared([&] { run(q, k, v.narrow(3, 0, E / 2).contiguous(), base); }, refuser,
                             "values"),
            !caps.channelwise)
      << "values narrower than the keys (channelwise: " << caps.channelwise << ")";

  // Incremental rows: one query at position t over keys 0..t equals row t of
  // the causal batch (with the defaults: "stride" types need an explicit one).
  if (caps.causal) {
    const Tensor batch = run(q, k, v, Mask::causal_mask());
    bool equal_rows = true;
    for (int64_t t : {0, 5, 11}) {
      Tensor row;
      if (!runs(
              [&] {
                row = run(q.narrow(2, t, 1), k.narrow(2, 0, t + 1), v.narrow(2, 0, t + 1),
                          Mask::causal_mask());
              },
              "") ||
          (row.select(2, 0) - batch.select(2, t)).abs().max().item<double>() > 1e-5) {
        equal_rows = false;
        break;
      }
    }
    EXPECT_EQ(equal_rows, caps.incremental != IncrementalRows::No)
        << "incremental rows (" << to_string(caps.incremental) << ")";
  } else {
    EXPECT_EQ(caps.incremental, IncrementalRows::No);
  }

  // Step form.
  const bool recurrent = static_cast<bool>(type.recurrent);
  EXPECT_EQ(runs(
                [&] {
                  make_recurrent_attention(name, params, {H, E, E});
                },
                "recurrent"),
            recurrent);
  const auto& steps = recurrent_attention_names();
  EXPECT_EQ(std::count(steps.begin(), steps.end(), name), recurrent ? 1 : 0);

  // Learned parameters.
  EXPECT_EQ(!attn->parameters().empty(), caps.learned) << "learned parameters";

  // Twins: the named type exists and runs in the direction this one lacks.
  if (!caps.causal_form.empty()) {
    EXPECT_TRUE(registry.get(caps.causal_form).capabilities.causal) << caps.causal_form;
  }
  if (!caps.bidirectional_form.empty()) {
    EXPECT_TRUE(registry.get(caps.bidirectional_form).capabilities.bidirectional)
        << caps.bidirectional_form;
  }
  // They appear in describe(), which fastattn list and the Python bindings read.
  if (name.find(':') == std::string::npos) {
    const auto d = registry.describe();
    bool found = false;
    for (const auto& t : d["types"]) {
      if (t["name"] != name) continue;
      found = true;
      EXPECT_EQ(t["capabilities"]["causal"].get<bool>(), caps.causal);
      EXPECT_EQ(t["capabilities"]["recurrent"].get<bool>(), recurrent);
      EXPECT_EQ(t["capabilities"]["attn_mask"].get<std::string>(), to_string(caps.attn_mask));
      EXPECT_EQ(t["capabilities"]["incremental"].get<std::string>(), to_string(caps.incremental));
    }
    EXPECT_TRUE(found);
  }
}

INSTANTIATE_TEST_SUITE_P(EveryType, DeclaredCapabilities, ::testing::ValuesIn(every_type()),
                         [](const auto& info) {
                           std::string n = info.param;
                           for (auto& c : n)
                             if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
                           return n;
                         });

TEST(CapabilitiesRegistry, AddRefusesInconsistentDeclarations) {
  AttentionRegistry r;
  auto make = [](std::string name, Capabilities caps) {
    return AttentionType{
        std::move(name),
        "test",
        {},
        [](const Params&, const AttentionDims&) -> AttentionPtr { return nullptr; },
        std::move(caps),
        /*recurrent=*/nullptr};
  };
  auto neither = Capabilities().causal_only("");
  neither.causal = false;
  EXPECT_THROW(r.add(make("a", neither)), c10::Error);
  EXPECT_THROW(r.add(make("d", Capabilities().bidirectional_only("").rows(IncrementalRows::Yes))),
               c10::Error);
  r.add(make("e", Capabilities()));
  EXPECT_TRUE(r.contains("e"));
}

}  // namespace
}  // namespace fastattn
