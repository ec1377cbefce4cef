// Transformer modules over any registered attention type, and builders that
// make whole encoders and decoders from a few settings or a JSON config.
//
//   auto encoder = fastattn::EncoderBuilder()
//                      .layers(4).heads(8).d_model(256)
//                      .attention("full", {{"softmax_temp", 0.125}})
//                      .build();
//   auto y = encoder(x, mask);  // x, y: (N, L, D)
//
// Modules take (N, L, D); the attention layer projects to heads and calls the
// attention type with (N, H, L, E). Parameter names follow fast-transformers
// and stay fixed (the recurrent twins share them), e.g.
//   layers.0.attention.query_projection.weight
//   layers.0.linear1.weight, layers.0.norm1.weight, norm.weight
// and for decoders layers.0.self_attention.*, layers.0.cross_attention.*,
// layers.0.norm3.*.
#pragma once

#include <torch/torch.h>

#include <nlohmann/json_fwd.hpp>

#include <optional>
#include <string>
#include <vector>

#include "fastattn/attention.h"
#include "fastattn/mask.h"
#include "fastattn/registry.h"

namespace fastattn {

// ---- attention layer --------------------------------------------------------

struct AttentionLayerOptions {
  AttentionLayerOptions(int64_t d_model, int64_t n_heads) : d_model_(d_model), n_heads_(n_heads) {}
  // Width D of the queries and of the output.
  TORCH_ARG(int64_t, d_model);
  TORCH_ARG(int64_t, n_heads);
  // E, per head; default d_model / n_heads (n_heads must then divide d_model).
  TORCH_ARG(std::optional<int64_t>, d_keys) = std::nullopt;
  // M, per head; default d_keys.
  TORCH_ARG(std::optional<int64_t>, d_values) = std::nullopt;
  // Width Dk of the keys and values (a memory of another width); default d_model.
  TORCH_ARG(std::optional<int64_t>, d_model_keys) = std::nullopt;

 public:
  // The resolved per-head sizes, checked (throws naming the option).
  AttentionDims dims() const;
};

// Projects queries, keys and values to heads, runs the attention type and
// projects its output back:
//   queries (N, L, D), keys (N, S, Dk), values (N, S, Dk) -> (N, L, D).
// Submodules: query_projection (D -> H·E), key_projection (Dk -> H·E),
// value_projection (Dk -> H·M), out_projection (H·M -> D), inner_attention.
class AttentionLayerImpl : public torch::nn::Module {
 public:
  AttentionLayerImpl(AttentionPtr attention, const AttentionLayerOptions& options);
  torch::Tensor forward(const torch::Tensor& queries, const torch::Tensor& keys,
                        const torch::Tensor& values, const Mask& mask = Mask());
  const AttentionLayerOptions& options() const { return options_; }
  const AttentionPtr& inner_attention() const { return inner_attention_; }

 private:
  AttentionLayerOptions options_;
  AttentionDims dims_;
  AttentionPtr inner_attention_;
  torch::nn::Linear query_projection_{nullptr}, key_projection_{nullptr},
      value_projection_{nullptr}, out_projection_{nullptr};
};
TORCH_MODULE(AttentionLayer);

// ---- encoder and decoder layers ---------------------------------------------

// The parts of a transformer layer around its attention.
struct TransformerLayerOptions {
  explicit TransformerLayerOptions(int64_t d_model) : d_model_(d_model) {}
  TORCH_ARG(int64_t, d_model);
  // Hidden width of the feed-forward block; default 4·d_model.
  TORCH_ARG(std::optional<int64_t>, d_ff) = std::nullopt;
  // Dropout after attention and in the feed-forward block, in [0, 1).
  TORCH_ARG(double, dropout) = 0.1;
  // "relu" or "gelu".
  TORCH_ARG(std::string, activation) = "relu";
  // Pre-norm (x + f(norm(x))) when true, post-norm (norm(x + f(x))) when false.
  TORCH_ARG(bool, norm_first) = false;
};

// Self-attention then feed-forward, each with a residual connection.
// Submodules: attention, linear1, linear2, norm1, norm2, dropout.
class TransformerEncoderLayerImpl : public torch::nn::Module {
 public:
  TransformerEncoderLayerImpl(AttentionLayer attention, const TransformerLayerOptions& options);
  // x: (N, L, D) -> (N, L, D); mask applies to the self-attention.
  torch::Tensor forward(const torch::Tensor& x, const Mask& mask = Mask());
  const TransformerLayerOptions& options() const { return options_; }

 private:
  TransformerLayerOptions options_;
  AttentionLayer attention_{nullptr};
  torch::nn::Linear linear1_{nullptr}, linear2_{nullptr};
  torch::nn::LayerNorm norm1_{nullptr}, norm2_{nullptr};
  torch::nn::Dropout dropout_{nullptr};
};
TORCH_MODULE(TransformerEncoderLayer);

// A stack of encoder layers and an optional final LayerNorm.
// Submodules: layers (layers.0, layers.1, ...), norm (when given).
class TransformerEncoderImpl : public torch::nn::Module {
 public:
  explicit TransformerEncoderImpl(std::vector<TransformerEncoderLayer> layers,
                                  torch::nn::LayerNorm norm = nullptr);
  // x: (N, L, D) -> (N, L, D).
  torch::Tensor forward(const torch::Tensor& x, const Mask& mask = Mask());
  const std::vector<TransformerEncoderLayer>& layers() const { return layers_; }

 private:
  std::vector<TransformerEncoderLayer> layers_;
  torch::nn::LayerNorm norm_{nullptr};
};
TORCH_MODULE(TransformerEncoder);

// Causal self-attention, cross-attention over a memory, feed-forward, each
// with a residual connection. The self-attention is always causal: x_mask may
// add key lengths or an attention mask, and is combined with the causal mask.
// Submodules: self_attention, cross_attention, linear1, linear2, norm1, norm2,
// norm3, dropout.
class TransformerDecoderLayerImpl : public torch::nn::Module {
 public:
  TransformerDecoderLayerImpl(AttentionLayer self_attention, AttentionLayer cross_attention,
                              const TransformerLayerOptions& options);
  // x: (N, L, D), memory: (N, S, Dm) -> (N, L, D). memory_mask applies to the
  // cross-attention (L queries, S keys), e.g. the memory's key lengths.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& memory,
                        const Mask& x_mask = Mask(), const Mask& memory_mask = Mask());
  const TransformerLayerOptions& options() const { return options_; }

 private:
  TransformerLayerOptions options_;
  AttentionLayer self_attention_{nullptr}, cross_attention_{nullptr};
  torch::nn::Linear linear1_{nullptr}, linear2_{nullptr};
  torch::nn::LayerNorm norm1_{nullptr}, norm2_{nullptr}, norm3_{nullptr};
  torch::nn::Dropout dropout_{nullptr};
};
TORCH_MODULE(TransformerDecoderLayer);

// A stack of decoder layers and an optional final LayerNorm.
class TransformerDecoderImpl : public torch::nn::Module {
 public:
  explicit TransformerDecoderImpl(std::vector<TransformerDecoderLayer> layers,
                                  torch::nn::LayerNorm norm = nullptr);
  // x: (N, L, D), memory: (N, S, Dm) -> (N, L, D).
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& memory,
                        const Mask& x_mask = Mask(), const Mask& memory_mask = Mask());
  const std::vector<TransformerDecoderLayer>& layers() const { return layers_; }

 private:
  std::vector<TransformerDecoderLayer> layers_;
  torch::nn::LayerNorm norm_{nullptr};
};
TORCH_MODULE(TransformerDecoder);

// ---- builders -----------------------------------------------------------------

// The settings both builders share. Unset sizes resolve as follows:
// query_dimensions E = d_model / heads when d_model is given (which heads must
// then divide), else 64; d_model = heads·E; value_dimensions M = E;
// feed_forward_dimensions = 4·d_model.
struct TransformerConfig {
  int64_t layers = 4;
  int64_t heads = 4;
  std::optional<int64_t> d_model;
  std::optional<int64_t> query_dimensions;
  std::optional<int64_t> value_dimensions;
  std::optional<int64_t> feed_forward_dimensions;
  double dropout = 0.1;
  std::string activation = "relu";
  bool norm_first = false;
  bool final_normalization = true;
};

// An attention type name and its (unvalidated) parameters.
struct AttentionSpec {
  std::string type = "full";
  ParamMap params;
};

namespace detail {
// The chained setters both builders share.
template <class Derived>
class TransformerBuilderBase {
 public:
  Derived& layers(int64_t n) { return set(config_.layers, n); }
  Derived& heads(int64_t h) { return set(config_.heads, h); }
  Derived& d_model(int64_t d) { return set(config_.d_model, d); }
  Derived& query_dimensions(int64_t e) { return set(config_.query_dimensions, e); }
  Derived& value_dimensions(int64_t m) { return set(config_.value_dimensions, m); }
  Derived& feed_forward_dimensions(int64_t f) { return set(config_.feed_forward_dimensions, f); }
  Derived& dropout(double p) { return set(config_.dropout, p); }
  Derived& activation(std::string a) { return set(config_.activation, std::move(a)); }
  Derived& norm_first(bool b) { return set(config_.norm_first, b); }
  Derived& final_normalization(bool b) { return set(config_.final_normalization, b); }
  const TransformerConfig& config() const { return config_; }

 protected:
  TransformerConfig config_;

 private:
  template <class T, class V>
  Derived& set(T& field, V&& value) {
    field = std::forward<V>(value);
    return static_cast<Derived&>(*this);
  }
};
}  // namespace detail

// Builds a TransformerEncoder. Every setting is checked at build() with a
// message naming it. For `sparse-strided` / `sparse-fixed` with mode
// "interleaved" and no "part", layer r gets part r mod 2 + 1 (A1, A2, A1, ...;
// both builders, every attention of the layer).
class EncoderBuilder : public detail::TransformerBuilderBase<EncoderBuilder> {
 public:
  EncoderBuilder& attention(std::string type, ParamMap params = {});
  TransformerEncoder build() const;
  // {"layers": 4, "heads": 8, "d_model": 256, "query_dimensions", "value_dimensions",
  //  "feed_forward_dimensions", "dropout", "activation", "norm_first",
  //  "final_normalization", "attention": "full" or {"type": "full", <params>}}.
  // Missing keys keep their defaults; an unknown key is an error listing the valid ones.
  static EncoderBuilder from_json(const nlohmann::json& j);
  const AttentionSpec& attention_spec() const { return attention_; }

 private:
  AttentionSpec attention_;
};

// Builds a TransformerDecoder (causal self-attention, cross-attention over a
// memory of width memory_dimensions, default d_model).
class DecoderBuilder : public detail::TransformerBuilderBase<DecoderBuilder> {
 public:
  DecoderBuilder& self_attention(std::string type, ParamMap params = {});
  DecoderBuilder& cross_attention(std::string type, ParamMap params = {});
  DecoderBuilder& memory_dimensions(int64_t d);
  TransformerDecoder build() const;
  // The encoder's keys, with "self_attention" and "cross_attention" instead of
  // "attention", plus "memory_dimensions".
  static DecoderBuilder from_json(const nlohmann::json& j);
  const AttentionSpec& self_attention_spec() const { return self_attention_; }
  const AttentionSpec& cross_attention_spec() const { return cross_attention_; }

 private:
  AttentionSpec self_attention_, cross_attention_;
  std::optional<int64_t> memory_dimensions_;
};

}  // namespace fastattn
