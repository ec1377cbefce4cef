// Table-driven bad-input tests for every public operator (include/fastattn/ops.h)
// and every registered attention type (the registry is iterated, so a new type
// is covered as soon as it registers): wrong ranks, N/H/E disagreement between
// q and k, S disagreement between k and v, mask shapes and dtypes, dtype
// mismatches, parameter ranges. Every error must name the argument. Also:
// non-contiguous inputs give the contiguous result, and empty inputs
// (N = 0, L = 0, S = 0) give an empty (or, for S = 0, all-zero) result.
// The promises are listed in docs/reliability.md.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cctype>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "attention_cases.h"
#include "expect_error.h"
#include "fastattn/ops.h"
#include "fastattn/registry.h"

namespace fastattn {
namespace {

using torch::Tensor;

// True when `name` occurs in `message` as a whole word (not inside another
// identifier): "q" matches "q must ..." but not "queries".
bool names_word(const std::string& message, const std::string& name) {
  auto is_id = [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; };
  for (size_t pos = message.find(name); pos != std::string::npos;
       pos = message.find(name, pos + 1)) {
    const bool left = pos == 0 || !is_id(message[pos - 1]);
    const size_t end = pos + name.size();
    const bool right = end >= message.size() || !is_id(message[end]);
    if (left && right) return true;
  }
  return false;
}

// Runs `f`; expects a c10::Error whose message names `arg` as a word.
::testing::AssertionResult raises_naming(const std::function<void()>& f, const std::string& arg) {
  try {
    f();
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    if (names_word(msg, arg)) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << "the error does not name '" << arg << "': " << msg;
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure() << "not a c10::Error: " << e.what();
  }
  return ::testing::AssertionFailure() << "no error raised (expected one naming '" << arg << "')";
}

constexpr int64_t kN = 2, kH = 2, kL = 5, kS = 7, kE = 4, kM = 3;

// Inputs of a q/k/v operator call.
struct Inputs {
  Tensor q, k, v;
  std::optional<Tensor> key_lengths;
  std::optional<Tensor> attn_mask;
};

Inputs make_inputs(int64_t N, int64_t H, int64_t L, int64_t S, torch::ScalarType dtype,
                   uint64_t seed = 0, int64_t M = kM) {
  torch::manual_seed(seed);
  auto o = torch::TensorOptions().dtype(dtype);
  Inputs in;
  in.q = torch::randn({N, H, L, kE}, o);
  in.k = torch::randn({N, H, S, kE}, o);
  in.v = torch::randn({N, H, S, M}, o);
  return in;
}

// A q/k/v operator of ops.h as a uniform call.
struct QkvOp {
  std::string name;
  std::function<Tensor(const Inputs&)> call;
  bool same_length = false;  // needs S == L
  bool key_lengths = true;   // takes key_lengths
  bool attn_mask = false;    // takes attn_mask
};

// clustered_topk_attention's extra inputs, sized from q and k where they are
// well formed (the table below mutates q, k and v).
Tensor clustered_topk_call(const Inputs& in) {
  const bool qok = in.q.defined() && in.q.dim() == 4;
  const int64_t N = qok ? in.q.size(0) : kN, H = qok ? in.q.size(1) : kH,
                L = qok ? in.q.size(2) : kL;
  const int64_t S = in.k.defined() && in.k.dim() == 4 ? in.k.size(2) : kS;
  const int64_t C = 2, K = std::min<int64_t>(3, S);
  auto gen_opts = torch::TensorOptions().dtype(torch::kLong);
  auto topk =
      S > 0 ? torch::randint(0, S, {N, H, C, K}, gen_opts) : torch::empty({N, H, C, 0}, gen_opts);
  auto dtype = in.q.defined() && in.q.is_floating_point() ? in.q.scalar_type() : torch::kDouble;
  auto mass = torch::rand({N, H, C}, torch::TensorOptions().dtype(dtype));
  auto assignments = torch::randint(0, C, {N, H, L}, gen_opts);
  return clustered_topk_attention(in.q, in.k, in.v, topk, mass, assignments, in.key_lengths, 0.5);
}

// full_attention_lse_topk's out, with topk = min(3, S) where k is well formed.
Tensor lse_topk_call(const Inputs& in) {
  const int64_t S = in.k.defined() && in.k.dim() == 4 ? in.k.size(2) : kS;
  return std::get<0>(full_attention_lse_topk(in.q, in.k, in.v, in.key_lengths, std::nullopt,
                                             std::min<int64_t>(3, S)));
}

std::vector<QkvOp> qkv_ops() {
  return {
      {"full_attention",
       [](const Inputs& in) {
         return full_attention(in.q, in.k, in.v, in.attn_mask, in.key_lengths);
       },
       false, true, true},
      {"full_attention causal",
       [](const Inputs& in) {
         return full_attention(in.q, in.k, in.v, in.attn_mask, in.key_lengths, true);
       },
       false, true, true},
      {"causal_linear_product",
       [](const Inputs& in) { return causal_linear_product(in.q, in.k, in.v); }, true, false,
       false},
      {"elu_linear_attention",
       [](const Inputs& in) { return elu_linear_attention(in.q, in.k, in.v, in.key_lengths); },
       false, true, false},
      {"elu_linear_attention causal",
       [](const Inputs& in) {
         return elu_linear_attention(in.q, in.k, in.v, in.key_lengths, true);
       },
       true, true, false},
      {"clustered_topk_attention", clustered_topk_call, false, true, false},
      {"hard_retrieval_attention",
       [](const Inputs& in) {
         return std::get<0>(
             hard_retrieval_attention(in.q, in.k, in.v, in.attn_mask, in.key_lengths));
       },
       false, true, true},
      {"hard_retrieval_attention sample",
       [](const Inputs& in) {
         return std::get<0>(hard_retrieval_attention(in.q, in.k, in.v, in.attn_mask, in.key_lengths,
                                                     true, true, 1.0, 7));
       },
       false, true, true},
      {"block_sparse_attention local",
       [](const Inputs& in) {
         return block_sparse_attention(in.q, in.k, in.v, "local", {3}, in.key_lengths);
       },
       false, true, false},
      {"block_sparse_attention strided causal",
       [](const Inputs& in) {
         return block_sparse_attention(in.q, in.k, in.v, "strided", {2, 0}, in.key_lengths, true);
       },
       false, true, false},
      {"block_sparse_attention fixed",
       [](const Inputs& in) {
         return block_sparse_attention(in.q, in.k, in.v, "fixed", {3, 1, 0, 0}, in.key_lengths);
       },
       false, true, false},
      {"full_attention_lse_topk", lse_topk_call, false, true, false},
  };
}

// A mutation of valid inputs and the argument its error must name.
struct Mutation {
  std::string what;
  std::string arg;
  std::function<void(Inputs&)> apply;
  bool needs_key_lengths = false;
  bool needs_attn_mask = false;
};

std::vector<Mutation> qkv_mutations() {
  auto dbl = torch::TensorOptions().dtype(torch::kDouble);
  auto lng = torch::TensorOptions().dtype(torch::kLong);
  return {
      {"q undefined", "q", [](Inputs& in) { in.q = Tensor(); }},
      {"q rank 3", "q", [](Inputs& in) { in.q = in.q[0]; }},
      {"q rank 5", "q", [](Inputs& in) { in.q = in.q.unsqueeze(0); }},
      {"k rank 3", "k", [](Inputs& in) { in.k = in.k[0]; }},
      {"v rank 3", "v", [](Inputs& in) { in.v = in.v[0]; }},
      {"k batch N", "k",
       [](Inputs& in) {
         in.k = torch::cat({in.k, in.k}, 0);
       }},
      {"k heads H", "k",
       [](Inputs& in) {
         in.k = torch::cat({in.k, in.k}, 1);
       }},
      {"k head dim E", "k",
       [](Inputs& in) {
         in.k = torch::cat({in.k, in.k}, 3);
       }},
      {"v length S", "v",
       [](Inputs& in) {
         in.v = torch::cat({in.v, in.v}, 2);
       }},
      {"v batch N", "v",
       [](Inputs& in) {
         in.v = torch::cat({in.v, in.v}, 0);
       }},
      {"v heads H", "v",
       [](Inputs& in) {
         in.v = torch::cat({in.v, in.v}, 1);
       }},
      {"q integer", "q", [](Inputs& in) { in.q = in.q.to(torch::kLong); }},
      {"q float16", "q", [](Inputs& in) { in.q = in.q.to(torch::kHalf); }},
      {"k float32", "k", [](Inputs& in) { in.k = in.k.to(torch::kFloat); }},
      {"v float32", "v", [](Inputs& in) { in.v = in.v.to(torch::kFloat); }},
      {"q head dim 0", "q",
       [](Inputs& in) {
         in.q = in.q.narrow(3, 0, 0);
         in.k = in.k.narrow(3, 0, 0);
       }},
      {"key_lengths floating", "key_lengths",
       [=](Inputs& in) { in.key_lengths = torch::full({in.q.size(0)}, 2.0, dbl); }, true},
      {"key_lengths bool", "key_lengths",
       [](Inputs& in) { in.key_lengths = torch::ones({in.q.size(0)}, torch::kBool); }, true},
      {"key_lengths (N+1,)", "key_lengths",
       [=](Inputs& in) { in.key_lengths = torch::full({in.q.size(0) + 1}, 2, lng); }, true},
      {"key_lengths (N, 1)", "key_lengths",
       [=](Inputs& in) {
         in.key_lengths = torch::full({in.q.size(0), 1}, 2, lng);
       },
       true},
      {"key_lengths > S", "key_lengths",
       [=](Inputs& in) { in.key_lengths = torch::full({in.q.size(0)}, in.k.size(2) + 1, lng); },
       true},
      {"key_lengths < 0", "key_lengths",
       [=](Inputs& in) { in.key_lengths = torch::full({in.q.size(0)}, -1, lng); }, true},
      {"attn_mask (L, S+1)", "attn_mask",
       [](Inputs& in) {
         in.attn_mask = torch::ones({in.q.size(2), in.k.size(2) + 1}, torch::kBool);
       },
       false, true},
      {"attn_mask (L+1, S)", "attn_mask",
       [](Inputs& in) {
         in.attn_mask = torch::ones({in.q.size(2) + 1, in.k.size(2)}, torch::kBool);
       },
       false, true},
      {"attn_mask (N+1, L, S)", "attn_mask",
       [](Inputs& in) {
         in.attn_mask = torch::ones({in.q.size(0) + 1, in.q.size(2), in.k.size(2)}, torch::kBool);
       },
       false, true},
      {"attn_mask (N, H+1, L, S)", "attn_mask",
       [](Inputs& in) {
         in.attn_mask = torch::ones({in.q.size(0), in.q.size(1) + 1, in.q.size(2), in.k.size(2)},
                                    torch::kBool);
       },
       false, true},
      {"attn_mask rank 1", "attn_mask",
       [](Inputs& in) { in.attn_mask = torch::ones({in.k.size(2)}, torch::kBool); }, false, true},
      {"attn_mask integer", "attn_mask",
       [](Inputs& in) {
         in.attn_mask = torch::ones({in.q.size(2), in.k.size(2)}, torch::kLong);
       },
       false, true},
  };
}

TEST(Validation, QkvOpsRejectBadInputsNamingTheArgument) {
  int checked = 0;
  for (const auto& op : qkv_ops()) {
    for (const auto& mut : qkv_mutations()) {
      if (mut.needs_key_lengths && !op.key_lengths) continue;
      if (mut.needs_attn_mask && !op.attn_mask) continue;
      auto in = make_inputs(kN, kH, kL, op.same_length ? kL : kS, torch::kDouble);
      ASSERT_NO_THROW(op.call(in)) << op.name << " rejects valid inputs";
      mut.apply(in);
      EXPECT_TRUE(raises_naming([&] { op.call(in); }, mut.arg)) << op.name << ": " << mut.what;
      ++checked;
    }
  }
  EXPECT_GT(checked, 200);
}

TEST(Validation, OpsNeedingEqualLengthsSayWhy) {
  for (const auto& op : qkv_ops()) {
    if (!op.same_length) continue;
    auto in = make_inputs(kN, kH, kL, kS, torch::kDouble);
    EXPECT_TRUE(raises_naming([&] { op.call(in); }, "k")) << op.name;
  }
}

// Per-op parameter and auxiliary-tensor checks.
struct Case {
  std::string what;
  std::string arg;
  std::function<void()> call;
};

std::vector<Case> op_parameter_cases() {
  auto d = torch::TensorOptions().dtype(torch::kDouble);
  auto lng = torch::TensorOptions().dtype(torch::kLong);
  auto q = torch::randn({kN, kH, kL, kE}, d), k = torch::randn({kN, kH, kS, kE}, d),
       v = torch::randn({kN, kH, kS, kM}, d);
  auto vl = torch::randn({kN, kH, kL, kM}, d);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  auto planes = [&](int64_t B, int64_t cols) { return torch::randn({B, cols}, d); };
  auto codes = hash_queries(q, planes(8, kE + 1));
  auto rot = torch::randn({2, kE, 4}, d);
  auto buckets = lsh_hash(q, rot);
  auto idx = torch::randint(-1, kL, {kN, 6}, lng);
  // clustered_topk_attention pieces (C = 2 clusters, K = 3 keys).
  auto topk = torch::randint(0, kS, {kN, kH, 2, 3}, lng);
  auto mass = torch::rand({kN, kH, 2}, d);
  auto asg = torch::randint(0, 2, {kN, kH, kL}, lng);
  auto ct = [=](Tensor tk, Tensor ms, Tensor as, double temp = 0.5) {
    clustered_topk_attention(q, k, v, tk, ms, as, std::nullopt, temp);
  };
  return {
      // full_attention
      {"full softmax_temp 0", "softmax_temp",
       [=] { full_attention(q, k, v, std::nullopt, std::nullopt, false, 0.0); }},
      {"full softmax_temp -1", "softmax_temp",
       [=] { full_attention(q, k, v, std::nullopt, std::nullopt, false, -1.0); }},
      {"full softmax_temp nan", "softmax_temp",
       [=] { full_attention(q, k, v, std::nullopt, std::nullopt, false, nan); }},
      // full_attention_lse_topk
      {"lse_topk topk -1", "topk",
       [=] { full_attention_lse_topk(q, k, v, std::nullopt, std::nullopt, -1); }},
      {"lse_topk topk S+1", "topk",
       [=] { full_attention_lse_topk(q, k, v, std::nullopt, std::nullopt, kS + 1); }},
      {"lse_topk softmax_temp 0", "softmax_temp",
       [=] { full_attention_lse_topk(q, k, v, std::nullopt, 0.0, 1); }},
      {"lse_topk softmax_temp nan", "softmax_temp",
       [=] { full_attention_lse_topk(q, k, v, std::nullopt, nan, 1); }},
      {"lse_topk k undefined", "k",
       [=] { full_attention_lse_topk(q, Tensor(), v, std::nullopt, std::nullopt, 1); }},
      // causal_linear_product
      {"causal_linear_product S != L", "k", [=] { causal_linear_product(q, k, v); }},
      // elu_linear_attention
      {"elu_linear eps 0", "eps", [=] { elu_linear_attention(q, k, v, std::nullopt, false, 0.0); }},
      {"elu_linear eps nan", "eps",
       [=] { elu_linear_attention(q, k, v, std::nullopt, false, nan); }},
      {"elu_linear causal S != L", "causal",
       [=] { elu_linear_attention(q, k, v, std::nullopt, true); }},
      // elu_feature_map
      {"elu_feature_map integer", "x", [] { elu_feature_map(torch::ones({3}, torch::kLong)); }},
      {"elu_feature_map undefined", "x", [] { elu_feature_map(Tensor()); }},
      // hash_queries
      {"hash x rank 3", "x", [=] { hash_queries(q[0], planes(8, kE + 1)); }},
      {"hash x integer", "x", [=] { hash_queries(q.to(torch::kLong), planes(8, kE + 1)); }},
      {"hash bits 0", "planes", [=] { hash_queries(q, planes(0, kE + 1)); }},
      {"hash bits 65", "planes", [=] { hash_queries(q, planes(65, kE + 1)); }},
      {"hash planes E columns", "planes", [=] { hash_queries(q, planes(8, kE)); }},
      {"hash planes rank 3", "planes",
       [=] {
         hash_queries(q, torch::randn({1, 8, kE + 1}, d));
       }},
      {"hash planes float32", "planes",
       [=] { hash_queries(q, planes(8, kE + 1).to(torch::kFloat)); }},
      // cluster_codes
      {"cluster clusters 0", "clusters", [=] { cluster_codes(codes, std::nullopt, 0, 3, 0); }},
      {"cluster clusters -3", "clusters", [=] { cluster_codes(codes, std::nullopt, -3, 3, 0); }},
      {"cluster iterations -1", "iterations",
       [=] { cluster_codes(codes, std::nullopt, 2, -1, 0); }},
      {"cluster codes float", "codes",
       [=] { cluster_codes(codes.to(torch::kDouble), std::nullopt, 2, 3, 0); }},
      {"cluster codes rank 4", "codes",
       [=] { cluster_codes(codes.unsqueeze(0), std::nullopt, 2, 3, 0); }},
      {"cluster lengths (N+1,)", "lengths",
       [=] { cluster_codes(codes, torch::full({kN + 1}, 2, lng), 2, 3, 0); }},
      {"cluster lengths > L", "lengths",
       [=] { cluster_codes(codes, torch::full({kN}, kL + 1, lng), 2, 3, 0); }},
      {"cluster lengths < 0", "lengths",
       [=] { cluster_codes(codes, torch::full({kN}, -1, lng), 2, 3, 0); }},
      {"cluster lengths float", "lengths",
       [=] { cluster_codes(codes, torch::full({kN}, 2.0, d), 2, 3, 0); }},
      // clustered_topk_attention
      {"topk index >= S", "topk", [=] { ct(topk + kS, mass, asg); }},
      {"topk index < 0", "topk", [=] { ct(topk - kS, mass, asg); }},
      {"topk float", "topk", [=] { ct(topk.to(torch::kDouble), mass, asg); }},
      {"topk rank 3", "topk", [=] { ct(topk[0], mass, asg); }},
      {"topk batch N+1", "topk",
       [=] {
         ct(torch::cat({topk, topk}, 0), mass, asg);
       }},
      {"mass (N, H, C+1)", "mass",
       [=] {
         ct(topk, torch::rand({kN, kH, 3}, d), asg);
       }},
      {"mass float32", "mass", [=] { ct(topk, mass.to(torch::kFloat), asg); }},
      {"assignments >= C", "assignments", [=] { ct(topk, mass, asg + 2); }},
      {"assignments < -1", "assignments", [=] { ct(topk, mass, asg - 3); }},
      {"assignments (N, H, L+1)", "assignments",
       [=] {
         ct(topk, mass, torch::zeros({kN, kH, kL + 1}, lng));
       }},
      {"assignments float", "assignments", [=] { ct(topk, mass, asg.to(torch::kDouble)); }},
      {"clustered_topk softmax_temp 0", "softmax_temp", [=] { ct(topk, mass, asg, 0.0); }},
      {"clustered_topk softmax_temp nan", "softmax_temp", [=] { ct(topk, mass, asg, nan); }},
      // hard_retrieval_attention
      {"hard additive attn_mask", "attn_mask",
       [=] {
         hard_retrieval_attention(q, k, v, torch::zeros({kL, kS}, d));
       }},
      {"hard softmax_temp -1", "softmax_temp",
       [=] { hard_retrieval_attention(q, k, v, std::nullopt, std::nullopt, false, true, -1.0); }},
      // block_sparse_attention
      {"sparse pattern unknown", "pattern", [=] { block_sparse_attention(q, k, v, "dense", {3}); }},
      {"sparse local window 0", "window", [=] { block_sparse_attention(q, k, v, "local", {0}); }},
      {"sparse local 2 params", "params",
       [=] {
         block_sparse_attention(q, k, v, "local", {3, 1});
       }},
      {"sparse strided stride 0", "stride",
       [=] {
         block_sparse_attention(q, k, v, "strided", {0, 0});
       }},
      {"sparse strided which 4", "which",
       [=] {
         block_sparse_attention(q, k, v, "strided", {2, 4});
       }},
      {"sparse strided which -1", "which",
       [=] {
         block_sparse_attention(q, k, v, "strided", {2, -1});
       }},
      {"sparse split one head", "heads",
       [=] {
         block_sparse_attention(q.narrow(1, 0, 1), k.narrow(1, 0, 1), v.narrow(1, 0, 1), "strided",
                                {2, 3});
       }},
      {"sparse fixed summary 0", "summary",
       [=] {
         block_sparse_attention(q, k, v, "fixed", {3, 0, 0, 0});
       }},
      {"sparse fixed summary > stride", "summary",
       [=] {
         block_sparse_attention(q, k, v, "fixed", {3, 4, 0, 0});
       }},
      {"sparse fixed per_head_summary 2", "per_head_summary",
       [=] {
         block_sparse_attention(q, k, v, "fixed", {3, 1, 0, 2});
       }},
      {"sparse softmax_temp 0", "softmax_temp",
       [=] { block_sparse_attention(q, k, v, "local", {3}, std::nullopt, false, 0.0); }},
      // lsh_hash
      {"lsh x rank 3", "x", [=] { lsh_hash(q[0], rot); }},
      {"lsh rotations E+1 rows", "rotations",
       [=] {
         lsh_hash(q, torch::randn({2, kE + 1, 4}, d));
       }},
      {"lsh rotations rank 2", "rotations", [=] { lsh_hash(q, rot[0]); }},
      {"lsh rounds 0", "rotations",
       [=] {
         lsh_hash(q, torch::randn({0, kE, 4}, d));
       }},
      {"lsh rotations float32", "rotations", [=] { lsh_hash(q, rot.to(torch::kFloat)); }},
      // reformer_attention
      {"reformer q rank 3", "q", [=] { reformer_attention(q[0], vl, buckets); }},
      {"reformer v length", "v", [=] { reformer_attention(q, v, buckets); }},
      {"reformer v float32", "v", [=] { reformer_attention(q, vl.to(torch::kFloat), buckets); }},
      {"reformer buckets length", "buckets",
       [=] {
         reformer_attention(q, vl, torch::zeros({kN, kH, 2, kL + 1}, lng));
       }},
      {"reformer buckets negative", "buckets", [=] { reformer_attention(q, vl, buckets - 1000); }},
      {"reformer buckets float", "buckets",
       [=] { reformer_attention(q, vl, buckets.to(torch::kDouble)); }},
      {"reformer chunk_size 0", "chunk_size",
       [=] { reformer_attention(q, vl, buckets, std::nullopt, 0); }},
      {"reformer key_lengths > L", "key_lengths",
       [=] { reformer_attention(q, vl, buckets, torch::full({kN}, kL + 1, lng)); }},
      {"reformer key_lengths (N+1,)", "key_lengths",
       [=] { reformer_attention(q, vl, buckets, torch::full({kN + 1}, 1, lng)); }},
      {"reformer softmax_temp 0", "softmax_temp",
       [=] { reformer_attention(q, vl, buckets, std::nullopt, 2, false, true, 0.0); }},
      // gather_tokens
      {"gather x rank 3", "x", [=] { gather_tokens(q[0], idx); }},
      {"gather x integer", "x", [=] { gather_tokens(q.to(torch::kLong), idx); }},
      {"gather index >= L", "index", [=] { gather_tokens(q, idx + kL + 1); }},
      {"gather index < -1", "index", [=] { gather_tokens(q, idx - kL - 2); }},
      {"gather index float", "index", [=] { gather_tokens(q, idx.to(torch::kDouble)); }},
      {"gather index (N+1, T)", "index",
       [=] {
         gather_tokens(q, torch::cat({idx, idx}, 0));
       }},
      {"gather index rank 3", "index", [=] { gather_tokens(q, idx.unsqueeze(0)); }},
  };
}

TEST(Validation, OpParametersAndAuxiliaryTensorsNamed) {
  for (const auto& c : op_parameter_cases()) {
    EXPECT_TRUE(raises_naming(c.call, c.arg)) << c.what;
  }
}

TEST(Validation, DispatcherAttentionOpNamesTypeAndParams) {
  auto q = torch::randn({1, 1, 3, 4});
  auto op = c10::Dispatcher::singleton().findSchemaOrThrow("fastattn::attention", "");
  auto typed = op.typed<Tensor(std::string, const Tensor&, const Tensor&, const Tensor&, bool,
                               const c10::optional<Tensor>&, const c10::optional<Tensor>&,
                               std::string, bool)>();
  EXPECT_TRUE(raises_naming(
      [&] { typed.call("no-such-type", q, q, q, false, c10::nullopt, c10::nullopt, "{}", false); },
      "no-such-type"));
  EXPECT_TRUE(raises_naming(
      [&] { typed.call("full", q, q, q, false, c10::nullopt, c10::nullopt, "{bad json", false); },
      "params_json"));
  EXPECT_TRUE(raises_naming(
      [&] {
        typed.call("full", q, q, q, false, c10::nullopt, c10::nullopt, R"({"softmax_temp": -1})",
                   false);
      },
      "softmax_temp"));
  EXPECT_TRUE(raises_naming(
      [&] { typed.call("full", q[0], q, q, false, c10::nullopt, c10::nullopt, "{}", false); },
      "q"));
}

// ---- non-contiguous inputs ---------------------------------------------------

// The same values in a strided layout: (N, L, H, E) storage viewed as (N, H, L, E).
Tensor strided_copy(const Tensor& t) {
  if (t.dim() < 3) return t.t().contiguous().t();
  auto storage = t.transpose(1, 2).contiguous();
  auto nc = storage.transpose(1, 2);
  EXPECT_FALSE(nc.is_contiguous());
  EXPECT_TRUE(torch::equal(nc, t));
  return nc;
}

TEST(Validation, NonContiguousInputsGiveTheContiguousResult) {
  for (const auto& op : qkv_ops()) {
    auto in = make_inputs(kN, kH, kL, op.same_length ? kL : kS, torch::kDouble, 3);
    if (op.key_lengths) in.key_lengths = torch::tensor({int64_t{3}, in.k.size(2)});
    if (op.attn_mask) in.attn_mask = torch::rand({kL, in.k.size(2)}) > 0.3;
    torch::manual_seed(11);
    auto expected = op.call(in);
    Inputs nc = in;
    nc.q = strided_copy(in.q);
    nc.k = strided_copy(in.k);
    nc.v = strided_copy(in.v);
    if (op.key_lengths) {
      nc.key_lengths = torch::stack({*in.key_lengths, *in.key_lengths}, 1).select(1, 0);
      EXPECT_FALSE(nc.key_lengths->is_contiguous());
    }
    if (op.attn_mask) nc.attn_mask = strided_copy(*in.attn_mask);
    torch::manual_seed(11);
    auto got = op.call(nc);
    EXPECT_TRUE(torch::allclose(got, expected, 1e-12, 1e-12)) << op.name;

    // Gradients through non-contiguous leaves match too.
    for (auto* t : {&in.q, &in.k, &in.v, &nc.q, &nc.k, &nc.v}) {
      *t = t->detach().requires_grad_(true);
    }
    auto w = torch::randn_like(expected);
    torch::manual_seed(11);
    (op.call(in) * w).sum().backward();
    torch::manual_seed(11);
    (op.call(nc) * w).sum().backward();
    for (auto [a, b] : {std::pair{&in.q, &nc.q}, {&in.k, &nc.k}, {&in.v, &nc.v}}) {
      ASSERT_TRUE(a->grad().defined() == b->grad().defined()) << op.name;
      if (a->grad().defined()) {
        EXPECT_TRUE(torch::allclose(a->grad(), b->grad(), 1e-12, 1e-12)) << op.name;
      }
    }
  }
}

TEST(Validation, NonContiguousInputsOfTheOtherOps) {
  auto d = torch::TensorOptions().dtype(torch::kDouble);
  auto x = torch::randn({kN, kH, kL, kE}, d);
  auto xn = strided_copy(x);
  auto planes = torch::randn({12, kE + 1}, d);
  auto planes_nc = planes.t().contiguous().t();
  ASSERT_FALSE(planes_nc.is_contiguous());
  EXPECT_TRUE(torch::equal(hash_queries(xn, planes_nc), hash_queries(x, planes)));

  auto codes = hash_queries(x, planes);
  auto codes_nc = codes.transpose(1, 2).contiguous().transpose(1, 2);
  auto lengths = torch::tensor({int64_t{4}, kL});
  auto [a1, c1] = cluster_codes(codes, lengths, 2, 3, 5);
  auto [a2, c2] =
      cluster_codes(codes_nc, torch::stack({lengths, lengths}, 1).select(1, 1), 2, 3, 5);
  EXPECT_TRUE(torch::equal(a1, a2));
  EXPECT_TRUE(torch::equal(c1, c2));

  EXPECT_TRUE(torch::allclose(elu_feature_map(xn), elu_feature_map(x)));

  auto rot = torch::randn({2, kE, 3}, d);
  auto rot_nc = rot.transpose(1, 2).contiguous().transpose(1, 2);
  auto buckets = lsh_hash(x, rot);
  EXPECT_TRUE(torch::equal(lsh_hash(xn, rot_nc), buckets));

  auto v = torch::randn({kN, kH, kL, kM}, d);
  auto buckets_nc = buckets.transpose(2, 3).contiguous().transpose(2, 3);
  EXPECT_TRUE(torch::allclose(reformer_attention(xn, strided_copy(v), buckets_nc, lengths, 2),
                              reformer_attention(x, v, buckets, lengths, 2), 1e-12, 1e-12));

  auto idx = torch::randint(-1, kL, {kN, 6}, torch::kLong);
  auto idx_nc = idx.t().contiguous().t();
  EXPECT_TRUE(torch::equal(gather_tokens(xn, idx_nc), gather_tokens(x, idx)));
}

// full_attention_lse_topk's other outputs (the table above checks out):
// lse and top_idx for strided inputs and key lengths, and their gradients.
TEST(Validation, LseTopkNonContiguousLseAndIndices) {
  auto in = make_inputs(kN, kH, kL, kS, torch::kDouble, 4);
  auto kl = torch::tensor({int64_t{2}, kS});
  auto kl_nc = torch::stack({kl, kl}, 1).select(1, 1);
  ASSERT_FALSE(kl_nc.is_contiguous());
  Inputs nc;
  nc.q = strided_copy(in.q);
  nc.k = strided_copy(in.k);
  nc.v = strided_copy(in.v);
  for (auto* t : {&in.q, &in.k, &in.v, &nc.q, &nc.k, &nc.v}) {
    *t = t->detach().requires_grad_(true);
  }
  auto [o1, l1, i1] = full_attention_lse_topk(in.q, in.k, in.v, kl, 0.7, 4);
  auto [o2, l2, i2] = full_attention_lse_topk(nc.q, nc.k, nc.v, kl_nc, 0.7, 4);
  EXPECT_TRUE(torch::allclose(o1, o2, 1e-12, 1e-12));
  EXPECT_TRUE(torch::allclose(l1, l2, 1e-12, 1e-12));
  EXPECT_TRUE(torch::equal(i1, i2));
  (o1.sum() + l1.sum()).backward();
  (o2.sum() + l2.sum()).backward();
  for (auto [a, b] : {std::pair{&in.q, &nc.q}, {&in.k, &nc.k}, {&in.v, &nc.v}}) {
    EXPECT_TRUE(torch::allclose(a->grad(), b->grad(), 1e-12, 1e-12));
  }
}

// ---- empty inputs ------------------------------------------------------------
// Promise: N = 0 or L = 0 gives an empty (N, H, L, M) result; S = 0 (no key at
// all) gives zeros, like a query whose keys are all masked. Gradients exist and
// have the inputs' shapes.

TEST(Validation, EmptyInputsGiveEmptyOrZeroResults) {
  struct Shape {
    int64_t N, L, S;
  };
  for (const auto& op : qkv_ops()) {
    for (Shape s : {Shape{0, kL, kS}, Shape{kN, 0, kS}, Shape{kN, kL, 0}, Shape{kN, 0, 0}}) {
      if (op.same_length && s.L != s.S) {
        if (s.N == 0)
          s.S = s.L;
        else
          continue;
      }
      auto in = make_inputs(s.N, kH, s.L, s.S, torch::kDouble);
      for (auto* t : {&in.q, &in.k, &in.v}) t->requires_grad_(true);
      if (op.key_lengths) in.key_lengths = torch::full({s.N}, s.S, torch::kLong);
      const std::string where = op.name + " N=" + std::to_string(s.N) +
                                " L=" + std::to_string(s.L) + " S=" + std::to_string(s.S);
      Tensor out;
      try {
        out = op.call(in);
      } catch (const c10::Error& e) {
        ADD_FAILURE() << where << ": " << e.what_without_backtrace();
        continue;
      }
      ASSERT_EQ(out.sizes(), (std::vector<int64_t>{s.N, kH, s.L, kM})) << where;
      EXPECT_TRUE(torch::all(out == 0).item<bool>()) << where;
      EXPECT_NO_THROW(out.sum().backward()) << where;
      for (auto* t : {&in.q, &in.k, &in.v}) {
        if (t->grad().defined()) {
          EXPECT_EQ(t->grad().sizes(), t->sizes()) << where;
        }
      }
    }
  }
}

// lse of an empty row set is -inf (S = 0); top_idx has topk = 0 columns there.
TEST(Validation, LseTopkEmptyInputs) {
  struct Shape {
    int64_t N, L, S;
  };
  for (Shape s : {Shape{0, kL, kS}, Shape{kN, 0, kS}, Shape{kN, kL, 0}, Shape{kN, 0, 0}}) {
    auto in = make_inputs(s.N, kH, s.L, s.S, torch::kDouble);
    const int64_t topk = std::min<int64_t>(2, s.S);
    auto [out, lse, idx] =
        full_attention_lse_topk(in.q, in.k, in.v, std::nullopt, std::nullopt, topk);
    EXPECT_EQ(out.sizes(), (std::vector<int64_t>{s.N, kH, s.L, kM}));
    EXPECT_EQ(lse.sizes(), (std::vector<int64_t>{s.N, kH, s.L}));
    EXPECT_EQ(idx.sizes(), (std::vector<int64_t>{s.N, kH, s.L, topk}));
    if (s.S == 0) {
      EXPECT_TRUE(torch::all(lse.isinf() & lse.lt(0)).item<bool>());
    }
  }
}

TEST(Validation, EmptyInputsOfTheOtherOps) {
  auto d = torch::TensorOptions().dtype(torch::kDouble);
  for (int64_t N : {int64_t{0}, kN}) {
    for (int64_t L : {int64_t{0}, kL}) {
      if (N > 0 && L > 0) continue;
      auto x = torch::randn({N, kH, L, kE}, d);
      auto codes = hash_queries(x, torch::randn({8, kE + 1}, d));
      EXPECT_EQ(codes.sizes(), (std::vector<int64_t>{N, kH, L}));
      auto [asg, counts] = cluster_codes(codes, std::nullopt, 3, 2, 0);
      EXPECT_EQ(asg.sizes(), (std::vector<int64_t>{N, kH, L}));
      // Clusters clamped to L, at least one column.
      EXPECT_EQ(counts.sizes(),
                (std::vector<int64_t>{N, kH, std::min<int64_t>(3, std::max<int64_t>(L, 1))}));
      EXPECT_EQ(elu_feature_map(x).sizes(), x.sizes());
      auto buckets = lsh_hash(x, torch::randn({2, kE, 3}, d));
      EXPECT_EQ(buckets.sizes(), (std::vector<int64_t>{N, kH, 2, L}));
      auto v = torch::randn({N, kH, L, kM}, d);
      EXPECT_EQ(reformer_attention(x, v, buckets, std::nullopt, 2).sizes(),
                (std::vector<int64_t>{N, kH, L, kM}));
      auto idx = torch::full({N, 3}, -1, torch::kLong);
      auto g = gather_tokens(x, idx);
      EXPECT_EQ(g.sizes(), (std::vector<int64_t>{N, kH, 3, kE}));
      EXPECT_TRUE(torch::all(g == 0).item<bool>());
    }
  }
}

// ---- attention types (every registered one) ----------------------------------

const AttentionDims kDims = cases::dims(kH, kE, kM);
int64_t width(const std::string& name) { return cases::value_width(name, kE, kM); }

// The mask a type accepts with no padding: none, or causal for types that
// only compute causal attention. S == L keeps every type happy.
Mask base_mask(const std::string& name) {
  auto a = cases::build_type(name, kDims);
  auto in = make_inputs(kN, kH, kL, kL, torch::kDouble, 0, width(name));
  try {
    a->forward(in.q, in.k, in.v, Mask());
    return Mask();
  } catch (const c10::Error&) {
    return Mask::causal_mask();
  }
}

std::vector<std::string> type_names() {
  // Built-in and library types (without other tests' throwaway types).
  std::vector<std::string> names = cases::registered_types();
  names.push_back("conditional-full:linear");
  return names;
}

TEST(Validation, EveryAttentionTypeRejectsBadInputsNamingTheArgument) {
  auto lng = torch::TensorOptions().dtype(torch::kLong);
  struct TypeMutation {
    std::string what, arg;
    std::function<void(Inputs&, Mask&)> apply;
  };
  const std::vector<TypeMutation> mutations = {
      {"queries rank 3", "queries", [](Inputs& in, Mask&) { in.q = in.q[0]; }},
      {"keys rank 3", "keys", [](Inputs& in, Mask&) { in.k = in.k[0]; }},
      {"values rank 5", "values", [](Inputs& in, Mask&) { in.v = in.v.unsqueeze(0); }},
      {"keys batch N", "keys",
       [](Inputs& in, Mask&) {
         in.k = torch::cat({in.k, in.k}, 0);
       }},
      {"keys heads H", "keys",
       [](Inputs& in, Mask&) {
         in.k = torch::cat({in.k, in.k}, 1);
       }},
      {"keys head dim E", "keys",
       [](Inputs& in, Mask&) {
         in.k = torch::cat({in.k, in.k}, 3);
       }},
      {"values length S", "values",
       [](Inputs& in, Mask&) {
         in.v = torch::cat({in.v, in.v}, 2);
       }},
      {"keys float32", "keys", [](Inputs& in, Mask&) { in.k = in.k.to(torch::kFloat); }},
      {"values float32", "values", [](Inputs& in, Mask&) { in.v = in.v.to(torch::kFloat); }},
      {"queries integer", "queries", [](Inputs& in, Mask&) { in.q = in.q.to(torch::kLong); }},
      {"key_lengths (N+1,)", "key_lengths",
       [=](Inputs& in, Mask& m) { m = m.with_key_lengths(torch::full({kN + 1}, 2, lng)); }},
      {"key_lengths > S", "key_lengths",
       [=](Inputs& in, Mask& m) { m = m.with_key_lengths(torch::full({kN}, kL + 1, lng)); }},
      {"attn_mask (L, S+1)", "attn_mask",
       [](Inputs& in, Mask& m) {
         m = m.with_attn_mask(torch::ones({kL, kL + 1}, torch::kBool));
       }},
      {"attn_mask (N+1, L, S)", "attn_mask",
       [](Inputs& in, Mask& m) {
         m = m.with_attn_mask(torch::ones({kN + 1, kL, kL}, torch::kBool));
       }},
  };
  for (const auto& name : type_names()) {
    const Mask base = base_mask(name);
    for (const auto& mut : mutations) {
      auto a = cases::build_type(name, kDims);
      auto in = make_inputs(kN, kH, kL, kL, torch::kDouble, 0, width(name));
      ASSERT_NO_THROW(a->forward(in.q, in.k, in.v, base)) << name;
      Mask m = base;
      EXPECT_TRUE(raises_naming(
          [&] {
            mut.apply(in, m);
            a->forward(in.q, in.k, in.v, m);
          },
          mut.arg))
          << name << ": " << mut.what;
    }
  }
}

TEST(Validation, EveryAttentionTypeChecksItsParameterRanges) {
  int checked = 0;
  for (const auto& name : type_names()) {
    const auto type = AttentionRegistry::global().get(name);
    for (const auto& s : type.params) {
      std::vector<ParamValue> bad;
      const bool is_int = s.type == ParamType::Int;
      if (s.type == ParamType::Choice) bad.push_back(std::string("no-such-choice"));
      if (s.type == ParamType::Bool || is_int || s.type == ParamType::Float) {
        bad.push_back(std::string("x"));  // wrong type
      }
      if (is_int) bad.push_back(1.5);
      if (s.min) {
        if (is_int)
          bad.push_back(static_cast<int64_t>(*s.min) - (s.min_exclusive ? 0 : 1));
        else
          bad.push_back(s.min_exclusive ? *s.min : *s.min - 0.5);
      }
      if (s.max) {
        if (is_int)
          bad.push_back(static_cast<int64_t>(*s.max) + (s.max_exclusive ? 0 : 1));
        else
          bad.push_back(s.max_exclusive ? *s.max : *s.max + 0.5);
      }
      if (s.type == ParamType::Float) bad.push_back(std::numeric_limits<double>::quiet_NaN());
      for (const auto& value : bad) {
        EXPECT_TRUE(raises_naming(
            [&] {
              make_attention(name, {{s.name, value}}, kDims);
            },
            s.name))
            << name << "." << s.name << " = " << param_value_to_string(value);
        ++checked;
      }
    }
    EXPECT_TRUE(raises_naming(
        [&] {
          make_attention(name, {{"no_such_param", int64_t{1}}});
        },
        "no_such_param"))
        << name;
  }
  EXPECT_GT(checked, 40);
  EXPECT_TRUE(raises_naming([] { make_attention("no-such-type"); }, "no-such-type"));
}

TEST(Validation, EveryAttentionTypeTakesNonContiguousInputs) {
  for (const auto& name : type_names()) {
    const Mask base = base_mask(name);
    auto in = make_inputs(kN, kH, kL, kL, torch::kDouble, 9, width(name));
    const Mask m = base.with_key_lengths(
        torch::stack({torch::tensor({int64_t{3}, kL}), torch::tensor({int64_t{3}, kL})}, 1)
            .select(1, 0));
    auto expected =
        cases::build_type(name, kDims)
            ->forward(in.q, in.k, in.v, base.with_key_lengths(torch::tensor({int64_t{3}, kL})));
    auto got = cases::build_type(name, kDims)
                   ->forward(strided_copy(in.q), strided_copy(in.k), strided_copy(in.v), m);
    EXPECT_TRUE(torch::allclose(got, expected, 1e-10, 1e-10)) << name;
  }
}

// Empty inputs of every type: N = 0 and L = S = 0 give an empty result; S = 0
// with L > 0 gives zeros where the type accepts S != L (else a clear error
// naming the keys).
TEST(Validation, EveryAttentionTypeHandlesEmptyInputs) {
  struct Shape {
    int64_t N, L, S;
  };
  for (const auto& name : type_names()) {
    const Mask base = base_mask(name);
    for (Shape s : {Shape{0, kL, kL}, Shape{kN, 0, 0}, Shape{kN, kL, 0}}) {
      auto a = cases::build_type(name, kDims);
      auto in = make_inputs(s.N, kH, s.L, s.S, torch::kDouble, 0, width(name));
      for (auto* t : {&in.q, &in.k, &in.v}) t->requires_grad_(true);
      const std::string where = name + " N=" + std::to_string(s.N) + " L=" + std::to_string(s.L) +
                                " S=" + std::to_string(s.S);
      Tensor out;
      try {
        out = a->forward(in.q, in.k, in.v, base);
      } catch (const c10::Error& e) {
        const std::string msg = e.what_without_backtrace();
        // Only S != L may be refused, by types that need S == L.
        EXPECT_TRUE(s.L != s.S && names_word(msg, "keys")) << where << ": " << msg;
        continue;
      }
      ASSERT_EQ(out.sizes(), (std::vector<int64_t>{s.N, kH, s.L, width(name)})) << where;
      EXPECT_TRUE(torch::all(out == 0).item<bool>()) << where;
      // Some types return a fresh zero tensor here (no graph: zero gradients).
      if (out.requires_grad()) {
        EXPECT_NO_THROW(out.sum().backward()) << where;
      }
    }
  }
}

}  // namespace
}  // namespace fastattn
