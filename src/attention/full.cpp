// Full softmax attention as an attention type (`full`), the
// `conditional-full:<type>` decorator's module, the common input checks of
// every attention type, the auxiliary-loss collection, and the registration
// of `full`.
//
// FullAttention calls the fused operator fastattn::full_attention (O(L) extra
// memory). Only in training with attention_dropout > 0 does it take a
// composite path (scores, softmax, dropout, matmul) that materialises the
// (N, H, L, S) attention matrix: dropout acts on the attention weights
// themselves, which the fused operator never forms.
#include <cmath>
#include <limits>

#include "attention/builtin_types.h"
#include "fastattn/attention.h"
#include "fastattn/ops.h"
#include "fastattn/recurrent.h"
#include "fastattn/registry.h"
#include "ops/dense_attention.h"
#include "ops/op_util.h"

namespace fastattn {

void check_attention_inputs(const torch::Tensor& queries, const torch::Tensor& keys,
                            const torch::Tensor& values, const Mask& mask) {
  TORCH_CHECK(queries.defined() && keys.defined() && values.defined(),
              "attention: queries, keys and values must be defined tensors");
  TORCH_CHECK(queries.dim() == 4, "attention: queries must have shape (N, H, L, E), got ",
              queries.sizes());
  const int64_t N = queries.size(0), H = queries.size(1), L = queries.size(2), E = queries.size(3);
  TORCH_CHECK(keys.dim() == 4 && keys.size(0) == N && keys.size(1) == H && keys.size(3) == E,
              "attention: keys must have shape (N, H, S, E) = (", N, ", ", H, ", S, ", E, "), got ",
              keys.sizes());
  const int64_t S = keys.size(2);
  TORCH_CHECK(
      values.dim() == 4 && values.size(0) == N && values.size(1) == H && values.size(2) == S,
      "attention: values must have shape (N, H, S, M) = (", N, ", ", H, ", ", S, ", M), got ",
      values.sizes());
  // One dtype rule for every type, whatever operators it is built from.
  ops::check_attention_dtype("attention", "queries", queries);
  TORCH_CHECK(keys.scalar_type() == queries.scalar_type(), "attention: keys must be ",
              queries.scalar_type(), " like the queries, got ", keys.scalar_type());
  TORCH_CHECK(values.scalar_type() == queries.scalar_type(), "attention: values must be ",
              queries.scalar_type(), " like the queries, got ", values.scalar_type());
  TORCH_CHECK(keys.device() == queries.device(), "attention: keys must be on ", queries.device(),
              " like the queries, got ", keys.device());
  TORCH_CHECK(values.device() == queries.device(), "attention: values must be on ",
              queries.device(), " like the queries, got ", values.device());
  if (mask.attn_mask()) {
    TORCH_CHECK(mask.attn_mask()->device() == queries.device(), "attention: attn_mask must be on ",
                queries.device(), " like the queries, got ", mask.attn_mask()->device());
  }
  mask.check(N, H, L, S);
}

torch::Tensor take_auxiliary_losses(torch::nn::Module& model) {
  torch::Tensor total;
  for (const auto& module : model.modules(/*include_self=*/true)) {
    auto* attention = dynamic_cast<AttentionBase*>(module.get());
    if (attention == nullptr) continue;
    auto loss = attention->take_auxiliary_loss();
    if (loss.defined()) total = total.defined() ? total + loss : loss;
  }
  return total;
}

// ---- full ---------------------------------------------------------------

FullAttention::FullAttention(std::optional<double> softmax_temp, double attention_dropout)
    : softmax_temp_(softmax_temp), attention_dropout_(attention_dropout) {
  TORCH_CHECK(!softmax_temp || (std::isfinite(*softmax_temp) && *softmax_temp > 0),
              "FullAttention: softmax_temp must be a finite number > 0, got ",
              softmax_temp.value_or(0.0));
  TORCH_CHECK(attention_dropout >= 0 && attention_dropout < 1,
              "FullAttention: attention_dropout must be in [0, 1), got ", attention_dropout);
}

torch::Tensor FullAttention::forward(const torch::Tensor& queries,  // (N, H, L, E)
                                     const torch::Tensor& keys,     // (N, H, S, E)
                                     const torch::Tensor& values,   // (N, H, S, M)
                                     const Mask& mask) {
  check_attention_inputs(queries, keys, values, mask);
  if (!(is_training() && attention_dropout_ > 0)) {
    if (!mask.attn_mask()) {
      // The dense-attention engine where it runs on PyTorch's fused kernels
      // (src/ops/dense_attention.h).
      ops::DenseAttentionSpec spec;
      spec.scale = softmax_temp_.value_or(1.0 / std::sqrt(static_cast<double>(queries.size(3))));
      spec.causal = mask.is_causal();
      spec.key_lengths = to_c10(mask.key_lengths());
      if (ops::types_use_dense_engine(queries, values, spec))
        return ops::dense_attention(queries, keys, values, spec);
    }
    return full_attention(queries, keys, values, mask.attn_mask(), mask.key_lengths(),
                          mask.is_causal(), softmax_temp_);
  }
  // Composite path: materialises the (N, H, L, S) scores (see the file comment).
  const int64_t N = queries.size(0), H = queries.size(1), L = queries.size(2), S = keys.size(2),
                E = queries.size(3);
  const double temp = softmax_temp_.value_or(1.0 / std::sqrt(static_cast<double>(E)));
  auto scores = torch::matmul(queries, keys.transpose(-1, -2)) * temp;  // (N, H, L, S)
  if (!mask.is_all_ones()) {
    auto additive = mask.dense_additive(N, H, L, S, scores.scalar_type(), scores.device());
    // A query that keeps no key outputs zeros: give its row finite scores so
    // that softmax (and its gradient) stays free of NaN, then zero it.
    auto dead = torch::isneginf(additive).all(-1, /*keepdim=*/true);  // (N, H, L, 1)
    scores = (scores + additive).masked_fill(dead, 0.0);
    auto probs = torch::softmax(scores, -1).masked_fill(dead, 0.0);
    return torch::matmul(torch::dropout(probs, attention_dropout_, /*train=*/true), values);
  }
  auto probs = torch::softmax(scores, -1);
  return torch::matmul(torch::dropout(probs, attention_dropout_, /*train=*/true), values);
}

// ---- conditional-full:<type> -----------------------------------------------

ConditionalFullAttention::ConditionalFullAttention(AttentionPtr inner,
                                                   std::shared_ptr<FullAttention> full,
                                                   int64_t length_limit)
    : inner_(std::move(inner)), full_(std::move(full)), length_limit_(length_limit) {
  TORCH_CHECK(inner_, "ConditionalFullAttention: inner must be an attention module, got null");
  TORCH_CHECK(full_, "ConditionalFullAttention: full must be a FullAttention, got null");
  TORCH_CHECK(length_limit_ >= 1, "ConditionalFullAttention: length_limit must be >= 1, got ",
              length_limit_);
  // fast-transformers' names, so that saved weights of the inner type load.
  register_module("full_attention", full_);
  register_module("other_attention", inner_);
}

torch::Tensor ConditionalFullAttention::forward(const torch::Tensor& queries,  // (N, H, L, E)
                                                const torch::Tensor& keys,     // (N, H, S, E)
                                                const torch::Tensor& values,   // (N, H, S, M)
                                                const Mask& mask) {
  TORCH_CHECK(keys.dim() == 4, "conditional-full: keys must have shape (N, H, S, E), got ",
              keys.sizes());
  // Full attention while both lengths fit (as fast-transformers does): its cost
  // is L·S, so a long query side alone also calls for the inner type.
  if (std::max(queries.size(2), keys.size(2)) <= length_limit_)
    return full_->forward(queries, keys, values, mask);
  return inner_->forward(queries, keys, values, mask);
}

std::string ConditionalFullAttention::type_name() const {
  return "conditional-full:" + inner_->type_name();
}

// ---- registration ---------------------------------------------------------

void register_full_attention_types(AttentionRegistry& registry) {
  registry.add(
      {"full",
       "exact softmax attention, fused (online softmax, O(N·H·L) extra memory)",
       {ParamSpec::real("softmax_temp", std::nullopt, "scale of the scores q·k; default 1/sqrt(E)",
                        0.0)
            .exclusive_min(),
        ParamSpec::real("attention_dropout", 0.0,
                        "dropout on the attention weights in training (then the L×S "
                        "matrix is materialised)",
                        0.0, 1.0)
            .exclusive_max()},
       [](const Params& p, const AttentionDims&) -> AttentionPtr {
         return std::make_shared<FullAttention>(p.get_optional_float("softmax_temp"),
                                                p.get_float("attention_dropout"));
       },
       Capabilities().masks("any").rows("yes"),
       [](const Params& p, const AttentionDims&) -> RecurrentAttentionPtr {
         // attention_dropout is accepted; steps never drop (inference).
         return std::make_shared<RecurrentFullAttention>(p.get_optional_float("softmax_temp"));
       },
       [](const Params& p, const AttentionDims&) -> RecurrentCrossAttentionPtr {
         return std::make_shared<RecurrentCrossFullAttention>(p.get_optional_float("softmax_temp"));
       }});
}

}  // namespace fastattn
