// The AFT attention types (Zhai et al. 2021, "An Attention Free Transformer"):
// `aft-simple` (no position bias) and `aft-full` (a learned position bias
// w = u vᵀ of rank `aft_parameterization` over positions up to
// `max_sequence_length`, shared by the heads, as fast-transformers'
// AFTFullAttention). Both are the operator fastattn::aft_attention
// (include/fastattn/ops.h): out_t = sigmoid(q_t) ⊙ Σ_s exp(k_s + w_ts) v_s /
// Σ_s exp(k_s + w_ts), channel by channel, so values have the width of the
// keys. Causal and key lengths; no attn_mask.
#pragma once

#include <torch/torch.h>

#include "fastattn/attention.h"
#include "fastattn/recurrent.h"

namespace fastattn {

class AftAttention : public AttentionBase {
 public:
  // full = false: AFT-simple (the other arguments unused, no parameters).
  // full = true: u and v (max_sequence_length × aft_parameterization,
  // float32, N(0, 0.01²) as the reference initialises them; `seed` for
  // their generator, else the global one).
  explicit AftAttention(bool full, int64_t max_sequence_length = 1024,
                        int64_t aft_parameterization = 64, std::optional<int64_t> seed = {});
  torch::Tensor forward(const torch::Tensor& queries, const torch::Tensor& keys,
                        const torch::Tensor& values, const Mask& mask) override;
  std::string type_name() const override { return full_ ? "aft-full" : "aft-simple"; }

  // AFT-full's bias for L queries over S keys: rows u[S-L : S] under causal
  // (the queries are the last L positions), u[0 : L] otherwise; columns
  // v[0 : S]. (L, S) float32.
  torch::Tensor position_bias(int64_t L, int64_t S, bool causal) const;

 private:
  bool full_;
  int64_t max_len_;
  torch::Tensor u_, v_;
};

// aft-simple's step form: causal AFT-simple one token at a time, in constant
// memory. State {m, num, den} (N, H, E): per channel the running maximum of
// the keys and the sums of exp(k - m)·v and exp(k - m) (make_state: -inf,
// 0, 0). Step t gives row t of the causal batch form (a key of -inf counts
// as the lowest finite value, as there).
class RecurrentAftSimpleAttention : public RecurrentAttentionBase {
 public:
  std::pair<torch::Tensor, RecurrentState> step(const torch::Tensor& query,
                                                const torch::Tensor& key,
                                                const torch::Tensor& value,
                                                const RecurrentState& state) override;
  std::string type_name() const override { return "aft-simple"; }
  std::vector<torch::Tensor> make_state(int64_t N, int64_t H, int64_t E, int64_t M,
                                        int64_t capacity,
                                        const torch::TensorOptions& options) const override;
  torch::Tensor step_in_place(const torch::Tensor& query, const torch::Tensor& key,
                              const torch::Tensor& value, torch::TensorList state) override;
};

}  // namespace fastattn
