// Decoder-only tasks on data shipped by Debian packages: the 8x8 digits of
// scikit-learn (gzip CSV read with zlib) and a character-level corpus
// (default: the fortunes package), and their models (CausalLanguageModel).
// Sampling from trained checkpoints is in sampling.cpp. Tested by
// tests/cpp/test_lm_tasks.cpp.
#include "fastattn/experiments/lm_tasks.h"

#include <ATen/CPUGeneratorImpl.h>
#include <zlib.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>

#include "experiments/train/as_lm.h"

namespace fastattn::train {

namespace {

namespace fs = std::filesystem;

std::string read_file(const std::string& path, const char* who) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in, who, ": cannot open '", path, "'");
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// Inflates a whole gzip file; a truncated or corrupt stream is an error.
std::string gunzip(const std::string& data, const std::string& path) {
  TORCH_CHECK(data.size() >= 2 && static_cast<unsigned char>(data[0]) == 0x1f &&
                  static_cast<unsigned char>(data[1]) == 0x8b,
              "digits: '", path,
              "' is not a gzip file (it does not start with the gzip magic bytes)");
  z_stream zs{};
  TORCH_CHECK(inflateInit2(&zs, 16 + MAX_WBITS) == Z_OK, "digits: zlib inflateInit2 failed");
  zs.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(data.data()));
  zs.avail_in = static_cast<uInt>(data.size());
  std::string out;
  char buf[1 << 16];
  int rc = Z_OK;
  while (rc == Z_OK) {
    zs.next_out = reinterpret_cast<Bytef*>(buf);
    zs.avail_out = sizeof(buf);
    rc = inflate(&zs, Z_NO_FLUSH);
    out.append(buf, sizeof(buf) - zs.avail_out);
    if (rc == Z_BUF_ERROR && zs.avail_in == 0) break;  // input ended early
  }
  const std::string msg = zs.msg ? zs.msg : "";
  const uInt left = zs.avail_in;
  inflateEnd(&zs);
  TORCH_CHECK(rc != Z_BUF_ERROR && rc != Z_OK, "digits: '", path,
              "' is truncated (the gzip stream ends before its end marker, after ", out.size(),
              " bytes of CSV)");
  TORCH_CHECK(rc == Z_STREAM_END, "digits: '", path,
              "' is corrupt (zlib: ", msg.empty() ? "error " + std::to_string(rc) : msg, ")");
  TORCH_CHECK(left == 0, "digits: '", path, "' is corrupt: ", left,
              " bytes follow the end of its gzip stream");
  return out;
}

// Cross-entropy summed over positions, softmax over the first `allowed` logits.
torch::Tensor summed_ce(const torch::Tensor& logits,  // (N, L, V)
                        const torch::Tensor& target,  // (N, L)
                        int64_t allowed, bool sum) {
  auto l = logits.narrow(-1, 0, allowed).reshape({-1, allowed});
  namespace F = torch::nn::functional;
  auto opts = F::CrossEntropyFuncOptions();
  if (sum) {
    opts.reduction(torch::kSum);
  } else {
    opts.reduction(torch::kMean);
  }
  return F::cross_entropy(l, target.reshape({-1}), opts);
}

std::shared_ptr<torch::nn::Module> make_lm(int64_t vocab, const nlohmann::json& model_config) {
  return CausalLanguageModel(vocab, EncoderBuilder::from_json(model_config)).ptr();
}

}  // namespace

// ---- digits ----------------------------------------------------------------------------

DigitsData load_digits(const std::string& path) {
  const auto csv = gunzip(read_file(path, "digits"), path);
  std::vector<int64_t> pixels, labels;
  std::istringstream lines(csv);
  std::string line;
  int64_t lineno = 0;
  while (std::getline(lines, line)) {
    ++lineno;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty()) continue;
    int64_t col = 0;
    size_t pos = 0;
    while (true) {
      const size_t comma = line.find(',', pos);
      const std::string field =
          line.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
      ++col;
      TORCH_CHECK(col <= 65, "digits: '", path, "' line ", lineno,
                  ": more than 65 columns (64 pixels and a label)");
      char* end = nullptr;
      const long v = field.empty() ? 0 : std::strtol(field.c_str(), &end, 10);
      TORCH_CHECK(!field.empty() && end && *end == '\0', "digits: '", path, "' line ", lineno,
                  " column ", col, ": expected an integer, got '", field, "'");
      if (col <= 64) {
        TORCH_CHECK(v >= 0 && v <= 16, "digits: '", path, "' line ", lineno, " column ", col,
                    ": a pixel must be in [0, 16], got ", v);
        pixels.push_back(v);
      } else {
        TORCH_CHECK(v >= 0 && v <= 9, "digits: '", path, "' line ", lineno,
                    ": the label (column 65) must be in [0, 9], got ", v);
        labels.push_back(v);
      }
      if (comma == std::string::npos) break;
      pos = comma + 1;
    }
    TORCH_CHECK(col == 65, "digits: '", path, "' line ", lineno,
                ": expected 65 columns (64 "
                "pixels and a label), got ",
                col);
  }
  TORCH_CHECK(!labels.empty(), "digits: '", path, "' holds no images");
  const auto n = static_cast<int64_t>(labels.size());
  return {torch::tensor(pixels, torch::kLong).reshape({n, 64}),
          torch::tensor(labels, torch::kLong)};
}

std::vector<std::string> digits_search_path() {
  std::vector<std::string> paths;
  if (const char* env = std::getenv("FASTATTN_DIGITS"); env && *env) paths.push_back(env);
  paths.push_back("/usr/lib/python3/dist-packages/sklearn/datasets/data/digits.csv.gz");
  paths.push_back("/usr/local/share/fastattn/data/digits.csv.gz");
  return paths;
}

std::string find_digits_file() {
  for (const auto& p : digits_search_path()) {
    std::error_code ec;
    if (fs::is_regular_file(p, ec)) return p;
  }
  return "";
}

DigitsTask::DigitsTask(DigitsTaskOptions o) : options_(std::move(o)) {
  path_ = options_.path.empty() ? find_digits_file() : options_.path;
  if (path_.empty()) {
    std::string list;
    for (const auto& p : digits_search_path()) list += "\n  " + p;
    TORCH_CHECK(false, "digits task: no digits.csv.gz found; looked in:", list,
                "\nrun scripts/install_deps.sh (it extracts the file from Debian's "
                "python3-sklearn), or set FASTATTN_DIGITS or the task's path");
  }
  auto all = load_digits(path_);
  const int64_t n = all.pixels.size(0);
  TORCH_CHECK(options_.test_size >= 1 && options_.test_size < n,
              "digits task: test_size must be in [1, ", n - 1, "] (the file holds ", n,
              " images), got ", options_.test_size);
  const int64_t n_train = n - options_.test_size;
  train_ = {all.pixels.narrow(0, 0, n_train), all.labels.narrow(0, 0, n_train)};
  test_ = {all.pixels.narrow(0, n_train, options_.test_size),
           all.labels.narrow(0, n_train, options_.test_size)};
}

nlohmann::json DigitsTask::config() const {
  // The path as given ("" = searched) so a checkpoint resumes on another machine.
  return {{"name", "digits"},
          {"path", options_.path},
          {"conditional", options_.conditional},
          {"test_size", options_.test_size}};
}

std::shared_ptr<torch::nn::Module> DigitsTask::make_model(
    const nlohmann::json& model_config) const {
  return make_lm(vocab_size(), model_config);
}

torch::Tensor DigitsTask::sequences(const DigitsData& images) const {
  const int64_t n = images.pixels.size(0);
  auto start = options_.conditional ? images.labels + kStart
                                    : torch::full({n}, kStart, torch::kLong);  // (n,)
  return torch::cat({start.unsqueeze(1), images.pixels}, 1);                   // (n, 65)
}

Batch DigitsTask::sample(int64_t B, at::Generator& gen) const {
  TORCH_CHECK(B >= 1, "digits task: batch size must be >= 1, got ", B);
  auto idx = torch::randint(0, train_size(), {B}, gen, torch::kLong);
  DigitsData d{train_.pixels.index_select(0, idx), train_.labels.index_select(0, idx)};
  return {{"tokens", sequences(d)}, {"labels", d.labels}};
}

torch::Tensor DigitsTask::loss(torch::nn::Module& model, const Batch& b) const {
  auto& m = as_lm(model, "digits task");
  const auto& t = b.at("tokens");                    // (N, 65)
  auto logits = m.forward(t.narrow(1, 0, kPixels));  // (N, 64, V)
  return summed_ce(logits, t.narrow(1, 1, kPixels), kLevels, /*sum=*/false);
}

nlohmann::json DigitsTask::evaluate(torch::nn::Module& model,
                                    const std::vector<Batch>& batches) const {
  auto& m = as_lm(model, "digits task");
  double nats = 0, images = 0;
  for (const auto& b : batches) {
    const auto& t = b.at("tokens");
    nats += summed_ce(m.forward(t.narrow(1, 0, kPixels)), t.narrow(1, 1, kPixels), kLevels, true)
                .item<double>();
    images += static_cast<double>(t.size(0));
  }
  const double per_dim = nats / (images * kPixels);
  return {{"bits_per_dim", per_dim / std::log(2.0)}, {"loss", per_dim}, {"images", images}};
}

std::vector<Batch> DigitsTask::evaluation_batches(int64_t batch_size, int64_t,
                                                  at::Generator&) const {
  std::vector<Batch> out;
  for (int64_t s = 0; s < test_size(); s += batch_size) {
    const int64_t n = std::min(batch_size, test_size() - s);
    DigitsData d{test_.pixels.narrow(0, s, n), test_.labels.narrow(0, s, n)};
    out.push_back({{"tokens", sequences(d)}, {"labels", d.labels}});
  }
  return out;
}

// ---- text corpus ------------------------------------------------------------------------

TextCorpus load_text_corpus(const std::string& path) {
  std::error_code ec;
  TORCH_CHECK(fs::exists(path, ec), "charlm: corpus '", path,
              "' does not exist (the default is the directory of Debian's `fortunes` package: "
              "run scripts/install_deps.sh, or give the task a path)");
  std::vector<std::string> files;
  if (fs::is_directory(path, ec)) {
    for (const auto& e : fs::directory_iterator(path)) {
      if (e.is_symlink() || !e.is_regular_file()) continue;
      if (e.path().extension() == ".dat") continue;
      files.push_back(e.path().string());
    }
    std::sort(files.begin(), files.end());
  } else {
    files.push_back(path);
  }
  TORCH_CHECK(!files.empty(), "charlm: corpus directory '", path, "' holds no text files");
  TextCorpus c;
  std::string all;
  for (const auto& f : files) all += read_file(f, "charlm");
  TORCH_CHECK(!all.empty(), "charlm: corpus '", path, "' is empty");
  c.files = static_cast<int64_t>(files.size());
  c.bytes = static_cast<int64_t>(all.size());
  for (size_t s = 0, block = 0; s < all.size(); s += TextCorpus::kBlock, ++block) {
    (block % 10 == 9 ? c.valid : c.train) += all.substr(s, TextCorpus::kBlock);
  }
  std::array<bool, 256> seen{};
  for (unsigned char ch : all) seen[ch] = true;
  c.index.fill(-1);
  for (int b = 0; b < 256; ++b) {
    if (seen[b]) {
      c.index[b] = static_cast<int16_t>(c.vocabulary.size());
      c.vocabulary.push_back(static_cast<uint8_t>(b));
    }
  }
  return c;
}

namespace {
// Two lowercase hex digits per byte.
std::string hex_bytes(const std::vector<uint8_t>& bytes) {
  static const char* digits = "0123456789abcdef";
  std::string s;
  for (uint8_t b : bytes) {
    s += digits[b >> 4];
    s += digits[b & 15];
  }
  return s;
}
}  // namespace

CharLMTask::CharLMTask(CharLMTaskOptions o) : options_(std::move(o)) {
  TORCH_CHECK(options_.length >= 1, "charlm task: length must be >= 1, got ", options_.length);
  corpus_ = load_text_corpus(options_.path);
  if (options_.vocabulary) {
    const std::string now = hex_bytes(corpus_.vocabulary);
    TORCH_CHECK(*options_.vocabulary == now, "charlm task: the corpus '", options_.path,
                "' now has a vocabulary of ", corpus_.vocabulary.size(), " bytes (hex ", now,
                ") but the model was trained with ", options_.vocabulary->size() / 2,
                " bytes (hex ", *options_.vocabulary,
                "); its token ids would name other characters. Use the corpus it was trained on");
  }
  const auto need = static_cast<size_t>(options_.length + 1);
  TORCH_CHECK(corpus_.train.size() >= need && corpus_.valid.size() >= need, "charlm task: corpus '",
              options_.path, "' splits into ", corpus_.train.size(), " training and ",
              corpus_.valid.size(), " validation bytes; both need a window of length + 1 = ", need,
              " (use a shorter length or a larger corpus)");
}

nlohmann::json CharLMTask::config() const {
  return {{"name", "charlm"},
          {"path", options_.path},
          {"length", options_.length},
          {"vocabulary", hex_bytes(corpus_.vocabulary)}};
}

std::shared_ptr<torch::nn::Module> CharLMTask::make_model(
    const nlohmann::json& model_config) const {
  return make_lm(vocab_size(), model_config);
}

torch::Tensor CharLMTask::encode(const std::string& text) const {
  std::vector<int64_t> t;
  t.reserve(text.size());
  for (unsigned char ch : text) {
    TORCH_CHECK(corpus_.index[ch] >= 0, "charlm: byte ", static_cast<int>(ch), " ('",
                std::string(1, static_cast<char>(ch)), "') does not occur in the corpus '",
                options_.path, "', so it has no token");
    t.push_back(corpus_.index[ch]);
  }
  return torch::tensor(t, torch::kLong);
}

std::string CharLMTask::decode(const torch::Tensor& tokens) const {
  auto t = tokens.to(torch::kLong).contiguous();
  std::string s;
  const auto* p = t.data_ptr<int64_t>();
  for (int64_t i = 0; i < t.numel(); ++i) {
    TORCH_CHECK(p[i] >= 0 && p[i] < vocab_size(), "charlm: token ", p[i], " outside [0, ",
                vocab_size(), ")");
    s += static_cast<char>(corpus_.vocabulary[static_cast<size_t>(p[i])]);
  }
  return s;
}

Batch CharLMTask::windows(const std::string& split, int64_t B, at::Generator& gen) const {
  TORCH_CHECK(B >= 1, "charlm task: batch size must be >= 1, got ", B);
  const int64_t W = options_.length + 1;
  const int64_t n = static_cast<int64_t>(split.size());
  auto starts = torch::randint(0, n - W + 1, {B}, gen, torch::kLong);
  auto tokens = torch::empty({B, W}, torch::kLong);
  auto* out = tokens.data_ptr<int64_t>();
  const auto* s = starts.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t i = 0; i < W; ++i) {
      out[b * W + i] = corpus_.index[static_cast<unsigned char>(split[s[b] + i])];
    }
  }
  return {{"tokens", tokens}};
}

Batch CharLMTask::sample(int64_t B, at::Generator& gen) const {
  return windows(corpus_.train, B, gen);
}

std::vector<Batch> CharLMTask::evaluation_batches(int64_t B, int64_t count,
                                                  at::Generator& gen) const {
  std::vector<Batch> out;
  for (int64_t i = 0; i < count; ++i) out.push_back(windows(corpus_.valid, B, gen));
  return out;
}

torch::Tensor CharLMTask::loss(torch::nn::Module& model, const Batch& b) const {
  auto& m = as_lm(model, "charlm task");
  const auto& t = b.at("tokens");
  const int64_t L = t.size(1) - 1;
  return summed_ce(m.forward(t.narrow(1, 0, L)), t.narrow(1, 1, L), vocab_size(), false);
}

nlohmann::json CharLMTask::evaluate(torch::nn::Module& model,
                                    const std::vector<Batch>& batches) const {
  auto& m = as_lm(model, "charlm task");
  double nats = 0, chars = 0;
  for (const auto& b : batches) {
    const auto& t = b.at("tokens");
    const int64_t L = t.size(1) - 1;
    nats += summed_ce(m.forward(t.narrow(1, 0, L)), t.narrow(1, 1, L), vocab_size(), true)
                .item<double>();
    chars += static_cast<double>(t.size(0) * L);
  }
  return {{"bits_per_char", nats / chars / std::log(2.0)}, {"loss", nats / chars}};
}

}  // namespace fastattn::train
