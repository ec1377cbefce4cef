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
//                  O(F·M) time and constant memory per step and head. The
//                  exponential maps (favor, generalized with kernel_fn exp)
//                  add offset (N, H): S and Z hold the sums times
//                  exp(-offset), the largest key offset so far
//                  (FeatureMap::map_keys), rescaled when it grows, and eps is
//                  scaled with them, as in the batch form.
//   full           key/value cache (K (N, H, t, E), V (N, H, t, M)), growing
//                  by one row per step into preallocated buffers whose
//                  capacity doubles (amortised O(E + M) copy per step);
//                  out = softmax(temp·q·K^T) V over the cached rows (the
//                  fused operator's one-query path on the buffers, limited
//                  to the filled rows by key lengths: no copy of the cache).
//                  O(t·(E + M)) per step.
//   hard-retrieval key/value cache (K (N, H, t, E), V (N, H, t, M)); out =
//                  V[argmax_j q·k_j] (the fused operator on the buffers, as
//                  for full). O(t·E + M) per step.
//   aft-simple     {m, num, den} (N, H, E): the running key maximum and the
//                  two sums per channel (RecurrentAftSimpleAttention,
//                  include/fastattn/aft.h). O(E) per step.
// With the same parameters (and so the same feature map weights), step i
// equals row i of the batch type's output under a causal mask.
//
// Every feature map's steps give the batch form's numbers (to rounding): the
// exponential maps' stabilising offset is carried in the state (above), and
// both forms scale eps with it, so neither depends on the offset. Steps never
// redraw random features (a redraw mid-sequence would invalidate the state).
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

  // Fixed-size stepping (torch.compile, static decoding loops): a zero state
  // for N sequences of H heads with room for `capacity` positions where the
  // state grows with them (key/value caches; constant-size states ignore
  // it). Tensors on `options`' dtype and device, except fill counters (int64
  // scalars on the CPU).
  virtual std::vector<torch::Tensor> make_state(int64_t N, int64_t H, int64_t E, int64_t M,
                                                int64_t capacity,
                                                const torch::TensorOptions& options) const = 0;
  // One step that updates a make_state state in place -> output (N, H, M),
  // the output step() gives for the same positions. Throws, naming the
  // capacity, when a cache is full.
  virtual torch::Tensor step_in_place(const torch::Tensor& query, const torch::Tensor& key,
                                      const torch::Tensor& value, torch::TensorList state) = 0;
  // What of a state step() returned the next step needs, without buffers
  // kept for growth (the attention_step operator's functional state).
  virtual std::vector<torch::Tensor> compact_state(const RecurrentState& state) const {
    return state.tensors;
  }
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
  // {S (N, H, F, M), Z (N, H, F)} zeros; updated by step_in_place.
  std::vector<torch::Tensor> make_state(int64_t N, int64_t H, int64_t E, int64_t M,
                                        int64_t capacity,
                                        const torch::TensorOptions& options) const override;
  torch::Tensor step_in_place(const torch::Tensor& query, const torch::Tensor& key,
                              const torch::Tensor& value, torch::TensorList state) override;
  const std::shared_ptr<FeatureMap>& feature_map() const { return feature_map_; }

 private:
  std::shared_ptr<FeatureMap> feature_map_;
  double eps_;
};

// The key/value cache the step forms of full and hard-retrieval share.
//
// State for step(): empty, or {K (N, H, t, E), V (N, H, t, M)} (a cache the
// caller built, e.g. from a prefix, or the compact state of the
// attention_step operator: copied into new buffers of exactly t + 1 rows at
// the next step), or
// what step returns: {K, V, K buffer (N, H, capacity, E), V buffer
// (N, H, capacity, M), filled (int64 scalar)}, where K and V are views of the
// first t rows of the buffers and `filled` counts the buffer rows written by
// any state. A step appends row t in place when the buffer has room and no
// other state has written past t (filled == t); otherwise (a second step from
// the same state, a full buffer) it copies the t rows into new buffers of
// capacity 2·(t + 1). Rows a state sees are never overwritten, so the state
// stays an input that is not modified (only the shared `filled` counter
// moves).
//
// State for step_in_place(): {K buffer (N, H, capacity, E), V buffer
// (N, H, capacity, M), filled (int64 scalar on the CPU)} from make_state; a
// step writes row `filled` and counts it.
class RecurrentCacheAttention : public RecurrentAttentionBase {
 public:
  std::vector<torch::Tensor> make_state(int64_t N, int64_t H, int64_t E, int64_t M,
                                        int64_t capacity,
                                        const torch::TensorOptions& options) const override;
  torch::Tensor step_in_place(const torch::Tensor& query, const torch::Tensor& key,
                              const torch::Tensor& value, torch::TensorList state) override;
  // {K, V}: the views of the filled rows.
  std::vector<torch::Tensor> compact_state(const RecurrentState& state) const override {
    return {state.tensors.at(0), state.tensors.at(1)};
  }
};

// full (causal) softmax attention with a key/value cache (above).
class RecurrentFullAttention : public RecurrentCacheAttention {
 public:
  explicit RecurrentFullAttention(std::optional<double> softmax_temp = std::nullopt);
  // The new state has t + 1 rows in K and V.
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
class RecurrentHardRetrievalAttention : public RecurrentCacheAttention {
 public:
  RecurrentHardRetrievalAttention() = default;
  // state: empty or the cache of RecurrentFullAttention ({K (N, H, t, E),
  // V (N, H, t, M)}, optionally with the buffers a step returns); the new
  // state has t + 1 rows, appended in amortised O(1) as for full.
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

// ---- cross-attention over a fixed memory ----------------------------------
//
// One query per step attends to a memory known in advance (a decoder's
// encoder output): prepare the memory once, then step any number of queries.
//
//   auto cross = fastattn::make_recurrent_cross_attention("linear", {}, {H, E, M});
//   auto memory = cross->prepare(keys, values, key_lengths);  // (N,H,S,E), (N,H,S,M), (N,)
//   auto out = cross->step(query, memory);                    // (N, H, E) -> (N, H, M)
//
// Step i of a query sequence equals row i of the batch type on the whole
// query sequence for types whose rows are independent of the other queries
// (linear, full, exact-topk, hard-retrieval, ...). Types that group queries
// (clustered, improved-clustered) give, per step, the batch type applied to
// that single query (one cluster of one), which is what a decoder that sees
// one query at a time can compute.
//
//   linear   memory state {S (N, H, F, M), Z (N, H, F)}: S = sum_j phi(k_j) v_j^T,
//            Z = sum_j phi(k_j) over the kept (unpadded) keys, mapped with the
//            batch type's key map (FAVOR+'s offset over the whole memory).
//            prepare O(S·F·M), step O(F·M) per head.
//   full     memory state {K, V[, key_lengths]}; step through the fused
//            full_attention operator. O(S·(E + M)) per step and head.
//   any other registered type (generic): memory state {K, V[, key_lengths]};
//            step calls the batch type with L = 1 and a key-lengths mask.
class RecurrentCrossAttentionBase : public torch::nn::Module {
 public:
  // keys (N, H, S, E), values (N, H, S, M), key_lengths (N,) integer in
  // [0, S] or none -> the memory state.
  virtual RecurrentState prepare(const torch::Tensor& keys, const torch::Tensor& values,
                                 const std::optional<torch::Tensor>& key_lengths) = 0;
  // query (N, H, E), memory state from prepare -> (N, H, M). The state is not modified.
  virtual torch::Tensor step(const torch::Tensor& query, const RecurrentState& memory) = 0;
  // The registry name of the batch type.
  virtual std::string type_name() const = 0;
};
using RecurrentCrossAttentionPtr = std::shared_ptr<RecurrentCrossAttentionBase>;

// linear over a memory. The feature map is a submodule named "feature_map",
// as in LinearAttention.
class RecurrentCrossLinearAttention : public RecurrentCrossAttentionBase {
 public:
  explicit RecurrentCrossLinearAttention(std::shared_ptr<FeatureMap> feature_map,
                                         double eps = 1e-6);
  RecurrentState prepare(const torch::Tensor& keys, const torch::Tensor& values,
                         const std::optional<torch::Tensor>& key_lengths) override;
  torch::Tensor step(const torch::Tensor& query, const RecurrentState& memory) override;
  std::string type_name() const override { return "linear"; }

 private:
  std::shared_ptr<FeatureMap> feature_map_;
  double eps_;
};

// full over a memory, through the fused operator.
class RecurrentCrossFullAttention : public RecurrentCrossAttentionBase {
 public:
  explicit RecurrentCrossFullAttention(std::optional<double> softmax_temp = std::nullopt);
  RecurrentState prepare(const torch::Tensor& keys, const torch::Tensor& values,
                         const std::optional<torch::Tensor>& key_lengths) override;
  torch::Tensor step(const torch::Tensor& query, const RecurrentState& memory) override;
  std::string type_name() const override { return "full"; }

 private:
  std::optional<double> softmax_temp_;
};

// hard-retrieval over a memory: memory state {K, V[, key_lengths]}; each
// head of a step returns the value row of its argmax raw score q·k over the
// kept keys (zeros when none is kept), as the batch type in eval mode. A step
// is one call of the fused operator: a dot product per key and a copy of one
// value row per head, no softmax, no value read but the retrieved ones.
// Steps never sample (they are for inference).
class RecurrentCrossHardRetrievalAttention : public RecurrentCrossAttentionBase {
 public:
  RecurrentState prepare(const torch::Tensor& keys, const torch::Tensor& values,
                         const std::optional<torch::Tensor>& key_lengths) override;
  torch::Tensor step(const torch::Tensor& query, const RecurrentState& memory) override;
  std::string type_name() const override { return "hard-retrieval"; }
};

// Any batch attention type over a memory: caches K and V and calls the batch
// type with one query. The batch module's parameters, buffers and submodules
// are registered under their own names (no extra prefix), so a wrapper
// around make_attention(name, ...) has the parameter names of the batch type
// and loads its weights by name. Its training flag follows the wrapper's.
class RecurrentCrossGenericAttention : public RecurrentCrossAttentionBase {
 public:
  explicit RecurrentCrossGenericAttention(AttentionPtr attention);
  RecurrentState prepare(const torch::Tensor& keys, const torch::Tensor& values,
                         const std::optional<torch::Tensor>& key_lengths) override;
  torch::Tensor step(const torch::Tensor& query, const RecurrentState& memory) override;
  std::string type_name() const override { return attention_->type_name(); }
  const AttentionPtr& attention() const { return attention_; }

 private:
  AttentionPtr attention_;
};

// Builds the cross-attention step form of any registered type (including
// conditional-full:<type>) from the batch type's parameters: "linear",
// "full" and "hard-retrieval" get their dedicated forms, every other type the
// generic one. Causal types (causal-linear, causal-*) cannot attend to a memory: an error says so.
RecurrentCrossAttentionPtr make_recurrent_cross_attention(const std::string& name,
                                                          const ParamMap& params = {},
                                                          const AttentionDims& dims = {});

}  // namespace fastattn
