// Recurrent twins of the transformer encoder modules (RecurrentAttentionLayer,
// RecurrentEncoderLayer, RecurrentEncoder), make_recurrent_encoder and
// copy_parameters. A step mirrors the batch layer's arithmetic on one
// position: O(N·D·(D + d_ff)) per layer plus the attention step.
// Tested by tests/cpp/test_recurrent.cpp (token by token against a causal
// batch encoder with the same weights).
#include "fastattn/recurrent_transformer.h"
#include "transformer/step_linear.h"
#include "transformer/stack.h"

namespace fastattn {

using torch::Tensor;

// ---- attention layer --------------------------------------------------------

RecurrentAttentionLayerImpl::RecurrentAttentionLayerImpl(RecurrentAttentionPtr attention,
                                                         const AttentionLayerOptions& options)
    : options_(options), dims_(options.dims()), inner_attention_(std::move(attention)) {
  TORCH_CHECK(inner_attention_,
              "RecurrentAttentionLayer: attention must be a recurrent attention module, got null");
  TORCH_CHECK(options_.d_model_keys().value_or(options_.d_model()) == options_.d_model(),
              "RecurrentAttentionLayer: self-attention needs d_model_keys = d_model = ",
              options_.d_model(), ", got ", options_.d_model_keys().value_or(0));
  const int64_t D = options_.d_model();
  transformer_detail::register_attention_layer(*this, inner_attention_, D, D, dims_,
                                               query_projection_, key_projection_,
                                               value_projection_, out_projection_);
}

std::pair<Tensor, RecurrentState> RecurrentAttentionLayerImpl::step(const Tensor& x,  // (N, D)
                                                                    const RecurrentState& state) {
  const int64_t D = options_.d_model();
  TORCH_CHECK(x.defined() && x.dim() == 2 && x.size(1) == D,
              "RecurrentAttentionLayer: x must have shape (N, ", D, "), got ",
              x.defined() ? x.sizes() : c10::IntArrayRef{});
  const int64_t N = x.size(0), H = dims_.heads, E = dims_.query_dim, M = dims_.value_dim;
  auto q = detail::step_linear(query_projection_, x).view({N, H, E});
  auto k = detail::step_linear(key_projection_, x).view({N, H, E});
  auto v = detail::step_linear(value_projection_, x).view({N, H, M});
  auto [out, next] = inner_attention_->step(q, k, v, state);  // (N, H, M)
  return {detail::step_linear(out_projection_, out.reshape({N, H * M})), std::move(next)};
}

// ---- encoder layer ----------------------------------------------------------

RecurrentEncoderLayerImpl::RecurrentEncoderLayerImpl(RecurrentAttentionLayer attention,
                                                     const TransformerLayerOptions& options)
    : options_(options) {
  transformer_detail::check_layer_options("RecurrentEncoderLayer", options_);
  TORCH_CHECK(!attention.is_empty(), "RecurrentEncoderLayer: attention must be set, got null");
  attention_ = register_module("attention", attention);
  transformer_detail::register_feed_forward(*this, options_, linear1_, linear2_, {&norm1_, &norm2_},
                                            dropout_);
}

std::pair<Tensor, RecurrentState> RecurrentEncoderLayerImpl::step(const Tensor& x,  // (N, D)
                                                                  const RecurrentState& state) {
  // As TransformerEncoderLayer::forward on one position.
  auto ff = [&](const Tensor& y) {
    return transformer_detail::feed_forward(y, linear1_, linear2_, dropout_, options_.activation());
  };
  if (options_.norm_first()) {
    auto [a, next] = attention_->step(norm1_(x), state);
    auto y = x + dropout_(a);
    return {y + ff(norm2_(y)), std::move(next)};
  }
  auto [a, next] = attention_->step(x, state);
  auto y = norm1_(x + dropout_(a));
  return {norm2_(y + ff(y)), std::move(next)};
}

// ---- encoder ----------------------------------------------------------------

RecurrentEncoderImpl::RecurrentEncoderImpl(std::vector<RecurrentEncoderLayer> layers,
                                           torch::nn::LayerNorm norm)
    : layers_(std::move(layers)) {
  norm_ = transformer_detail::register_stack(*this, "RecurrentEncoder", layers_, std::move(norm));
}

std::pair<Tensor, std::vector<RecurrentState>> RecurrentEncoderImpl::step(
    const Tensor& x,  // (N, D)
    const std::vector<RecurrentState>& state) {
  TORCH_CHECK(state.empty() || state.size() == layers_.size(),
              "RecurrentEncoder: state must be empty or hold one state per layer (", layers_.size(),
              "), got ", state.size());
  std::vector<RecurrentState> next;
  next.reserve(layers_.size());
  Tensor y = x;
  for (size_t i = 0; i < layers_.size(); ++i) {
    auto [out, s] = layers_[i]->step(y, state.empty() ? RecurrentState{} : state[i]);
    y = out;
    next.push_back(std::move(s));
  }
  if (!norm_.is_empty()) y = norm_(y);
  return {y, std::move(next)};
}

// ---- construction -----------------------------------------------------------

RecurrentEncoder make_recurrent_encoder(const EncoderBuilder& builder) {
  // The batch encoder resolves and checks every size; mirror its structure.
  auto batch = builder.build();
  const auto& spec = builder.attention_spec();
  std::vector<RecurrentEncoderLayer> layers;
  for (const auto& layer : batch->layers()) {
    auto attn = std::dynamic_pointer_cast<AttentionLayerImpl>(layer->named_children()["attention"]);
    TORCH_CHECK(attn, "make_recurrent_encoder: layer without an attention layer");
    RecurrentAttentionLayer ra(
        make_recurrent_attention(spec.type, spec.params, attn->options().dims()), attn->options());
    layers.emplace_back(ra, layer->options());
  }
  torch::nn::LayerNorm norm{nullptr};
  const auto children = batch->named_children();
  if (const auto* n = children.find("norm")) {
    auto ln = std::dynamic_pointer_cast<torch::nn::LayerNormImpl>(*n);
    TORCH_CHECK(ln, "make_recurrent_encoder: the encoder's norm is not a LayerNorm");
    norm = torch::nn::LayerNorm(ln->options);
  }
  return RecurrentEncoder(std::move(layers), norm);
}

void copy_parameters(torch::nn::Module& to, const torch::nn::Module& from) {
  torch::NoGradGuard no_grad;
  auto copy = [](const char* kind, torch::OrderedDict<std::string, Tensor> dst,
                 const torch::OrderedDict<std::string, Tensor>& src) {
    TORCH_CHECK(dst.size() == src.size(), "copy_parameters: to has ", dst.size(), " ", kind,
                "s and from has ", src.size());
    for (auto& item : dst) {
      const Tensor* s = src.find(item.key());
      TORCH_CHECK(s, "copy_parameters: ", kind, " '", item.key(), "' of to is missing in from");
      TORCH_CHECK(s->sizes() == item.value().sizes(), "copy_parameters: ", kind, " '", item.key(),
                  "' must have shape ", item.value().sizes(), ", got ", s->sizes());
      item.value().copy_(*s);
    }
  };
  copy("parameter", to.named_parameters(), from.named_parameters());
  copy("buffer", to.named_buffers(), from.named_buffers());
}

}  // namespace fastattn
