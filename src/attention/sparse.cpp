// `local`, `sparse-strided` and `sparse-fixed`: the registry types over the
// block-sparse operator (src/ops/block_sparse_attention.cpp).
#include "fastattn/sparse.h"

#include <cmath>

#include "attention/builtin_types.h"
#include "fastattn/ops.h"
#include "fastattn/registry.h"
#include "ops/dense_attention.h"
#include "ops/engine_pieces.h"
#include "ops/op_util.h"

namespace fastattn {

LocalAttention::LocalAttention(int64_t window, std::optional<double> softmax_temp,
                               double attention_dropout)
    : window_(window), softmax_temp_(softmax_temp), attention_dropout_(attention_dropout) {
  TORCH_CHECK(window >= 1, "local: window must be >= 1, got ", window);
  check_softmax_temp("local", softmax_temp);
  check_attention_dropout("local", attention_dropout);
}

torch::Tensor LocalAttention::forward(const torch::Tensor& queries,  // (N, H, L, E)
                                      const torch::Tensor& keys,     // (N, H, S, E)
                                      const torch::Tensor& values,   // (N, H, S, M)
                                      const Mask& mask) {
  check_attention_inputs(type_name(), queries, keys, values, mask);
  const double dropout = is_training() ? attention_dropout_ : 0.0;
  // The window on the dense-attention engine where it runs on PyTorch's fused
  // kernels (src/ops/dense_attention.h): the same keys as the "local" pattern.
  // With dropout, the block-sparse kernels (the engine's calls take none yet).
  ops::DenseAttentionSpec spec;
  spec.scale = softmax_temp_.value_or(1.0 / std::sqrt(static_cast<double>(queries.size(3))));
  spec.causal = mask.is_causal();
  spec.window_left = mask.is_causal() ? window_ - 1 : window_ / 2;
  spec.window_right = mask.is_causal() ? 0 : window_ - 1 - window_ / 2;
  spec.key_lengths = to_c10(mask.key_lengths());
  if (dropout == 0 && ops::types_use_dense_engine(queries, values, spec))
    return ops::dense_attention(queries, keys, values, spec);
  return block_sparse_attention(queries, keys, values, "local", {window_}, mask.key_lengths(),
                                mask.is_causal(), softmax_temp_, dropout);
}

SparseTransformerAttention::SparseTransformerAttention(bool fixed, SparseTransformerOptions options)
    : fixed_(fixed), options_(std::move(options)) {
  const char* who = fixed ? "sparse-fixed" : "sparse-strided";
  const auto& o = options_;
  TORCH_CHECK(!o.stride || *o.stride >= 1, who, ": stride must be >= 1, got ", *o.stride);
  TORCH_CHECK(!o.summary || *o.summary >= 1, who, ": summary must be >= 1, got ", *o.summary);
  TORCH_CHECK(!o.summary || !o.stride || *o.summary <= *o.stride, who,
              ": summary must be <= stride (", *o.stride, "), got ", *o.summary);
  TORCH_CHECK(fixed || !o.summary, who, ": summary applies only to sparse-fixed");
  TORCH_CHECK(fixed || !o.per_head_summary, who, ": per_head_summary applies only to sparse-fixed");
  TORCH_CHECK(o.part == 1 || o.part == 2, who, ": part must be 1 (A1) or 2 (A2), got ", o.part);
  check_softmax_temp(who, o.softmax_temp);
  check_attention_dropout(who, o.attention_dropout);
}

std::pair<std::string, std::vector<int64_t>> SparseTransformerAttention::pattern(int64_t L) const {
  const auto& o = options_;
  const int64_t l =
      o.stride.value_or(std::max<int64_t>(1, std::llround(std::sqrt(static_cast<double>(L)))));
  const int64_t which = o.mode == SparseMode::Merged ? 0 : o.mode == SparseMode::Split ? 3 : o.part;
  if (!fixed_) return {"strided", {l, which}};
  const int64_t c = o.summary.value_or(std::min<int64_t>(8, l));
  TORCH_CHECK(c <= l, "sparse-fixed: summary (", c, ") must be <= stride (", l,
              o.stride ? "" : ", the default round(sqrt(L))", ")");
  return {"fixed", {l, c, which, o.per_head_summary ? 1 : 0}};
}

torch::Tensor SparseTransformerAttention::forward(const torch::Tensor& queries,  // (N, H, L, E)
                                                  const torch::Tensor& keys,     // (N, H, S, E)
                                                  const torch::Tensor& values,   // (N, H, S, M)
                                                  const Mask& mask) {
  check_attention_inputs(type_name(), queries, keys, values, mask);
  TORCH_CHECK(options_.mode != SparseMode::Split || queries.size(1) >= 2, type_name(),
              ": mode split needs at least 2 heads, got ", queries.size(1));
  const auto [pattern_name, params] = this->pattern(queries.size(2));
  const double dropout = is_training() ? options_.attention_dropout : 0.0;
  // On the dense-attention engine where it runs on PyTorch's fused kernels:
  // the pattern as disjoint pieces merged by logsumexp (src/ops/engine_pieces.h).
  // Key lengths keep the block-sparse kernels (the pieces' sequences are
  // planned once for every batch item), and so does dropout.
  if (!mask.key_lengths() && dropout == 0 &&
      ops::types_use_dense_engine(queries, values, {}, /*pieces=*/true)) {
    const double scale =
        options_.softmax_temp.value_or(1.0 / std::sqrt(static_cast<double>(queries.size(3))));
    return ops::block_sparse_on_engine(queries, keys, values, scale, pattern_name, params,
                                       mask.is_causal());
  }
  return block_sparse_attention(queries, keys, values, pattern_name, params, mask.key_lengths(),
                                mask.is_causal(), options_.softmax_temp, dropout);
}

// ---- registration ---------------------------------------------------------

namespace {

std::vector<ParamSpec> factorized_specs(bool fixed) {
  std::vector<ParamSpec> specs = {
      ParamSpec::integer("stride", std::nullopt,
                         "l: the block / stride length; default round(sqrt(L))", 1),
      ParamSpec::choice("mode", "merged", {"merged", "split", "interleaved"},
                        "merged: every head attends A1 ∪ A2; split: the first ceil(H/2) heads A1, "
                        "the others A2; interleaved: only the sub-pattern `part` (the builders "
                        "give layer r part r mod 2 + 1)"),
      ParamSpec::integer("part", std::nullopt, "mode interleaved: 1 (A1) or 2 (A2); default 1", 1,
                         2)};
  if (fixed) {
    specs.push_back(ParamSpec::integer("summary", std::nullopt,
                                       "c: the last c positions of every block are summaries (A2); "
                                       "default min(8, stride)",
                                       1));
    specs.push_back(ParamSpec::boolean(
        "per_head_summary", false,
        "head h uses the c positions [l - c·(g+1), l - c·g) of each block, g = h mod (l / c)"));
  }
  specs.push_back(softmax_temp_spec());
  specs.push_back(attention_dropout_spec());
  return specs;
}

AttentionPtr make_factorized(bool fixed, const Params& p) {
  SparseTransformerOptions o;
  const char* who = fixed ? "sparse-fixed" : "sparse-strided";
  o.stride = p.get_optional_int("stride");
  const auto& mode = p.get_string("mode");
  o.mode = mode == "merged"  ? SparseMode::Merged
           : mode == "split" ? SparseMode::Split
                             : SparseMode::Interleaved;
  const auto part = p.get_optional_int("part");
  TORCH_CHECK(!part || o.mode == SparseMode::Interleaved, who,
              ": part applies only to mode interleaved, got mode ", mode);
  o.part = part.value_or(1);
  if (fixed) {
    o.summary = p.get_optional_int("summary");
    o.per_head_summary = p.get_bool("per_head_summary");
  }
  o.softmax_temp = p.get_optional_float("softmax_temp");
  o.attention_dropout = p.get_float("attention_dropout");
  return std::make_shared<SparseTransformerAttention>(fixed, o);
}

}  // namespace

void register_sparse_attention_types(AttentionRegistry& registry) {
  registry.add({"local",
                "each query attends a window of `window` keys around it (causal: the window "
                "ending at itself); block-sparse fused kernel, O(L·window)",
                {ParamSpec::integer("window", int64_t{128},
                                    "keys per query: causal offsets [-(w-1), 0], else "
                                    "[-floor(w/2), w-1-floor(w/2)]",
                                    1),
                 softmax_temp_spec(), attention_dropout_spec()},
                [](const Params& p, const AttentionDims&) -> AttentionPtr {
                  return std::make_shared<LocalAttention>(p.get_int("window"),
                                                          p.get_optional_float("softmax_temp"),
                                                          p.get_float("attention_dropout"));
                },
                Capabilities().rows(IncrementalRows::Yes),
                /*recurrent=*/nullptr});
  registry.add({"sparse-strided",
                "Sparse Transformer strided pattern (Child et al. 2019): A1 = the previous l "
                "positions, A2 = every l-th position; O(L·sqrt L) with l = sqrt L",
                factorized_specs(false),
                [](const Params& p, const AttentionDims&) { return make_factorized(false, p); },
                Capabilities().rows(IncrementalRows::Stride), /*recurrent=*/nullptr});
  registry.add({"sparse-fixed",
                "Sparse Transformer fixed pattern (Child et al. 2019): A1 = the same block of l, "
                "A2 = the last c positions of every block; O(L·(l + c·L/l))",
                factorized_specs(true),
                [](const Params& p, const AttentionDims&) { return make_factorized(true, p); },
                Capabilities().rows(IncrementalRows::Stride), /*recurrent=*/nullptr});
}

}  // namespace fastattn
