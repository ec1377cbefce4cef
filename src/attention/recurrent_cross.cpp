// Recurrent cross-attention's shared parts (include/fastattn/recurrent.h):
// one query per step over a fixed memory, prepared once. Memory and query
// checks, the cached {K, V[, key_lengths]} memory, the generic form (any
// registered type: K, V cached, the batch type called with L = 1) and
// make_recurrent_cross_attention. The dedicated forms live beside their
// types: linear (linear.cpp: S = sum_j phi(k_j) v_j^T and Z precomputed,
// O(F·M) a step), full (full.cpp: the fused operator over the cache) and
// hard-retrieval (hard_retrieval.cpp).
// Tested by tests/cpp/test_recurrent_decoder.cpp (each step against the batch
// type's row for that query).
#include <cmath>

#include "attention/normaliser_eps.h"
#include "fastattn/feature_maps.h"
#include "fastattn/ops.h"
#include "fastattn/recurrent.h"
#include "attention/step_state.h"
#include "ops/op_util.h"

namespace fastattn {

using torch::Tensor;

// keys (N, H, S, E), values (N, H, S, M), key_lengths (N,) integer in [0, S].
void check_memory(const char* type, const Tensor& keys, const Tensor& values,
                  const std::optional<Tensor>& key_lengths) {
  TORCH_CHECK(keys.defined() && keys.dim() == 4, type, ": keys must have shape (N, H, S, E), got ",
              keys.defined() ? keys.sizes() : c10::IntArrayRef{});
  const int64_t N = keys.size(0), H = keys.size(1), S = keys.size(2);
  TORCH_CHECK(values.defined() && values.dim() == 4 && values.size(0) == N && values.size(1) == H &&
                  values.size(2) == S,
              type, ": values must have shape (N, H, S, M) = (", N, ", ", H, ", ", S,
              ", M) like the keys, got ", values.defined() ? values.sizes() : c10::IntArrayRef{});
  ops::check_attention_dtype(type, "keys", keys);
  TORCH_CHECK(values.scalar_type() == keys.scalar_type(), type, ": values must be ",
              keys.scalar_type(), " like the keys, got ", values.scalar_type());
  TORCH_CHECK(values.device() == keys.device(), type, ": values must be on ", keys.device(),
              " like the keys, got ", values.device());
  if (key_lengths) {
    const auto& kl = *key_lengths;
    TORCH_CHECK(kl.defined() && kl.dim() == 1 && kl.size(0) == N, type,
                ": key_lengths must have shape (N,) = (", N, "), got ",
                kl.defined() ? kl.sizes() : c10::IntArrayRef{});
    TORCH_CHECK(!kl.is_floating_point() && kl.scalar_type() != torch::kBool, type,
                ": key_lengths must be an integer tensor, got ", kl.scalar_type());
    if (N > 0) {
      const auto lo = kl.min().item<int64_t>(), hi = kl.max().item<int64_t>();
      TORCH_CHECK(lo >= 0 && hi <= S, type, ": key_lengths must be in [0, S = ", S, "], got [", lo,
                  ", ", hi, "]");
    }
  }
}

namespace {

// query (N, H, E) against the memory's keys (N, H, S, E).
void check_query(const char* type, const Tensor& query, const Tensor& keys) {
  TORCH_CHECK(query.defined() && query.dim() == 3 && query.size(0) == keys.size(0) &&
                  query.size(1) == keys.size(1) && query.size(2) == keys.size(3),
              type, ": query must have shape (N, H, E) = (", keys.size(0), ", ", keys.size(1), ", ",
              keys.size(3), ") like the memory's keys, got ",
              query.defined() ? query.sizes() : c10::IntArrayRef{});
  TORCH_CHECK(query.scalar_type() == keys.scalar_type(), type, ": query must be ",
              keys.scalar_type(), " like the memory, got ", query.scalar_type());
  TORCH_CHECK(query.device() == keys.device(), type, ": query must be on ", keys.device(),
              " like the memory, got ", query.device());
}

}  // namespace

RecurrentState cache_memory(const char* type, const Tensor& keys, const Tensor& values,
                            const std::optional<Tensor>& key_lengths, bool contiguous) {
  check_memory(type, keys, values, key_lengths);
  RecurrentState s{
      {contiguous ? keys.contiguous() : keys, contiguous ? values.contiguous() : values}};
  if (key_lengths) s.tensors.push_back(key_lengths->to(keys.device(), torch::kLong));
  return s;
}

std::optional<Tensor> cached_key_lengths(const char* type, const Tensor& query,
                                         const RecurrentState& memory) {
  TORCH_CHECK(memory.tensors.size() == 2 || memory.tensors.size() == 3, type,
              ": memory state must hold {K, V} or {K, V, key_lengths} from prepare, got ",
              memory.tensors.size(), " tensors");
  check_query(type, query, memory.tensors[0]);
  if (memory.tensors.size() == 3) return memory.tensors[2];
  return std::nullopt;
}

// ---- generic ----------------------------------------------------------------

RecurrentCrossGenericAttention::RecurrentCrossGenericAttention(AttentionPtr attention)
    : attention_(std::move(attention)) {
  TORCH_CHECK(attention_,
              "RecurrentCrossGenericAttention: attention must be an attention module, got null");
  // The batch module's own names, without a prefix, so that weights load by name.
  for (const auto& p : attention_->named_parameters(/*recurse=*/false)) {
    register_parameter(p.key(), p.value(), p.value().requires_grad());
  }
  for (const auto& b : attention_->named_buffers(/*recurse=*/false)) {
    register_buffer(b.key(), b.value());
  }
  for (const auto& c : attention_->named_children()) register_module(c.key(), c.value());
}

RecurrentState RecurrentCrossGenericAttention::prepare(const Tensor& keys,    // (N, H, S, E)
                                                       const Tensor& values,  // (N, H, S, M)
                                                       const std::optional<Tensor>& key_lengths) {
  return cache_memory("recurrent cross attention", keys, values, key_lengths,
                      /*contiguous=*/false);
}

Tensor RecurrentCrossGenericAttention::step(const Tensor& query,  // (N, H, E)
                                            const RecurrentState& memory) {
  const std::string type = "recurrent cross " + attention_->type_name();
  const auto lengths = cached_key_lengths(type.c_str(), query, memory);
  Mask mask;
  if (lengths) mask = mask.with_key_lengths(*lengths);
  attention_->train(is_training());
  return attention_->forward(query.unsqueeze(2), memory.tensors[0], memory.tensors[1], mask)
      .squeeze(2);  // (N, H, M)
}

// ---- construction by name ---------------------------------------------------

RecurrentCrossAttentionPtr make_recurrent_cross_attention(const std::string& name,
                                                          const ParamMap& params,
                                                          const AttentionDims& dims) {
  const auto& registry = AttentionRegistry::global();
  TORCH_CHECK(registry.contains(name), "make_recurrent_cross_attention: unknown attention type '",
              name, "'");
  const AttentionType type = registry.get(name);
  const auto& caps = type.capabilities;
  TORCH_CHECK(caps.bidirectional,
              "make_recurrent_cross_attention: name must be a type that attends to a whole "
              "memory, got the causal type '",
              name, "'",
              caps.bidirectional_form.empty()
                  ? std::string()
                  : " (for cross-attention use '" + caps.bidirectional_form + "')");
  if (type.recurrent_cross) return type.recurrent_cross(registry.validate(name, params), dims);
  return std::make_shared<RecurrentCrossGenericAttention>(make_attention(name, params, dims));
}

}  // namespace fastattn
