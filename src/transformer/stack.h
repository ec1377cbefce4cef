// What the encoder and decoder stacks (batch and recurrent) share: their
// layers registered as the module list "layers" (a null layer refused with
// a message naming `who`) and an optional final norm registered as "norm";
// what their attention layers share (the inner attention and the four
// projections); and what their encoder and decoder layers share (the
// options' checks, the feed-forward block and the norms).
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <initializer_list>
#include <string>
#include <vector>

#include "fastattn/attention.h"
#include "fastattn/transformer.h"
#include "transformer/step_linear.h"

namespace fastattn::transformer_detail {

// Registers `layers` and `norm` (when not empty) on `stack`; returns the norm
// as registered.
template <typename Layer>
torch::nn::LayerNorm register_stack(torch::nn::Module& stack, const char* who,
                                    const std::vector<Layer>& layers, torch::nn::LayerNorm norm) {
  auto list = torch::nn::ModuleList();
  for (const auto& layer : layers) {
    TORCH_CHECK(!layer.is_empty(), who, ": layers must not hold a null layer");
    list->push_back(layer);
  }
  stack.register_module("layers", list);
  if (norm.is_empty()) return norm;
  return torch::nn::LayerNorm(stack.register_module("norm", norm));
}

// Registers an attention layer's `inner` attention as "inner_attention" and
// its projections, queries (D -> H*E), keys (Dk -> H*E), values (Dk -> H*M)
// and output (H*M -> D), under the names fast-transformers gives them.
template <typename Inner>
void register_attention_layer(torch::nn::Module& layer, Inner& inner, int64_t D, int64_t Dk,
                              const AttentionDims& dims, torch::nn::Linear& query,
                              torch::nn::Linear& key, torch::nn::Linear& value,
                              torch::nn::Linear& out) {
  const int64_t H = dims.heads, E = dims.query_dim, M = dims.value_dim;
  inner = layer.register_module("inner_attention", inner);
  query = layer.register_module("query_projection", torch::nn::Linear(D, H * E));
  key = layer.register_module("key_projection", torch::nn::Linear(Dk, H * E));
  value = layer.register_module("value_projection", torch::nn::Linear(Dk, H * M));
  out = layer.register_module("out_projection", torch::nn::Linear(H * M, D));
}

inline void check_layer_options(const char* who, const TransformerLayerOptions& o) {
  TORCH_CHECK(o.d_model() >= 1, who, ": d_model must be >= 1, got ", o.d_model());
  TORCH_CHECK(!o.d_ff() || *o.d_ff() >= 1, who, ": d_ff must be >= 1, got ", o.d_ff().value_or(0));
  TORCH_CHECK(o.dropout() >= 0 && o.dropout() < 1, who, ": dropout must be in [0, 1), got ",
              o.dropout());
  TORCH_CHECK(o.activation() == "relu" || o.activation() == "gelu", who,
              ": activation must be one of relu, gelu, got '", o.activation(), "'");
}

// Registers a layer's feed-forward block and norms, after its attention
// modules: "linear1" (D -> d_ff), "linear2" (d_ff -> D), the layer norms of
// width D "norm1", "norm2", ... and "dropout".
inline void register_feed_forward(torch::nn::Module& layer, const TransformerLayerOptions& o,
                                  torch::nn::Linear& linear1, torch::nn::Linear& linear2,
                                  std::initializer_list<torch::nn::LayerNorm*> norms,
                                  torch::nn::Dropout& dropout) {
  const int64_t D = o.d_model(), F = o.d_ff().value_or(4 * D);
  linear1 = layer.register_module("linear1", torch::nn::Linear(D, F));
  linear2 = layer.register_module("linear2", torch::nn::Linear(F, D));
  int i = 0;
  for (auto* norm : norms)
    *norm = layer.register_module("norm" + std::to_string(++i),
                                  torch::nn::LayerNorm(torch::nn::LayerNormOptions({D})));
  dropout = layer.register_module("dropout", torch::nn::Dropout(o.dropout()));
}

// dropout(linear2(dropout(activation(linear1(y))))), width D to D: a batch
// (N, L, D) or one step's position (N, D) (step_linear: a gemv for one row).
inline torch::Tensor feed_forward(const torch::Tensor& y, const torch::nn::Linear& linear1,
                                  const torch::nn::Linear& linear2, torch::nn::Dropout& dropout,
                                  const std::string& activation) {
  auto h = detail::step_linear(linear1, y);
  h = activation == "gelu" ? torch::gelu(h) : torch::relu(h);
  return dropout(detail::step_linear(linear2, dropout(h)));
}

}  // namespace fastattn::transformer_detail
