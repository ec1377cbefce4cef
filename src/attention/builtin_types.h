// The built-in attention types, one registration function per family
// (internal). AttentionRegistry::global() calls register_builtin_types once;
// a new family declares its function here and adds one line below.
#pragma once

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

inline void register_builtin_types(AttentionRegistry& registry) {
  register_full_attention_types(registry);
  register_linear_attention_types(registry);
  register_clustered_attention_types(registry);
  register_hard_retrieval_attention_types(registry);
  register_sparse_attention_types(registry);
  register_reformer_attention_types(registry);
  register_clusterformer_attention_types(registry);
}

}  // namespace fastattn
