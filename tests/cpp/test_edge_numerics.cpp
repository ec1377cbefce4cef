// Defined numerics at the edges, for every registered attention type (the
// registry is iterated) and every attention operator:
//   - a query whose keys are all masked (key_lengths = 0 for a batch element,
//     or an all-false attn_mask row) outputs zeros and gets finite gradients
//     (zero for the masked batch element), never NaN;
//   - scores |q·k| ~ 1e4 stay finite through the online softmax, and the
//     linear normalisers never divide by zero.
// The promises are listed in docs/reliability.md.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "attention_cases.h"
#include "fastattn/ops.h"
#include "fastattn/registry.h"

namespace fastattn {
namespace {

using torch::Tensor;

constexpr int64_t kN = 2, kH = 2, kL = 6, kE = 4, kM = 3;

const AttentionDims kDims = cases::dims(kH, kE, kM);

// Every registered type, the decorator, and the linear types with each of
// their feature maps.
std::vector<std::pair<std::string, ParamMap>> configurations() {
  std::vector<std::pair<std::string, ParamMap>> out;
  for (const auto& name : cases::registered_types()) {
    out.push_back({name, {}});
    for (const auto& s : AttentionRegistry::global().get(name).params) {
      if (s.name != "feature_map") continue;
      for (const auto& c : s.choices) {
        if (c != std::get<std::string>(*s.default_value)) out.push_back({name, {{s.name, c}}});
      }
    }
  }
  out.push_back({"conditional-full:linear", {}});
  return out;
}

std::string label(const std::pair<std::string, ParamMap>& c) {
  std::string s = c.first;
  for (const auto& [k, v] : c.second) s += " " + k + "=" + param_value_to_string(v);
  return s;
}

Mask base_mask(AttentionBase& a, int64_t M) {
  auto q = torch::randn({kN, kH, kL, kE}, torch::kDouble);
  try {
    a.forward(q, q, torch::randn({kN, kH, kL, M}, torch::kDouble), Mask());
    return Mask();
  } catch (const c10::Error&) {
    return Mask::causal_mask();
  }
}

struct Leaves {
  Tensor q, k, v;
};
Leaves leaves(double scale, uint64_t seed, int64_t M) {
  torch::manual_seed(seed);
  auto o = torch::TensorOptions().dtype(torch::kDouble);
  Leaves l{torch::randn({kN, kH, kL, kE}, o) * scale, torch::randn({kN, kH, kL, kE}, o) * scale,
           torch::randn({kN, kH, kL, M}, o)};
  for (auto* t : {&l.q, &l.k, &l.v}) t->requires_grad_(true);
  return l;
}

bool finite(const Tensor& t) { return !t.defined() || torch::isfinite(t).all().item<bool>(); }

TEST(EdgeNumerics, AllKeysMaskedByKeyLengthsGivesZerosAndZeroGradients) {
  for (const auto& c : configurations()) {
    auto a = cases::build_type(c.first, kDims, c.second);
    const int64_t M = cases::value_width(c.first, kE, kM);
    const Mask mask = base_mask(*a, M).with_key_lengths(torch::tensor({int64_t{0}, kL}));
    auto l = leaves(1.0, 1, M);
    Tensor out;
    try {
      out = a->forward(l.q, l.k, l.v, mask);
    } catch (const c10::Error& e) {
      ADD_FAILURE() << label(c) << ": " << e.what_without_backtrace();
      continue;
    }
    EXPECT_TRUE(finite(out)) << label(c);
    EXPECT_TRUE(torch::all(out[0] == 0).item<bool>()) << label(c) << "\n" << out[0];
    (out * torch::randn_like(out)).sum().backward();
    for (auto* t : {&l.q, &l.k, &l.v}) {
      if (!t->grad().defined()) continue;
      EXPECT_TRUE(finite(t->grad())) << label(c);
      EXPECT_TRUE(torch::all(t->grad()[0] == 0).item<bool>()) << label(c);
    }
  }
}

TEST(EdgeNumerics, AllFalseAttnMaskRowGivesZerosAndFiniteGradients) {
  int covered = 0;
  for (const auto& c : configurations()) {
    auto a = cases::build_type(c.first, kDims, c.second);
    const int64_t M = cases::value_width(c.first, kE, kM);
    const Mask base = base_mask(*a, M);
    auto keep = torch::ones({kL, kL}, torch::kBool);
    keep[kL - 1] = false;  // the last query keeps no key (causal keeps the rest nonempty)
    const Mask mask = base.with_attn_mask(keep);
    auto l = leaves(1.0, 2, M);
    Tensor out;
    try {
      out = a->forward(l.q, l.k, l.v, mask);
    } catch (const c10::Error& e) {
      // Types without attn_mask support must say so.
      EXPECT_NE(std::string(e.what_without_backtrace()).find("attn_mask"), std::string::npos)
          << label(c) << ": " << e.what_without_backtrace();
      continue;
    }
    ++covered;
    EXPECT_TRUE(finite(out)) << label(c);
    EXPECT_TRUE(torch::all(out.select(2, kL - 1) == 0).item<bool>()) << label(c);
    (out * torch::randn_like(out)).sum().backward();
    for (auto* t : {&l.q, &l.k, &l.v}) EXPECT_TRUE(finite(t->grad())) << label(c);
    EXPECT_TRUE(torch::all(l.q.grad().select(2, kL - 1) == 0).item<bool>()) << label(c);
  }
  EXPECT_GE(covered, 2);  // full and hard-retrieval at least
}

TEST(EdgeNumerics, LargeScoresStayFinite) {
  // Entries ~ 70: |q·k| ~ 70² · sqrt(E) ~ 1e4.
  for (const auto& c : configurations()) {
    auto a = cases::build_type(c.first, kDims, c.second);
    const int64_t M = cases::value_width(c.first, kE, kM);
    const Mask mask = base_mask(*a, M).with_key_lengths(torch::tensor({int64_t{3}, kL}));
    auto l = leaves(70.0, 3, M);
    Tensor out;
    try {
      out = a->forward(l.q, l.k, l.v, mask);
    } catch (const c10::Error& e) {
      ADD_FAILURE() << label(c) << ": " << e.what_without_backtrace();
      continue;
    }
    EXPECT_TRUE(finite(out)) << label(c);
    (out * torch::randn_like(out)).sum().backward();
    for (auto* t : {&l.q, &l.k, &l.v}) EXPECT_TRUE(finite(t->grad())) << label(c);
  }
}

// float32 too: the kernels' float accumulation must not overflow either.
TEST(EdgeNumerics, LargeScoresStayFiniteInFloat32) {
  for (const auto& c : configurations()) {
    auto a = cases::build_type(c.first, kDims, c.second);
    const int64_t M = cases::value_width(c.first, kE, kM);
    const Mask mask = base_mask(*a, M).with_key_lengths(torch::tensor({int64_t{3}, kL}));
    torch::manual_seed(4);
    auto q = torch::randn({kN, kH, kL, kE}) * 70, k = torch::randn({kN, kH, kL, kE}) * 70,
         v = torch::randn({kN, kH, kL, M});
    Tensor out;
    try {
      out = a->forward(q, k, v, mask);
    } catch (const c10::Error& e) {
      ADD_FAILURE() << label(c) << ": " << e.what_without_backtrace();
      continue;
    }
    EXPECT_TRUE(finite(out)) << label(c);
  }
}

// The operators directly: all-masked queries and huge scores.
TEST(EdgeNumerics, OperatorsAllMaskedAndLargeScores) {
  auto o = torch::TensorOptions().dtype(torch::kDouble);
  const auto kl = torch::tensor({int64_t{0}, kL});
  for (double scale : {1.0, 70.0}) {
    torch::manual_seed(6);
    auto q = (torch::randn({kN, kH, kL, kE}, o) * scale).requires_grad_(true);
    auto k = (torch::randn({kN, kH, kL, kE}, o) * scale).requires_grad_(true);
    auto v = torch::randn({kN, kH, kL, kM}, o).requires_grad_(true);
    auto topk = torch::randint(0, kL, {kN, kH, 2, 3}, torch::kLong);
    auto asg = torch::randint(0, 2, {kN, kH, kL}, torch::kLong);
    auto mass = torch::rand({kN, kH, 2}, o).requires_grad_(true);
    auto buckets = lsh_hash(q.detach(), torch::randn({2, kE, 2}, o));
    const std::vector<std::pair<std::string, std::function<Tensor()>>> calls = {
        {"full_attention", [&] { return full_attention(q, k, v, std::nullopt, kl); }},
        {"full_attention causal", [&] { return full_attention(q, k, v, std::nullopt, kl, true); }},
        {"full_attention_lse_topk",
         [&] { return std::get<0>(full_attention_lse_topk(q, k, v, kl, std::nullopt, 3)); }},
        {"elu_linear_attention", [&] { return elu_linear_attention(q, k, v, kl); }},
        {"elu_linear_attention causal", [&] { return elu_linear_attention(q, k, v, kl, true); }},
        {"hard_retrieval_attention",
         [&] { return std::get<0>(hard_retrieval_attention(q, k, v, std::nullopt, kl)); }},
        {"hard_retrieval_attention sample",
         [&] {
           return std::get<0>(
               hard_retrieval_attention(q, k, v, std::nullopt, kl, false, true, std::nullopt, 3));
         }},
        {"block_sparse_attention",
         [&] {
           return block_sparse_attention(q, k, v, "strided", {2, 0}, kl);
         }},
        {"clustered_topk_attention",
         [&] { return clustered_topk_attention(q, k, v, topk, mass, asg, kl, 0.5); }},
        {"reformer_attention", [&] { return reformer_attention(q, v, buckets, kl, 2); }},
    };
    for (const auto& [name, call] : calls) {
      for (auto* t : {&q, &k, &v, &mass}) t->mutable_grad() = Tensor();
      auto out = call();
      const std::string where = name + " scale " + std::to_string(scale);
      EXPECT_TRUE(finite(out)) << where;
      EXPECT_TRUE(torch::all(out[0] == 0).item<bool>()) << where;
      (out * torch::randn_like(out)).sum().backward();
      for (auto* t : {&q, &k, &v, &mass}) {
        if (!t->grad().defined()) continue;
        EXPECT_TRUE(finite(t->grad())) << where;
        EXPECT_TRUE(torch::all(t->grad()[0] == 0).item<bool>()) << where;
      }
    }
  }
}

// full_attention_lse_topk's lse: -inf for the element without keys, finite
// elsewhere even for huge scores; gradients through lse (nonzero weight on the
// -inf rows too) stay finite and are zero for the element without keys.
TEST(EdgeNumerics, LseTopkLseAllMaskedAndLargeScores) {
  auto o = torch::TensorOptions().dtype(torch::kDouble);
  const auto kl = torch::tensor({int64_t{0}, kL});
  for (double scale : {1.0, 70.0}) {
    for (auto dtype : {torch::kDouble, torch::kFloat}) {
      const std::string where =
          "scale " + std::to_string(scale) + (dtype == torch::kDouble ? " float64" : " float32");
      torch::manual_seed(8);
      auto q = (torch::randn({kN, kH, kL, kE}, o) * scale).to(dtype).requires_grad_(true);
      auto k = (torch::randn({kN, kH, kL, kE}, o) * scale).to(dtype).requires_grad_(true);
      auto v = torch::randn({kN, kH, kL, kM}, o).to(dtype).requires_grad_(true);
      auto [out, lse, idx] = full_attention_lse_topk(q, k, v, kl, std::nullopt, 2);
      EXPECT_TRUE(finite(out)) << where;
      EXPECT_TRUE(torch::all(out[0] == 0).item<bool>()) << where;
      EXPECT_TRUE(torch::all(lse[0].isinf() & lse[0].lt(0)).item<bool>()) << where;
      EXPECT_TRUE(finite(lse[1])) << where;
      EXPECT_TRUE(torch::all(idx.ge(0) & idx.lt(kL)).item<bool>()) << where;
      torch::autograd::backward({out, lse}, {torch::randn_like(out), torch::ones_like(lse)});
      for (auto* t : {&q, &k, &v}) {
        EXPECT_TRUE(finite(t->grad())) << where;
        EXPECT_TRUE(torch::all(t->grad()[0] == 0).item<bool>()) << where;
      }
    }
  }
}

}  // namespace
}  // namespace fastattn
