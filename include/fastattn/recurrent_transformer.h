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

#include <optional>
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

// ---- decoder ------------------------------------------------------------------
//
// RecurrentDecoder: the token-by-token twin of TransformerDecoder. Prepare the
// memory once (projected keys and values of every layer's cross-attention),
// then feed one target position at a time; each step returns what the batch
// decoder returns at that position (causal self-attention, cross-attention
// over the whole memory, key padding of the memory through key_lengths).
//
//   auto builder = fastattn::DecoderBuilder().layers(2).heads(4).d_model(64)
//                      .self_attention("causal-linear").cross_attention("linear");
//   auto batch = builder.build();
//   auto rnn = fastattn::make_recurrent_decoder(builder);
//   fastattn::copy_parameters(*rnn, *batch);
//   auto state = rnn->prepare(memory, fastattn::Mask().with_key_lengths(lengths));
//   auto [y, next] = rnn->step(x_i, state);  // x_i, y: (N, D)

// Projections to heads around a recurrent cross-attention: queries (N, D),
// memory (N, S, Dk). Submodules as AttentionLayer: inner_attention,
// query_projection, key_projection, value_projection, out_projection.
class RecurrentCrossAttentionLayerImpl : public torch::nn::Module {
 public:
  RecurrentCrossAttentionLayerImpl(RecurrentCrossAttentionPtr attention,
                                   const AttentionLayerOptions& options);
  // memory (N, S, Dk), key_lengths (N,) or none -> the memory state.
  RecurrentState prepare(const torch::Tensor& memory,
                         const std::optional<torch::Tensor>& key_lengths);
  // x (N, D) -> (N, D).
  torch::Tensor step(const torch::Tensor& x, const RecurrentState& memory);

 private:
  AttentionLayerOptions options_;
  AttentionDims dims_;
  RecurrentCrossAttentionPtr inner_attention_;
  torch::nn::Linear query_projection_{nullptr}, key_projection_{nullptr},
      value_projection_{nullptr}, out_projection_{nullptr};
};
TORCH_MODULE(RecurrentCrossAttentionLayer);

// The state of a RecurrentDecoder: per layer, the prepared memory (fixed)
// and the self-attention state (empty before the first token).
struct RecurrentDecoderState {
  std::vector<RecurrentState> memory;
  std::vector<RecurrentState> self;
};

// Twin of TransformerDecoderLayer. Submodules: self_attention,
// cross_attention, linear1, linear2, norm1, norm2, norm3, dropout.
class RecurrentDecoderLayerImpl : public torch::nn::Module {
 public:
  RecurrentDecoderLayerImpl(RecurrentAttentionLayer self_attention,
                            RecurrentCrossAttentionLayer cross_attention,
                            const TransformerLayerOptions& options);
  RecurrentState prepare(const torch::Tensor& memory,
                         const std::optional<torch::Tensor>& key_lengths);
  // x (N, D), the layer's memory state and self-attention state -> (output
  // (N, D), new self-attention state).
  std::pair<torch::Tensor, RecurrentState> step(const torch::Tensor& x,
                                                const RecurrentState& memory,
                                                const RecurrentState& self_state);

 private:
  TransformerLayerOptions options_;
  RecurrentAttentionLayer self_attention_{nullptr};
  RecurrentCrossAttentionLayer cross_attention_{nullptr};
  torch::nn::Linear linear1_{nullptr}, linear2_{nullptr};
  torch::nn::LayerNorm norm1_{nullptr}, norm2_{nullptr}, norm3_{nullptr};
  torch::nn::Dropout dropout_{nullptr};
};
TORCH_MODULE(RecurrentDecoderLayer);

// Twin of TransformerDecoder. Submodules: layers (layers.0, ...), norm (when given).
class RecurrentDecoderImpl : public torch::nn::Module {
 public:
  explicit RecurrentDecoderImpl(std::vector<RecurrentDecoderLayer> layers,
                                torch::nn::LayerNorm norm = nullptr);
  // memory (N, S, Dm); memory_mask may hold key_lengths (N,) (padding); an
  // attn_mask or a causal memory mask is an error (a step has one query).
  RecurrentDecoderState prepare(const torch::Tensor& memory, const Mask& memory_mask = Mask());
  // x (N, D) -> (output (N, D), new state). The state's memory part is shared.
  std::pair<torch::Tensor, RecurrentDecoderState> step(const torch::Tensor& x,
                                                       const RecurrentDecoderState& state);
  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

 private:
  std::vector<RecurrentDecoderLayer> layers_;
  torch::nn::LayerNorm norm_{nullptr};
};
TORCH_MODULE(RecurrentDecoder);

// The recurrent twin of builder.build(): the self-attention type must have a
// recurrent form (recurrent_attention_names()); the cross-attention type may
// be any registered type (make_recurrent_cross_attention). Fresh weights:
// copy them with copy_parameters.
RecurrentDecoder make_recurrent_decoder(const DecoderBuilder& builder);

// Copies every parameter and buffer of `from` into `to` by name. A name
// missing on either side or a shape mismatch is an error naming it.
void copy_parameters(torch::nn::Module& to, const torch::nn::Module& from);

}  // namespace fastattn
