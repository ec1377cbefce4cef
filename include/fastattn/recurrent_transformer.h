// Recurrent (token-by-token) twins of the transformer encoder modules, for
// autoregressive inference: fed one position x_i (N, D) at a time with the
// state of the previous positions, RecurrentEncoder returns what
// TransformerEncoder returns at position i under a causal mask. Parameter
// names are those of the batch modules (layers.0.attention.query_projection.weight,
// layers.0.linear1.weight, norm.weight, ...), so one set of weights serves
// both: copy_parameters(recurrent, batch) copies them by name.
//
//   auto builder = fastattn::EncoderBuilder().layers(2).heads(4).d_model(64)
//                      .attention("causal-linear");
//   auto batch = builder.build();              // train it (causal mask) ...
//   auto rnn = fastattn::make_recurrent_encoder(builder);
//   fastattn::copy_parameters(*rnn, *batch);
//   std::vector<fastattn::RecurrentState> state;  // empty: before the first token
//   auto [y, next] = rnn->step(x_i, state);       // x_i, y: (N, D)
//
// Each layer keeps its attention's state (see recurrent.h); the step costs the
// attention step plus O(N·D·(D + d_ff)) per layer.
// Tested by tests/cpp/test_recurrent.cpp.
#pragma once

#include <torch/torch.h>

#include <utility>
#include <vector>

#include "fastattn/recurrent.h"
#include "fastattn/transformer.h"

namespace fastattn {

// Projections to heads around a recurrent attention: x (N, D) -> (N, D).
// Submodules as AttentionLayer: inner_attention, query_projection,
// key_projection, value_projection, out_projection.
class RecurrentAttentionLayerImpl : public torch::nn::Module {
 public:
  RecurrentAttentionLayerImpl(RecurrentAttentionPtr attention,
                              const AttentionLayerOptions& options);
  // x (N, D) -> (output (N, D), new state); self-attention (keys = values = x).
  std::pair<torch::Tensor, RecurrentState> step(const torch::Tensor& x,
                                                const RecurrentState& state);

 private:
  AttentionLayerOptions options_;
  AttentionDims dims_;
  RecurrentAttentionPtr inner_attention_;
  torch::nn::Linear query_projection_{nullptr}, key_projection_{nullptr},
      value_projection_{nullptr}, out_projection_{nullptr};
};
TORCH_MODULE(RecurrentAttentionLayer);

// Twin of TransformerEncoderLayer. Submodules: attention, linear1, linear2,
// norm1, norm2, dropout.
class RecurrentEncoderLayerImpl : public torch::nn::Module {
 public:
  RecurrentEncoderLayerImpl(RecurrentAttentionLayer attention,
                            const TransformerLayerOptions& options);
  // x (N, D) -> (output (N, D), new state).
  std::pair<torch::Tensor, RecurrentState> step(const torch::Tensor& x,
                                                const RecurrentState& state);

 private:
  TransformerLayerOptions options_;
  RecurrentAttentionLayer attention_{nullptr};
  torch::nn::Linear linear1_{nullptr}, linear2_{nullptr};
  torch::nn::LayerNorm norm1_{nullptr}, norm2_{nullptr};
  torch::nn::Dropout dropout_{nullptr};
};
TORCH_MODULE(RecurrentEncoderLayer);

// Twin of TransformerEncoder. Submodules: layers (layers.0, ...), norm (when given).
class RecurrentEncoderImpl : public torch::nn::Module {
 public:
  explicit RecurrentEncoderImpl(std::vector<RecurrentEncoderLayer> layers,
                                torch::nn::LayerNorm norm = nullptr);
  // x (N, D), state: empty or one RecurrentState per layer -> (output (N, D), new state).
  std::pair<torch::Tensor, std::vector<RecurrentState>> step(
      const torch::Tensor& x, const std::vector<RecurrentState>& state);
  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

 private:
  std::vector<RecurrentEncoderLayer> layers_;
  torch::nn::LayerNorm norm_{nullptr};
};
TORCH_MODULE(RecurrentEncoder);

// The recurrent twin of builder.build(): same sizes, attention type and
// parameters (the type must have a recurrent form, see
// recurrent_attention_names()). Its weights are fresh: copy them with
// copy_parameters.
RecurrentEncoder make_recurrent_encoder(const EncoderBuilder& builder);

// Copies every parameter and buffer of `from` into `to` by name. A name
// missing on either side or a shape mismatch is an error naming it.
void copy_parameters(torch::nn::Module& to, const torch::nn::Module& from);

}  // namespace fastattn
