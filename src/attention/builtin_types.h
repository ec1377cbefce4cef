// The built-in attention types, one registration function per family
// (internal). AttentionRegistry::global() calls register_builtin_types once;
// a new family declares its function here and adds one line below.
#pragma once

#include <cmath>
#include <optional>

#include "fastattn/registry.h"

namespace fastattn {

// full (src/attention/full.cpp).
void register_full_attention_types(AttentionRegistry& registry);

// linear, causal-linear (src/attention/linear.cpp).
void register_linear_attention_types(AttentionRegistry& registry);
// clustered, improved-clustered, exact-topk (src/attention/clustered.cpp).
void register_clustered_attention_types(AttentionRegistry& registry);
// local, sparse-strided, sparse-fixed (src/attention/sparse.cpp).
void register_sparse_attention_types(AttentionRegistry& registry);

// hard-retrieval (src/attention/hard_retrieval.cpp).
void register_hard_retrieval_attention_types(AttentionRegistry& registry);

// reformer (src/attention/reformer.cpp).
void register_reformer_attention_types(AttentionRegistry& registry);

// clusterformer (src/attention/clusterformer.cpp).
void register_clusterformer_attention_types(AttentionRegistry& registry);

// aft-simple, aft-full (src/attention/aft.cpp).
void register_aft_attention_types(AttentionRegistry& registry);

// The attention_dropout parameter of the softmax types: applied in training
// mode only (fused where the type's kernels have it, issue 64).
// The softmax types' temperature (one spec; `description` where a type
// reads it differently).
inline ParamSpec softmax_temp_spec(
    const char* description = "scale of the scores q·k; default 1/sqrt(E)") {
  return ParamSpec::real("softmax_temp", std::nullopt, description, 0.0).exclusive_min();
}

// The seed of a type's own generator (what it draws: `draws`); without it
// the global CPU generator (torch::manual_seed).
inline ParamSpec seed_spec(const std::string& draws) {
  return ParamSpec::integer(
      "seed", std::nullopt,
      "seed of the module's generator (" + draws + "); default: the global CPU generator", 0);
}

inline ParamSpec attention_dropout_spec() {
  return ParamSpec::real("attention_dropout", 0.0,
                         "dropout on the attention weights, in training mode only", 0.0, 1.0)
      .exclusive_max();
}

// The checks of softmax_temp_spec and attention_dropout_spec in the types'
// constructors (which run without the registry too).
inline void check_softmax_temp(const char* who, const std::optional<double>& t) {
  TORCH_CHECK(!t || (std::isfinite(*t) && *t > 0), who,
              ": softmax_temp must be a finite number > 0, got ", t.value_or(0.0));
}
inline void check_attention_dropout(const char* who, double p) {
  TORCH_CHECK(p >= 0 && p < 1, who, ": attention_dropout must be in [0, 1), got ", p);
}

inline void register_builtin_types(AttentionRegistry& registry) {
  register_full_attention_types(registry);
  register_linear_attention_types(registry);
  register_clustered_attention_types(registry);
  register_hard_retrieval_attention_types(registry);
  register_sparse_attention_types(registry);
  register_reformer_attention_types(registry);
  register_clusterformer_attention_types(registry);
  register_aft_attention_types(registry);
}

}  // namespace fastattn
