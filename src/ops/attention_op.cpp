// Registry access through the dispatcher (torch.ops.fastattn.<op> in Python):
//
//   attention(type, q (N,H,L,E), k (N,H,S,E), v (N,H,S,M), causal, key_lengths (N,)?,
//             attn_mask?, params_json) -> (N,H,L,M)
//     builds `type` from AttentionRegistry::global() with the JSON parameters
//     and the dims of the tensors, and runs its forward once;
//   attention_step(type, q (N,H,E), k (N,H,E), v (N,H,M), state, params_json)
//     -> (out (N,H,M), state): one step of make_recurrent_attention(type);
//   attention_types() -> str
//     the registry's describe() JSON.
//
// Both are registered under CompositeImplicitAutograd: `attention` is a
// composition of other dispatcher ops (full_attention, the types' kernels),
// so autograd records those inner ops and gradients flow without a backward
// of its own. Each call builds a fresh instance, in evaluation mode (no
// dropout; training-only behaviour such as sampling is off); types that draw
// random parameters draw them from the default generator (seed it with
// torch::manual_seed / torch.manual_seed).
// Tested by tests/python/test_ops.py.
#include <nlohmann/json.hpp>

#include "fastattn/attention.h"
#include "fastattn/mask.h"
#include "fastattn/recurrent.h"
#include "fastattn/registry.h"

namespace fastattn::ops {
namespace {

ParamMap parse_params(const std::string& type, const std::string& params_json) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(params_json.empty() ? std::string("{}") : params_json);
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(false, "fastattn::attention: params_json for type '", type, "' is not valid JSON (",
                e.what(), "), got: ", params_json);
  }
  TORCH_CHECK(j.is_object(), "fastattn::attention: params_json for type '", type,
              "' must be a JSON object such as {\"softmax_temp\": 0.125}, got: ", params_json);
  return params_from_json(j);
}

// The dims a type is built with: heads and the query and value widths.
AttentionDims dims_of(const at::Tensor& q, const at::Tensor& v) {
  AttentionDims dims;
  dims.heads = q.size(1);
  dims.query_dim = q.size(-1);
  dims.value_dim = v.size(-1);
  return dims;
}

// A fresh instance, in evaluation mode, on q's device. It holds its
// parameters and buffers on the CPU; only the device changes, since
// Module::to(dtype) would also convert integer buffers.
void prepare_instance(torch::nn::Module& m, const at::Tensor& q) {
  m.eval();
  if (!q.device().is_cpu()) m.to(q.device());
}

// `str` arguments as std::string: accepted by the dispatcher on LibTorch 1.13
// and 2.x alike.
at::Tensor attention(std::string type, const at::Tensor& q, const at::Tensor& k,
                     const at::Tensor& v, bool causal, const c10::optional<at::Tensor>& key_lengths,
                     const c10::optional<at::Tensor>& attn_mask, std::string params_json) {
  // The dims come from the tensors, so check their ranks before reading them.
  TORCH_CHECK(q.dim() == 4, "fastattn::attention: q must have shape (N, H, L, E), got ", q.dim(),
              " dimensions ", q.sizes());
  TORCH_CHECK(k.dim() == 4, "fastattn::attention: k must have shape (N, H, S, E), got ", k.dim(),
              " dimensions ", k.sizes());
  TORCH_CHECK(v.dim() == 4, "fastattn::attention: v must have shape (N, H, S, M), got ", v.dim(),
              " dimensions ", v.sizes());

  // The registry names the type or parameter in its errors (unknown type,
  // unknown parameter, wrong kind, out of range).
  AttentionPtr attn =
      AttentionRegistry::global().build(type, parse_params(type, params_json), dims_of(q, v));
  prepare_instance(*attn, q);

  Mask mask;
  if (causal) mask = mask.with_causal(true);
  if (key_lengths.has_value()) mask = mask.with_key_lengths(*key_lengths);
  if (attn_mask.has_value()) mask = mask.with_attn_mask(*attn_mask);
  return attn->forward(q, k, v, mask);
}

// One step of make_recurrent_attention(type): a fresh instance per call, like
// `attention`; the state round-trips as its tensors.
std::tuple<at::Tensor, std::vector<at::Tensor>> attention_step(
    std::string type, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    at::TensorList state, std::string params_json) {
  TORCH_CHECK(q.dim() == 3, "fastattn::attention_step: q must have shape (N, H, E), got ", q.dim(),
              " dimensions ", q.sizes());
  TORCH_CHECK(v.dim() == 3, "fastattn::attention_step: v must have shape (N, H, M), got ", v.dim(),
              " dimensions ", v.sizes());
  auto attn = make_recurrent_attention(type, parse_params(type, params_json), dims_of(q, v));
  prepare_instance(*attn, q);
  RecurrentState in;
  in.tensors.assign(state.begin(), state.end());
  auto [out, next] = attn->step(q, k, v, in);
  return {out, next.tensors};
}

std::string attention_types() { return AttentionRegistry::global().describe().dump(); }

}  // namespace
}  // namespace fastattn::ops

TORCH_LIBRARY_IMPL(fastattn, CompositeImplicitAutograd, m) {
  m.impl("attention", &fastattn::ops::attention);
  m.impl("attention_step", &fastattn::ops::attention_step);
  // attention_types has no tensor argument, so the dispatcher computes an
  // empty key set and looks up the Undefined key; a CompositeImplicitAutograd
  // kernel is also installed there (checked on LibTorch 1.13 by
  // test_attention_types_lists_full).
  m.impl("attention_types", &fastattn::ops::attention_types);
}
