// Helpers of the step forms (include/fastattn/recurrent.h), shared by the
// types' files where each type's step forms live beside it (internal).
// Self-attention steps (src/attention/recurrent.cpp): state checks and the
// key/value cache of full and hard-retrieval. Cross-attention steps over a
// prepared memory (src/attention/recurrent_cross.cpp): memory and query
// checks, the cached {K, V[, key_lengths]} memory.
#pragma once

#include <torch/torch.h>

#include <optional>

#include "fastattn/recurrent.h"

namespace fastattn {

// State tensor `name` against the expected shape, like's dtype and device.
void check_state_tensor(const char* type, const char* name, const torch::Tensor& t,
                        c10::IntArrayRef expected, const torch::Tensor& like);

// Appends (key, value) to a key/value cache state (empty, {K, V}, or the
// {K, V, K buffer, V buffer, filled} a step returns): in place where the
// buffer has room and no other state has written row t yet, else into grown
// buffers. Returns the new 5-tensor state; its K and V views hold t + 1 rows.
RecurrentState append_to_cache(const char* type, const torch::Tensor& query,
                               const torch::Tensor& key, const torch::Tensor& value,
                               const RecurrentState& state);

// Key lengths (N,) = t + 1 for the state append_to_cache returns: the rows of
// its buffers that hold keys.
torch::Tensor filled_rows(const RecurrentState& cache);

// keys (N, H, S, E), values (N, H, S, M), key_lengths (N,) integer in [0, S].
void check_memory(const char* type, const torch::Tensor& keys, const torch::Tensor& values,
                  const std::optional<torch::Tensor>& key_lengths);

// The {K, V[, key_lengths]} memory state of full, hard-retrieval and the
// generic form, after check_memory; K and V made contiguous where
// `contiguous` (so that an operator copies nothing at each step).
RecurrentState cache_memory(const char* type, const torch::Tensor& keys,
                            const torch::Tensor& values,
                            const std::optional<torch::Tensor>& key_lengths, bool contiguous);

// A step's checks of a cache_memory state and of its query (N, H, E)
// against the memory's keys; returns the memory's key lengths, if any.
std::optional<torch::Tensor> cached_key_lengths(const char* type, const torch::Tensor& query,
                                                const RecurrentState& memory);

}  // namespace fastattn
