// A minimal decoder-only language model and autoregressive generation in its
// recurrent form.
//
// CausalLanguageModel: token embedding + sinusoidal positional encoding + a
// causal TransformerEncoder stack + output projection to the vocabulary:
//   tokens (N, L) int64 -> logits (N, L, V)   (position i sees tokens 0..i).
// RecurrentCausalLanguageModel is its token-by-token twin with the same
// parameter names (embedding.weight, encoder.layers.0.attention...,
// encoder.norm.weight, output.weight, output.bias), so copy_parameters (or
// CausalLanguageModel::recurrent()) moves the batch weights over:
//
//   auto encoder = fastattn::EncoderBuilder().layers(1).heads(8).d_model(512)
//                      .attention("causal-linear");
//   fastattn::CausalLanguageModel model(/*vocab_size=*/256, encoder);
//   auto rnn = model->recurrent();  // shares nothing, copies the weights
//   fastattn::GenerationOptions opt;
//   opt.max_new_tokens = 100;
//   opt.temperature = 0.8;
//   opt.top_k = 40;
//   opt.seed = 1;
//   auto result = fastattn::generate(*rnn, prefix, opt);  // prefix (N, P) int64
//   // result.tokens (N, P + T): the prefix and T <= max_new_tokens new tokens
//
// Generation feeds the prefix through the recurrent model one token at a
// time (constant memory per token for causal-linear, a growing key/value
// cache for full), then samples each new token from the last logits and feeds
// it back. Cost per new token: one step of every layer plus the O(D·V)
// output projection.
//
// Tested by tests/cpp/test_generation.cpp.
#pragma once

#include <torch/torch.h>

#include <optional>
#include <utility>
#include <vector>

#include "fastattn/recurrent_transformer.h"
#include "fastattn/transformer.h"

namespace fastattn {

// The sinusoidal encoding of Vaswani et al. at positions [start, start + L):
// (L, D) with pe[p, 2i] = sin(p / 10000^(2i/D)), pe[p, 2i+1] = cos(...).
// Computed on the fly (no table, no length limit).
torch::Tensor sinusoidal_positions(int64_t start, int64_t length, int64_t d_model,
                                   const torch::TensorOptions& options = {});

class RecurrentCausalLanguageModelImpl;

// Submodules: embedding (V, D), encoder (TransformerEncoder), output (D -> V).
class CausalLanguageModelImpl : public torch::nn::Module {
 public:
  // The encoder's attention type must be causal-capable ("causal-linear",
  // "full", ...); forward always applies a causal mask.
  CausalLanguageModelImpl(int64_t vocab_size, const EncoderBuilder& encoder);
  // tokens (N, L) integer in [0, V) -> logits (N, L, V). key_lengths (N,)
  // optional (right padding).
  torch::Tensor forward(const torch::Tensor& tokens,
                        const std::optional<torch::Tensor>& key_lengths = std::nullopt);
  // A RecurrentCausalLanguageModel with this model's weights (copied), dtype
  // and training mode.
  std::shared_ptr<RecurrentCausalLanguageModelImpl> recurrent() const;
  int64_t vocab_size() const { return vocab_size_; }
  int64_t d_model() const { return d_model_; }
  const EncoderBuilder& encoder_builder() const { return builder_; }

 private:
  int64_t vocab_size_, d_model_;
  EncoderBuilder builder_;
  torch::nn::Embedding embedding_{nullptr};
  TransformerEncoder encoder_{nullptr};
  torch::nn::Linear output_{nullptr};
};
TORCH_MODULE(CausalLanguageModel);

// The state of a RecurrentCausalLanguageModel: the encoder's per-layer states
// and the position of the next token.
struct LanguageModelState {
  std::vector<RecurrentState> layers;
  int64_t position = 0;
};

// Token-by-token twin of CausalLanguageModel (the encoder's attention type
// needs a recurrent form: recurrent_attention_names()).
class RecurrentCausalLanguageModelImpl : public torch::nn::Module {
 public:
  RecurrentCausalLanguageModelImpl(int64_t vocab_size, const EncoderBuilder& encoder);
  // token (N,) integer in [0, V) at position state.position -> (logits
  // (N, V), new state at position + 1). The state is not modified.
  std::pair<torch::Tensor, LanguageModelState> step(const torch::Tensor& token,
                                                    const LanguageModelState& state);
  int64_t vocab_size() const { return vocab_size_; }
  int64_t d_model() const { return d_model_; }
  // The recurrent encoder, e.g. to build or inspect its states.
  const RecurrentEncoder& encoder() const { return encoder_; }

 private:
  int64_t vocab_size_, d_model_;
  torch::nn::Embedding embedding_{nullptr};
  RecurrentEncoder encoder_{nullptr};
  torch::nn::Linear output_{nullptr};
};
TORCH_MODULE(RecurrentCausalLanguageModel);

struct GenerationOptions {
  // New tokens to generate after the prefix (>= 0).
  int64_t max_new_tokens = 32;
  // Greedy (argmax) decoding; otherwise sampling from softmax(logits / temperature).
  bool greedy = false;
  // > 0; sampling only.
  double temperature = 1.0;
  // Sample among the k most likely tokens only (1 <= k <= V); sampling only.
  std::optional<int64_t> top_k;
  // A sequence that produces this token stops (the token is kept); finished
  // sequences are padded with it until all have stopped or max_new_tokens.
  std::optional<int64_t> stop_token;
  // Seed of the sampling generator; the same seed gives the same tokens.
  uint64_t seed = 0;
};

struct GenerationResult {
  torch::Tensor tokens;   // (N, P + T) int64: the prefix, then T <= max_new_tokens tokens
  torch::Tensor lengths;  // (N,) int64: P + the new tokens of each sequence up to and
                          // including its stop token
};

// Generates from `prefix` (N, P) integer, P >= 1, in [0, V). Runs under
// NoGradGuard and does not change the model's training mode (use eval()
// to switch dropout off).
GenerationResult generate(RecurrentCausalLanguageModelImpl& model, const torch::Tensor& prefix,
                          const GenerationOptions& options = {});

}  // namespace fastattn
