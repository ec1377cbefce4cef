// Tests of the decoder-only tasks (lm_tasks.h): the digits loader on the real
// file and on corrupt copies, a tiny digits model learning, the char-LM
// corpus split and windows, sampling from trained checkpoints (recurrent form
// equal to the batch model), and the trainer's time budget.
//   ./build/fastattn_tests --gtest_filter='Digits*:CharLM*:TrainedModel*:TimeBudget*'
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "expect_error.h"
#include "temp_files.h"
#include "fastattn/experiments/lm_tasks.h"
#include "fastattn/safetensors.h"

using namespace fastattn;
using namespace fastattn::train;

namespace {

using fastattn::testing::read_bytes;
using fastattn::testing::TempDir;
using fastattn::testing::write_bytes;

void write_gzip(const std::string& path, const std::string& text) {
  gzFile f = gzopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr);
  ASSERT_EQ(gzwrite(f, text.data(), static_cast<unsigned>(text.size())),
            static_cast<int>(text.size()));
  gzclose(f);
}

// The real file, or "" (the test then skips with a message).
std::string digits_file() { return find_digits_file(); }

#define REQUIRE_DIGITS(path)                                                                 \
  const std::string path = digits_file();                                                    \
  if (path.empty())                                                                          \
  GTEST_SKIP() << "digits.csv.gz not found (run scripts/install_deps.sh, which extracts it " \
                  "from Debian's python3-sklearn, or set FASTATTN_DIGITS)"

// A deterministic English-like text of `n` bytes.
std::string make_text(size_t n) {
  const char* words[] = {"the ", "cat ", "sat ", "on ", "a ", "mat. ", "Dogs ", "bark!\n"};
  std::string s;
  uint64_t x = 12345;
  while (s.size() < n) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    s += words[(x >> 33) % 8];
  }
  s.resize(n);
  return s;
}

TrainConfig tiny_lm_config(const nlohmann::json& task, const std::string& attention) {
  TrainConfig c;
  c.task = task;
  c.model = {{"layers", 1},    {"heads", 2},
             {"d_model", 16},  {"feed_forward_dimensions", 32},
             {"dropout", 0.0}, {"attention", attention}};
  c.optimizer.lr = 3e-3;
  c.optimizer.name = "adam";
  c.batch_size = 16;
  c.eval_batches = 2;
  c.steps = 5;
  return c;
}

}  // namespace

// ---- digits loader ----------------------------------------------------------------------

TEST(DigitsLoader, ReadsTheRealFile) {
  REQUIRE_DIGITS(path);
  auto d = load_digits(path);
  ASSERT_EQ(d.pixels.sizes(), (std::vector<int64_t>{1797, 64}));
  ASSERT_EQ(d.labels.sizes(), (std::vector<int64_t>{1797}));
  EXPECT_GE(d.pixels.min().item<int64_t>(), 0);
  EXPECT_EQ(d.pixels.max().item<int64_t>(), 16);
  // Every digit occurs, about 180 times each.
  auto counts = torch::bincount(d.labels, {}, 10);
  EXPECT_EQ(counts.numel(), 10);
  EXPECT_GE(counts.min().item<int64_t>(), 170);
  EXPECT_LE(counts.max().item<int64_t>(), 190);
  // The first image is a 0 (scikit-learn's load_digits()[0]).
  EXPECT_EQ(d.labels[0].item<int64_t>(), 0);
  EXPECT_EQ(d.pixels[0].narrow(0, 0, 8).sum().item<int64_t>(), 0 + 0 + 5 + 13 + 9 + 1 + 0 + 0);
}

TEST(DigitsLoader, RejectsCorruptFilesWithClearErrors) {
  REQUIRE_DIGITS(path);
  TempDir dir;
  const auto good = read_bytes(path);
  const std::string p = dir.path + "/bad.csv.gz";

  write_bytes(p, good.substr(0, good.size() / 2));
  EXPECT_ERROR_CONTAINS(load_digits(p), "bad.csv.gz", "truncated");

  auto flipped = good;
  for (size_t i = good.size() / 3; i < good.size() / 3 + 16; ++i) flipped[i] ^= 0x5a;
  write_bytes(p, flipped);
  EXPECT_ERROR_CONTAINS(load_digits(p), "bad.csv.gz", "corrupt");

  write_bytes(p, good + "extra");
  EXPECT_ERROR_CONTAINS(load_digits(p), "corrupt", "5 bytes follow the end");

  write_bytes(p, "0,1,2\n");
  EXPECT_ERROR_CONTAINS(load_digits(p), "not a gzip file");

  write_bytes(p, "");
  EXPECT_ERROR_CONTAINS(load_digits(p), "not a gzip file");

  EXPECT_ERROR_CONTAINS(load_digits(dir.path + "/missing.csv.gz"), "cannot open", "missing.csv.gz");

  std::string row;
  for (int i = 0; i < 64; ++i) row += std::to_string(i % 17) + ",";
  write_gzip(p, row + "3\n" + row.substr(0, row.size() - 1) + "\n");  // line 2: 64 columns
  EXPECT_ERROR_CONTAINS(load_digits(p), "line 2", "expected 65 columns", "got 64");
  write_gzip(p, row + "\n");  // an empty 65th field
  EXPECT_ERROR_CONTAINS(load_digits(p), "line 1 column 65", "expected an integer, got ''");

  write_gzip(p, row + "3,4\n");
  EXPECT_ERROR_CONTAINS(load_digits(p), "line 1", "more than 65 columns");

  write_gzip(p, "17," + row.substr(2) + "3\n");
  EXPECT_ERROR_CONTAINS(load_digits(p), "line 1 column 1", "[0, 16]", "17");

  write_gzip(p, row + "x\n");
  EXPECT_ERROR_CONTAINS(load_digits(p), "line 1 column 65", "expected an integer", "'x'");

  write_gzip(p, row + "10\n");
  EXPECT_ERROR_CONTAINS(load_digits(p), "label", "[0, 9]");

  write_gzip(p, "\n");
  EXPECT_ERROR_CONTAINS(load_digits(p), "holds no images");

  // A well-formed small file loads.
  write_gzip(p, row + "3\r\n" + row + "7\n");
  auto d = load_digits(p);
  EXPECT_EQ(d.pixels.size(0), 2);
  EXPECT_EQ(d.labels[1].item<int64_t>(), 7);
}

// ---- digits task ------------------------------------------------------------------------

TEST(DigitsTask, SplitAndSequences) {
  REQUIRE_DIGITS(path);
  DigitsTask task({path, /*conditional=*/true, /*test_size=*/297});
  EXPECT_EQ(task.train_size(), 1500);
  EXPECT_EQ(task.test_size(), 297);
  EXPECT_EQ(task.vocab_size(), 27);
  auto all = load_digits(path);
  EXPECT_TRUE(torch::equal(task.test_split().pixels, all.pixels.narrow(0, 1500, 297)));
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
  auto b = task.sample(5, gen);
  ASSERT_EQ(b.at("tokens").sizes(), (std::vector<int64_t>{5, 65}));
  EXPECT_TRUE(torch::equal(b.at("tokens").select(1, 0), b.at("labels") + DigitsTask::kStart));
  int64_t images = 0;
  for (const auto& e : task.evaluation_batches(64, 1, gen)) images += e.at("tokens").size(0);
  EXPECT_EQ(images, 297);  // the whole test split, whatever count says
  EXPECT_ERROR_CONTAINS(DigitsTask({path, false, 1797}), "test_size must be in [1, 1796]");
  EXPECT_ERROR_CONTAINS(make_task({{"name", "digits"}, {"nope", 1}}), "unknown key 'nope'",
                        "conditional");
}

TEST(DigitsTask, TinyModelBitsPerDimFalls) {
  REQUIRE_DIGITS(path);
  auto c = tiny_lm_config({{"name", "digits"}, {"path", path}}, "causal-linear");
  c.steps = 30;
  Trainer trainer(c);
  const double before = trainer.evaluate()["bits_per_dim"].get<double>();
  // A fresh model is near the uniform guess over 17 levels (log2 17 = 4.09).
  EXPECT_GT(before, 3.0);
  EXPECT_LT(before, 6.0);
  trainer.run();
  const auto after = trainer.evaluate();
  EXPECT_EQ(after["images"].get<double>(), 297);
  EXPECT_LT(after["bits_per_dim"].get<double>(), before - 0.5);
  EXPECT_NEAR(after["bits_per_dim"].get<double>(), after["loss"].get<double>() / std::log(2.0),
              1e-9);
}

// ---- char-LM ----------------------------------------------------------------------------

TEST(CharLMTask, CorpusSplitIsDeterministic) {
  TempDir dir;
  const auto text = make_text(105000);
  const std::string file = dir.path + "/corpus.txt";
  write_bytes(file, text);
  auto a = load_text_corpus(file), b = load_text_corpus(file);
  EXPECT_EQ(a.train, b.train);
  EXPECT_EQ(a.valid, b.valid);
  // Blocks of 10,000 bytes; block 9 is validation.
  EXPECT_EQ(a.valid, text.substr(90000, 10000));
  EXPECT_EQ(a.train, text.substr(0, 90000) + text.substr(100000));
  EXPECT_EQ(a.bytes, 105000);
  // The vocabulary: the sorted distinct bytes.
  std::string sorted(text);
  std::sort(sorted.begin(), sorted.end());
  sorted.erase(std::unique(sorted.begin(), sorted.end()), sorted.end());
  ASSERT_EQ(a.vocabulary.size(), sorted.size());
  for (size_t i = 0; i < sorted.size(); ++i) {
    EXPECT_EQ(a.vocabulary[i], static_cast<uint8_t>(sorted[i]));
    EXPECT_EQ(a.index[static_cast<unsigned char>(sorted[i])], static_cast<int16_t>(i));
  }

  // A directory: regular files in name order, no .dat files, no symbolic links.
  const std::string d = dir.path + "/dir";
  ASSERT_EQ(::mkdir(d.c_str(), 0755), 0);
  write_bytes(d + "/b", text.substr(0, 60000));
  write_bytes(d + "/a", text.substr(60000));
  write_bytes(d + "/a.dat", "BINARY INDEX");
  ASSERT_EQ(::symlink((d + "/a").c_str(), (d + "/a.u8").c_str()), 0);
  auto c = load_text_corpus(d);
  EXPECT_EQ(c.files, 2);
  EXPECT_EQ(c.bytes, 105000);
  const auto joined = text.substr(60000) + text.substr(0, 60000);
  EXPECT_EQ(c.valid, joined.substr(90000, 10000));
}

TEST(CharLMTask, WindowsComeFromTheirSplit) {
  TempDir dir;
  const std::string file = dir.path + "/corpus.txt";
  write_bytes(file, make_text(105000));
  CharLMTask task({file, 32});
  auto g1 = at::make_generator<at::CPUGeneratorImpl>(7);
  auto g2 = at::make_generator<at::CPUGeneratorImpl>(7);
  auto a = task.sample(4, g1), b = task.sample(4, g2);
  EXPECT_TRUE(torch::equal(a.at("tokens"), b.at("tokens")));
  ASSERT_EQ(a.at("tokens").sizes(), (std::vector<int64_t>{4, 33}));
  auto eval = task.evaluation_batches(4, 3, g1);
  ASSERT_EQ(eval.size(), 3u);
  for (const auto& e : eval) {
    for (int64_t i = 0; i < 4; ++i) {
      EXPECT_NE(task.corpus().valid.find(task.decode(e.at("tokens")[i])), std::string::npos);
    }
  }
  EXPECT_EQ(task.decode(task.encode("the cat")), "the cat");
  EXPECT_ERROR_CONTAINS(task.encode("zebra"), "does not occur in the corpus");
  EXPECT_ERROR_CONTAINS(CharLMTask({file, 20000}), "validation bytes", "length + 1 = 20001");
  EXPECT_ERROR_CONTAINS(CharLMTask({dir.path + "/none", 8}), "does not exist");
}

TEST(CharLMTask, StoredVocabularyMustMatchTheCorpus) {
  TempDir dir;
  const std::string file = dir.path + "/corpus.txt";
  write_bytes(file, make_text(105000));
  const auto config = CharLMTask({file, 32}).config();
  ASSERT_TRUE(config.contains("vocabulary"));
  // Rebuilt from its config (as from a checkpoint): same vocabulary, fine.
  EXPECT_EQ(make_task(config)->config(), config);
  // The corpus changed: one more distinct byte shifts the token ids.
  write_bytes(file, make_text(105000) + "~");
  EXPECT_ERROR_CONTAINS(make_task(config), "now has a vocabulary of",
                        "token ids would name other characters");
  // A config without it (older checkpoints) still loads.
  auto old = config;
  old.erase("vocabulary");
  EXPECT_NO_THROW(make_task(old));
}

// ---- trained models -------------------------------------------------------------------

TEST(TrainedModel, DigitsRoundTripAndRecurrentEqualsBatch) {
  REQUIRE_DIGITS(path);
  TempDir dir;
  auto c =
      tiny_lm_config({{"name", "digits"}, {"path", path}, {"conditional", true}}, "causal-linear");
  Trainer trainer(c);
  trainer.run(dir.path);
  auto trained = load_trained_model(dir.path);
  EXPECT_EQ(trained.step, 5);
  EXPECT_EQ(trained.task->name(), "digits");
  auto want = state_tensors(trainer.model()), got = state_tensors(*trained.model);
  ASSERT_EQ(want.size(), got.size());
  for (const auto& [name, t] : want) EXPECT_TRUE(torch::equal(t, got.at(name))) << name;

  SampleOptions o;
  o.count = 3;
  o.greedy = true;
  o.label = 4;
  auto rec = sample_digits(trained, o);
  EXPECT_TRUE(rec.recurrent);
  ASSERT_EQ(rec.tokens.sizes(), (std::vector<int64_t>{3, 64}));
  EXPECT_TRUE(torch::equal(rec.labels, torch::full({3}, 4, torch::kLong)));
  EXPECT_GE(rec.tokens.min().item<int64_t>(), 0);
  EXPECT_LE(rec.tokens.max().item<int64_t>(), 16);
  o.recurrent = false;
  auto batch = sample_digits(trained, o);
  EXPECT_FALSE(batch.recurrent);
  EXPECT_TRUE(torch::equal(rec.tokens, batch.tokens));

  // Sampling: the same seed gives the same images.
  o.greedy = false;
  o.recurrent = true;
  o.label.reset();
  o.seed = 11;
  auto s1 = sample_digits(trained, o), s2 = sample_digits(trained, o);
  EXPECT_TRUE(torch::equal(s1.tokens, s2.tokens));
  EXPECT_TRUE(torch::equal(s1.labels, s2.labels));
  const auto ascii = digit_ascii(s1.tokens[0]);
  EXPECT_EQ(std::count(ascii.begin(), ascii.end(), '\n'), 8);
  const auto pgm = digits_pgm(s1.tokens, 2);
  EXPECT_EQ(pgm.rfind("P5\n", 0), 0u);
  o.label = 10;
  EXPECT_ERROR_CONTAINS(sample_digits(trained, o), "label must be in [0, 9]");

  // The task type's generator: --label and --pgm, the images side by side.
  GenerateRequest request;
  request.options = o;
  request.options.label.reset();
  request.values = {{"label", 4}, {"pgm", dir.path + "/d.pgm"}};
  const auto g = find_task_type("digits")->generator.run(trained, request);
  EXPECT_EQ(g.unit, "images");
  EXPECT_TRUE(torch::equal(g.result.labels, torch::full({3}, 4, torch::kLong)));
  std::string first_line;
  for (int64_t i = 0; i < 3; ++i)
    first_line += digit_ascii(g.result.tokens[i]).substr(0, 16) + "  ";
  EXPECT_EQ(g.text.substr(0, first_line.size() + 1), first_line + "\n");
  EXPECT_NE(g.text.find("\nlabels: 4,4,4\n"), std::string::npos) << g.text;
  EXPECT_EQ(g.record.at("labels"), (std::vector<int64_t>{4, 4, 4}));
  std::ifstream f(dir.path + "/d.pgm", std::ios::binary);
  const std::string written((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  EXPECT_EQ(written, digits_pgm(g.result.tokens));
  ASSERT_EQ(g.notes.size(), 1u);
  request.values = {{"pgm", dir.path + "/missing/d.pgm"}};
  EXPECT_ERROR_CONTAINS(find_task_type("digits")->generator.run(trained, request),
                        "cannot write --pgm file");
}

TEST(TrainedModel, CharLMRoundTripWithFullAttention) {
  TempDir dir;
  const std::string file = dir.path + "/corpus.txt";
  write_bytes(file, make_text(105000));
  auto c = tiny_lm_config({{"name", "charlm"}, {"path", file}, {"length", 32}}, "full");
  Trainer trainer(c);
  trainer.run(dir.path + "/ckpt");
  auto trained = load_trained_model(dir.path + "/ckpt");
  const auto& task = dynamic_cast<const CharLMTask&>(*trained.task);
  SampleOptions o;
  o.count = 2;
  o.greedy = true;
  auto r = sample_text(trained, "the ", 12, o);
  EXPECT_TRUE(r.recurrent);
  ASSERT_EQ(r.tokens.sizes(), (std::vector<int64_t>{2, 16}));
  EXPECT_EQ(task.decode(r.tokens[0]).substr(0, 4), "the ");
  o.recurrent = false;
  EXPECT_TRUE(torch::equal(sample_text(trained, "the ", 12, o).tokens, r.tokens));
  EXPECT_ERROR_CONTAINS(sample_text(trained, "", 3, o), "at least one character");
  EXPECT_ERROR_CONTAINS(sample_digits(trained, o), "not digits");
  // The task type's generator (`fastattn generate --checkpoint`): the same
  // samples, rendered, with its own flags' values and its --json fields.
  GenerateRequest request;
  request.options = o;
  request.values = {{"prompt", "the "}, {"max_new_tokens", 12}};
  const auto g = find_task_type("charlm")->generator.run(trained, request);
  EXPECT_TRUE(torch::equal(g.result.tokens, r.tokens));
  EXPECT_EQ(g.unit, "sequences");
  EXPECT_EQ(g.text, "---- sample 1\n" + task.decode(r.tokens[0]) + "\n---- sample 2\n" +
                        task.decode(r.tokens[1]) + "\n");
  EXPECT_EQ(g.record.at("new_tokens"), 12);
  EXPECT_GT(g.record.at("tokens_per_second").get<double>(), 0.0);
  request.values = {{"max_new_tokens", -1}};
  EXPECT_ERROR_CONTAINS(find_task_type("charlm")->generator.run(trained, request),
                        "--max-new-tokens must be >= 0, got -1");
  EXPECT_GT(trainer.evaluate()["bits_per_char"].get<double>(), 0.0);
}

TEST(TrainedModel, MissingCheckpointIsAnError) {
  TempDir dir;
  EXPECT_ERROR_CONTAINS(load_trained_model(dir.path), "model.safetensors");
}

// ---- time budget ------------------------------------------------------------------------

TEST(TimeBudget, StopsEarlyAndResumesTheSameBudget) {
  TempDir dir;
  const std::string file = dir.path + "/corpus.txt";
  write_bytes(file, make_text(105000));
  auto c = tiny_lm_config({{"name", "charlm"}, {"path", file}, {"length", 16}}, "causal-linear");
  c.steps = 100000;
  c.time_budget = 0.3;
  Trainer trainer(c);
  trainer.run(dir.path + "/ckpt");
  EXPECT_LT(trainer.step(), c.steps);
  EXPECT_GE(trainer.train_seconds(), 0.3);
  // The budget is spent: a resumed run with the same budget does no step.
  Trainer resumed(c);
  resumed.load_checkpoint(dir.path + "/ckpt");
  EXPECT_NEAR(resumed.train_seconds(), trainer.train_seconds(), 1e-3);
  const int64_t at = resumed.step();
  resumed.run();
  EXPECT_EQ(resumed.step(), at);
  EXPECT_ERROR_CONTAINS(Trainer([&] {
                          auto bad = c;
                          bad.time_budget = -1;
                          return bad;
                        }()),
                        "time_budget must be >= 0");
}
