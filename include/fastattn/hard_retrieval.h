// Hard retrieval attention as an attention type (`hard-retrieval`), after Xu
// et al., "Learning Hard Retrieval Decoder Attention for Transformers": every
// head of every query attends to exactly one key and returns its value row.
//
//   auto attn = fastattn::make_attention("hard-retrieval", {{"seed", int64_t{7}}});
//   attn->train();  // sample one key per query from softmax(temp·q·k)
//   attn->eval();   // argmax of q·k (no softmax), a gather of V
//
// In training (is_training()) `train_mode` decides the forward: `sample`
// (the paper: a multinomial draw from the softmax, from the module's seeded
// generator) or `argmax`; evaluation always takes the argmax. Gradients are
// straight-through (see fastattn::hard_retrieval_attention in ops.h).
// Masks: causal, key lengths and a bool attn_mask; query lengths are ignored
// (padded queries still retrieve). The step form for decoding with a key
// cache is RecurrentHardRetrievalAttention (recurrent.h).
#pragma once

#include <ATen/core/Generator.h>

#include <optional>
#include <string>
#include <utility>

#include "fastattn/attention.h"

namespace fastattn {

class HardRetrievalAttention : public AttentionBase {
 public:
  // train_mode: "sample" or "argmax"; softmax_temp: scale of the scores in the
  // softmax (default 1/sqrt(E)); seed: the module's own generator (default:
  // the global CPU generator, torch::manual_seed).
  explicit HardRetrievalAttention(std::string train_mode = "sample",
                                  std::optional<double> softmax_temp = std::nullopt,
                                  std::optional<int64_t> seed = std::nullopt);
  torch::Tensor forward(const torch::Tensor& queries, const torch::Tensor& keys,
                        const torch::Tensor& values, const Mask& mask) override;
  // The output and the retrieved key per (n, h, query): (N, H, L) int64, -1
  // for a query that keeps no key.
  std::pair<torch::Tensor, torch::Tensor> forward_with_indices(const torch::Tensor& queries,
                                                               const torch::Tensor& keys,
                                                               const torch::Tensor& values,
                                                               const Mask& mask);
  std::string type_name() const override { return "hard-retrieval"; }
  const std::string& train_mode() const { return train_mode_; }

 private:
  std::string train_mode_;
  std::optional<double> softmax_temp_;
  at::Generator gen_;
};

}  // namespace fastattn
