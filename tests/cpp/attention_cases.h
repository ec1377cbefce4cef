// Attention-type helpers shared by the robustness tests (test_validation.cpp,
// test_edge_numerics.cpp) and the operator fuzzer (fuzz/fuzz_ops.cpp, which
// includes this header from both the fuzzer and the test build): the
// registered types without the throwaway "test-*" types that other tests
// register, their dimensions, a type built with seeded defaults, and the dense
// attention rows of clustered and improved clustered attention.
// No GoogleTest here: the libFuzzer build has none.
#pragma once

#include <torch/torch.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "fastattn/mask.h"
#include "fastattn/registry.h"

namespace fastattn::cases {

// Other tests register throwaway types named "test-*" in the global registry;
// the robustness tables and the fuzzer skip them.
inline bool is_throwaway_type(const std::string& name) { return name.rfind("test-", 0) == 0; }

// The registered type names (registry order), without the throwaway ones.
inline std::vector<std::string> registered_types() {
  std::vector<std::string> names;
  for (const auto& n : AttentionRegistry::global().names()) {
    if (!is_throwaway_type(n)) names.push_back(n);
  }
  return names;
}

inline AttentionDims dims(int64_t heads, int64_t query_dim, int64_t value_dim) {
  AttentionDims d;
  d.heads = heads;
  d.query_dim = query_dim;
  d.value_dim = value_dim;
  return d;
}

// The value width a type's cases use: E for the types that work channel by
// channel (AFT: values as wide as the keys), M for the others.
inline int64_t value_width(const std::string& name, int64_t E, int64_t M) {
  return AttentionRegistry::global().get(name).capabilities.channelwise ? E : M;
}

// True when the type `name` has a parameter called `param`.
inline bool has_param(const std::string& name, const std::string& param) {
  for (const auto& s : AttentionRegistry::global().get(name).params) {
    if (s.name == param) return true;
  }
  return false;
}

// Builds `name` in eval mode with `params`, plus seed = `seed` when the type
// takes a `seed` parameter that `params` leaves out; torch's global generator
// is seeded with `init_seed` first (for the types' parameter initialisation).
inline AttentionPtr build_type(const std::string& name, const AttentionDims& d,
                               ParamMap params = {}, int64_t seed = 1, uint64_t init_seed = 5) {
  if (has_param(name, "seed") && !params.count("seed")) params["seed"] = seed;
  torch::manual_seed(init_seed);
  auto a = make_attention(name, params, d);
  a->eval();
  return a;
}

// One forward and backward of `name` in `dtype` (seeded defaults, small
// clusters / top-k / windows so that every path is taken; causal where the
// type is, with key lengths) on shapes that leave vector tails (N=2, H=3,
// L=S=45, E=40, M=24 or E for channelwise types). The inputs, the loss weights and the type's
// parameters are bfloat16-representable, so runs in any dtype see the same
// values. Returns out, then grad q, k, v (zeros where a type has none).
inline std::vector<torch::Tensor> run_small_case(const std::string& name, torch::ScalarType dtype) {
  const auto& type = AttentionRegistry::global().get(name);
  ParamMap params;
  const ParamMap small = {
      {"clusters", int64_t{5}}, {"topk", int64_t{7}},       {"window", int64_t{9}},
      {"bits", int64_t{31}},    {"chunk_size", int64_t{8}}, {"n_buckets", int64_t{4}},
      {"stride", int64_t{6}},   {"seed", int64_t{3}},       {"length_limit", int64_t{8}}};
  for (const auto& spec : type.params)
    if (auto it = small.find(spec.name); it != small.end()) params.emplace(*it);
  const int64_t N = 2, H = 3, L = 45, E = 40, M = value_width(name, E, 24);
  auto attn = build_type(name, dims(H, E, M), params);
  attn->to(torch::kBFloat16);
  attn->to(dtype);
  torch::manual_seed(11);
  auto rounded = [&](std::initializer_list<int64_t> shape) {
    return torch::randn(shape, torch::kFloat64).to(torch::kBFloat16).to(dtype);
  };
  torch::Tensor q = rounded({N, H, L, E}).requires_grad_(),
                k = rounded({N, H, L, E}).requires_grad_(),
                v = rounded({N, H, L, M}).requires_grad_();
  const torch::Tensor w = rounded({N, H, L, M});
  Mask mask = type.capabilities.bidirectional ? Mask::none() : Mask::causal_mask();
  mask = mask.with_key_lengths(torch::tensor({L, L - 13}));
  std::vector<torch::Tensor> r;
  torch::Tensor out = attn->forward(q, k, v, mask);
  r.push_back(out.detach().clone());
  (out * w).sum().backward();
  for (const torch::Tensor& x : {q, k, v})
    r.push_back(x.grad().defined() ? x.grad().clone() : torch::zeros_like(x));
  return r;
}

// Attention rows (N, H, L, S) of full, clustered and improved clustered
// attention, written densely from the definitions (Vyas et al. 2020, eq. 3-4,
// 9-10) for the clusters `assignments` (N, H, L) in [-1, C) with `counts`
// (N, H, C): centroids are member means, each cluster's top-k keys are those
// of its centroid's highest scores (ties broken by torch::topk, so callers
// compare with an operator only where the k-th and (k+1)-th kept weights
// differ), padded queries (-1) and queries without kept keys get zero rows.
struct ClusteredRows {
  torch::Tensor full, clustered, improved;
  torch::Tensor centroid_scores;  // (N, H, C, S): scaled centroid·key scores, unmasked
};

inline ClusteredRows clustered_rows(const torch::Tensor& q, const torch::Tensor& k,
                                    const torch::Tensor& assignments, const torch::Tensor& counts,
                                    int64_t topk, const std::optional<torch::Tensor>& key_lengths,
                                    std::optional<double> softmax_temp = std::nullopt) {
  const int64_t N = q.size(0), H = q.size(1), L = q.size(2), S = k.size(2), C = counts.size(2);
  const double temp = softmax_temp.value_or(1.0 / std::sqrt(double(q.size(3))));
  auto keep = torch::ones({N, 1, 1, S}, torch::kBool);
  if (key_lengths) keep = torch::arange(S).view({1, 1, 1, S}).lt(key_lengths->view({N, 1, 1, 1}));
  auto softmax = [&](const torch::Tensor& s, const torch::Tensor& kp) {
    auto dead = kp.logical_not().all(-1, true);
    auto x = s.masked_fill(kp.logical_not(), -INFINITY).masked_fill(dead, 0.0);
    return torch::softmax(x, -1).masked_fill(dead, 0.0);
  };
  auto valid = assignments.ge(0).unsqueeze(-1).to(q.scalar_type());  // (N, H, L, 1)
  auto a = assignments.clamp_min(0);
  auto member = torch::one_hot(a, C).to(q.scalar_type()) * valid;  // (N, H, L, C)
  auto centroids = torch::matmul(member.transpose(-1, -2), q) /
                   counts.clamp_min(1).unsqueeze(-1).to(q.scalar_type());
  ClusteredRows r;
  r.full = softmax(torch::matmul(q, k.transpose(-1, -2)) * temp, keep);
  auto scores_c = torch::matmul(centroids, k.transpose(-1, -2)) * temp;  // (N, H, C, S)
  auto probs_c = softmax(scores_c, keep);
  auto per_query = [&](const torch::Tensor& x) {  // (N, H, C, S) -> (N, H, L, S)
    return x.gather(2, a.unsqueeze(-1).expand({N, H, L, S}));
  };
  r.clustered = per_query(probs_c) * valid;
  r.centroid_scores = scores_c;
  const int64_t kk = std::min(topk, S);
  // By score, not weight: weights that underflow to 0 would tie.
  auto idx = std::get<1>(scores_c.detach().masked_fill(keep.logical_not(), -INFINITY).topk(kk, -1));
  auto in_top = per_query(torch::zeros({N, H, C, S}, torch::kBool).scatter(-1, idx, true));
  auto mass = (per_query(probs_c) * in_top).sum(-1, true);
  auto exact = softmax(torch::matmul(q, k.transpose(-1, -2)) * temp, keep.logical_and(in_top));
  r.improved = torch::where(in_top, exact * mass, per_query(probs_c)) * valid;
  return r;
}

}  // namespace fastattn::cases
