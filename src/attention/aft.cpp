// The `aft-simple` and `aft-full` attention types (include/fastattn/aft.h)
// and their registration; the work is the operator fastattn::aft_attention
// (src/ops/aft_attention.cpp). Tested by tests/cpp/test_aft.cpp.
#include "fastattn/aft.h"

#include <ATen/CPUGeneratorImpl.h>

#include <limits>

#include "attention/builtin_types.h"
#include "fastattn/ops.h"
#include "fastattn/registry.h"

namespace fastattn {

namespace {
// Bounds of aft-full's sizes: u and v hold positions × rank float32 values
// each, and the bias is formed as an L×S matrix per call (65536² float32 is
// 16 GiB already).
constexpr int64_t kAftMaxPositions = 65536;
constexpr int64_t kAftMaxRank = 1024;
}  // namespace

AftAttention::AftAttention(bool full, int64_t max_sequence_length, int64_t aft_parameterization,
                           std::optional<int64_t> seed)
    : full_(full), max_len_(max_sequence_length) {
  if (!full_) return;
  TORCH_CHECK(max_sequence_length >= 1 && max_sequence_length <= kAftMaxPositions,
              "aft-full: max_sequence_length must be in [1, ", kAftMaxPositions, "], got ",
              max_sequence_length);
  TORCH_CHECK(aft_parameterization >= 1 && aft_parameterization <= kAftMaxRank,
              "aft-full: aft_parameterization must be in [1, ", kAftMaxRank, "], got ",
              aft_parameterization);
  TORCH_CHECK(!seed || *seed >= 0, "aft-full: seed must be >= 0, got ", seed.value_or(0));
  auto gen = seed ? at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(*seed))
                  : at::detail::getDefaultCPUGenerator();
  const std::vector<int64_t> shape = {max_sequence_length, aft_parameterization};
  u_ = register_parameter("u", torch::randn(shape, gen, torch::kFloat) * 0.01);
  v_ = register_parameter("v", torch::randn(shape, gen, torch::kFloat) * 0.01);
}

torch::Tensor AftAttention::position_bias(int64_t L, int64_t S, bool causal) const {
  TORCH_CHECK(full_, "aft-simple has no position bias");
  const int64_t rows = std::max(L, S);
  TORCH_CHECK(rows <= max_len_, "aft-full: sequences up to max_sequence_length = ", max_len_,
              " positions (the learned position bias), got L = ", L, " queries and S = ", S,
              " keys");
  const int64_t first = causal ? S - L : 0;
  TORCH_CHECK(first >= 0, "aft-full: causal attention of more queries (L = ", L,
              ") than keys (S = ", S, ") has no positions for the first queries");
  return u_.narrow(0, first, L).mm(v_.narrow(0, 0, S).t());
}

torch::Tensor AftAttention::forward(const torch::Tensor& queries, const torch::Tensor& keys,
                                    const torch::Tensor& values, const Mask& mask) {
  check_attention_inputs(type_name(), queries, keys, values, mask);
  std::optional<torch::Tensor> w;
  if (full_) {
    w = position_bias(queries.size(2), keys.size(2), mask.is_causal())
            .to(queries.device(), queries.scalar_type());
  }
  return aft_attention(queries, keys, values, w, mask.key_lengths(), mask.is_causal());
}

// ---- aft-simple's step form -------------------------------------------------

std::pair<torch::Tensor, RecurrentState> RecurrentAftSimpleAttention::step(
    const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value,
    const RecurrentState& state) {
  constexpr const char* who = "recurrent aft-simple";
  check_step_inputs(who, query, key, value);
  const int64_t N = query.size(0), H = query.size(1), E = query.size(2);
  TORCH_CHECK(value.size(2) == E, who,
              ": AFT works channel by channel: value must have the width E = ", E,
              " of the query and key, got ", value.size(2));
  auto s = state.empty() ? make_state(N, H, E, E, 0, query.options()) : state.tensors;
  TORCH_CHECK(s.size() == 3, who, ": state must be empty or hold {m, num, den} (N, H, E), got ",
              s.size(), " tensors");
  for (const auto& t : s) {
    TORCH_CHECK(t.sizes() == query.sizes() && t.scalar_type() == query.scalar_type() &&
                    t.device() == query.device(),
                who, ": state tensors must be ", query.scalar_type(),
                " (N, H, E) = ", query.sizes(), " on ", query.device(), ", got ", t.scalar_type(),
                " ", t.sizes(), " on ", t.device());
  }
  double lowest = 0;  // the lowest finite value of the key's dtype
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, key.scalar_type(), "aft step", [&] {
    lowest = static_cast<double>(std::numeric_limits<scalar_t>::lowest());
  });
  const auto x = key.clamp_min(lowest);
  auto m = torch::maximum(s[0], x);
  auto r = (s[0] - m).exp(), e = (x - m).exp();
  auto num = s[1] * r + e * value, den = s[2] * r + e;
  auto out = torch::sigmoid(query) * num / den;
  return {out, RecurrentState{{m, num, den}}};
}

std::vector<torch::Tensor> RecurrentAftSimpleAttention::make_state(
    int64_t N, int64_t H, int64_t E, int64_t /*M*/, int64_t /*capacity*/,
    const torch::TensorOptions& options) const {
  return {torch::full({N, H, E}, -std::numeric_limits<double>::infinity(), options),
          torch::zeros({N, H, E}, options), torch::zeros({N, H, E}, options)};
}

torch::Tensor RecurrentAftSimpleAttention::step_in_place(const torch::Tensor& query,
                                                         const torch::Tensor& key,
                                                         const torch::Tensor& value,
                                                         torch::TensorList state) {
  TORCH_CHECK(state.size() == 3,
              "recurrent aft-simple: an in-place state must hold {m, num, den} from make_state, "
              "got ",
              state.size(), " tensors");
  auto [out, next] = step(query, key, value, RecurrentState{state.vec()});
  for (size_t i = 0; i < 3; ++i) state[i].copy_(next.tensors[i]);
  return out;
}

void register_aft_attention_types(AttentionRegistry& registry) {
  registry.add({"aft-simple",
                "Attention Free Transformer without position bias (Zhai et al. 2021): "
                "sigmoid(q) times a softmax over the keys per channel of the values; O(S·E)",
                {},
                [](const Params&, const AttentionDims&) -> AttentionPtr {
                  return std::make_shared<AftAttention>(false);
                },
                Capabilities().rows(IncrementalRows::Yes).channel_by_channel(),
                [](const Params&, const AttentionDims&) -> RecurrentAttentionPtr {
                  return std::make_shared<RecurrentAftSimpleAttention>();
                }});
  registry.add(
      {"aft-full",
       "Attention Free Transformer with a learned position bias w = u·vᵀ (Zhai et al. 2021): "
       "sigmoid(q) times a softmax over keys + w per channel; O(L·S·E) as two matrix products",
       {ParamSpec::integer("max_sequence_length", 1024,
                           "positions the learned position bias covers (L and S at most; its L×S "
                           "matrix is formed per call)",
                           1, kAftMaxPositions),
        ParamSpec::integer("aft_parameterization", 64, "rank of the position bias u·vᵀ", 1,
                           kAftMaxRank),
        seed_spec("the position bias's initial values")},
       [](const Params& p, const AttentionDims&) -> AttentionPtr {
         return std::make_shared<AftAttention>(true, p.get_int("max_sequence_length"),
                                               p.get_int("aft_parameterization"),
                                               p.get_optional_int("seed"));
       },
       Capabilities().rows(IncrementalRows::Yes).with_learned_parameters().channel_by_channel()});
}

}  // namespace fastattn
