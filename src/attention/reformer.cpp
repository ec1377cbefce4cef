// Reformer LSH attention as an attention type (`reformer`) and its
// registration. Rotations (rounds, E, n_buckets/2) are drawn in float64 from
// the module's generator (the same seed gives the same rotations in every
// dtype), the queries are hashed by fastattn::lsh_hash and attended by
// fastattn::reformer_attention (src/kernels/reformer/).
// Tested by tests/cpp/test_reformer_attention.cpp; timed by
// bench/bench_reformer_attention.cpp.
#include <ATen/CPUGeneratorImpl.h>

#include <cmath>

#include "attention/builtin_types.h"
#include "fastattn/ops.h"
#include "fastattn/reformer.h"
#include "fastattn/registry.h"
#include "ops/dense_attention.h"
#include "ops/engine_pieces.h"

namespace fastattn {

ReformerAttention::ReformerAttention(ReformerOptions options) : options_(std::move(options)) {
  const char* who = "ReformerAttention";
  const auto& o = options_;
  TORCH_CHECK(o.chunk_size >= 1, who, ": chunk_size must be >= 1, got ", o.chunk_size);
  TORCH_CHECK(o.n_buckets == 1 || (o.n_buckets >= 2 && o.n_buckets % 2 == 0), who,
              ": n_buckets must be 1 or an even number >= 2 (argmax over [xR; -xR]), got ",
              o.n_buckets);
  TORCH_CHECK(o.n_buckets <= (int64_t(1) << 24), who, ": n_buckets must be <= 2^24, got ",
              o.n_buckets);
  TORCH_CHECK(o.rounds >= 1 && o.rounds <= kMaxReformerRounds, who, ": rounds must be in [1, ",
              kMaxReformerRounds, "], got ", o.rounds);
  check_softmax_temp(who, o.softmax_temp);
  TORCH_CHECK(!o.seed || *o.seed >= 0, who, ": seed must be >= 0, got ", o.seed.value_or(0));
  check_attention_dropout(who, o.attention_dropout);
  gen_ = o.seed ? at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(*o.seed))
                : at::detail::getDefaultCPUGenerator();
}

torch::Tensor ReformerAttention::hash(const torch::Tensor& queries) {
  TORCH_CHECK(queries.dim() == 4, "reformer: queries must have shape (N, H, L, E), got ",
              queries.sizes());
  const int64_t E = queries.size(3), L = queries.size(2);
  // L positions fill at most L buckets: more only cost rotation columns (and
  // memory) without separating anything further, so n_buckets is clamped to
  // L rounded up to even.
  const int64_t buckets =
      options_.n_buckets == 1 ? 1 : std::min(options_.n_buckets, std::max<int64_t>(2, L + L % 2));
  torch::Tensor rotations;
  {
    torch::NoGradGuard no_grad;
    rotations = torch::randn({options_.rounds, E, buckets / 2}, gen_,
                             torch::TensorOptions().dtype(torch::kDouble));
  }
  return lsh_hash(queries.detach(), rotations.to(queries.device(), queries.scalar_type()));
}

torch::Tensor ReformerAttention::forward(const torch::Tensor& queries,  // (N, H, L, E)
                                         const torch::Tensor& keys,     // (N, H, L, E), unused
                                         const torch::Tensor& values,   // (N, H, L, M)
                                         const Mask& mask) {
  check_attention_inputs(type_name(), queries, keys, values, mask);
  TORCH_CHECK(keys.size(2) == queries.size(2),
              "reformer: shared-QK attention needs as many keys as queries (S == L; the keys are "
              "the normalised queries), got queries ",
              queries.sizes(), " and keys ", keys.sizes());
  // Every position is a query and a key: the padding is the shorter length.
  std::optional<torch::Tensor> lengths = mask.key_lengths();
  if (mask.query_lengths()) {
    auto ql = mask.query_lengths()->to(torch::kLong);
    lengths = lengths ? torch::minimum(lengths->to(torch::kLong), ql) : ql;
  }
  auto buckets = hash(queries);
  const double dropout = is_training() ? options_.attention_dropout : 0.0;
  // On the dense-attention engine where it runs on PyTorch's fused kernels:
  // each round's sorted chunks as packed sequences (src/ops/engine_pieces.h).
  // Causal and padded calls keep the Reformer kernels (their order is not the
  // sorted one), and so does dropout (the engine's calls take none yet).
  if (!mask.is_causal() && !lengths && dropout == 0 &&
      ops::types_use_dense_engine(queries, values, {}, /*pieces=*/true)) {
    const double temp =
        options_.softmax_temp.value_or(1.0 / std::sqrt(static_cast<double>(queries.size(3))));
    return ops::reformer_on_engine(queries, values, buckets, options_.chunk_size, options_.masked,
                                   temp);
  }
  return reformer_attention(queries, values, buckets, lengths, options_.chunk_size,
                            mask.is_causal(), options_.masked, options_.softmax_temp, dropout);
}

void register_reformer_attention_types(AttentionRegistry& registry) {
  registry.add(
      {"reformer",
       "Reformer LSH attention: shared QK (keys = normalised queries), hashed by random "
       "rotations, sorted by bucket, attention within chunks and one chunk back, several rounds "
       "(Kitaev et al. 2020)",
       {ParamSpec::integer("chunk_size", 32,
                           "sorted positions per chunk (each chunk also sees "
                           "the previous one); clamped to L",
                           1),
        ParamSpec::integer("n_buckets", 64,
                           "hash buckets per round: 1, or even (argmax over [xR; -xR]); "
                           "clamped to L rounded up to even (L positions fill at most L buckets)",
                           1, double(int64_t(1) << 24)),
        ParamSpec::integer("rounds", 4, "hashing rounds, combined by their log-sum-exp", 1,
                           double(kMaxReformerRounds)),
        softmax_temp_spec(), seed_spec("the rotations, drawn at every forward"),
        ParamSpec::boolean("masked", true,
                           "mask out the self position (score -1e5) unless it is the only one"),
        attention_dropout_spec()},
       [](const Params& p, const AttentionDims&) -> AttentionPtr {
         ReformerOptions o;
         o.chunk_size = p.get_int("chunk_size");
         o.n_buckets = p.get_int("n_buckets");
         o.rounds = p.get_int("rounds");
         o.softmax_temp = p.get_optional_float("softmax_temp");
         o.seed = p.get_optional_int("seed");
         o.masked = p.get_bool("masked");
         o.attention_dropout = p.get_float("attention_dropout");
         return std::make_shared<ReformerAttention>(o);
       },
       Capabilities().selecting(),
       /*recurrent=*/nullptr});
}

}  // namespace fastattn
