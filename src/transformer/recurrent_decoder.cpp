// Recurrent twins of the transformer decoder modules
// (RecurrentCrossAttentionLayer, RecurrentDecoderLayer, RecurrentDecoder) and
// make_recurrent_decoder. prepare projects the memory once per layer
// (O(N·S·Dm·D) plus the cross type's preparation); a step mirrors the batch
// layer on one position: the self-attention step, the cross-attention step,
// O(N·D·(D + d_ff)) per layer.
// Tested by tests/cpp/test_recurrent_decoder.cpp (token by token against a
// batch decoder with the same weights).
#include "fastattn/recurrent_transformer.h"
#include "transformer/step_linear.h"
#include "transformer/stack.h"

namespace fastattn {

using torch::Tensor;

// ---- cross-attention layer --------------------------------------------------

RecurrentCrossAttentionLayerImpl::RecurrentCrossAttentionLayerImpl(
    RecurrentCrossAttentionPtr attention, const AttentionLayerOptions& options)
    : options_(options), dims_(options.dims()), inner_attention_(std::move(attention)) {
  TORCH_CHECK(inner_attention_,
              "RecurrentCrossAttentionLayer: attention must be a recurrent cross-attention "
              "module, got null");
  const int64_t D = options_.d_model(), Dk = options_.d_model_keys().value_or(D);
  transformer_detail::register_attention_layer(*this, inner_attention_, D, Dk, dims_,
                                               query_projection_, key_projection_,
                                               value_projection_, out_projection_);
}

RecurrentState RecurrentCrossAttentionLayerImpl::prepare(const Tensor& memory,  // (N, S, Dk)
                                                         const std::optional<Tensor>& key_lengths) {
  const int64_t Dk = options_.d_model_keys().value_or(options_.d_model());
  TORCH_CHECK(memory.defined() && memory.dim() == 3 && memory.size(2) == Dk,
              "RecurrentCrossAttentionLayer: memory must have shape (N, S, ", Dk, "), got ",
              memory.defined() ? memory.sizes() : c10::IntArrayRef{});
  const int64_t N = memory.size(0), S = memory.size(1);
  const int64_t H = dims_.heads, E = dims_.query_dim, M = dims_.value_dim;
  auto k = key_projection_(memory).view({N, S, H, E}).transpose(1, 2);    // (N, H, S, E)
  auto v = value_projection_(memory).view({N, S, H, M}).transpose(1, 2);  // (N, H, S, M)
  return inner_attention_->prepare(k, v, key_lengths);
}

Tensor RecurrentCrossAttentionLayerImpl::step(const Tensor& x,  // (N, D)
                                              const RecurrentState& memory) {
  const int64_t D = options_.d_model();
  TORCH_CHECK(x.defined() && x.dim() == 2 && x.size(1) == D,
              "RecurrentCrossAttentionLayer: x must have shape (N, ", D, "), got ",
              x.defined() ? x.sizes() : c10::IntArrayRef{});
  const int64_t N = x.size(0), H = dims_.heads, E = dims_.query_dim, M = dims_.value_dim;
  auto out = inner_attention_->step(detail::step_linear(query_projection_, x).view({N, H, E}),
                                    memory);  // (N, H, M)
  return detail::step_linear(out_projection_, out.reshape({N, H * M}));
}

// ---- decoder layer ----------------------------------------------------------

RecurrentDecoderLayerImpl::RecurrentDecoderLayerImpl(RecurrentAttentionLayer self_attention,
                                                     RecurrentCrossAttentionLayer cross_attention,
                                                     const TransformerLayerOptions& options)
    : options_(options) {
  transformer_detail::check_layer_options("RecurrentDecoderLayer", options_);
  TORCH_CHECK(!self_attention.is_empty() && !cross_attention.is_empty(),
              "RecurrentDecoderLayer: self_attention and cross_attention must be set");
  self_attention_ = register_module("self_attention", self_attention);
  cross_attention_ = register_module("cross_attention", cross_attention);
  transformer_detail::register_feed_forward(*this, options_, linear1_, linear2_,
                                            {&norm1_, &norm2_, &norm3_}, dropout_);
}

RecurrentState RecurrentDecoderLayerImpl::prepare(const Tensor& memory,
                                                  const std::optional<Tensor>& key_lengths) {
  return cross_attention_->prepare(memory, key_lengths);
}

std::pair<Tensor, RecurrentState> RecurrentDecoderLayerImpl::step(
    const Tensor& x,  // (N, D)
    const RecurrentState& memory, const RecurrentState& self_state) {
  // As TransformerDecoderLayer::forward on one position.
  auto ff = [&](const Tensor& y) {
    return transformer_detail::feed_forward(y, linear1_, linear2_, dropout_, options_.activation());
  };
  if (options_.norm_first()) {
    auto [a, next] = self_attention_->step(norm1_(x), self_state);
    auto y = x + dropout_(a);
    y = y + dropout_(cross_attention_->step(norm2_(y), memory));
    return {y + ff(norm3_(y)), std::move(next)};
  }
  auto [a, next] = self_attention_->step(x, self_state);
  auto y = norm1_(x + dropout_(a));
  y = norm2_(y + dropout_(cross_attention_->step(y, memory)));
  return {norm3_(y + ff(y)), std::move(next)};
}

// ---- decoder ----------------------------------------------------------------

RecurrentDecoderImpl::RecurrentDecoderImpl(std::vector<RecurrentDecoderLayer> layers,
                                           torch::nn::LayerNorm norm)
    : layers_(std::move(layers)) {
  norm_ = transformer_detail::register_stack(*this, "RecurrentDecoder", layers_, std::move(norm));
}

RecurrentDecoderState RecurrentDecoderImpl::prepare(const Tensor& memory,  // (N, S, Dm)
                                                    const Mask& memory_mask) {
  TORCH_CHECK(!memory_mask.attn_mask(),
              "RecurrentDecoder: memory_mask may hold key_lengths only, got an attn_mask");
  TORCH_CHECK(!memory_mask.is_causal(),
              "RecurrentDecoder: memory_mask may hold key_lengths only, got a causal mask");
  RecurrentDecoderState state;
  for (auto& layer : layers_)
    state.memory.push_back(layer->prepare(memory, memory_mask.key_lengths()));
  state.self.resize(layers_.size());
  return state;
}

std::pair<Tensor, RecurrentDecoderState> RecurrentDecoderImpl::step(
    const Tensor& x,  // (N, D)
    const RecurrentDecoderState& state) {
  TORCH_CHECK(state.memory.size() == layers_.size(),
              "RecurrentDecoder: state must come from prepare (one memory state per layer, ",
              layers_.size(), "), got ", state.memory.size());
  TORCH_CHECK(state.self.empty() || state.self.size() == layers_.size(),
              "RecurrentDecoder: state.self must be empty or hold one state per layer (",
              layers_.size(), "), got ", state.self.size());
  RecurrentDecoderState next;
  next.memory = state.memory;
  next.self.reserve(layers_.size());
  Tensor y = x;
  for (size_t i = 0; i < layers_.size(); ++i) {
    auto [out, s] =
        layers_[i]->step(y, state.memory[i], state.self.empty() ? RecurrentState{} : state.self[i]);
    y = out;
    next.self.push_back(std::move(s));
  }
  if (!norm_.is_empty()) y = norm_(y);
  return {y, std::move(next)};
}

// ---- construction -----------------------------------------------------------

RecurrentDecoder make_recurrent_decoder(const DecoderBuilder& builder) {
  // The batch decoder resolves and checks every size; mirror its structure.
  auto batch = builder.build();
  const auto& self_spec = builder.self_attention_spec();
  const auto& cross_spec = builder.cross_attention_spec();
  std::vector<RecurrentDecoderLayer> layers;
  for (const auto& layer : batch->layers()) {
    const auto children = layer->named_children();
    auto self = std::dynamic_pointer_cast<AttentionLayerImpl>(children["self_attention"]);
    auto cross = std::dynamic_pointer_cast<AttentionLayerImpl>(children["cross_attention"]);
    TORCH_CHECK(self && cross, "make_recurrent_decoder: layer without its attention layers");
    RecurrentAttentionLayer rs(
        make_recurrent_attention(self_spec.type, self_spec.params, self->options().dims()),
        self->options());
    RecurrentCrossAttentionLayer rc(
        make_recurrent_cross_attention(cross_spec.type, cross_spec.params, cross->options().dims()),
        cross->options());
    layers.emplace_back(rs, rc, layer->options());
  }
  torch::nn::LayerNorm norm{nullptr};
  const auto children = batch->named_children();
  if (const auto* n = children.find("norm")) {
    auto ln = std::dynamic_pointer_cast<torch::nn::LayerNormImpl>(*n);
    TORCH_CHECK(ln, "make_recurrent_decoder: the decoder's norm is not a LayerNorm");
    norm = torch::nn::LayerNorm(ln->options);
  }
  return RecurrentDecoder(std::move(layers), norm);
}

}  // namespace fastattn
