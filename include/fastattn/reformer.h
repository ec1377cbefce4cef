// Reformer LSH attention (Kitaev et al. 2020, "Reformer: The Efficient
// Transformer"), a baseline of the clustered-attention paper.
//
// Shared-QK attention: the keys are the queries L2-normalised; the `keys`
// argument of forward() is only shape-checked (its content is ignored and gets
// no gradient). Per round, positions are hashed by argmax over [q·R; -q·R]
// (R: E x n_buckets/2 Gaussian rotations drawn from the module's generator at
// every forward), sorted by (bucket, position), cut into chunks of
// chunk_size; each chunk attends to itself and the previous chunk. Rounds are
// combined by their log-sum-exp. See fastattn::reformer_attention (ops.h) and
// docs/attention-types.md.
#pragma once

#include <ATen/core/Generator.h>
#include <torch/torch.h>

#include <optional>

#include "fastattn/attention.h"

namespace fastattn {

// Bound on `rounds` (each round is a full hashing and attention pass; the
// Reformer paper uses up to 8).
constexpr int64_t kMaxReformerRounds = 1024;

struct ReformerOptions {
  int64_t chunk_size = 32;             // sorted positions per chunk; clamped to L
  int64_t n_buckets = 64;              // 1, or an even number >= 2; clamped to L rounded up to even
  int64_t rounds = 4;                  // hashing rounds, in [1, kMaxReformerRounds]
  std::optional<double> softmax_temp;  // default 1/sqrt(E)
  // Seeds the module's own generator; without it the default CPU generator
  // (torch::manual_seed) is used. Each forward draws fresh rotations.
  std::optional<int64_t> seed;
  bool masked = true;              // a position attends to itself only if it sees nothing else
  double attention_dropout = 0.0;  // in training mode, fused (CPU)
};

// `reformer`. Masks: key lengths (and query lengths: the padding is the
// shorter of the two, since every position is both a query and a key) and
// causal; an attention mask is an error. Needs S == L.
class ReformerAttention : public AttentionBase {
 public:
  explicit ReformerAttention(ReformerOptions options = {});
  torch::Tensor forward(const torch::Tensor& queries, const torch::Tensor& keys,
                        const torch::Tensor& values, const Mask& mask) override;
  std::string type_name() const override { return "reformer"; }
  const ReformerOptions& options() const { return options_; }

  // The buckets (N, H, rounds, L) the next forward would use for `queries`,
  // drawing rotations from the module's generator (so it advances it).
  torch::Tensor hash(const torch::Tensor& queries);

 private:
  ReformerOptions options_;
  at::Generator gen_;
};

}  // namespace fastattn
