// Decoder-only training tasks over real data that Debian packages ship, and
// generation from their trained checkpoints (docs/training.md, "Digits" and
// "Character-level language modelling"; docs/experiments.md).
//
//   digits  autoregressive generation of the 8x8 handwritten digits of
//           scikit-learn (digits.csv.gz: 1,797 images, 17 grey levels),
//           pixel by pixel; metric: bits per dimension on held-out images.
//   charlm  character (byte) level language modelling on a text corpus
//           (default: the `fortunes` package); metric: bits per character on
//           a held-out split.
//
// Both train a fastattn::CausalLanguageModel (generation.h) whose model
// config is EncoderBuilder JSON; the attention type must accept a causal mask
// (full, causal-linear, causal-improved-clustered, ...). Sampling uses the
// recurrent form where the type has one (causal-linear, full) and re-runs the
// batch model over the prefix otherwise.
//
//   fastattn::train::TrainConfig c;
//   c.task = {{"name", "digits"}};
//   c.model = {{"layers", 2}, {"heads", 4}, {"d_model", 64}, {"attention", "causal-linear"}};
//   fastattn::train::Trainer trainer(c);
//   trainer.run("runs/digits");
//   auto trained = fastattn::train::load_trained_model("runs/digits");
//   auto images = fastattn::train::sample_digits(trained, {.count = 16});  // (16, 64)
//
// Tested by tests/cpp/test_lm_tasks.cpp.
#pragma once

#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <array>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fastattn/generation.h"
#include "fastattn/experiments/train.h"

namespace fastattn::train {

// ---- digits --------------------------------------------------------------------------

// The images of scikit-learn's digits.csv.gz: `pixels` (n, 64) int64 in
// [0, 16], row-major 8x8; `labels` (n,) int64 in [0, 9].
struct DigitsData {
  torch::Tensor pixels;
  torch::Tensor labels;
};

// Reads a gzip-compressed CSV of rows of 65 integers (64 pixels in 0..16, the
// label in 0..9). A truncated or corrupt gzip stream, a row with another
// number of columns, a value that is not an integer or out of range, or an
// empty file is an error naming the file and the line.
DigitsData load_digits(const std::string& path);

// Where the digits file is looked for, in order: $FASTATTN_DIGITS, the file
// of Debian's python3-sklearn, and the copy scripts/install_deps.sh extracts
// from that package without installing it.
std::vector<std::string> digits_search_path();
// The first file of digits_search_path() that exists, or "" when none does.
std::string find_digits_file();

// Tokens: grey levels 0..16, then the start token 17 (unconditional), or with
// `conditional` the start tokens 17 + label (the label is the first token,
// so samples can be asked for a given digit). Sequences are [start, p0, ...,
// p63]; the model predicts p_i from start, p0..p_{i-1}. The loss and the
// metrics use a softmax over the 17 grey levels only (the start tokens are
// never targets), so bits_per_dim = cross-entropy / ln 2 per pixel over 17
// outcomes (log2(17) = 4.09 for a uniform guess).
// Split: the first 1797 - test_size rows train, the last test_size rows
// (default 297) are the held-out test set; the rows are used in file order.
struct DigitsTaskOptions {
  std::string path;  // "" = find_digits_file()
  bool conditional = false;
  int64_t test_size = 297;
};

class DigitsTask : public Task {
 public:
  static constexpr int64_t kLevels = 17;
  static constexpr int64_t kPixels = 64;
  static constexpr int64_t kStart = 17;

  explicit DigitsTask(DigitsTaskOptions options);
  std::string name() const override { return "digits"; }
  nlohmann::json config() const override;
  // A CausalLanguageModel over vocab_size() tokens (model_config: EncoderBuilder JSON).
  std::shared_ptr<torch::nn::Module> make_model(const nlohmann::json& model_config) const override;
  // "tokens" (N, 65) int64 (start token, 64 pixels) of random training
  // images, "labels" (N,).
  Batch sample(int64_t batch_size, at::Generator& gen) const override;
  torch::Tensor loss(torch::nn::Module& model, const Batch& batch) const override;
  // bits_per_dim, loss (nats per pixel), images.
  nlohmann::json evaluate(torch::nn::Module& model,
                          const std::vector<Batch>& batches) const override;
  // The whole test split in batches of batch_size (count is ignored).
  std::vector<Batch> evaluation_batches(int64_t batch_size, int64_t count,
                                        at::Generator& gen) const override;

  int64_t vocab_size() const { return kLevels + (options_.conditional ? 10 : 1); }
  const DigitsTaskOptions& options() const { return options_; }
  const std::string& path() const { return path_; }
  int64_t train_size() const { return train_.pixels.size(0); }
  int64_t test_size() const { return test_.pixels.size(0); }
  // The split's images (pixels (n, 64), labels (n,)).
  const DigitsData& train_split() const { return train_; }
  const DigitsData& test_split() const { return test_; }
  // Sequences for images: (n, 65) start token(s) + pixels.
  torch::Tensor sequences(const DigitsData& images) const;

 private:
  DigitsTaskOptions options_;
  std::string path_;
  DigitsData train_, test_;
};

// ---- character-level language modelling ------------------------------------------

// A text corpus: the bytes of one file, or of every regular file of a
// directory that is not a symbolic link and does not end in ".dat", in
// byte order of their names, concatenated. The vocabulary is the sorted set of
// the bytes that occur (deterministic for a given corpus). Split: the corpus
// is cut into blocks of kBlock bytes; every 10th block (index 9, 19, ...) is
// validation, the rest training, each concatenated in order.
struct TextCorpus {
  static constexpr int64_t kBlock = 10000;
  std::string train, valid;
  std::vector<uint8_t> vocabulary;   // sorted distinct bytes
  std::array<int16_t, 256> index{};  // byte -> token, -1 when absent
  int64_t files = 0;
  int64_t bytes = 0;
};
TextCorpus load_text_corpus(const std::string& path);

// Windows of `length` + 1 tokens; the model predicts each token from those
// before it in the window. Metric: bits_per_char (cross-entropy / ln 2 per
// predicted byte) on `eval_batches` fixed random windows of the validation
// split. The default corpus is the directory of Debian's `fortunes` package.
struct CharLMTaskOptions {
  std::string path = "/usr/share/games/fortunes";
  int64_t length = 256;
  // The byte vocabulary a model was trained with (config key "vocabulary",
  // two hex digits per byte, as config() writes it): when set, the corpus
  // must still have exactly this vocabulary, otherwise token ids would name
  // other characters; construction fails with both listed.
  std::optional<std::string> vocabulary;
};

class CharLMTask : public Task {
 public:
  explicit CharLMTask(CharLMTaskOptions options);
  std::string name() const override { return "charlm"; }
  nlohmann::json config() const override;
  std::shared_ptr<torch::nn::Module> make_model(const nlohmann::json& model_config) const override;
  // "tokens" (N, length + 1) int64: random windows of the training split.
  Batch sample(int64_t batch_size, at::Generator& gen) const override;
  torch::Tensor loss(torch::nn::Module& model, const Batch& batch) const override;
  // bits_per_char, loss (nats per byte).
  nlohmann::json evaluate(torch::nn::Module& model,
                          const std::vector<Batch>& batches) const override;
  // `count` batches of windows of the validation split.
  std::vector<Batch> evaluation_batches(int64_t batch_size, int64_t count,
                                        at::Generator& gen) const override;

  int64_t vocab_size() const { return static_cast<int64_t>(corpus_.vocabulary.size()); }
  const TextCorpus& corpus() const { return corpus_; }
  const CharLMTaskOptions& options() const { return options_; }
  // Text -> (L,) int64 tokens; a byte not in the vocabulary is an error naming it.
  torch::Tensor encode(const std::string& text) const;
  // (L,) tokens -> text.
  std::string decode(const torch::Tensor& tokens) const;

 private:
  Batch windows(const std::string& split, int64_t batch_size, at::Generator& gen) const;
  CharLMTaskOptions options_;
  TextCorpus corpus_;
};

// ---- trained models ------------------------------------------------------------------

// A model rebuilt from <dir>/model.safetensors (its weights and the training
// config stored in its metadata), in eval mode, with its task.
struct TrainedModel {
  TrainConfig config;
  int64_t step = 0;
  std::unique_ptr<Task> task;
  std::shared_ptr<torch::nn::Module> model;
};
TrainedModel load_trained_model(const std::string& dir);

// Autoregressive sampling for the decoder-only tasks. With the recurrent
// form (the attention type is in recurrent_attention_names()) each token
// costs one step; otherwise the batch model re-runs over the prefix.
struct SampleOptions {
  int64_t count = 16;            // sequences
  double temperature = 1.0;      // > 0
  bool greedy = false;           // argmax instead of sampling
  std::optional<int64_t> label;  // digits, conditional models: the digit (else random)
  uint64_t seed = 0;
  bool recurrent = true;  // false: always re-run the batch model (for comparison)
};
struct SampleResult {
  torch::Tensor tokens;    // digits: (count, 64) pixels; charlm: (count, P + T) tokens
  torch::Tensor labels;    // digits, conditional: (count,) the labels used
  bool recurrent = false;  // whether the recurrent form was used
  double seconds = 0.0;    // time spent sampling
};
// Digits: `count` images (N, 64) int64 in [0, 16].
SampleResult sample_digits(TrainedModel& trained, const SampleOptions& options);
// Char-LM: continues `prompt` (at least one byte) by `new_tokens` bytes, for each of `count`.
SampleResult sample_text(TrainedModel& trained, const std::string& prompt, int64_t new_tokens,
                         const SampleOptions& options);

// What `fastattn generate --checkpoint` hands a task type's generator
// (TaskGenerator, train.h): the common sampling options (count already
// resolved) and {key: value} of the type's own flags that were given, typed
// by their kind.
struct GenerateRequest {
  SampleOptions options;
  nlohmann::json values = nlohmann::json::object();
};
// What the generator gives back: the samples rendered for a terminal, what
// `count` of them are ("images", "sequences"), the sampling result, the
// fields it adds to --json, and lines saying what it wrote (files named by
// its flags, such as --pgm).
struct GenerateReport {
  std::string text;
  std::string unit;
  SampleResult result;
  nlohmann::json record = nlohmann::json::object();
  std::vector<std::string> notes;
};
// The generators of the built-in types: digits (--label D, --pgm FILE; 16
// images printed as ASCII, 8 side by side) and charlm (--prompt TEXT,
// --max-new-tokens T; one text).
TaskGenerator digits_generator();
TaskGenerator charlm_generator();

// An 8x8 image (64,) in [0, 16] as 8 lines of characters, light to dark.
std::string digit_ascii(const torch::Tensor& pixels);
// Images (N, 64) tiled 8 per row (1 pixel white gaps), magnified `scale`
// times, as a binary PGM (P5, maxval 16, ink dark on white).
std::string digits_pgm(const torch::Tensor& images, int64_t scale = 4);

}  // namespace fastattn::train
