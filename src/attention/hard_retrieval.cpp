// The `hard-retrieval` attention type (see include/fastattn/hard_retrieval.h)
// and its registration. The module only chooses the mode and draws a seed
// per training forward from its generator; the work is the operator
// fastattn::hard_retrieval_attention (src/ops/hard_retrieval_attention.cpp).
// Tested by tests/cpp/test_hard_retrieval.cpp.
#include "fastattn/hard_retrieval.h"

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <limits>
#include <tuple>

#include "attention/builtin_types.h"
#include "attention/step_state.h"
#include "fastattn/ops.h"
#include "fastattn/recurrent.h"
#include "fastattn/registry.h"
#include "ops/dense_attention.h"
#include "ops/op_shell.h"
#include "ops/op_util.h"

namespace fastattn {

namespace {

// The argmax of the raw scores q·k over the keys each query sees (causal
// aligned bottom-right, key lengths) by score tiles: a chunk of queries
// against all keys as one matrix product (cuBLAS on the GPU; float32 for
// 16-bit inputs, as the kernels accumulate), masked, then argmax (ties: the
// lowest j, as the kernels); -1 for a query without keys. (N, H, L) int64.
torch::Tensor argmax_by_score_tiles(const torch::Tensor& q, const torch::Tensor& k,
                                    const c10::optional<torch::Tensor>& key_lengths, bool causal) {
  torch::NoGradGuard no_grad;
  const int64_t N = q.size(0), H = q.size(1), L = q.size(2), S = k.size(2);
  auto index = torch::full({N, H, L}, -1, q.options().dtype(torch::kLong));
  if (L == 0 || S == 0) return index;
  const bool widen = q.scalar_type() == torch::kHalf || q.scalar_type() == torch::kBFloat16;
  const auto kt = (widen ? k.to(torch::kFloat) : k).transpose(-1, -2);
  const auto j = torch::arange(S, index.options()).view({1, 1, 1, S});
  // About 2^24 scores at a time.
  const int64_t chunk = std::max<int64_t>(1, (int64_t{1} << 24) / std::max<int64_t>(1, N * H * S));
  for (int64_t l0 = 0; l0 < L; l0 += chunk) {
    const int64_t n = std::min(chunk, L - l0);
    auto qc = q.narrow(2, l0, n);
    auto scores = torch::matmul(widen ? qc.to(torch::kFloat) : qc, kt);  // (N, H, n, S)
    auto keep = torch::ones({1, 1, n, S}, index.options().dtype(torch::kBool));
    if (causal) {
      auto p = torch::arange(l0, l0 + n, index.options()).view({1, 1, n, 1}) + (S - L);
      keep = keep & j.le(p);
    }
    if (key_lengths) keep = keep & j.lt(key_lengths->to(index.options()).view({N, 1, 1, 1}));
    scores.masked_fill_(keep.logical_not(), -std::numeric_limits<double>::infinity());
    auto dead = keep.any(-1).expand({N, H, n}).logical_not();
    index.narrow(2, l0, n).copy_(scores.argmax(-1).masked_fill(dead, -1));
  }
  return index;
}

// The rows of v at index (0 for -1): the hard retrieval's output, with the
// straight-through gradient to v (an index-add of grad_out) from autograd.
torch::Tensor gather_values(const torch::Tensor& v, const torch::Tensor& index) {
  auto rows = v.gather(2, index.clamp_min(0).unsqueeze(-1).expand(
                              {index.size(0), index.size(1), index.size(2), v.size(3)}));
  return rows * index.ge(0).unsqueeze(-1).to(v.scalar_type());
}

// Hard retrieval with the straight-through backward on the dense-attention
// engine: the forward's one-hot choice (the argmax by score tiles, or a
// sample from fastattn's kernel); the softmax P it stands for as the engine's (P V, lse), so that
// dq, dk are the engine's backward of P V for the same grad_out (the
// operator's eqs. 8-10, src/ops/hard_retrieval_attention.cpp) and dv is the
// index-add of grad_out.
struct HardRetrievalOnEngine {
  struct Saved {
    torch::Tensor q, k, v, soft, lse, index;
    ops::DenseAttentionSpec spec;
    auto tensors() { return std::tie(q, k, v, soft, lse, index); }
  };

  static std::tuple<torch::Tensor, torch::Tensor> forward(Saved* saved, const torch::Tensor& q,
                                                          const torch::Tensor& k,
                                                          const torch::Tensor& v,
                                                          const ops::DenseAttentionSpec& spec,
                                                          bool sample, int64_t seed) {
    torch::Tensor out, index;
    if (sample) {
      std::tie(out, index) = hard_retrieval_attention(
          q, k, v, std::nullopt, to_std(spec.key_lengths), spec.causal, true, spec.scale, seed);
    } else {
      index = argmax_by_score_tiles(q, k, spec.key_lengths, spec.causal);
      out = gather_values(v, index);
    }
    if (saved) {
      auto [soft, lse] = ops::dense_attention_forward(q, k, v, spec);
      *saved = {q, k, v, soft, lse, index, spec};
    }
    return {out, index};
  }

  static torch::autograd::variable_list backward(const Saved& s,
                                                 const torch::autograd::variable_list& grads) {
    if (!grads[0].defined()) return {};
    const auto go = grads[0].to(s.soft.scalar_type());
    auto [dq, dk, soft_dv] =
        ops::dense_attention_backward(go, s.q, s.k, s.v, s.soft, s.lse, s.spec);
    auto src = go * (s.index >= 0).unsqueeze(-1).to(go.scalar_type());
    auto dv = torch::zeros_like(s.v).scatter_add_(
        2, s.index.clamp_min(0).unsqueeze(-1).expand_as(go), src);
    return {dq, dk, dv};
  }
};

}  // namespace

HardRetrievalAttention::HardRetrievalAttention(std::string train_mode,
                                               std::optional<double> softmax_temp,
                                               std::optional<int64_t> seed)
    : train_mode_(std::move(train_mode)), softmax_temp_(softmax_temp) {
  TORCH_CHECK(train_mode_ == "sample" || train_mode_ == "argmax",
              "HardRetrievalAttention: train_mode must be 'sample' or 'argmax', got '", train_mode_,
              "'");
  check_softmax_temp("HardRetrievalAttention", softmax_temp);
  TORCH_CHECK(!seed || *seed >= 0, "HardRetrievalAttention: seed must be >= 0, got ",
              seed.value_or(0));
  gen_ = seed ? at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(*seed))
              : at::detail::getDefaultCPUGenerator();
}

std::pair<torch::Tensor, torch::Tensor> HardRetrievalAttention::forward_with_indices(
    const torch::Tensor& queries,  // (N, H, L, E)
    const torch::Tensor& keys,     // (N, H, S, E)
    const torch::Tensor& values,   // (N, H, S, M)
    const Mask& mask) {
  check_attention_inputs(type_name(), queries, keys, values, mask);
  const bool sample = is_training() && train_mode_ == "sample";
  int64_t seed = 0;
  if (sample) {
    // One op seed per forward from the module's generator (drawn on the CPU;
    // randint locks the generator itself).
    seed = torch::randint(0, int64_t(1) << 62, {1}, gen_, torch::kLong).item<int64_t>();
  }
  ops::DenseAttentionSpec spec;
  spec.scale = softmax_temp_.value_or(1.0 / std::sqrt(static_cast<double>(queries.size(3))));
  spec.causal = mask.is_causal();
  spec.key_lengths = to_c10(mask.key_lengths());
  // Where the dense-attention engine runs on PyTorch's fused kernels: the
  // argmax by score tiles (matrix products), and in training through q or k
  // the softmax the straight-through backward sees from the engine.
  if (!mask.attn_mask() && ops::types_use_dense_engine(queries, values, spec)) {
    if (torch::GradMode::is_enabled() && (queries.requires_grad() || keys.requires_grad())) {
      auto [out, index] =
          ops::Shell<HardRetrievalOnEngine>::autograd(queries, keys, values, spec, sample, seed);
      return {out, index};
    }
    if (!sample) {
      auto index = argmax_by_score_tiles(queries, keys, spec.key_lengths, spec.causal);
      return {gather_values(values, index), index};
    }
  }
  auto [out, index] =
      hard_retrieval_attention(queries, keys, values, mask.attn_mask(), mask.key_lengths(),
                               mask.is_causal(), sample, softmax_temp_, seed);
  return {out, index};
}

torch::Tensor HardRetrievalAttention::forward(const torch::Tensor& queries,
                                              const torch::Tensor& keys,
                                              const torch::Tensor& values, const Mask& mask) {
  return forward_with_indices(queries, keys, values, mask).first;
}

void register_hard_retrieval_attention_types(AttentionRegistry& registry) {
  registry.add(
      {"hard-retrieval",
       "each head attends to one key: argmax of q·k in evaluation (a gather of V), a sample "
       "from the softmax in training, straight-through gradients (Xu et al.)",
       {ParamSpec::choice("train_mode", "sample", {"sample", "argmax"},
                          "training forward: sample from softmax(temp·q·k) (the paper) or take "
                          "the argmax; evaluation always takes the argmax"),
        softmax_temp_spec("scale of the scores in the training softmax (sampling and gradients); "
                          "default 1/sqrt(E)"),
        seed_spec("training samples")},
       [](const Params& p, const AttentionDims&) -> AttentionPtr {
         return std::make_shared<HardRetrievalAttention>(p.get_string("train_mode"),
                                                         p.get_optional_float("softmax_temp"),
                                                         p.get_optional_int("seed"));
       },
       Capabilities().masks(MaskKinds::Bool).rows(IncrementalRows::Yes).selecting(),
       [](const Params&, const AttentionDims&) -> RecurrentAttentionPtr {
         return std::make_shared<RecurrentHardRetrievalAttention>();  // steps take the argmax
       },
       [](const Params&, const AttentionDims&) -> RecurrentCrossAttentionPtr {
         return std::make_shared<RecurrentCrossHardRetrievalAttention>();  // the argmax
       }});
}

// ---- step forms (include/fastattn/recurrent.h) -------------------------------

using torch::Tensor;

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

RecurrentState RecurrentCrossHardRetrievalAttention::prepare(
    const Tensor& keys,    // (N, H, S, E)
    const Tensor& values,  // (N, H, S, M)
    const std::optional<Tensor>& key_lengths) {
  return cache_memory("recurrent cross hard-retrieval", keys, values, key_lengths,
                      /*contiguous=*/true);
}

Tensor RecurrentCrossHardRetrievalAttention::step(const Tensor& query,  // (N, H, E)
                                                  const RecurrentState& memory) {
  constexpr const char* type = "recurrent cross hard-retrieval";
  const auto lengths = cached_key_lengths(type, query, memory);
  // The operator: raw scores, padding never retrieved, the first of equal
  // maxima; one value row per head, nothing else read; zeros for a memory
  // without kept keys.
  return std::get<0>(hard_retrieval_attention(query.unsqueeze(2), memory.tensors[0],
                                              memory.tensors[1], std::nullopt, lengths))
      .squeeze(2);  // (N, H, M)
}

}  // namespace fastattn
