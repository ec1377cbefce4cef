// Transformer modules: the attention layer (projections to and from heads),
// encoder and decoder layers (pre- or post-norm) and their stacks.
// Cost per layer: the attention type's, plus O(N·L·D·(D + d_ff)) for the
// projections and the feed-forward block.
#include "fastattn/transformer.h"
#include "fastattn/clusterformer.h"
#include "transformer/stack.h"

namespace fastattn {

using transformer_detail::check_layer_options;
using transformer_detail::feed_forward;

namespace {

// x must be (N, <length>, width).
void check_width(const char* who, const char* name, const char* length, const torch::Tensor& x,
                 int64_t width) {
  TORCH_CHECK(x.dim() == 3 && x.size(2) == width, who, ": ", name, " must have shape (N, ", length,
              ", ", width, "), got ", x.sizes());
}

}  // namespace

// ---- attention layer --------------------------------------------------------

AttentionDims AttentionLayerOptions::dims() const {
  TORCH_CHECK(d_model_ >= 1, "AttentionLayer: d_model must be >= 1, got ", d_model_);
  TORCH_CHECK(n_heads_ >= 1, "AttentionLayer: n_heads must be >= 1, got ", n_heads_);
  TORCH_CHECK(d_keys_ || d_model_ % n_heads_ == 0, "AttentionLayer: d_model (", d_model_,
              ") must be divisible by n_heads (", n_heads_, ") when d_keys is not given");
  AttentionDims d;
  d.heads = n_heads_;
  d.query_dim = d_keys_.value_or(d_model_ / n_heads_);
  d.value_dim = d_values_.value_or(d.query_dim);
  TORCH_CHECK(d.query_dim >= 1, "AttentionLayer: d_keys must be >= 1, got ", d.query_dim);
  TORCH_CHECK(d.value_dim >= 1, "AttentionLayer: d_values must be >= 1, got ", d.value_dim);
  TORCH_CHECK(!d_model_keys_ || *d_model_keys_ >= 1,
              "AttentionLayer: d_model_keys must be >= 1, got ", d_model_keys_.value_or(0));
  return d;
}

AttentionLayerImpl::AttentionLayerImpl(AttentionPtr attention, const AttentionLayerOptions& options)
    : options_(options), dims_(options.dims()), inner_attention_(std::move(attention)) {
  TORCH_CHECK(inner_attention_, "AttentionLayer: attention must be an attention module, got null");
  const int64_t D = options_.d_model(), Dk = options_.d_model_keys().value_or(D);
  transformer_detail::register_attention_layer(*this, inner_attention_, D, Dk, dims_,
                                               query_projection_, key_projection_,
                                               value_projection_, out_projection_);
}

torch::Tensor AttentionLayerImpl::forward(const torch::Tensor& queries,  // (N, L, D)
                                          const torch::Tensor& keys,     // (N, S, Dk)
                                          const torch::Tensor& values,   // (N, S, Dk)
                                          const Mask& mask) {
  const int64_t D = options_.d_model(), Dk = options_.d_model_keys().value_or(D);
  check_width("AttentionLayer", "queries", "L", queries, D);
  check_width("AttentionLayer", "keys", "S", keys, Dk);
  check_width("AttentionLayer", "values", "S", values, Dk);
  const int64_t N = queries.size(0), L = queries.size(1), S = keys.size(1);
  TORCH_CHECK(keys.size(0) == N && values.size(0) == N && values.size(1) == S,
              "AttentionLayer: keys and values must have shape (N, S, ", Dk, ") with N = ", N,
              " and the same S, got ", keys.sizes(), " and ", values.sizes());
  const int64_t H = dims_.heads, E = dims_.query_dim, M = dims_.value_dim;
  auto q = query_projection_(queries).view({N, L, H, E}).transpose(1, 2);  // (N, H, L, E)
  auto k = key_projection_(keys).view({N, S, H, E}).transpose(1, 2);       // (N, H, S, E)
  auto v = value_projection_(values).view({N, S, H, M}).transpose(1, 2);   // (N, H, S, M)
  auto out = inner_attention_->forward(q, k, v, mask);                     // (N, H, L, M)
  return out_projection_(out.transpose(1, 2).reshape({N, L, H * M}));      // (N, L, D)
}

// ---- encoder ------------------------------------------------------------------

TransformerEncoderLayerImpl::TransformerEncoderLayerImpl(AttentionLayer attention,
                                                         const TransformerLayerOptions& options)
    : options_(options) {
  check_layer_options("TransformerEncoderLayer", options_);
  TORCH_CHECK(!attention.is_empty(), "TransformerEncoderLayer: attention must be set, got null");
  const int64_t D = options_.d_model();
  TORCH_CHECK(
      attention->options().d_model() == D && attention->options().d_model_keys().value_or(D) == D,
      "TransformerEncoderLayer: attention must map width d_model = ", D,
      " to itself, got d_model = ", attention->options().d_model(),
      ", d_model_keys = ", attention->options().d_model_keys().value_or(D));
  attention_ = register_module("attention", attention);
  transformer_detail::register_feed_forward(*this, options_, linear1_, linear2_, {&norm1_, &norm2_},
                                            dropout_);
}

torch::Tensor TransformerEncoderLayerImpl::forward(const torch::Tensor& x,  // (N, L, D)
                                                   const Mask& mask) {
  auto ff = [&](const torch::Tensor& y) {
    return feed_forward(y, linear1_, linear2_, dropout_, options_.activation());
  };
  if (options_.norm_first()) {
    auto h = norm1_(x);
    auto y = x + dropout_(attention_(h, h, h, mask));
    return y + ff(norm2_(y));
  }
  auto y = norm1_(x + dropout_(attention_(x, x, x, mask)));
  return norm2_(y + ff(y));
}

TransformerEncoderImpl::TransformerEncoderImpl(std::vector<TransformerEncoderLayer> layers,
                                               torch::nn::LayerNorm norm)
    : layers_(std::move(layers)) {
  norm_ = transformer_detail::register_stack(*this, "TransformerEncoder", layers_, std::move(norm));
  link_clusterformer_centroids(*this);  // "handed" ClusterFormer centroids, layer to layer
}

torch::Tensor TransformerEncoderImpl::forward(const torch::Tensor& x,  // (N, L, D)
                                              const Mask& mask) {
  auto y = x;
  for (auto& layer : layers_) y = layer(y, mask);
  return norm_.is_empty() ? y : norm_(y);
}

// ---- decoder ------------------------------------------------------------------

TransformerDecoderLayerImpl::TransformerDecoderLayerImpl(AttentionLayer self_attention,
                                                         AttentionLayer cross_attention,
                                                         const TransformerLayerOptions& options)
    : options_(options) {
  check_layer_options("TransformerDecoderLayer", options_);
  TORCH_CHECK(!self_attention.is_empty() && !cross_attention.is_empty(),
              "TransformerDecoderLayer: self_attention and cross_attention must be set");
  const int64_t D = options_.d_model();
  TORCH_CHECK(self_attention->options().d_model() == D &&
                  self_attention->options().d_model_keys().value_or(D) == D,
              "TransformerDecoderLayer: self_attention must map width d_model = ", D,
              " to itself, got d_model = ", self_attention->options().d_model(),
              ", d_model_keys = ", self_attention->options().d_model_keys().value_or(D));
  TORCH_CHECK(cross_attention->options().d_model() == D,
              "TransformerDecoderLayer: cross_attention's d_model must equal d_model = ", D,
              ", got ", cross_attention->options().d_model());
  self_attention_ = register_module("self_attention", self_attention);
  cross_attention_ = register_module("cross_attention", cross_attention);
  transformer_detail::register_feed_forward(*this, options_, linear1_, linear2_,
                                            {&norm1_, &norm2_, &norm3_}, dropout_);
}

torch::Tensor TransformerDecoderLayerImpl::forward(const torch::Tensor& x,       // (N, L, D)
                                                   const torch::Tensor& memory,  // (N, S, Dm)
                                                   const Mask& x_mask, const Mask& memory_mask) {
  const Mask self_mask = x_mask.with_causal(true);
  auto ff = [&](const torch::Tensor& y) {
    return feed_forward(y, linear1_, linear2_, dropout_, options_.activation());
  };
  if (options_.norm_first()) {
    auto h = norm1_(x);
    auto y = x + dropout_(self_attention_(h, h, h, self_mask));
    y = y + dropout_(cross_attention_(norm2_(y), memory, memory, memory_mask));
    return y + ff(norm3_(y));
  }
  auto y = norm1_(x + dropout_(self_attention_(x, x, x, self_mask)));
  y = norm2_(y + dropout_(cross_attention_(y, memory, memory, memory_mask)));
  return norm3_(y + ff(y));
}

TransformerDecoderImpl::TransformerDecoderImpl(std::vector<TransformerDecoderLayer> layers,
                                               torch::nn::LayerNorm norm)
    : layers_(std::move(layers)) {
  norm_ = transformer_detail::register_stack(*this, "TransformerDecoder", layers_, std::move(norm));
  link_clusterformer_centroids(*this);  // "handed" ClusterFormer centroids, layer to layer
}

torch::Tensor TransformerDecoderImpl::forward(const torch::Tensor& x,       // (N, L, D)
                                              const torch::Tensor& memory,  // (N, S, Dm)
                                              const Mask& x_mask, const Mask& memory_mask) {
  auto y = x;
  for (auto& layer : layers_) y = layer(y, memory, x_mask, memory_mask);
  return norm_.is_empty() ? y : norm_(y);
}

}  // namespace fastattn
