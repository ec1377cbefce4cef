// The step forms' shared parts (include/fastattn/recurrent.h): input and
// state checks, the key/value cache of full and hard-retrieval (grown by
// doubling, appended in place), the fixed-size in-place cache state, and
// make_recurrent_attention. Each type's step form lives beside its type
// (linear.cpp: causal-linear; full.cpp; hard_retrieval.cpp; aft.cpp).
// Tested by tests/cpp/test_recurrent.cpp (each step against the batch type's
// causal output).
#include "fastattn/recurrent.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "attention/normaliser_eps.h"
#include "fastattn/feature_maps.h"
#include "fastattn/ops.h"
#include "attention/step_state.h"
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

void check_state_tensor(const char* type, const char* name, const Tensor& t,
                        c10::IntArrayRef expected, const Tensor& like) {
  TORCH_CHECK(t.defined() && t.sizes() == expected, type, ": state ", name, " must have shape ",
              expected, ", got ", t.defined() ? t.sizes() : c10::IntArrayRef{});
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), type, ": state ", name, " must be ",
              like.scalar_type(), " like the query, got ", t.scalar_type());
  TORCH_CHECK(t.device() == like.device(), type, ": state ", name, " must be on ", like.device(),
              " like the query, got ", t.device());
}

// ---- key/value caches (full, hard-retrieval) ----------------------------------

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

}  // namespace

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

Tensor filled_rows(const RecurrentState& cache) {
  const auto& K = cache.tensors[0];
  return torch::full({K.size(0)}, K.size(2), torch::dtype(torch::kLong).device(K.device()));
}

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
