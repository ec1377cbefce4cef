// Registry access through the dispatcher (torch.ops.fastattn.<op> in Python):
//
//   attention(type, q (N,H,L,E), k (N,H,S,E), v (N,H,S,M), causal, key_lengths (N,)?,
//             attn_mask?, params_json, training) -> (N,H,L,M)
//     builds `type` from AttentionRegistry::global() with the JSON parameters
//     and the dims of the tensors, in training mode when `training` (attention
//     dropout, sampling), and runs its forward once;
//   attention_forward(...same...) -> (out, rng_state)
//   attention_backward(type, grad_out, q, k, v, ..., rng_state) -> (grad_q, grad_k, grad_v)
//   attention_step(type, q (N,H,E), k (N,H,E), v (N,H,M), state, params_json)
//     -> (out (N,H,M), state): one step of make_recurrent_attention(type);
//   attention_step_state(type, q, v, capacity, params_json) -> state and
//   attention_step_(type, q, k, v, state!, params_json) -> out: the same step
//     on a fixed-size state updated in place (static shapes for compiled
//     decoding loops); attention_step_state_spec describes that state;
//   attention_types() -> str
//     the registry's describe() JSON.
//
// `attention` is one opaque operator with its own backward, so that
// torch.compile and torch.export see a single node with a fake (shape)
// implementation (python/fastattn/_fake.py) whatever the type does inside
// (K-means, hashing, data-dependent sizes). Traced (fake or functional
// tensors, a dispatch mode, functorch), its backward `attention_backward`
// recomputes the type's forward with autograd on and differentiates that
// (the trade of activation checkpointing: one more forward, and only q, k, v
// saved). Run eagerly on plain tensors, the forward keeps the type's own
// autograd graph instead, and the backward differentiates it: no second
// forward (a third of a forward+backward for most types), at the memory of
// whatever the type's forward saves (as any PyTorch module's does).
// Random draws (clustering planes, Reformer rotations, types' initial
// parameters, dropout seeds) come from the default CPU generator, and on
// CUDA torch's dropout draws from the device's; attention_forward returns
// those generators' states as it found them and attention_backward replays
// from them, so both passes draw the same numbers (the same dropout mask
// included). Each call builds a fresh instance, in evaluation mode unless
// `training` (then attention dropout applies, and training-only behaviour
// such as hard-retrieval's sampling). Tested by tests/python/test_ops.py and test_compile.py.
#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <mutex>
#include <new>
#include <stdexcept>
#include <nlohmann/json.hpp>

#include "fastattn/attention.h"
#include "fastattn/mask.h"
#include "fastattn/recurrent.h"
#include "fastattn/registry.h"
#include "ops/op_shell.h"
#include "ops/op_util.h"

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

// A fresh instance, in training mode only when asked (attention dropout,
// hard-retrieval's sampling), on q's device. It holds its
// parameters and buffers on the CPU; only the device changes, since
// Module::to(dtype) would also convert integer buffers.
void prepare_instance(torch::nn::Module& m, const at::Tensor& q, bool training = false) {
  m.train(training);
  if (!q.device().is_cpu()) m.to(q.device());
}

// "type 'reformer' with parameters {"rounds":2147483648}" for the messages.
std::string type_and_params(const std::string& type, const std::string& params_json) {
  std::string s = "type '" + type + "'";
  if (!params_json.empty() && params_json != "{}") s += " with parameters " + params_json;
  return s;
}

bool is_allocation_failure(const c10::Error& e) {
  const std::string what = e.what_without_backtrace();
  for (const char* sign : {"can't allocate memory", "Storage size calculation overflowed",
                           "out of memory", "Out of memory"}) {
    if (what.find(sign) != std::string::npos) return true;
  }
  return false;
}

// Runs fn (building and running a type); an allocation that fails (too much
// memory asked by a parameter for these inputs) becomes one error that names
// the type, its parameters and the inputs, rather than an allocator message
// that names none of them.
template <typename Fn>
auto naming_allocation_failures(const std::string& op, const std::string& type,
                                const std::string& params_json, const at::Tensor& q,
                                const at::Tensor& k, const at::Tensor& v, Fn&& fn) {
  std::string detail;
  try {
    return fn();
  } catch (const std::bad_alloc&) {
    detail = "std::bad_alloc";
  } catch (const std::length_error& e) {
    detail = std::string("std::length_error: ") + e.what();
  } catch (const c10::Error& e) {
    if (!is_allocation_failure(e)) throw;
    detail = e.what_without_backtrace();
  }
  TORCH_CHECK(false, op, ": ", type_and_params(type, params_json),
              " could not allocate the memory it needs for q ", q.sizes(), ", k ", k.sizes(),
              ", v ", v.sizes(), " (", detail,
              "); a parameter that sets a size (such as clusters, n_features, rounds, topk) is "
              "too large for this machine, or the inputs are");
}

// Whether every element of t is finite. One reduction first, not isfinite's
// five passes and two temporaries (a large share of the registry operator's
// time for linear attention; measured: git show 5f604de:docs/benchmarks.md,
// "Against fast-transformers, the bounds per type, and bfloat16"): the sum
// is finite when every element is, unless it overflows, which the exact
// check then settles.
// `witness`: a tensor whose sum is finite only if t's elements are (the
// type's take_finite_witness()), read instead of t when defined.
// Every element finite, by one pass over a small CPU tensor's elements (x - x
// is 0 for finite x and NaN otherwise; the loop vectorises). Below
// kSmallFinite elements this is cheaper than a reduction's dispatch and
// thread-pool start, which cost a tiny call more than its attention.
constexpr int64_t kSmallFinite = int64_t{1} << 14;
template <typename T>
bool finite_elements(const at::Tensor& t) {
  const auto c = t.contiguous();
  const T* p = c.data_ptr<T>();
  bool ok = true;
  for (int64_t i = 0, n = c.numel(); i < n; ++i) ok &= (p[i] - p[i]) == T(0);
  return ok;
}

bool all_finite(const at::Tensor& t, const at::Tensor& witness = at::Tensor()) {
  if (!t.defined() || !t.is_floating_point() || t.numel() == 0) return true;
  if (t.is_cpu() && t.numel() <= kSmallFinite) {
    if (t.scalar_type() == at::kFloat) return finite_elements<float>(t);
    if (t.scalar_type() == at::kDouble) return finite_elements<double>(t);
  }
  if (std::isfinite((witness.defined() ? witness : t).sum().item<double>())) return true;
  return torch::isfinite(t).all().item<bool>();
}

// Whether non-finite results are explained by the inputs: a non-finite q, k,
// v (or output gradient), or an additive mask or state with NaN or +inf (-inf
// drops a key).
bool nonfinite_inputs(std::initializer_list<const at::Tensor*> inputs,
                      at::TensorList other_inputs) {
  for (const at::Tensor* t : inputs) {
    if (!all_finite(*t)) return true;
  }
  for (const auto& t : other_inputs) {
    if (t.defined() && t.is_floating_point() &&
        (t.isnan().any().item<bool>() || t.isposinf().any().item<bool>()))
      return true;
  }
  return false;
}

double largest_abs(const at::Tensor& t) {
  return t.defined() && t.numel() ? t.abs().max().item<double>() : 0.0;
}

// Output that is not finite although q, k and v are (scores past the dtype's
// range, an exponential that overflows): an error that says so, rather than
// NaN or inf handed on silently. On the CPU only: on CUDA the check would
// synchronise the stream at every call.
// `witness`: the type's take_finite_witness(), read instead of the output
// when defined (a few values in place of a pass over the whole output).
void check_finite_result(const char* op, const std::string& type, const std::string& params_json,
                         const at::Tensor& out, const at::Tensor& witness, const at::Tensor& q,
                         const at::Tensor& k, const at::Tensor& v,
                         at::TensorList other_inputs = {}) {
  if (!out.device().is_cpu() || all_finite(out, witness)) return;
  if (nonfinite_inputs({&q, &k, &v}, other_inputs)) return;  // non-finite in, non-finite out
  TORCH_CHECK(false, op, ": ", type_and_params(type, params_json), " overflowed ",
              out.scalar_type(), " on finite inputs (largest |q| = ", largest_abs(q),
              ", |k| = ", largest_abs(k), ", |v| = ", largest_abs(v),
              "): the output would hold inf or NaN. Scale the inputs down, lower softmax_temp, "
              "or use float64");
}

// The same rule for the backward (issue 66): gradients that are not finite
// although q, k, v and the output's gradient are raise an error naming the
// type, its parameters and the gradient, instead of reaching the optimiser.
// CPU only, as the forward's check.
void check_finite_gradients(const std::string& type, const std::string& params_json,
                            const std::vector<at::Tensor>& grads, const at::Tensor& grad_out,
                            const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const c10::optional<at::Tensor>& attn_mask) {
  static const char* const kNames[] = {"grad_q", "grad_k", "grad_v"};
  int bad = -1;
  for (int i = 0; i < 3 && bad < 0; ++i) {
    if (grads[i].defined() && grads[i].device().is_cpu() && !all_finite(grads[i])) bad = i;
  }
  if (bad < 0) return;
  if (nonfinite_inputs({&q, &k, &v, &grad_out},
                       attn_mask ? at::TensorList(*attn_mask) : at::TensorList()))
    return;
  TORCH_CHECK(false, "fastattn::attention: ", type_and_params(type, params_json), " overflowed ",
              grads[bad].scalar_type(),
              " in the backward on finite inputs and a finite output gradient (largest |q| = ",
              largest_abs(q), ", |k| = ", largest_abs(k), ", |v| = ", largest_abs(v),
              ", |grad_out| = ", largest_abs(grad_out), "): ", kNames[bad],
              " would hold inf or NaN. Scale the inputs down, lower softmax_temp, or use "
              "float64");
}

// A type's output and its take_finite_witness().
struct TypeResult {
  at::Tensor out, finite_witness;
};

// The type's forward: `str` arguments as std::string, accepted by the
// dispatcher on LibTorch 1.13 and 2.x alike.
TypeResult run_type(const std::string& type, const at::Tensor& q, const at::Tensor& k,
                    const at::Tensor& v, bool causal, const c10::optional<at::Tensor>& key_lengths,
                    const c10::optional<at::Tensor>& attn_mask, const std::string& params_json,
                    bool training) {
  // The dims come from the tensors, so check their ranks before reading them.
  TORCH_CHECK(q.dim() == 4, "fastattn::attention: q must have shape (N, H, L, E), got ", q.dim(),
              " dimensions ", q.sizes());
  TORCH_CHECK(k.dim() == 4, "fastattn::attention: k must have shape (N, H, S, E), got ", k.dim(),
              " dimensions ", k.sizes());
  TORCH_CHECK(v.dim() == 4, "fastattn::attention: v must have shape (N, H, S, M), got ", v.dim(),
              " dimensions ", v.sizes());

  // The registry names the type or parameter in its errors (unknown type,
  // unknown parameter, wrong kind, out of range).
  const ParamMap params = parse_params(type, params_json);
  return naming_allocation_failures("fastattn::attention", type, params_json, q, k, v, [&] {
    AttentionPtr attn = AttentionRegistry::global().build(type, params, dims_of(q, v));
    prepare_instance(*attn, q, training);
    Mask mask;
    if (causal) mask = mask.with_causal(true);
    if (key_lengths.has_value()) mask = mask.with_key_lengths(*key_lengths);
    if (attn_mask.has_value()) mask = mask.with_attn_mask(*attn_mask);
    TypeResult r;
    r.out = attn->forward(q, k, v, mask);
    r.finite_witness = attn->take_finite_witness();
    return r;
  });
}

// The gradient of an input the output does not depend on (Reformer's keys):
// zeros in the input's row layout, in a buffer of the output cache (a fresh
// at::zeros takes a page fault per page on every call).
at::Tensor zero_grad_like(const at::Tensor& input) {
  return ops::empty_rows_like(input, input.size(3)).zero_();
}

// The generators a call on `device` draws from: the default CPU generator
// (the types' own draws), and on CUDA the device's default generator too
// (attention dropout there: torch's dropout, PyTorch's fused kernels).
std::vector<at::Generator> generators_of(const c10::Device& device) {
  std::vector<at::Generator> gens{at::detail::getDefaultCPUGenerator()};
  if (device.is_cuda()) gens.push_back(at::globalContext().defaultGenerator(device));
  return gens;
}

// Their states as one uint8 tensor (the CPU generator's first), and a scope
// that replays from a saved one (restoring the generators' own states after).
// A generator's lock is held only to read and write its state: the type's
// draws take it too.
at::Tensor rng_state(const c10::Device& device) {
  std::vector<at::Tensor> states;
  for (auto& gen : generators_of(device)) {
    std::lock_guard<std::mutex> lock(gen.mutex());
    states.push_back(gen.get_state());
  }
  return states.size() == 1 ? states[0] : at::cat(states);
}

class ReplayRng {
 public:
  ReplayRng(const at::Tensor& state, const c10::Device& device)
      : device_(device), saved_(rng_state(device)) {
    set(state);
  }
  ~ReplayRng() { set(saved_); }
  ReplayRng(const ReplayRng&) = delete;
  ReplayRng& operator=(const ReplayRng&) = delete;

 private:
  void set(const at::Tensor& state) const {
    int64_t offset = 0;
    for (auto& gen : generators_of(device_)) {
      std::lock_guard<std::mutex> lock(gen.mutex());
      const int64_t n = gen.get_state().numel();
      TORCH_CHECK(offset + n <= state.numel(), "fastattn::attention_backward: rng_state holds ",
                  state.numel(), " bytes, fewer than the generators of ", device_,
                  " take; pass the rng_state "
                  "attention_forward returned for inputs on the same device");
      gen.set_state(state.narrow(0, offset, n));
      offset += n;
    }
  }
  c10::Device device_;
  at::Tensor saved_;
};

// The type's output, checked finite, not sharing memory with its inputs (an
// operator's output must not), in the layout the fake implementation
// promises: q's row layout (ops::empty_rows_like), which the linear types'
// kernels write, so that a layer's transpose of a (N, L, H, E) projection's
// result back is a view.
at::Tensor type_output(const std::string& type, const at::Tensor& q, const at::Tensor& k,
                       const at::Tensor& v, bool causal,
                       const c10::optional<at::Tensor>& key_lengths,
                       const c10::optional<at::Tensor>& attn_mask, const std::string& params_json,
                       bool training) {
  auto [out, witness] =
      run_type(type, q, k, v, causal, key_lengths, attn_mask, params_json, training);
  check_finite_result("fastattn::attention", type, params_json, out, witness, q, k, v,
                      attn_mask ? at::TensorList(*attn_mask) : at::TensorList());
  if (out.is_alias_of(q) || out.is_alias_of(k) || out.is_alias_of(v)) out = out.clone();
  return ops::in_rows_layout_of(out, q);
}

std::tuple<at::Tensor, at::Tensor> attention_forward(std::string type, const at::Tensor& q,
                                                     const at::Tensor& k, const at::Tensor& v,
                                                     bool causal,
                                                     const c10::optional<at::Tensor>& key_lengths,
                                                     const c10::optional<at::Tensor>& attn_mask,
                                                     std::string params_json, bool training) {
  auto rng = rng_state(q.device());  // before the type draws
  return {type_output(type, q, k, v, causal, key_lengths, attn_mask, params_json, training), rng};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward(
    std::string type, const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& v, bool causal, const c10::optional<at::Tensor>& key_lengths,
    const c10::optional<at::Tensor>& attn_mask, std::string params_json, const at::Tensor& rng,
    bool training) {
  // Autograd records even where the caller runs in inference mode (a
  // compiled graph, torch.inference_mode): leave it, and copy the inference
  // tensors, which autograd may not save.
  c10::InferenceMode not_inference(false);
  at::AutoGradMode grad_mode(true);
  const auto usable = [](const at::Tensor& t) { return t.is_inference() ? t.clone() : t; };
  const auto usable_opt = [&](const c10::optional<at::Tensor>& t) {
    return t.has_value() ? c10::optional<at::Tensor>(usable(*t)) : t;
  };
  auto qd = usable(q).detach().requires_grad_(true), kd = usable(k).detach().requires_grad_(true),
       vd = usable(v).detach().requires_grad_(true);
  at::Tensor out;
  {
    ReplayRng replay(rng, q.device());
    out = run_type(type, qd, kd, vd, causal, usable_opt(key_lengths), usable_opt(attn_mask),
                   params_json, training)
              .out;
  }
  std::vector<at::Tensor> grads(3);
  if (out.requires_grad()) {
    grads = torch::autograd::grad({out}, {qd, kd, vd}, {usable(grad_out)},
                                  /*retain_graph=*/false,
                                  /*create_graph=*/false, /*allow_unused=*/true);
  }
  check_finite_gradients(type, params_json, grads, grad_out, q, k, v, attn_mask);
  // In the inputs' row layouts, as the fake implementation promises
  // (inductor asserts the strides): autograd gives most gradients of a strided
  // input (a transposed (N, L, H, E) projection, say) that input's strides.
  const at::Tensor* inputs[3] = {&q, &k, &v};
  for (int i = 0; i < 3; ++i) {
    grads[i] = grads[i].defined() ? ops::in_rows_layout_of(grads[i], *inputs[i])
                                  : zero_grad_like(*inputs[i]);
  }
  return {grads[0], grads[1], grads[2]};
}

constexpr char kForwardOp[] = "fastattn::attention_forward";
constexpr char kStepOp[] = "fastattn::attention_step";
constexpr char kStepInPlaceOp[] = "fastattn::attention_step_";
constexpr char kBackwardOp[] = "fastattn::attention_backward";

// The opaque form: the forward operator, and the backward operator that
// recomputes the type's forward with autograd from the generators' saved
// states.
struct AttentionOp {
  struct Saved {
    at::Tensor q, k, v, rng, key_lengths, attn_mask;
    std::string type, params_json;
    bool causal = false, training = false;
    auto tensors() { return std::tie(q, k, v, rng, key_lengths, attn_mask); }
  };

  static at::Tensor forward(Saved* saved, std::string type, const at::Tensor& q,
                            const at::Tensor& k, const at::Tensor& v, bool causal,
                            const c10::optional<at::Tensor>& key_lengths,
                            const c10::optional<at::Tensor>& attn_mask, std::string params_json,
                            bool training) {
    // Without a backward, no generator state and no second operator.
    if (!saved)
      return type_output(type, q, k, v, causal, key_lengths, attn_mask, params_json, training);
    auto [out, rng] = ops::call_op<kForwardOp, attention_forward>(
        type, q, k, v, causal, key_lengths, attn_mask, params_json, training);
    *saved = {q,
              k,
              v,
              rng,
              ops::or_undefined(key_lengths),
              ops::or_undefined(attn_mask),
              type,
              params_json,
              causal,
              training};
    return out;
  }

  static torch::autograd::variable_list backward(const Saved& s,
                                                 const torch::autograd::variable_list& grads) {
    auto [gq, gk, gv] = ops::call_op<kBackwardOp, attention_backward>(
        s.type, grads[0], s.q, s.k, s.v, s.causal, ops::opt(s.key_lengths), ops::opt(s.attn_mask),
        s.params_json, s.rng, s.training);
    return {at::Tensor(), gq, gk, gv};
  }
};

// Whether autograd records a call on these inputs.
bool records_grad(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  at::TensorList state = {}) {
  bool needs = q.requires_grad() || k.requires_grad() || v.requires_grad();
  for (const auto& t : state) needs = needs || t.requires_grad();
  return needs && at::GradMode::is_enabled();
}

// Without autograd (inference mode, or below it): the forward alone.
at::Tensor attention_no_grad(std::string type, const at::Tensor& q, const at::Tensor& k,
                             const at::Tensor& v, bool causal,
                             const c10::optional<at::Tensor>& key_lengths,
                             const c10::optional<at::Tensor>& attn_mask, std::string params_json,
                             bool training) {
  return ops::Shell<AttentionOp>::no_grad(type, q, k, v, causal, key_lengths, attn_mask,
                                          params_json, training);
}

// Eager form: the forward runs the type with autograd on, on leaves that
// share q, k and v's memory, and keeps that graph (through the saved inner
// output); the backward differentiates it. The caller gets a detached alias
// of the inner output, so the autograd Function never rewires the inner
// graph's node. retain_graph on the inner graph, so a caller's
// retain_graph=True backward can run again; its buffers go when this node
// releases its saved variables (after a backward without retain_graph).
struct EagerAttentionOp {
  // The forward records the type's own graph: the shell runs it with
  // autograd's dispatch keys on.
  static constexpr bool kRecordsGraph = true;

  struct Saved {
    at::Tensor q, k, v, out, attn_mask;
    std::string type, params_json;
    auto tensors() { return std::tie(q, k, v, out, attn_mask); }
  };

  static at::Tensor forward(Saved* saved, std::string type, const at::Tensor& q,
                            const at::Tensor& k, const at::Tensor& v, bool causal,
                            const c10::optional<at::Tensor>& key_lengths,
                            const c10::optional<at::Tensor>& attn_mask, std::string params_json,
                            bool training) {
    const auto leaf = [](const at::Tensor& t) {
      return t.detach().requires_grad_(t.requires_grad());
    };
    auto ql = leaf(q), kl = leaf(k), vl = leaf(v);
    TypeResult inner;
    {
      at::AutoGradMode grad_mode(true);
      inner = run_type(type, ql, kl, vl, causal, key_lengths, attn_mask, params_json, training);
    }
    check_finite_result("fastattn::attention", type, params_json, inner.out, inner.finite_witness,
                        q, k, v, attn_mask ? at::TensorList(*attn_mask) : at::TensorList());
    if (saved) *saved = {ql, kl, vl, inner.out, ops::or_undefined(attn_mask), type, params_json};
    at::Tensor out = inner.out.detach();
    // Not sharing memory with the inputs, in q's row layout (as attention_forward).
    if (out.is_alias_of(q) || out.is_alias_of(k) || out.is_alias_of(v)) out = out.clone();
    return ops::in_rows_layout_of(out, q);
  }

  static torch::autograd::variable_list backward(const Saved& s,
                                                 const torch::autograd::variable_list& grads) {
    const at::Tensor* saved[4] = {&s.q, &s.k, &s.v, &s.out};
    std::vector<at::Tensor> inputs, result(3);
    std::vector<int> index;
    for (int i = 0; i < 3; ++i) {
      if (saved[i]->requires_grad()) {
        inputs.push_back(*saved[i]);
        index.push_back(i);
      }
    }
    if (saved[3]->requires_grad() && !inputs.empty()) {
      auto g = torch::autograd::grad({*saved[3]}, inputs, {grads[0]}, /*retain_graph=*/true,
                                     /*create_graph=*/false, /*allow_unused=*/true);
      for (size_t j = 0; j < index.size(); ++j) result[index[j]] = g[j];
    }
    check_finite_gradients(s.type, s.params_json, result, grads[0], s.q, s.k, s.v,
                           ops::opt(s.attn_mask));
    // Zeros for an input the output does not depend on (as attention_backward),
    // in the inputs' row layouts.
    for (int i = 0; i < 3; ++i) {
      if (!saved[i]->requires_grad()) continue;
      result[i] = result[i].defined() ? ops::in_rows_layout_of(result[i], *saved[i])
                                      : zero_grad_like(*saved[i]);
    }
    return {at::Tensor(), result[0], result[1], result[2]};
  }
};

// Plain eager tensors: no Python subclass (fake, functional), no functorch
// wrapper, no dispatch mode active. Anything else is being traced or
// transformed and takes the opaque forward/backward pair.
bool eager_tensors(std::initializer_list<const at::Tensor*> tensors) {
  if (c10::impl::tls_is_dispatch_key_included(c10::DispatchKey::Python)) return false;
  const c10::DispatchKeySet traced({c10::DispatchKey::Python, c10::DispatchKey::Functionalize,
                                    c10::DispatchKey::FuncTorchGradWrapper,
                                    c10::DispatchKey::FuncTorchBatched});
  for (const at::Tensor* t : tensors) {
    if (t == nullptr || !t->defined()) continue;
    if (t->is_meta() || (t->key_set() & traced) != c10::DispatchKeySet()) return false;
  }
  return true;
}

at::Tensor attention_autograd(std::string type, const at::Tensor& q, const at::Tensor& k,
                              const at::Tensor& v, bool causal,
                              const c10::optional<at::Tensor>& key_lengths,
                              const c10::optional<at::Tensor>& attn_mask, std::string params_json,
                              bool training) {
  if (!records_grad(q, k, v)) {
    at::AutoDispatchBelowAutograd below;
    return attention_no_grad(type, q, k, v, causal, key_lengths, attn_mask, params_json, training);
  }
  if (eager_tensors(
          {&q, &k, &v, key_lengths ? &*key_lengths : nullptr, attn_mask ? &*attn_mask : nullptr}))
    return ops::Shell<EagerAttentionOp>::autograd(type, q, k, v, causal, key_lengths, attn_mask,
                                                  params_json, training);
  return ops::Shell<AttentionOp>::autograd(type, q, k, v, causal, key_lengths, attn_mask,
                                           params_json, training);
}

void check_step_shapes(const char* op, const at::Tensor& q, const at::Tensor& v) {
  TORCH_CHECK(q.dim() == 3, op, ": q must have shape (N, H, E), got ", q.dim(), " dimensions ",
              q.sizes());
  TORCH_CHECK(v.dim() == 3, op, ": v must have shape (N, H, M), got ", v.dim(), " dimensions ",
              v.sizes());
}

// The step form of `type` for q (N, H, E) and v (N, H, M): a fresh instance
// per call, like `attention`, on q's device.
RecurrentAttentionPtr recurrent_instance(const std::string& type, const std::string& params_json,
                                         const at::Tensor& q, const at::Tensor& v) {
  auto attn = make_recurrent_attention(type, parse_params(type, params_json), dims_of(q, v));
  prepare_instance(*attn, q);
  return attn;
}

// One step of make_recurrent_attention(type), functional: the returned state
// ({S, Z}, or a cache {K, V} of t + 1 rows) shares no memory with the inputs,
// so torch.compile can trace it (a cache step copies the t cached rows).
std::tuple<at::Tensor, std::vector<at::Tensor>> attention_step(
    std::string type, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    at::TensorList state, std::string params_json) {
  constexpr const char* op = "fastattn::attention_step";
  check_step_shapes(op, q, v);
  // A cache's fixed-size state ends in its int64 fill count.
  const bool in_place_state = !state.empty() && state.back().defined() &&
                              state.back().scalar_type() == at::kLong && state.back().dim() == 0;
  TORCH_CHECK(state.size() <= 3 && !in_place_state, op,
              ": state must be empty or the tensors the previous step returned, got ", state.size(),
              " tensors (attention_step_ steps the fixed-size state of "
              "attention_step_state in place)");
  auto [out, compact] = naming_allocation_failures(op, type, params_json, q, k, v, [&] {
    auto attn = recurrent_instance(type, params_json, q, v);
    auto [o, next] = attn->step(q, k, v, RecurrentState{{state.begin(), state.end()}});
    return std::make_pair(o, attn->compact_state(next));
  });
  check_finite_result(op, type, params_json, out, at::Tensor(), q, k, v, state);
  // The compact state: a cache step returns views of its new buffers (exactly
  // t + 1 rows from a compact state, 16 from an empty one).
  for (auto& t : compact) t = t.contiguous();
  return {out, compact};
}

// A zero state for attention_step_ (see make_state).
std::vector<at::Tensor> attention_step_state(std::string type, const at::Tensor& q,
                                             const at::Tensor& v, int64_t capacity,
                                             std::string params_json) {
  constexpr const char* op = "fastattn::attention_step_state";
  check_step_shapes(op, q, v);
  return naming_allocation_failures(op, type, params_json, q, q, v, [&] {
    return recurrent_instance(type, params_json, q, v)
        ->make_state(q.size(0), q.size(1), q.size(2), v.size(2), capacity, q.options());
  });
}

// One step that updates an attention_step_state state in place.
at::Tensor attention_step_in_place(std::string type, const at::Tensor& q, const at::Tensor& k,
                                   const at::Tensor& v, at::TensorList state,
                                   std::string params_json) {
  constexpr const char* op = "fastattn::attention_step_";
  check_step_shapes(op, q, v);
  auto out = naming_allocation_failures(op, type, params_json, q, k, v, [&] {
    return recurrent_instance(type, params_json, q, v)->step_in_place(q, k, v, state);
  });
  check_finite_result(op, type, params_json, out, at::Tensor(), q, k, v, state);
  return out;
}

// The Autograd kernels of the step operators. Without gradients to record,
// the call goes on below autograd (to the kernel, or to the fake
// implementation when torch.compile traces). With them, attention_step runs
// here and autograd records the ATen operations it is made of (eager only: a
// compiled step is not differentiable), and attention_step_ refuses, rather
// than returning an output that silently does not depend on q, k, v.
std::tuple<at::Tensor, std::vector<at::Tensor>> attention_step_autograd(
    std::string type, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    at::TensorList state, std::string params_json) {
  if (records_grad(q, k, v, state)) return attention_step(type, q, k, v, state, params_json);
  at::AutoDispatchBelowAutograd below;
  return ops::call_op<kStepOp, attention_step>(type, q, k, v, state, params_json);
}

at::Tensor attention_step_in_place_autograd(std::string type, const at::Tensor& q,
                                            const at::Tensor& k, const at::Tensor& v,
                                            at::TensorList state, std::string params_json) {
  TORCH_CHECK(!records_grad(q, k, v, state),
              "fastattn::attention_step_ steps a state in place for inference and has no "
              "gradients: run it under torch.no_grad(), or use attention_step (functional, "
              "differentiable)");
  at::AutoDispatchBelowAutograd below;
  return ops::call_op<kStepInPlaceOp, attention_step_in_place>(type, q, k, v, state, params_json);
}

// What attention_step_state returns, for the fake implementations: a JSON
// list, per tensor, of {"shape": sizes after (N, H) (-1: the capacity) or
// all sizes when not "batched", "dtype": "query" | "int64", "device":
// "query" | "cpu"}. Built from make_state on the meta device (no memory).
std::string attention_step_state_spec(std::string type, int64_t E, int64_t M,
                                      std::string params_json) {
  AttentionDims dims;
  dims.heads = 1;
  dims.query_dim = E;
  dims.value_dim = M;
  auto attn = make_recurrent_attention(type, parse_params(type, params_json), dims);
  const auto meta = at::TensorOptions().dtype(at::kFloat).device(at::kMeta);
  // Two capacities tell the capacity dimensions apart.
  const auto one = attn->make_state(1, 1, E, M, 1, meta),
             two = attn->make_state(1, 1, E, M, 2, meta);
  auto spec = nlohmann::json::array();
  for (size_t i = 0; i < one.size(); ++i) {
    const bool on_query = one[i].device().is_meta();
    std::vector<int64_t> shape;
    for (int64_t d = on_query ? 2 : 0; d < one[i].dim(); ++d)
      shape.push_back(one[i].size(d) == two[i].size(d) ? one[i].size(d) : -1);
    spec.push_back({{"shape", shape},
                    {"batched", on_query},
                    {"dtype", one[i].scalar_type() == at::kFloat ? "query" : "int64"},
                    {"device", on_query ? "query" : "cpu"}});
  }
  return spec.dump();
}

std::string attention_types() { return AttentionRegistry::global().describe().dump(); }

}  // namespace
}  // namespace fastattn::ops

TORCH_LIBRARY_IMPL(fastattn, CompositeExplicitAutograd, m) {
  m.impl("attention", &fastattn::ops::attention_no_grad);
  m.impl("attention_forward", &fastattn::ops::attention_forward);
  m.impl("attention_backward", &fastattn::ops::attention_backward);
}

TORCH_LIBRARY_IMPL(fastattn, Autograd, m) {
  m.impl("attention", &fastattn::ops::attention_autograd);
  m.impl("attention_step", &fastattn::ops::attention_step_autograd);
  m.impl("attention_step_", &fastattn::ops::attention_step_in_place_autograd);
  m.impl("attention_step_state", torch::CppFunction::makeFallthrough());
}

TORCH_LIBRARY_IMPL(fastattn, CompositeExplicitAutograd, m) {
  m.impl("attention_step", &fastattn::ops::attention_step);
  m.impl("attention_step_", &fastattn::ops::attention_step_in_place);
  m.impl("attention_step_state", &fastattn::ops::attention_step_state);
}

TORCH_LIBRARY_IMPL(fastattn, CompositeImplicitAutograd, m) {
  m.impl("attention_step_state_spec", &fastattn::ops::attention_step_state_spec);
  // attention_types has no tensor argument, so the dispatcher computes an
  // empty key set and looks up the Undefined key; a CompositeImplicitAutograd
  // kernel is also installed there (checked on LibTorch 1.13 by
  // test_attention_types_lists_full).
  m.impl("attention_types", &fastattn::ops::attention_types);
}
