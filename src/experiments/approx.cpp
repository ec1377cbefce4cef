// The approximation experiment (include/fastattn/experiments/approx.h): Debian
// description corpus, sentence embeddings in length-sorted batches, and the
// comparison of attention types against full attention on the same weights.
// Tests: ./build/fastattn_tests --gtest_filter='Approx*:MiniLM*'
#include "fastattn/experiments/approx.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <numeric>
#include <set>
#include <sstream>
#include <tuple>

namespace fastattn {

namespace {

std::string cache_dir() {
  if (const char* c = std::getenv("FASTATTN_CACHE"); c && *c) return c;
  const char* home = std::getenv("HOME");
  return std::string(home && *home ? home : ".") + "/.cache/fastattn";
}

int64_t count_words(const std::string& s) {
  std::istringstream in(s);
  std::string w;
  int64_t n = 0;
  while (in >> w) ++n;
  return n;
}

double now_ms() {
  using clock = std::chrono::steady_clock;
  return std::chrono::duration<double, std::milli>(clock::now().time_since_epoch()).count();
}

}  // namespace

std::string default_minilm_dir() {
  if (const char* d = std::getenv("FASTATTN_MINILM_DIR"); d && *d) return d;
  return cache_dir() + "/minilm";
}

std::string default_corpus_path() { return cache_dir() + "/debian/Translation-en"; }

// ---- corpus --------------------------------------------------------------------------

std::vector<Passage> read_debian_descriptions(const std::string& path,
                                              const CorpusOptions& options) {
  TORCH_CHECK(options.passages >= 1, "read_debian_descriptions: passages must be >= 1, got ",
              options.passages);
  TORCH_CHECK(options.min_words >= 0, "read_debian_descriptions: min_words must be >= 0, got ",
              options.min_words);
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in, "Debian descriptions '", path,
              "': cannot open (run scripts/fetch_minilm.sh, or give a Translation-en, Packages "
              "or /var/lib/dpkg/status file)");
  struct Entry {
    std::string package, short_text, long_text;
  };
  std::vector<Entry> entries;
  Entry cur;
  bool in_description = false;
  int64_t paragraphs = 0;
  auto finish = [&] {
    if (!cur.package.empty() && !cur.long_text.empty()) entries.push_back(cur);
    cur = Entry();
    in_description = false;
  };
  std::string line;
  while (std::getline(in, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty()) {
      if (!cur.package.empty()) ++paragraphs;
      finish();
      continue;
    }
    if (line[0] == ' ' || line[0] == '\t') {
      if (!in_description) continue;  // continuation of another field
      std::string text = line.substr(1);
      if (text == ".") {
        cur.long_text += "\n";
      } else {
        const auto b = text.find_first_not_of(" \t");
        if (b == std::string::npos) continue;
        if (!cur.long_text.empty() && cur.long_text.back() != '\n') cur.long_text += " ";
        cur.long_text += text.substr(b);
      }
      continue;
    }
    in_description = false;
    const auto colon = line.find(':');
    if (colon == std::string::npos) continue;
    const std::string field = line.substr(0, colon);
    std::string value = line.substr(colon + 1);
    const auto b = value.find_first_not_of(" \t");
    value = b == std::string::npos ? "" : value.substr(b);
    if (field == "Package") {
      cur.package = value;
    } else if (field == "Description-en" || field == "Description") {
      cur.short_text = value;
      in_description = true;
    }
  }
  if (!cur.package.empty()) ++paragraphs;
  finish();
  TORCH_CHECK(!in.bad(), "Debian descriptions '", path, "': read error");
  TORCH_CHECK(paragraphs > 0, "Debian descriptions '", path,
              "': no 'Package:' paragraphs (expected a Translation-en, Packages or status file)");

  std::sort(entries.begin(), entries.end(),
            [](const Entry& a, const Entry& b) { return a.package < b.package; });
  std::vector<Passage> candidates;
  std::set<std::string> seen;
  for (auto& e : entries) {
    // Trim trailing paragraph breaks.
    while (!e.long_text.empty() && (e.long_text.back() == '\n' || e.long_text.back() == ' '))
      e.long_text.pop_back();
    if (count_words(e.long_text) < options.min_words) continue;
    if (!seen.insert(e.long_text).second) continue;
    candidates.push_back({e.package, e.short_text + "\n" + e.long_text});
  }
  const int64_t K = static_cast<int64_t>(candidates.size());
  const int64_t n = std::min(options.passages, K);
  std::vector<Passage> out;
  out.reserve(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) out.push_back(candidates[static_cast<size_t>(i * K / n)]);
  return out;
}

// ---- sentence embeddings ---------------------------------------------------------------

SentenceEncoder::SentenceEncoder(const std::string& model_dir, int64_t max_length)
    : tokenizer_(WordPieceTokenizer::from_file(model_dir + "/vocab.txt", [&] {
        WordPieceOptions o;
        o.max_length = max_length;
        return o;
      }())) {
  const auto config = BertConfig::from_json_file(model_dir + "/config.json");
  TORCH_CHECK(max_length <= config.max_position_embeddings, "SentenceEncoder: max_length ",
              max_length, " exceeds the model's max_position_embeddings ",
              config.max_position_embeddings);
  TORCH_CHECK(tokenizer_.vocab_size() == config.vocab_size, "SentenceEncoder: vocab.txt has ",
              tokenizer_.vocab_size(),
              " tokens but config.json says vocab_size = ", config.vocab_size);
  model_ = BertEncoder(config);
  load_bert_weights(*model_, model_dir + "/model.safetensors");
  model_->eval();
}

std::vector<WordPieceEncoding> SentenceEncoder::encode(
    const std::vector<std::string>& texts) const {
  std::vector<WordPieceEncoding> out;
  out.reserve(texts.size());
  for (const auto& t : texts) out.push_back(tokenizer_.encode(t));
  return out;
}

torch::Tensor SentenceEncoder::embed(const std::vector<WordPieceEncoding>& encodings,
                                     int64_t batch_size) {
  TORCH_CHECK(batch_size >= 1, "SentenceEncoder::embed: batch_size must be >= 1, got ", batch_size);
  const int64_t P = static_cast<int64_t>(encodings.size());
  const int64_t D = model_->config().hidden_size;
  auto out = torch::empty({P, D}, torch::kFloat);
  // Longest first, so that each batch pads to about its own length.
  std::vector<int64_t> order(static_cast<size_t>(P));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return encodings[static_cast<size_t>(a)].ids.size() >
           encodings[static_cast<size_t>(b)].ids.size();
  });
  torch::NoGradGuard no_grad;
  for (int64_t b0 = 0; b0 < P; b0 += batch_size) {
    const int64_t B = std::min(batch_size, P - b0);
    const int64_t L = static_cast<int64_t>(
        encodings[static_cast<size_t>(order[static_cast<size_t>(b0)])].ids.size());
    auto ids = torch::full({B, L}, tokenizer_.pad_id(), torch::kLong);
    auto lengths = torch::empty({B}, torch::kLong);
    auto ids_a = ids.accessor<int64_t, 2>();
    for (int64_t i = 0; i < B; ++i) {
      const auto& e = encodings[static_cast<size_t>(order[static_cast<size_t>(b0 + i)])].ids;
      for (size_t j = 0; j < e.size(); ++j) ids_a[i][static_cast<int64_t>(j)] = e[j];
      lengths[i] = static_cast<int64_t>(e.size());
    }
    auto emb = mean_pool_normalize(model_->forward(ids, lengths), lengths).to(torch::kFloat);
    for (int64_t i = 0; i < B; ++i) out[order[static_cast<size_t>(b0 + i)]] = emb[i];
  }
  return out;
}

// ---- comparison -------------------------------------------------------------------------

torch::Tensor nearest_neighbours(const torch::Tensor& e, int64_t k) {
  TORCH_CHECK(e.dim() == 2, "nearest_neighbours: e must be (P, D), got ", e.sizes());
  const int64_t P = e.size(0);
  TORCH_CHECK(k >= 1 && k < P, "nearest_neighbours: k must lie in [1, P - 1] = [1, ", P - 1,
              "], got ", k);
  auto sim = e.to(torch::kDouble).matmul(e.to(torch::kDouble).t());
  sim.fill_diagonal_(-std::numeric_limits<double>::infinity());
  return std::get<1>(sim.topk(k, 1));
}

ApproxReport compare_attention(SentenceEncoder& encoder,
                               const std::vector<WordPieceEncoding>& encodings,
                               const std::vector<AttentionChoice>& choices,
                               const ApproxOptions& options) {
  const int64_t P = static_cast<int64_t>(encodings.size());
  TORCH_CHECK(options.neighbours >= 1 && options.neighbours < P,
              "compare_attention: needs more "
              "passages (",
              P, ") than neighbours (", options.neighbours, ")");
  ApproxReport report;
  report.passages = P;
  for (const auto& e : encodings) {
    report.tokens += static_cast<int64_t>(e.ids.size());
    report.max_tokens = std::max<int64_t>(report.max_tokens, static_cast<int64_t>(e.ids.size()));
    if (e.truncated > 0) ++report.truncated_passages;
  }
  auto& model = encoder.model();
  const std::string original_type = model->attention_type();
  auto run = [&](const AttentionChoice& c) {
    model->set_attention(c.type, c.params);
    // One untimed batch (first-touch allocations, lazy initialisation).
    const size_t warm = static_cast<size_t>(std::min<int64_t>(options.batch_size, P));
    encoder.embed(std::vector<WordPieceEncoding>(encodings.begin(), encodings.begin() + warm),
                  options.batch_size);
    const double t0 = now_ms();
    auto e = encoder.embed(encodings, options.batch_size);
    return std::make_pair(e, (now_ms() - t0) / static_cast<double>(P));
  };
  const AttentionChoice full{"full", "full", {}};
  const auto [reference, full_ms] = run(full);
  const auto ref_nn = nearest_neighbours(reference, options.neighbours);
  std::vector<AttentionChoice> all = {full};
  all.insert(all.end(), choices.begin(), choices.end());
  try {
    for (size_t i = 0; i < all.size(); ++i) {
      torch::Tensor e;
      double ms = full_ms;
      if (i == 0) {
        e = reference;
      } else {
        std::tie(e, ms) = run(all[i]);
      }
      const auto cos = (e.to(torch::kDouble) * reference.to(torch::kDouble)).sum(1);  // (P,)
      const auto nn = nearest_neighbours(e, options.neighbours);
      // |top-k ∩ top-k_ref| per row: compare every pair of the two (P, k) lists.
      const auto hits = nn.unsqueeze(2).eq(ref_nn.unsqueeze(1)).any(2).sum(1);  // (P,)
      ApproxRow row;
      row.label = all[i].label;
      row.type = all[i].type;
      row.params = all[i].params;
      row.mean_cosine = cos.mean().item<double>();
      row.min_cosine = cos.min().item<double>();
      row.knn_overlap =
          hits.to(torch::kDouble).mean().item<double>() / static_cast<double>(options.neighbours);
      row.ms_per_passage = ms;
      report.rows.push_back(row);
    }
  } catch (...) {
    model->set_attention(original_type);
    throw;
  }
  model->set_attention(original_type);
  return report;
}

}  // namespace fastattn
