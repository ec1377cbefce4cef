// A BERT-family encoder (Devlin et al. 2019) over any registered attention
// type, loading Hugging Face BERT weights by name, and sentence embeddings
// (mean pooling over valid tokens, then L2 normalisation: what
// sentence-transformers' all-MiniLM-L6-v2 does).
//
//   auto config = fastattn::BertConfig::from_json_file(dir + "/config.json");
//   fastattn::BertEncoder bert(config, "improved-clustered", {{"clusters", 25}, {"seed", 0}});
//   fastattn::load_bert_weights(*bert, dir + "/model.safetensors");
//   auto h = bert->forward(ids, lengths);          // (N, L) -> (N, L, D)
//   auto e = fastattn::mean_pool_normalize(h, lengths);  // (N, D), unit rows
//
// Architecture (post-LayerNorm, as Hugging Face's BertModel):
//   x = LayerNorm(word[ids] + position[0..L) + token_type[types])
//   per layer: a = LayerNorm(x + dense(attention(query(x), key(x), value(x))))
//              x = LayerNorm(a + dense(gelu(dense(a))))       (gelu: exact, erf)
// The attention is the registry type, called with (N, H, L, E) and a Mask of
// key_lengths and query_lengths = lengths (padding never attended, never
// clustered). Outputs at padded positions are computed but meaningless.
//
// Parameter names are Hugging Face's, e.g. embeddings.word_embeddings.weight,
// encoder.layer.0.attention.self.query.weight,
// encoder.layer.0.attention.output.LayerNorm.bias,
// encoder.layer.0.intermediate.dense.weight, encoder.layer.0.output.dense.weight.
// Parameters or buffers of the attention type itself live under
// encoder.layer.<i>.attention.self.inner_attention.* and are not loaded.
#pragma once

#include <torch/torch.h>

#include <string>
#include <vector>

#include "fastattn/attention.h"
#include "fastattn/registry.h"

namespace fastattn {

struct BertConfig {
  int64_t vocab_size = 30522;
  int64_t hidden_size = 768;
  int64_t num_hidden_layers = 12;
  int64_t num_attention_heads = 12;
  int64_t intermediate_size = 3072;
  int64_t max_position_embeddings = 512;
  int64_t type_vocab_size = 2;
  double layer_norm_eps = 1e-12;

  // Reads a Hugging Face config.json. Only model_type "bert" (or absent),
  // hidden_act "gelu" and position_embedding_type "absolute" are supported;
  // anything else is an error naming the field.
  static BertConfig from_json_file(const std::string& path);
  void check() const;  // sizes positive, heads divide hidden_size
};

// encoder.layer.<i>.attention.self: the projections and the attention type.
class BertSelfAttentionImpl : public torch::nn::Module {
 public:
  BertSelfAttentionImpl(const BertConfig& config, AttentionPtr attention);
  // x: (N, L, D) -> (N, L, D) (heads concatenated, before attention.output).
  torch::Tensor forward(const torch::Tensor& x, const Mask& mask);
  void set_attention(AttentionPtr attention);
  const AttentionPtr& attention() const { return inner_attention_; }

 private:
  int64_t heads_;
  torch::nn::Linear query_{nullptr}, key_{nullptr}, value_{nullptr};
  AttentionPtr inner_attention_;
};
TORCH_MODULE(BertSelfAttention);

// dense then LayerNorm over a residual: LayerNorm(dense(h) + residual). Hugging
// Face's BertSelfOutput and BertOutput.
class BertDenseNormImpl : public torch::nn::Module {
 public:
  BertDenseNormImpl(int64_t in, int64_t out, double eps);
  torch::Tensor forward(const torch::Tensor& h, const torch::Tensor& residual);

 private:
  torch::nn::Linear dense_{nullptr};
  torch::nn::LayerNorm norm_{nullptr};
};
TORCH_MODULE(BertDenseNorm);

class BertLayerImpl : public torch::nn::Module {
 public:
  BertLayerImpl(const BertConfig& config, AttentionPtr attention);
  torch::Tensor forward(const torch::Tensor& x, const Mask& mask);  // (N, L, D)
  BertSelfAttention& self_attention() { return self_; }

 private:
  BertSelfAttention self_{nullptr};
  BertDenseNorm attention_output_{nullptr};
  torch::nn::Linear intermediate_{nullptr};
  BertDenseNorm output_{nullptr};
};
TORCH_MODULE(BertLayer);

class BertEncoderImpl : public torch::nn::Module {
 public:
  // Every layer gets its own instance of the attention type `type` built with
  // `params` (a `seed` makes randomised types reproducible; every layer then
  // uses the same seed).
  BertEncoderImpl(const BertConfig& config, const std::string& type = "full",
                  const ParamMap& params = {});
  // input_ids: (N, L) int64; lengths: (N,) int64 valid tokens per row (the rest
  // is padding), each in [1, L]; token_type_ids: (N, L) int64 or undefined
  // (zeros). Returns the last hidden states (N, L, D).
  torch::Tensor forward(const torch::Tensor& input_ids, const torch::Tensor& lengths,
                        const torch::Tensor& token_type_ids = {});
  // Replaces the attention type of every layer (the weights stay).
  void set_attention(const std::string& type, const ParamMap& params = {});
  const BertConfig& config() const { return config_; }
  const std::string& attention_type() const { return type_; }

 private:
  BertConfig config_;
  std::string type_;
  torch::nn::Embedding word_{nullptr}, position_{nullptr}, token_type_{nullptr};
  torch::nn::LayerNorm embedding_norm_{nullptr};
  std::vector<BertLayer> layers_;
};
TORCH_MODULE(BertEncoder);

struct BertLoadReport {
  std::vector<std::string> ignored;  // in the file, not used (pooler.*, embeddings.position_ids)
};

// Loads Hugging Face BertModel weights by name (float32 files into any
// floating dtype). `prefix` is stripped from the file's names first (e.g.
// "bert." for BertFor... checkpoints). Every weight of the encoder must be in
// the file with its shape; names in the file that are neither encoder weights
// nor known unused ones (pooler.*, embeddings.position_ids, which must be
// 0..max_position-1) are an error listing them.
BertLoadReport load_bert_weights(BertEncoderImpl& model, const std::string& path,
                                 const std::string& prefix = "");

// Mean of the hidden states over each row's first `lengths` positions, then
// L2 normalisation: hidden (N, L, D), lengths (N,) -> (N, D).
torch::Tensor mean_pool_normalize(const torch::Tensor& hidden, const torch::Tensor& lengths);

}  // namespace fastattn
