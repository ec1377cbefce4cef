// Recurrent (token-by-token) attention: the step forms of causal attention
// types, for autoregressive inference. A step takes one query, key and value
// per (n, h) and the state of the previous steps, and returns the output for
// that query with the new state; the state is an explicit input and output
// (nothing is hidden in the module), so callers can keep, copy or drop it.
//
//   auto attn = fastattn::make_recurrent_attention("causal-linear", {{"feature_map", "elu"}},
//                                                  {heads, E, M});
//   fastattn::RecurrentState state;  // empty: before the first token
//   for (int64_t i = 0; i < L; ++i) {
//     auto [out, next] = attn->step(q[i], k[i], v[i], state);  // (N, H, E/E/M) -> (N, H, M)
//     state = std::move(next);
//   }
//
// Types:
//   causal-linear  state (S (N, H, F, M), Z (N, H, F)):
//                  S += phi(k) v^T, Z += phi(k), out = phi(q)·S / (phi(q)·Z + eps).
//                  O(F·M) time and constant memory per step and head.
//   full           key/value cache (K (N, H, t, E), V (N, H, t, M)), growing
//                  by one row per step; out = softmax(temp·q·K^T) V through
//                  the fused full_attention operator. O(t·(E + M)) per step.
//   hard-retrieval key/value cache as for full; out = V[argmax_j q·k_j], a
//                  gather. O(t·E + M) per step.
// With the same parameters (and so the same feature map weights), step i
// equals row i of the batch type's output under a causal mask.
//
// Limitation (random feature maps): the batch causal-linear type stabilises
// FAVOR+ keys by subtracting the max exponent over the whole sequence, which
// a step cannot know in advance. The recurrent form maps keys with the
// unstabilised map (FeatureMap::forward, a fixed offset of 0) and queries with
// forward_queries (a per-query offset, which cancels). The two forms then
// agree up to how eps weighs against the normaliser, and very large key
// exponents can overflow in the recurrent form. For elu and relu (and rff,
// which has no offset) both forms compute the same thing. Steps never redraw
// random features (a redraw mid-sequence would invalidate the state).
//
// Tested by tests/cpp/test_recurrent.cpp.
#pragma once

#include <torch/torch.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "fastattn/attention.h"
#include "fastattn/registry.h"

namespace fastattn {

// The state of a recurrent attention: a few tensors whose meaning belongs to
// the type (see the file comment). Empty before the first step.
struct RecurrentState {
  std::vector<torch::Tensor> tensors;
  bool empty() const { return tensors.empty(); }
};

class RecurrentAttentionBase : public torch::nn::Module {
 public:
  // query (N, H, E), key (N, H, E), value (N, H, M), state from the previous
  // step (or empty) -> (output (N, H, M), new state). `state` is not modified.
  virtual std::pair<torch::Tensor, RecurrentState> step(const torch::Tensor& query,
                                                        const torch::Tensor& key,
                                                        const torch::Tensor& value,
                                                        const RecurrentState& state) = 0;
  // The registry name of the batch type this is the step form of.
  virtual std::string type_name() const = 0;
};
using RecurrentAttentionPtr = std::shared_ptr<RecurrentAttentionBase>;

// Checks the common step contract: query (N, H, E), key (N, H, E) and value
// (N, H, M) with agreeing N, H, E, dtype and device; throws naming the argument.
void check_step_inputs(const char* type, const torch::Tensor& query, const torch::Tensor& key,
                       const torch::Tensor& value);

// causal-linear as a recurrence. The feature map is a submodule named
// "feature_map", as in CausalLinearAttention: pass that type's feature_map()
// to share its weights.
class RecurrentLinearAttention : public RecurrentAttentionBase {
 public:
  explicit RecurrentLinearAttention(std::shared_ptr<FeatureMap> feature_map, double eps = 1e-6);
  // state: empty or {S (N, H, F, M), Z (N, H, F)}.
  std::pair<torch::Tensor, RecurrentState> step(const torch::Tensor& query,
                                                const torch::Tensor& key,
                                                const torch::Tensor& value,
                                                const RecurrentState& state) override;
  std::string type_name() const override { return "causal-linear"; }
  const std::shared_ptr<FeatureMap>& feature_map() const { return feature_map_; }

 private:
  std::shared_ptr<FeatureMap> feature_map_;
  double eps_;
};

// full (causal) softmax attention with a key/value cache.
class RecurrentFullAttention : public RecurrentAttentionBase {
 public:
  explicit RecurrentFullAttention(std::optional<double> softmax_temp = std::nullopt);
  // state: empty or {K (N, H, t, E), V (N, H, t, M)}; the new state has t + 1 rows.
  std::pair<torch::Tensor, RecurrentState> step(const torch::Tensor& query,
                                                const torch::Tensor& key,
                                                const torch::Tensor& value,
                                                const RecurrentState& state) override;
  std::string type_name() const override { return "full"; }

 private:
  std::optional<double> softmax_temp_;
};

// hard-retrieval with a key/value cache (Xu et al.): each head of the new
// query retrieves the cached value row at argmax_j q·k_j (raw scores, ties to
// the lowest j), as the batch type does in evaluation; steps never sample.
// O(t·E + M) per step and head: a dot product per cached key, then a gather.
// Only the retrieved value rows are read: a caller that caches the layer's
// inputs instead of projected values can call retrieve() and project just
// those rows (H per step instead of t), as the paper suggests.
class RecurrentHardRetrievalAttention : public RecurrentAttentionBase {
 public:
  RecurrentHardRetrievalAttention() = default;
  // state: empty or {K (N, H, t, E), V (N, H, t, M)}; the new state has t + 1 rows.
  std::pair<torch::Tensor, RecurrentState> step(const torch::Tensor& query,
                                                const torch::Tensor& key,
                                                const torch::Tensor& value,
                                                const RecurrentState& state) override;
  // The cached row each head retrieves: query (N, H, E), keys (N, H, t, E)
  // -> (N, H) int64 in [0, t) (-1 when t == 0). Reads no values.
  static torch::Tensor retrieve(const torch::Tensor& query, const torch::Tensor& keys);
  std::string type_name() const override { return "hard-retrieval"; }
};

// The names make_recurrent_attention accepts ("causal-linear", "full",
// "hard-retrieval").
const std::vector<std::string>& recurrent_attention_names();

// Builds the step form of a registered type from the same parameters as the
// batch type (validated against the registry's specs, so the same seed gives
// the same feature map). An unsupported name gives an error listing the
// supported ones. For full, attention_dropout is accepted but steps never
// drop (steps are for inference).
RecurrentAttentionPtr make_recurrent_attention(const std::string& name, const ParamMap& params = {},
                                               const AttentionDims& dims = {});

}  // namespace fastattn
