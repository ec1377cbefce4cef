// Approximating a pretrained encoder's attention without fine-tuning (the
// clustered-attention paper's Table 4 experiment, on all-MiniLM-L6-v2): embed
// a corpus with full attention and with other attention types in the same
// weights, and measure how close the embeddings and their nearest-neighbour
// retrieval stay. `fastattn approx` is the command; docs/approx.md the results.
//
//   auto model = fastattn::SentenceEncoder(fastattn::default_minilm_dir());
//   auto corpus = fastattn::read_debian_descriptions(fastattn::default_corpus_path(), {});
//   auto report = fastattn::compare_attention(model, texts, {{"clustered-25", "clustered",
//                                             {{"clusters", 25}, {"seed", 0}}}}, {});
#pragma once

#include <torch/torch.h>

#include <string>
#include <vector>

#include "fastattn/experiments/bert.h"
#include "fastattn/registry.h"
#include "fastattn/experiments/wordpiece.h"

namespace fastattn {

// $FASTATTN_MINILM_DIR, else $FASTATTN_CACHE/minilm, else ~/.cache/fastattn/minilm
// (where scripts/fetch_minilm.sh puts model.safetensors, config.json, vocab.txt).
std::string default_minilm_dir();
// $FASTATTN_CACHE/debian/Translation-en (same cache rule).
std::string default_corpus_path();

// ---- corpus --------------------------------------------------------------------------

struct Passage {
  std::string package;
  std::string text;  // short description, newline, long description
};

struct CorpusOptions {
  int64_t passages = 300;  // how many to select (fewer when fewer qualify)
  int64_t min_words = 40;  // words (whitespace-separated) of the long description
};

// Debian package descriptions from a deb822 file: Translation-en
// ("Description-en:") or a Packages / dpkg status file ("Description:"). The
// long description's lines lose their leading space; " ." lines become
// paragraph breaks. Selection, deterministic for a given file: keep packages
// whose long description has >= min_words words; drop repeated long
// descriptions (the first package by name keeps it); sort by package name
// (byte order); take `passages` of them evenly spaced (index floor(i·K/n) of
// the K candidates).
std::vector<Passage> read_debian_descriptions(const std::string& path,
                                              const CorpusOptions& options);

// ---- sentence embeddings ---------------------------------------------------------------

// The model directory's tokenizer and encoder (config.json, vocab.txt,
// model.safetensors), float32, inference only.
class SentenceEncoder {
 public:
  explicit SentenceEncoder(const std::string& model_dir, int64_t max_length = 256);
  std::vector<WordPieceEncoding> encode(const std::vector<std::string>& texts) const;
  // Unit-norm embeddings (P, D), float32, rows in the order of `encodings`.
  // Passages are sorted by length and run `batch_size` at a time, padded to
  // the longest in the batch (key_lengths mask the padding).
  torch::Tensor embed(const std::vector<WordPieceEncoding>& encodings, int64_t batch_size = 16);
  BertEncoder& model() { return model_; }
  const WordPieceTokenizer& tokenizer() const { return tokenizer_; }

 private:
  WordPieceTokenizer tokenizer_;
  BertEncoder model_{nullptr};
};

// ---- comparison -------------------------------------------------------------------------

struct AttentionChoice {
  std::string label;  // as shown in the table, e.g. "improved-clustered:clusters=25"
  std::string type;
  ParamMap params;
};

struct ApproxOptions {
  int64_t batch_size = 16;
  int64_t neighbours = 10;  // top-k for the retrieval overlap
};

struct ApproxRow {
  std::string label, type;
  ParamMap params;
  double mean_cosine = 0, min_cosine = 0;  // to the full-attention embedding
  double knn_overlap = 0;  // mean |top-k(full) ∩ top-k(type)| / k over passages (self excluded)
  double ms_per_passage = 0;
};

struct ApproxReport {
  int64_t passages = 0, tokens = 0, max_tokens = 0;
  int64_t truncated_passages = 0;  // passages cut to the model's max length
  std::vector<ApproxRow> rows;     // "full" first
};

// Top-`k` neighbours (by cosine, self excluded) of every row of unit-norm `e`
// (P, D): (P, k) int64, nearest first.
torch::Tensor nearest_neighbours(const torch::Tensor& e, int64_t k);

// Embeds `encodings` with full attention, then with each choice (the model's
// weights are shared; its attention is set back to full afterwards), and
// compares. Time per passage is wall time of embed() / passages, after one
// untimed batch.
ApproxReport compare_attention(SentenceEncoder& encoder,
                               const std::vector<WordPieceEncoding>& encodings,
                               const std::vector<AttentionChoice>& choices,
                               const ApproxOptions& options = {});

}  // namespace fastattn
