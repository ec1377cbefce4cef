// Linear attention types (Katharopoulos et al. 2020, "Transformers are RNNs"):
// `linear` and `causal-linear`, and their registration.
//
//   linear:        out = phi(Q) (phi(K)^T V) / (phi(Q) sum_j phi(K_j) + eps).
//                  Two ATen matmuls (BLAS): O(N·H·(L+S)·F·M) time, O((L+S)·F + F·M)
//                  memory per head; no L×S tensor.
//   causal-linear: numerator and normaliser from one call of the chunked
//                  operator causal_linear_product (carried F×(M+1) state) on
//                  [V, 1]: column M is phi(q_i)·sum_{j<=i} phi(k_j), summed in
//                  the numerator's order and precision (a separate float32
//                  cumulative sum over 65536 terms would drift from it); costs
//                  one extra, scalar, column. S == L required.
// With the elu map on the CPU both types call the fused operator
// elu_linear_attention instead (map, products and normaliser in one kernel).
// Padded keys (key_lengths) get phi(k) = 0, so they add nothing to either sum.
// Tested by tests/cpp/test_linear_attention.cpp; timed by
// bench/bench_linear_attention.cpp.
#include <cmath>

#include "attention/builtin_types.h"
#include "attention/step_state.h"
#include "attention/normaliser_eps.h"
#include "fastattn/attention.h"
#include "fastattn/feature_maps.h"
#include "fastattn/ops.h"
#include "fastattn/recurrent.h"
#include "fastattn/registry.h"
#include "ops/elu_linear_output_sums.h"
#include "ops/op_shell.h"

namespace fastattn {

using torch::Tensor;

namespace {

// out = prod[..., :M] / (prod[..., M] + eps) for prod (N, H, L, M + 1) and
// eps a scalar or (N, H, 1, 1) tensor (shifted_eps), with a fused backward
// (grad_num = g / d, grad_den = -sum(g ∘ out) / d): two passes instead of the
// generic narrow / add / div chain (about ten at L·M size).
// A query whose features meet no key's (normaliser and numerator exactly 0:
// with relu features, a query whose positive features no key shares) is a
// query without keys: output 0 (0 / eps), as a fully masked row of softmax
// attention, and no gradient. Its 1/eps would otherwise overflow for a tiny
// eps and reach dv or dq as 0 · inf = NaN; with non-negative features every
// product of that row with a key is 0, so 0 is also the exact derivative.
struct NormaliseLastColumn {
  struct Saved {
    Tensor out, d, zero_den;
    auto tensors() { return std::tie(out, d, zero_den); }
  };
  static Tensor forward(Saved* saved, const Tensor& prod, const Tensor& eps) {
    const int64_t M = prod.size(-1) - 1;
    auto den = prod.narrow(-1, M, 1);
    auto d = den + eps;                    // (N, H, L, 1)
    auto out = prod.narrow(-1, 0, M) / d;  // (N, H, L, M)
    if (saved) *saved = {out, d, den.eq(0)};
    return out;
  }
  static torch::autograd::variable_list backward(const Saved& s,
                                                 const torch::autograd::variable_list& grads) {
    const auto &out = s.out, &d = s.d, &zero_den = s.zero_den;
    const auto& g = grads[0];
    const int64_t M = out.size(-1);
    auto grad = torch::empty({out.size(0), out.size(1), out.size(2), M + 1}, out.options());
    auto head = grad.narrow(-1, 0, M);
    torch::div_out(head, g, d);
    grad.narrow(-1, M, 1).copy_(-(g * out).sum(-1, /*keepdim=*/true) / d);
    // Rows without keys (above); on the CPU their test runs only when a
    // normaliser is 0 (no host synchronisation on other devices).
    if (!out.device().is_cpu() || zero_den.any().item<bool>())
      grad.masked_fill_(zero_den & out.eq(0).all(-1, /*keepdim=*/true), 0.0);
    return {grad};
  }
};

void check_eps(const char* type, double eps) {
  TORCH_CHECK(std::isfinite(eps) && eps > 0, type, ": eps must be a finite number > 0, got ", eps);
}

// The elu map on the CPU runs as one fused operator (elu_linear_attention):
// map, products and normaliser in one kernel; bfloat16 in float32 there
// (the ATen composition in bfloat16, LibTorch 1.13's bfloat16 elu_backward
// a large part of it, was far slower than the float32 operator; measured:
// git show 5f604de:docs/benchmarks.md, "bfloat16 through the float32 kernels
// without fresh copies").
bool fused_elu(const FeatureMap& fm, const Tensor& q) {
  return fm.name() == "elu" && q.device().is_cpu() &&
         (q.scalar_type() == torch::kFloat || q.scalar_type() == torch::kDouble ||
          q.scalar_type() == torch::kBFloat16);
}

// The fused operator, with its per-head sums of |out| in *witness (ops::EluLinearOutputSums;
// undefined where the operator has none).
Tensor fused_elu_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Mask& mask,
                           bool causal, double eps, Tensor* witness) {
  ops::EluLinearOutputSums sums;
  auto out =
      elu_linear_attention(q, k, v, mask.key_lengths(), causal, eps_in(eps, q.scalar_type()));
  *witness = sums.take();
  return out;
}

struct MappedFeatures {
  Tensor qf, kf;  // phi(Q) (N, H, L, F), phi(K) (N, H, S, F)
  Tensor eps;     // the normaliser's eps in the keys' scale (shifted_eps)
};

// phi(Q) and phi(K) with padded keys zeroed, and the eps that goes with them.
MappedFeatures feature_mapped(const char* type, FeatureMap& fm, bool training, const Tensor& q,
                              const Tensor& k, const Mask& mask, double eps) {
  fm.maybe_redraw(training);
  const int64_t N = k.size(0), S = k.size(2);
  std::optional<Tensor> keep;
  if (mask.key_lengths()) keep = mask.key_keep(N, S, k.device());  // (N, S)
  auto qf = fm.forward_queries(q);
  auto [kf, offset] = fm.map_keys(k, keep);
  TORCH_CHECK(qf.dim() == 4 && kf.dim() == 4 && qf.size(3) == kf.size(3) &&
                  qf.size(2) == q.size(2) && kf.size(2) == S,
              type, ": feature map '", fm.name(), "' must map (N, H, L, E) to (N, H, L, F), got ",
              qf.sizes(), " for queries ", q.sizes(), " and ", kf.sizes(), " for keys ", k.sizes());
  if (keep) kf = kf.masked_fill(keep->reshape({N, 1, S, 1}).logical_not(), 0.0);
  return {qf, kf, shifted_eps(eps, offset, q.scalar_type(), q.options())};
}

struct LinearOptions {
  FeatureMapOptions map;
  double eps = 1e-6;
};

LinearOptions linear_options(const Params& p, const AttentionDims& dims) {
  LinearOptions o;
  o.map.kind = p.get_string("feature_map");
  o.map.query_dim = dims.query_dim;
  o.map.n_features = p.get_optional_int("n_features");
  o.map.softmax_temp = p.get_optional_float("softmax_temp");
  o.map.orthogonal = p.get_bool("orthogonal");
  o.map.smoothing = p.get_float("smoothing");
  o.map.kernel_fn = p.get_string("kernel_fn");
  o.map.seed = static_cast<uint64_t>(p.get_int("seed"));
  o.map.redraw = p.get_int("redraw");
  o.eps = p.get_float("eps");
  return o;
}

std::vector<ParamSpec> linear_params() {
  return {
      ParamSpec::choice("feature_map", "elu", feature_map_names(),
                        "phi: elu (elu+1), relu, favor (Performer FAVOR+), rff (random Fourier "
                        "features), smoothed-rff (rff plus a constant feature), generalized "
                        "(Performer's generalized random features f(W x))"),
      ParamSpec::integer("n_features", std::nullopt,
                         "random maps: number of features m (rff: even; a model size: the "
                         "E x m matrix); default query_dim",
                         1, double(kMaxRandomFeatures)),
      softmax_temp_spec("favor / rff: kernel scale, exp(temp·q·k) or exp(-temp·|q-k|²/2); default "
                        "1/sqrt(E)"),
      ParamSpec::boolean("orthogonal", true, "favor / rff: orthogonal random blocks"),
      ParamSpec::real("smoothing", 1.0, "smoothed-rff: constant added to the kernel", 0.0)
          .exclusive_min(),
      ParamSpec::choice("kernel_fn", "relu", kernel_function_names(),
                        "generalized: the kernel function f of the random features"),
      ParamSpec::real("eps", 1e-6, "added to the normaliser phi(q)·sum phi(k)", 0.0)
          .exclusive_min(),
      ParamSpec::integer("seed", 0, "seed of the random feature map's generator", 0),
      ParamSpec::integer("redraw", 1,
                         "random maps: redraw every n-th forward in training (0: never); "
                         "evaluation never redraws",
                         0),
  };
}

}  // namespace

// ---- linear -----------------------------------------------------------------

LinearAttention::LinearAttention(std::shared_ptr<FeatureMap> feature_map, double eps)
    : feature_map_(std::move(feature_map)), eps_(eps) {
  TORCH_CHECK(feature_map_, "LinearAttention: feature_map must be a feature map, got null");
  check_eps("LinearAttention", eps_);
  register_module("feature_map", feature_map_);
}

Tensor LinearAttention::forward(const Tensor& queries,  // (N, H, L, E)
                                const Tensor& keys,     // (N, H, S, E)
                                const Tensor& values,   // (N, H, S, M)
                                const Mask& mask) {
  check_attention_inputs(type_name(), queries, keys, values, mask);
  finite_witness_ = Tensor();
  if (fused_elu(*feature_map_, queries))
    return fused_elu_attention(queries, keys, values, mask, /*causal=*/false, eps_,
                               &finite_witness_);
  auto [qf, kf, eps] =
      feature_mapped("linear", *feature_map_, is_training(), queries, keys, mask, eps_);
  // [phi(K)^T V | sum_j phi(K_j)] is small (F × (M + 1) per head): one product
  // with phi(Q) then gives numerator and normaliser together.
  auto kvz = torch::cat({torch::matmul(kf.transpose(-1, -2), values), kf.sum(2).unsqueeze(-1)},
                        -1);  // (N, H, F, M + 1)
  return ops::Shell<NormaliseLastColumn>::autograd(torch::matmul(qf, kvz), eps);  // (N, H, L, M)
}

// ---- causal-linear ----------------------------------------------------------

CausalLinearAttention::CausalLinearAttention(std::shared_ptr<FeatureMap> feature_map, double eps)
    : feature_map_(std::move(feature_map)), eps_(eps) {
  TORCH_CHECK(feature_map_, "CausalLinearAttention: feature_map must be a feature map, got null");
  check_eps("CausalLinearAttention", eps_);
  register_module("feature_map", feature_map_);
}

Tensor CausalLinearAttention::forward(const Tensor& queries,  // (N, H, L, E)
                                      const Tensor& keys,     // (N, H, S, E)
                                      const Tensor& values,   // (N, H, S, M)
                                      const Mask& mask) {
  check_attention_inputs(type_name(), queries, keys, values, mask);
  TORCH_CHECK(keys.size(2) == queries.size(2),
              "causal-linear: needs as many keys as queries (S == L), got queries ",
              queries.sizes(), " and keys ", keys.sizes());
  finite_witness_ = Tensor();
  if (fused_elu(*feature_map_, queries))
    return fused_elu_attention(queries, keys, values, mask, /*causal=*/true, eps_,
                               &finite_witness_);
  auto [qf, kf, eps] =
      feature_mapped("causal-linear", *feature_map_, is_training(), queries, keys, mask, eps_);
  // One product for numerator and normaliser: v gets a column of ones, so
  // column M of the result is phi(q_i)·sum_{j<=i} phi(k_j), accumulated in
  // exactly the numerator's order (and its precision).
  auto ones = torch::ones({values.size(0), values.size(1), values.size(2), 1}, values.options());
  auto prod = causal_linear_product(qf, kf, torch::cat({values, ones}, -1));  // (N, H, L, M + 1)
  return ops::Shell<NormaliseLastColumn>::autograd(prod, eps);
}

void register_linear_attention_types(AttentionRegistry& registry) {
  registry.add({"linear",
                "linear attention phi(Q)(phi(K)^T V), normalised: O(L·F·M) time, no L×S "
                "matrix (no attn_mask, no causal: see causal-linear)",
                linear_params(),
                [](const Params& p, const AttentionDims& dims) -> AttentionPtr {
                  const auto o = linear_options(p, dims);
                  return std::make_shared<LinearAttention>(make_feature_map(o.map), o.eps);
                },
                Capabilities().bidirectional_only("causal-linear"), /*recurrent=*/nullptr,
                [](const Params& p, const AttentionDims& dims) -> RecurrentCrossAttentionPtr {
                  // The batch type's feature map: the same parameters give the same map.
                  const auto o = linear_options(p, dims);
                  return std::make_shared<RecurrentCrossLinearAttention>(make_feature_map(o.map),
                                                                         o.eps);
                }});
  registry.add({"causal-linear",
                "causal linear attention through the chunked causal_linear_product operator "
                "(needs a causal mask and S == L)",
                linear_params(),
                [](const Params& p, const AttentionDims& dims) -> AttentionPtr {
                  const auto o = linear_options(p, dims);
                  return std::make_shared<CausalLinearAttention>(make_feature_map(o.map), o.eps);
                },
                Capabilities().causal_only("linear"),
                [](const Params& p, const AttentionDims& dims) -> RecurrentAttentionPtr {
                  // The same parameters give the same feature map (and weights) as
                  // the batch type.
                  const auto o = linear_options(p, dims);
                  return std::make_shared<RecurrentLinearAttention>(make_feature_map(o.map), o.eps);
                }});
}

// ---- step forms (include/fastattn/recurrent.h) -------------------------------

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

RecurrentCrossLinearAttention::RecurrentCrossLinearAttention(
    std::shared_ptr<FeatureMap> feature_map, double eps)
    : feature_map_(std::move(feature_map)), eps_(eps) {
  TORCH_CHECK(feature_map_,
              "RecurrentCrossLinearAttention: feature_map must be a feature map, got null");
  TORCH_CHECK(std::isfinite(eps_) && eps_ > 0,
              "RecurrentCrossLinearAttention: eps must be a finite number > 0, got ", eps_);
  register_module("feature_map", feature_map_);
}

RecurrentState RecurrentCrossLinearAttention::prepare(const Tensor& keys,    // (N, H, S, E)
                                                      const Tensor& values,  // (N, H, S, M)
                                                      const std::optional<Tensor>& key_lengths) {
  constexpr const char* type = "recurrent cross linear";
  check_memory(type, keys, values, key_lengths);
  const int64_t N = keys.size(0), S = keys.size(2);
  // As LinearAttention: the key map sees the kept keys only, padded keys are 0.
  std::optional<Tensor> keep;
  if (key_lengths) {
    keep = torch::arange(S, keys.options().dtype(torch::kLong)).unsqueeze(0) <
           key_lengths->to(keys.device(), torch::kLong).unsqueeze(1);  // (N, S)
  }
  auto [kf, offset] = feature_map_->map_keys(keys, keep);  // (N, H, S, F)
  TORCH_CHECK(kf.dim() == 4 && kf.size(2) == S, type, ": feature map '", feature_map_->name(),
              "' must map (N, H, S, E) to (N, H, S, F), got ", kf.sizes());
  if (keep) kf = kf.masked_fill(keep->reshape({N, 1, S, 1}).logical_not(), 0.0);
  auto Sm = torch::matmul(kf.transpose(-1, -2), values);  // (N, H, F, M)
  auto Z = kf.sum(2);                                     // (N, H, F)
  RecurrentState memory{{Sm, Z}};
  // The keys' offset (exponential maps), for the normaliser's eps.
  if (offset.defined()) memory.tensors.push_back(offset.view({N, keys.size(1)}));
  return memory;
}

Tensor RecurrentCrossLinearAttention::step(const Tensor& query,  // (N, H, E)
                                           const RecurrentState& memory) {
  constexpr const char* type = "recurrent cross linear";
  const size_t tensors = feature_map_->shifts_keys() ? 3 : 2;
  TORCH_CHECK(memory.tensors.size() == tensors, type,
              ": memory state must hold {S (N, H, F, M), Z (N, H, F)",
              tensors == 3 ? ", offset (N, H)" : "", "} from prepare, got ", memory.tensors.size(),
              " tensors");
  const auto &Sm = memory.tensors[0], &Z = memory.tensors[1];
  TORCH_CHECK(query.defined() && query.dim() == 3 && Sm.dim() == 4 && query.size(0) == Sm.size(0) &&
                  query.size(1) == Sm.size(1),
              type, ": query must have shape (N, H, E) with N, H = ", Sm.size(0), ", ", Sm.size(1),
              " of the memory, got ", query.defined() ? query.sizes() : c10::IntArrayRef{});
  TORCH_CHECK(query.scalar_type() == Sm.scalar_type(), type, ": query must be ", Sm.scalar_type(),
              " like the memory, got ", query.scalar_type());
  auto qf = feature_map_->forward_queries(query.unsqueeze(2));  // (N, H, 1, F)
  TORCH_CHECK(qf.dim() == 4 && qf.size(3) == Sm.size(2), type, ": feature map '",
              feature_map_->name(), "' gave query features ", qf.sizes(), " for a memory of ",
              Sm.size(2), " features");
  auto num = torch::matmul(qf, Sm).squeeze(2);  // (N, H, M)
  const auto offset = tensors == 3 ? memory.tensors[2].view({Sm.size(0), Sm.size(1), 1}) : Tensor();
  auto den = (qf.squeeze(2) * Z).sum(-1, /*keepdim=*/true) +
             shifted_eps(eps_, offset, qf.scalar_type(), qf.options());  // (N, H, 1)
  return num / den;
}

}  // namespace fastattn
