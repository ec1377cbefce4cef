// Recurrent (token-by-token) attention: step forms of `causal-linear` (an RNN
// with state S = sum_j phi(k_j) v_j^T, Z = sum_j phi(k_j): O(F·M) per step)
// and `full` (a growing key/value cache: O(t·(E + M)) at step t), and
// make_recurrent_attention. See include/fastattn/recurrent.h for the
// contract and the FAVOR+ key-offset limitation.
// Tested by tests/cpp/test_recurrent.cpp (each step against the batch type's
// causal output).
#include "fastattn/recurrent.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "attention/normaliser_eps.h"
#include "fastattn/feature_maps.h"
#include "fastattn/ops.h"
#include "ops/op_util.h"

namespace fastattn {

using torch::Tensor;

void check_step_inputs(const char* type, const Tensor& query, const Tensor& key,
                       const Tensor& value) {
  TORCH_CHECK(query.defined() && key.defined() && value.defined(), type,
              ": query, key and value must be defined tensors");
  TORCH_CHECK(query.dim() == 3, type, ": query must have shape (N, H, E), got ", query.sizes());
  const int64_t N = query.size(0), H = query.size(1), E = query.size(2);
  TORCH_CHECK(key.dim() == 3 && key.size(0) == N && key.size(1) == H && key.size(2) == E, type,
              ": key must have shape (N, H, E) = (", N, ", ", H, ", ", E, ") like the query, got ",
              key.sizes());
  TORCH_CHECK(value.dim() == 3 && value.size(0) == N && value.size(1) == H, type,
              ": value must have shape (N, H, M) = (", N, ", ", H, ", M), got ", value.sizes());
  ops::check_attention_dtype(type, "query", query);
  TORCH_CHECK(key.scalar_type() == query.scalar_type(), type, ": key must be ", query.scalar_type(),
              " like the query, got ", key.scalar_type());
  TORCH_CHECK(value.scalar_type() == query.scalar_type(), type, ": value must be ",
              query.scalar_type(), " like the query, got ", value.scalar_type());
  TORCH_CHECK(key.device() == query.device(), type, ": key must be on ", query.device(),
              " like the query, got ", key.device());
  TORCH_CHECK(value.device() == query.device(), type, ": value must be on ", query.device(),
              " like the query, got ", value.device());
}

namespace {

// Checks state tensor `name` against the expected shape, dtype and device.
void check_state_tensor(const char* type, const char* name, const Tensor& t,
                        c10::IntArrayRef expected, const Tensor& like) {
  TORCH_CHECK(t.defined() && t.sizes() == expected, type, ": state ", name, " must have shape ",
              expected, ", got ", t.defined() ? t.sizes() : c10::IntArrayRef{});
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), type, ": state ", name, " must be ",
              like.scalar_type(), " like the query, got ", t.scalar_type());
  TORCH_CHECK(t.device() == like.device(), type, ": state ", name, " must be on ", like.device(),
              " like the query, got ", t.device());
}

}  // namespace

// ---- causal-linear ----------------------------------------------------------

RecurrentLinearAttention::RecurrentLinearAttention(std::shared_ptr<FeatureMap> feature_map,
                                                   double eps)
    : feature_map_(std::move(feature_map)), eps_(eps) {
  TORCH_CHECK(feature_map_,
              "RecurrentLinearAttention: feature_map must be a feature map, got null");
  TORCH_CHECK(std::isfinite(eps_) && eps_ > 0,
              "RecurrentLinearAttention: eps must be a finite number > 0, got ", eps_);
  register_module("feature_map", feature_map_);
}

std::pair<Tensor, RecurrentState> RecurrentLinearAttention::step(const Tensor& query,  // (N, H, E)
                                                                 const Tensor& key,    // (N, H, E)
                                                                 const Tensor& value,  // (N, H, M)
                                                                 const RecurrentState& state) {
  constexpr const char* type = "recurrent causal-linear";
  check_step_inputs(type, query, key, value);
  const int64_t N = query.size(0), H = query.size(1), M = value.size(2);
  const int64_t F = feature_map_->output_dim();
  auto qf = feature_map_->forward_queries(query.unsqueeze(2));  // (N, H, 1, F)
  // The key's features shifted by its own offset c_k (exponential maps; see
  // include/fastattn/feature_maps.h), or unshifted.
  auto [kf, key_offset] = feature_map_->map_keys(key.unsqueeze(2));  // (N, H, 1, F)
  TORCH_CHECK(qf.dim() == 4 && qf.size(3) == F && kf.sizes() == qf.sizes(), type, ": feature map '",
              feature_map_->name(), "' must map (N, H, 1, E) to (N, H, 1, ", F, "), got ",
              qf.sizes(), " for the query and ", kf.sizes(), " for the key");
  const bool shifted = key_offset.defined();
  const size_t tensors = shifted ? 3 : 2;
  auto kv = torch::matmul(kf.transpose(-1, -2), value.unsqueeze(2));  // (N, H, F, M)
  auto kz = kf.squeeze(2);                                            // (N, H, F)
  Tensor S, Z, offset;
  if (state.empty()) {
    S = kv;
    Z = kz;
    if (shifted) offset = key_offset.view({N, H});
  } else {
    TORCH_CHECK(state.tensors.size() == tensors, type,
                ": state must be empty or hold {S (N, H, F, M), Z (N, H, F)",
                shifted ? ", offset (N, H)" : "", "} for feature map '", feature_map_->name(),
                "', got ", state.tensors.size(), " tensors");
    check_state_tensor(type, "S", state.tensors[0], {N, H, F, M}, query);
    check_state_tensor(type, "Z", state.tensors[1], {N, H, F}, query);
    if (!shifted) {
      S = state.tensors[0] + kv;
      Z = state.tensors[1] + kz;
    } else {
      // S and Z hold the unshifted sums times exp(-offset), offset the largest
      // key offset so far: when this key's is larger, the sums are rescaled
      // to it; otherwise the key is. make_state's offset -inf: no key yet.
      check_state_tensor(type, "offset", state.tensors[2], {N, H}, query);
      const auto& old = state.tensors[2];
      offset = torch::maximum(old, key_offset.view({N, H}));
      auto keep_old = (old - offset).exp(), scale_key = (key_offset.view({N, H}) - offset).exp();
      S = state.tensors[0] * keep_old.view({N, H, 1, 1}) + kv * scale_key.view({N, H, 1, 1});
      Z = state.tensors[1] * keep_old.view({N, H, 1}) + kz * scale_key.view({N, H, 1});
    }
  }
  auto num = torch::matmul(qf, S).squeeze(2);  // (N, H, M)
  auto eps = shifted_eps(eps_, shifted ? offset.view({N, H, 1}) : Tensor(), qf.scalar_type(),
                         qf.options());
  auto den = (qf.squeeze(2) * Z).sum(-1, /*keepdim=*/true) + eps;  // (N, H, 1)
  RecurrentState next{{S, Z}};
  if (shifted) next.tensors.push_back(offset);
  return {num / den, std::move(next)};
}

std::vector<Tensor> RecurrentLinearAttention::make_state(
    int64_t N, int64_t H, int64_t /*E*/, int64_t M, int64_t /*capacity*/,
    const torch::TensorOptions& options) const {
  const int64_t F = feature_map_->output_dim();
  std::vector<Tensor> state{torch::zeros({N, H, F, M}, options), torch::zeros({N, H, F}, options)};
  // The running offset of the exponential maps: -inf before the first key.
  if (feature_map_->shifts_keys())
    state.push_back(torch::full({N, H}, -std::numeric_limits<double>::infinity(), options));
  return state;
}

Tensor RecurrentLinearAttention::step_in_place(const Tensor& query, const Tensor& key,
                                               const Tensor& value, torch::TensorList state) {
  const size_t tensors = feature_map_->shifts_keys() ? 3 : 2;
  TORCH_CHECK(state.size() == tensors,
              "recurrent causal-linear: an in-place state must hold {S (N, H, F, M), Z (N, H, F)",
              tensors == 3 ? ", offset (N, H)" : "", "} from make_state, got ", state.size(),
              " tensors");
  auto [out, next] = step(query, key, value, RecurrentState{state.vec()});
  for (size_t i = 0; i < tensors; ++i) state[i].copy_(next.tensors[i]);
  return out;
}

// ---- full -------------------------------------------------------------------

RecurrentFullAttention::RecurrentFullAttention(std::optional<double> softmax_temp)
    : softmax_temp_(softmax_temp) {
  TORCH_CHECK(!softmax_temp || (std::isfinite(*softmax_temp) && *softmax_temp > 0),
              "RecurrentFullAttention: softmax_temp must be a finite number > 0, got ",
              softmax_temp.value_or(0.0));
}

namespace {

// Smallest buffer a cache starts with (rows).
constexpr int64_t kMinCacheCapacity = 16;

// New buffers of capacity `cap` > t holding the t rows of K and V:
// {K view, V view, K buffer, V buffer, filled = t}.
RecurrentState grow_cache(const Tensor& K, const Tensor& V, int64_t t, int64_t cap) {
  auto kb = torch::empty({K.size(0), K.size(1), cap, K.size(3)}, K.options());
  auto vb = torch::empty({V.size(0), V.size(1), cap, V.size(3)}, V.options());
  if (t > 0) {
    kb.narrow(2, 0, t).copy_(K);
    vb.narrow(2, 0, t).copy_(V);
  }
  auto filled = torch::full({}, t, torch::TensorOptions().dtype(torch::kLong));
  return RecurrentState{{kb.narrow(2, 0, t), vb.narrow(2, 0, t), kb, vb, filled}};
}

// Appends (key, value) to a key/value cache state (empty, {K, V}, or the
// {K, V, K buffer, V buffer, filled} a step returns): in place where the
// buffer has room and no other state has written row t yet, else into grown
// buffers. Returns the new 5-tensor state; its K and V views hold t + 1 rows.
RecurrentState append_to_cache(const char* type, const Tensor& query, const Tensor& key,
                               const Tensor& value, const RecurrentState& state) {
  check_step_inputs(type, query, key, value);
  const int64_t N = query.size(0), H = query.size(1), E = query.size(2), M = value.size(2);
  RecurrentState cache;  // {K, V, K buffer, V buffer, filled} with room for row t
  int64_t t = 0;
  if (state.empty()) {
    cache = grow_cache(torch::empty({N, H, 0, E}, query.options()),
                       torch::empty({N, H, 0, M}, query.options()), 0, kMinCacheCapacity);
  } else {
    TORCH_CHECK(state.tensors.size() == 2 || state.tensors.size() == 5, type,
                ": state must be empty or hold {K (N, H, t, E), V (N, H, t, M)} (optionally "
                "followed by the K buffer, V buffer and fill count a step returns), got ",
                state.tensors.size(), " tensors");
    const auto& K0 = state.tensors[0];
    t = K0.defined() && K0.dim() == 4 ? K0.size(2) : -1;
    check_state_tensor(type, "K", K0, {N, H, t, E}, query);
    check_state_tensor(type, "V", state.tensors[1], {N, H, t, M}, query);
    bool in_place = false;
    if (state.tensors.size() == 5) {
      const auto &kb = state.tensors[2], &vb = state.tensors[3], &filled = state.tensors[4];
      const int64_t cap = kb.defined() && kb.dim() == 4 ? kb.size(2) : -1;
      TORCH_CHECK(cap >= t, type, ": state K buffer must have shape (", N, ", ", H, ", >= ", t,
                  ", ", E, "), got ", kb.defined() ? kb.sizes() : c10::IntArrayRef{});
      check_state_tensor(type, "K buffer", kb, {N, H, cap, E}, query);
      check_state_tensor(type, "V buffer", vb, {N, H, cap, M}, query);
      // Same storage and start (data_ptr() is null for an empty view in torch 2.x).
      const auto starts_at = [](const Tensor& view, const Tensor& buffer) {
        return view.is_alias_of(buffer) && view.storage_offset() == buffer.storage_offset();
      };
      TORCH_CHECK(starts_at(K0, kb) && starts_at(state.tensors[1], vb), type,
                  ": state K and V must be views of the first t rows of the K and V buffers");
      TORCH_CHECK(filled.defined() && filled.numel() == 1 && filled.scalar_type() == torch::kLong,
                  type, ": state fill count must be one int64, got ",
                  filled.defined() ? filled.sizes() : c10::IntArrayRef{});
      // Append in place only where no other state has written row t yet.
      in_place = t < cap && filled.item<int64_t>() == t;
      if (in_place) cache = state;
    }
    // A compact {K, V} grows by exactly its new row (the attention_step
    // operator's functional state); a buffer state doubles (amortised O(1)).
    if (!in_place)
      cache =
          grow_cache(K0, state.tensors[1], t,
                     state.tensors.size() == 2 ? t + 1 : std::max(kMinCacheCapacity, 2 * (t + 1)));
  }
  auto &kb = cache.tensors[2], &vb = cache.tensors[3];
  kb.select(2, t).copy_(key);
  vb.select(2, t).copy_(value);
  cache.tensors[4].fill_(t + 1);
  return RecurrentState{{kb.narrow(2, 0, t + 1), vb.narrow(2, 0, t + 1), kb, vb, cache.tensors[4]}};
}

// Key lengths (N,) = t + 1 for the state append_to_cache returns: the rows of
// its buffers that hold keys.
Tensor filled_rows(const RecurrentState& cache) {
  const auto& K = cache.tensors[0];
  return torch::full({K.size(0)}, K.size(2), torch::dtype(torch::kLong).device(K.device()));
}

}  // namespace

std::vector<Tensor> RecurrentCacheAttention::make_state(int64_t N, int64_t H, int64_t E, int64_t M,
                                                        int64_t capacity,
                                                        const torch::TensorOptions& options) const {
  TORCH_CHECK(capacity >= 1, "recurrent ", type_name(),
              ": capacity must be >= 1 (the positions the cache holds), got ", capacity);
  return {torch::zeros({N, H, capacity, E}, options), torch::zeros({N, H, capacity, M}, options),
          torch::zeros({}, torch::TensorOptions().dtype(torch::kLong))};
}

Tensor RecurrentCacheAttention::step_in_place(const Tensor& query, const Tensor& key,
                                              const Tensor& value, torch::TensorList state) {
  const std::string type = "recurrent " + type_name();
  TORCH_CHECK(state.size() == 3, type,
              ": an in-place state must hold {K buffer (N, H, capacity, E), V buffer (N, H, "
              "capacity, M), filled (int64 scalar)} from make_state, got ",
              state.size(), " tensors");
  const auto &kb = state[0], &vb = state[1], &filled = state[2];
  TORCH_CHECK(
      kb.defined() && kb.dim() == 4 && vb.defined() && vb.dim() == 4 && vb.size(2) == kb.size(2),
      type, ": state K and V buffers must have shapes (N, H, capacity, E) and (N, H, ",
      "capacity, M), got ", kb.defined() ? kb.sizes() : c10::IntArrayRef{}, " and ",
      vb.defined() ? vb.sizes() : c10::IntArrayRef{});
  TORCH_CHECK(filled.defined() && filled.numel() == 1 && filled.scalar_type() == torch::kLong, type,
              ": state fill count must be one int64, got ",
              filled.defined() ? filled.sizes() : c10::IntArrayRef{});
  const int64_t t = filled.item<int64_t>(), capacity = kb.size(2);
  TORCH_CHECK(t >= 0, type, ": state fill count must be >= 0, got ", t);
  TORCH_CHECK(t < capacity, type, ": the state is full: it holds ", capacity, " positions and ", t,
              " are filled; allocate it with a larger capacity (or reset its fill count to 0)");
  // The buffer form step() appends to in place (filled == t < capacity).
  return step(query, key, value,
              RecurrentState{{kb.narrow(2, 0, t), vb.narrow(2, 0, t), kb, vb, filled}})
      .first;
}

std::pair<Tensor, RecurrentState> RecurrentFullAttention::step(const Tensor& query,  // (N, H, E)
                                                               const Tensor& key,    // (N, H, E)
                                                               const Tensor& value,  // (N, H, M)
                                                               const RecurrentState& state) {
  auto next = append_to_cache("recurrent full", query, key, value, state);
  // The newest query sees every cached key: the fused operator (its
  // single-query path) over the whole buffers, limited to the t + 1 filled
  // rows by key lengths, so nothing is copied and the rows past them are
  // never read.
  auto out = full_attention(query.unsqueeze(2), next.tensors[2], next.tensors[3], std::nullopt,
                            filled_rows(next), false, softmax_temp_);
  return {out.squeeze(2), std::move(next)};
}

// ---- hard-retrieval -------------------------------------------------------------

std::pair<Tensor, RecurrentState> RecurrentHardRetrievalAttention::step(
    const Tensor& query,  // (N, H, E)
    const Tensor& key,    // (N, H, E)
    const Tensor& value,  // (N, H, M)
    const RecurrentState& state) {
  auto next = append_to_cache("recurrent hard-retrieval", query, key, value, state);
  // The newest query sees every cached key: the argmax of the raw scores
  // (first of equal maxima), never a sample, by the fused operator over the
  // whole buffers limited to the t + 1 filled rows (as for full above): a
  // dot product per key, then a copy of one value row per head.
  auto out = std::get<0>(hard_retrieval_attention(
      query.unsqueeze(2), next.tensors[2], next.tensors[3], std::nullopt, filled_rows(next)));
  return {out.squeeze(2), std::move(next)};
}

Tensor RecurrentHardRetrievalAttention::retrieve(const Tensor& query,   // (N, H, E)
                                                 const Tensor& keys) {  // (N, H, t, E)
  TORCH_CHECK(query.defined() && query.dim() == 3,
              "recurrent hard-retrieval: query must have shape (N, H, E), got ",
              query.defined() ? query.sizes() : c10::IntArrayRef{});
  // Zero-width values: the op computes the indices and copies nothing.
  auto none = torch::empty({keys.size(0), keys.size(1), keys.size(2), 0}, keys.options());
  return std::get<1>(hard_retrieval_attention(query.unsqueeze(2), keys, none)).squeeze(2);
}

// ---- construction by name ---------------------------------------------------

const std::vector<std::string>& recurrent_attention_names() {
  static const std::vector<std::string> names = AttentionRegistry::global().recurrent_names();
  return names;
}

RecurrentAttentionPtr make_recurrent_attention(const std::string& name, const ParamMap& params,
                                               const AttentionDims& dims) {
  const auto& registry = AttentionRegistry::global();
  if (registry.contains(name)) {
    const auto type = registry.get(name);
    if (type.recurrent) {
      auto attn = type.recurrent(registry.validate(name, params), dims);
      TORCH_CHECK(attn, "make_recurrent_attention: the step factory of '", name, "' returned null");
      return attn;
    }
  }
  std::string supported;
  for (const auto& n : recurrent_attention_names()) {
    supported += (supported.empty() ? "" : ", ") + n;
  }
  TORCH_CHECK(false, "make_recurrent_attention: name must be a type with a recurrent form (",
              supported, "), got '", name, "'");
  return nullptr;
}

}  // namespace fastattn
