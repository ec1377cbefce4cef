// Tests of the WordPiece tokenizer, the BERT encoder and its weight loading,
// sentence embeddings and the approximation experiment's helpers.
//   ./build/fastattn_tests --gtest_filter='WordPiece*:Bert*:Approx*:MiniLM*'
// MiniLM* tests need the real model (scripts/fetch_minilm.sh; CTest runs it
// first when the network allows) and skip with a message when it is absent.
// They compare with tests/reference/minilm_reference.py (run with
// /usr/bin/python3: independent tokenizer from unicodedata, float64 forward
// in plain torch ops).
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <torch/torch.h>

#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>

#include "expect_error.h"
#include "temp_files.h"
#include "fastattn/experiments/approx.h"
#include "fastattn/experiments/bert.h"
#include "fastattn/safetensors.h"
#include "fastattn/experiments/wordpiece.h"

using namespace fastattn;

namespace {

using fastattn::testing::TempDir;

bool file_exists(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0;
}

std::vector<std::string> hf_test_vocab() {
  return {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "want", "##want", "##ed", "wa", "un",
          "runn",  "##ing", ",",     "a",     "##a",  "hello",  "!",    "e",  "cafe"};
}

}  // namespace

// ---- tokenizer (no model needed) -----------------------------------------------------

TEST(WordPieceTest, BasicTokenizerLowerCasesSplitsPunctuationAndStripsAccents) {
  WordPieceTokenizer tok(hf_test_vocab());
  using V = std::vector<std::string>;
  EXPECT_EQ(tok.basic_tokenize(" \tHeLLo!how  \n Are yoU?  "),
            (V{"hello", "!", "how", "are", "you", "?"}));
  EXPECT_EQ(tok.basic_tokenize("H\xC3\xA4LLo!how  \n Are yoU?  "),  // HäLLo
            (V{"hallo", "!", "how", "are", "you", "?"}));
  // Crème Brûlée, naïve, Ångström, Ø (no decomposition: kept), ß (kept).
  EXPECT_EQ(tok.basic_tokenize("Cr\xC3\xA8me Br\xC3\xBBl\xC3\xA9"
                               "e na\xC3\xAFve \xC3\x85ngstr\xC3\xB6m"),
            (V{"creme", "brulee", "naive", "angstrom"}));
  EXPECT_EQ(tok.basic_tokenize("\xC3\x98l stra\xC3\x9F"
                               "e"),
            (V{"\xC3\xB8l",
               "stra\xC3\x9F"
               "e"}));
  // An already decomposed accent (e + U+0301) loses its mark too.
  EXPECT_EQ(tok.basic_tokenize("e\xCC\x81t\xCC\x81"), (V{"et"}));
  // CJK ideographs become words of their own.
  EXPECT_EQ(tok.basic_tokenize("ah\xE5\x8D\x9A\xE6\x8E\xA8zz"),
            (V{"ah", "\xE5\x8D\x9A", "\xE6\x8E\xA8", "zz"}));
  // Control characters (BEL, zero-width space Cf, NUL) vanish; NBSP and
  // U+2028 separate words.
  EXPECT_EQ(tok.basic_tokenize(std::string("a\x07"
                                           "b\xE2\x80\x8B"
                                           "c",
                                           8) +
                               std::string(1, '\0') +
                               "d e\xC2\xA0"
                               "f\xE2\x80\xA8g"),
            (V{"abcd", "e", "f", "g"}));
  // Punctuation: ASCII symbols (incl. $ ^ ` which are not category P) and
  // Unicode P* (left double quotation mark, em dash).
  EXPECT_EQ(tok.basic_tokenize("$5^x`y \xE2\x80\x9Chi\xE2\x80\x94there"),
            (V{"$", "5", "^", "x", "`", "y", "\xE2\x80\x9C", "hi", "\xE2\x80\x94", "there"}));
  // Hangul syllables decompose to jamo (han -> U+1112 U+1161 U+11AB).
  EXPECT_EQ(tok.basic_tokenize("\xED\x95\x9C"), (V{"\xE1\x84\x92\xE1\x85\xA1\xE1\x86\xAB"}));
  // Invalid UTF-8 becomes U+FFFD, which the clean-up drops.
  EXPECT_EQ(tok.basic_tokenize("ab\xFF"
                               "cd \xC3"),
            (V{"abcd"}));
  // Greek capitals lower-case; Cyrillic too.
  EXPECT_EQ(tok.basic_tokenize("\xCE\x91\xCE\x92 \xD0\x96"), (V{"\xCE\xB1\xCE\xB2", "\xD0\xB6"}));
}

TEST(WordPieceTest, GreedyLongestMatchPieces) {
  WordPieceTokenizer tok(hf_test_vocab());
  using V = std::vector<std::string>;
  // Hugging Face's own example for this vocabulary.
  EXPECT_EQ(tok.tokenize("UNwant\xC3\xA9"
                         "d,running"),
            (V{"un", "##want", "##ed", ",", "runn", "##ing"}));
  EXPECT_EQ(tok.tokenize("unwantedX running"), (V{"[UNK]", "runn", "##ing"}));
  EXPECT_EQ(tok.tokenize(""), V{});
  EXPECT_EQ(tok.tokenize(" \n\t "), V{});
  EXPECT_EQ(tok.tokenize("Caf\xC3\xA9!"), (V{"cafe", "!"}));
  // A word of exactly max_chars_per_word (100) characters is split; one more
  // character makes it [UNK].
  const auto w100 = tok.tokenize(std::string(100, 'a'));
  ASSERT_EQ(w100.size(), 100u);
  EXPECT_EQ(w100[0], "a");
  EXPECT_EQ(w100[99], "##a");
  EXPECT_EQ(tok.tokenize(std::string(101, 'a') + " hello"), (V{"[UNK]", "hello"}));
}

TEST(WordPieceTest, EncodeAddsSpecialTokensAndReportsTruncation) {
  WordPieceOptions o;
  o.max_length = 5;
  WordPieceTokenizer tok(hf_test_vocab(), o);
  auto e = tok.encode("hello");
  EXPECT_EQ(e.ids, (std::vector<int64_t>{2, 14, 3}));
  EXPECT_EQ(e.truncated, 0);
  e = tok.encode("hello , hello ! a a");  // 6 pieces, 3 fit
  EXPECT_EQ(e.ids, (std::vector<int64_t>{2, 14, 11, 14, 3}));
  EXPECT_EQ(e.truncated, 3);
  e = tok.encode("");
  EXPECT_EQ(e.ids, (std::vector<int64_t>{2, 3}));
}

TEST(WordPieceTest, RejectsBadVocabularies) {
  EXPECT_ERROR_CONTAINS(WordPieceTokenizer({"[UNK]", "[CLS]", "[SEP]"}), "[PAD]",
                        "not in the vocabulary");
  EXPECT_ERROR_CONTAINS(WordPieceTokenizer({"[UNK]", "a", "a"}), "line 3", "'a'", "twice");
  EXPECT_ERROR_CONTAINS(WordPieceTokenizer({"[UNK]", ""}), "line 2", "empty");
  EXPECT_ERROR_CONTAINS(WordPieceTokenizer::from_file("/nonexistent/vocab.txt"),
                        "/nonexistent/vocab.txt", "cannot open");
  // A file's own faults name the file and the line.
  fastattn::testing::TempDir dir("wordpiece");
  const std::string vocab = dir.path + "/vocab.txt";
  fastattn::testing::write_bytes(vocab, "[UNK]\na\na\n");
  EXPECT_ERROR_CONTAINS(WordPieceTokenizer::from_file(vocab), vocab.c_str(), "line 3", "twice");
  WordPieceOptions o;
  o.max_length = 1;
  EXPECT_ERROR_CONTAINS(WordPieceTokenizer(hf_test_vocab(), o), "max_length", ">= 2");
}

TEST(WordPieceTest, Utf8RoundTrip) {
  const std::u32string s = {U'a', 0xE9, 0x4E2D, 0x1F600, 0x10FFFF};
  EXPECT_EQ(utf8_decode(utf8_encode(s)), s);
  // Overlong "/" (C0 AF), a surrogate (ED A0 80), a lone continuation byte.
  EXPECT_EQ(utf8_decode("\xC0\xAF"
                        "x\xED\xA0\x80"
                        "y\x80"),
            (std::u32string{0xFFFD, U'x', 0xFFFD, U'y', 0xFFFD}));
}

// Expected words, pieces and ids in the tests below were produced by Hugging Face
// transformers 5.24.0's pure-Python BERT tokenizer (BertTokenizerLegacy, the
// BertTokenizer of 4.x; do_lower_case=True) under Python 3.11 (Unicode 14.0).

namespace {

// hf_test_vocab() and what the special-token and sigma tests need.
std::vector<std::string> parity_test_vocab() {
  auto v = hf_test_vocab();  // ids 0-17 unchanged
  for (const char* t :
       {"[MASK]", "[", "]", "sep", "mask", "x", "world", "\xCE\xB1" /* α */, "##\xCF\x83" /* ##σ */,
        "##\xCF\x82" /* ##ς */, "\xCF\x83" /* σ */, "\xCF\x82" /* ς */})
    v.push_back(t);
  return v;
}

}  // namespace

TEST(WordPieceTest, CapitalSigmaLowerCasesAsPythonDoes) {
  WordPieceTokenizer tok(parity_test_vocab());
  using V = std::vector<std::string>;
  // ΟΔΥΣΣΕΥΣ ΑΣ. ΑΣ.Β ΣΑ Σ: final sigma at the end of a word, also before
  // case-ignorable punctuation ('.'), not before a letter or alone.
  EXPECT_EQ(
      tok.basic_tokenize("\xCE\x9F\xCE\x94\xCE\xA5\xCE\xA3\xCE\xA3\xCE\x95\xCE\xA5\xCE\xA3 "
                         "\xCE\x91\xCE\xA3. \xCE\x91\xCE\xA3.\xCE\x92 \xCE\xA3\xCE\x91 \xCE\xA3"),
      (V{"\xCE\xBF\xCE\xB4\xCF\x85\xCF\x83\xCF\x83\xCE\xB5\xCF\x85\xCF\x82", "\xCE\xB1\xCF\x82",
         ".", "\xCE\xB1\xCF\x83", ".", "\xCE\xB2", "\xCF\x83\xCE\xB1", "\xCF\x83"}));
  // Α'Σ Σ'Α ΑΣ' ΑΣ-Β 1Σ ΑΣ1: the apostrophe is case-ignorable, '-' and
  // digits are not, and a digit is not cased.
  EXPECT_EQ(tok.basic_tokenize("\xCE\x91'\xCE\xA3 \xCE\xA3'\xCE\x91 \xCE\x91\xCE\xA3' "
                               "\xCE\x91\xCE\xA3-\xCE\x92 1\xCE\xA3 \xCE\x91\xCE\xA3"
                               "1"),
            (V{"\xCE\xB1", "'", "\xCF\x82", "\xCF\x83", "'", "\xCE\xB1", "\xCE\xB1\xCF\x82", "'",
               "\xCE\xB1\xCF\x82", "-", "\xCE\xB2", "1\xCF\x83",
               "\xCE\xB1\xCF\x82"
               "1"}));
  // Ά+U+0301 Σ, Α+soft hyphen+Σ (dropped by the clean-up first), ΑΣ·Β (middle
  // dot: case-ignorable punctuation), ʰΣ (modifier letter: case-ignorable,
  // so nothing cased before), ⒶΣ (circled A: cased, category So).
  EXPECT_EQ(
      tok.basic_tokenize("\xCE\x86\xCC\x81\xCE\xA3 \xCE\x91\xC2\xAD\xCE\xA3 "
                         "\xCE\x91\xCE\xA3\xC2\xB7\xCE\x92 \xCA\xB0\xCE\xA3 \xE2\x92\xB6\xCE\xA3"),
      (V{"\xCE\xB1\xCF\x82", "\xCE\xB1\xCF\x82", "\xCE\xB1\xCF\x83", "\xC2\xB7", "\xCE\xB2",
         "\xCA\xB0\xCF\x83", "\xE2\x93\x90\xCF\x82"}));
  // ΑΣ[SEP]Β ΑΣ中 ΣΣ ΌΣΟΣ: a special token and a CJK ideograph end the
  // word the sigma's context is read in.
  EXPECT_EQ(tok.basic_tokenize("\xCE\x91\xCE\xA3[SEP]\xCE\x92 \xCE\x91\xCE\xA3\xE4\xB8\xAD "
                               "\xCE\xA3\xCE\xA3 \xCE\x8C\xCE\xA3\xCE\x9F\xCE\xA3"),
            (V{"\xCE\xB1\xCF\x82", "[SEP]", "\xCE\xB2", "\xCE\xB1\xCF\x82", "\xE4\xB8\xAD",
               "\xCF\x83\xCF\x82", "\xCE\xBF\xCF\x83\xCE\xBF\xCF\x82"}));
  // ΑΣ ΑΣΣ Σ: the pieces and ids.
  EXPECT_EQ(tok.tokenize("\xCE\x91\xCE\xA3 \xCE\x91\xCE\xA3\xCE\xA3 \xCE\xA3"),
            (V{"\xCE\xB1", "##\xCF\x82", "\xCE\xB1", "##\xCF\x83", "##\xCF\x82", "\xCF\x83"}));
  EXPECT_EQ(tok.encode("\xCE\x91\xCE\xA3 \xCE\x91\xCE\xA3\xCE\xA3 \xCE\xA3").ids,
            (std::vector<int64_t>{2, 25, 27, 25, 26, 27, 28, 3}));
  // final_sigma = false: sigma everywhere (Hugging Face's Rust tokenizer).
  WordPieceOptions o;
  o.final_sigma = false;
  WordPieceTokenizer rust_like(parity_test_vocab(), o);
  EXPECT_EQ(rust_like.basic_tokenize("\xCE\x9F\xCE\xA3 \xCE\x91\xCE\xA3."),
            (V{"\xCE\xBF\xCF\x83", "\xCE\xB1\xCF\x83", "."}));
  // Without lower-casing the capital stays.
  o.lower_case = false;
  o.final_sigma = true;
  EXPECT_EQ(WordPieceTokenizer(parity_test_vocab(), o).basic_tokenize("\xCE\x91\xCE\xA3"),
            (V{"\xCE\x91\xCE\xA3"}));
}

TEST(WordPieceTest, SpecialTokensWrittenInTheTextStayWhole) {
  WordPieceTokenizer tok(parity_test_vocab());
  using V = std::vector<std::string>;
  using Ids = std::vector<int64_t>;
  EXPECT_EQ(tok.mask_id(), 18);
  EXPECT_EQ(tok.tokenize("hello[SEP]world [MASK] x[mask]!"),
            (V{"hello", "[SEP]", "world", "[MASK]", "x", "[", "mask", "]", "!"}));
  EXPECT_EQ(tok.encode("hello[SEP]world [MASK] x[mask]!").ids,
            (Ids{2, 14, 3, 24, 18, 23, 19, 22, 20, 15, 3}));
  EXPECT_EQ(tok.tokenize("[CLS][PAD] [UNK] [SEP ] [[SEP]]"),
            (V{"[CLS]", "[PAD]", "[UNK]", "[", "sep", "]", "[", "[SEP]", "]"}));
  EXPECT_EQ(tok.encode("[CLS][PAD] [UNK] [SEP ] [[SEP]]").ids,
            (Ids{2, 2, 0, 1, 19, 21, 20, 19, 3, 20, 3}));
  // Case-sensitive; a special token ends the word before it (ΑΣ -> ας).
  EXPECT_EQ(tok.tokenize("[Sep] [sep] [MASK [SEP]\xCE\x91\xCE\xA3[SEP]"),
            (V{"[", "sep", "]", "[", "sep", "]", "[", "mask", "[SEP]", "\xCE\xB1", "##\xCF\x82",
               "[SEP]"}));
  EXPECT_EQ(tok.encode("[Sep] [sep] [MASK [SEP]\xCE\x91\xCE\xA3[SEP]").ids,
            (Ids{2, 19, 21, 20, 19, 21, 20, 19, 22, 3, 25, 27, 3, 3}));
  // Matched in the raw text, before the clean-up: cafe+U+0301 [MASK] NUL
  // [SEP] ideographic space, NEL (a control character), x.
  const std::string raw = std::string("cafe\xCC\x81[MASK]") + '\0' +
                          "[SEP]\xE3\x80\x80\xC2\x85"
                          "x";
  EXPECT_EQ(tok.tokenize(raw), (V{"cafe", "[MASK]", "[SEP]", "x"}));
  EXPECT_EQ(tok.encode(raw).ids, (Ids{2, 17, 18, 3, 23, 3}));
  EXPECT_EQ(tok.basic_tokenize("a[UNK]b"), (V{"a", "[UNK]", "b"}));
  // Truncation counts a special token as one piece.
  WordPieceOptions o;
  o.max_length = 4;
  const auto e = WordPieceTokenizer(parity_test_vocab(), o).encode("[MASK][MASK] x");
  EXPECT_EQ(e.ids, (Ids{2, 18, 18, 3}));
  EXPECT_EQ(e.truncated, 1);
  // split_special_tokens = true: written special tokens are plain text.
  o = WordPieceOptions();
  o.split_special_tokens = true;
  EXPECT_EQ(WordPieceTokenizer(parity_test_vocab(), o).tokenize("x[SEP]x"),
            (V{"x", "[", "sep", "]", "x"}));
  // A vocabulary without [MASK]: it is not special (Hugging Face would append
  // it to the vocabulary as a new token).
  WordPieceTokenizer no_mask(hf_test_vocab());
  EXPECT_EQ(no_mask.mask_id(), -1);
  EXPECT_EQ(no_mask.basic_tokenize("[MASK][SEP]"), (V{"[", "mask", "]", "[SEP]"}));
  // Other special tokens: the longest match at the leftmost position (as
  // Hugging Face's added-token trie, with "<s>" and "<s></s>" added).
  o = WordPieceOptions();
  o.cls_token = "<s>";
  o.sep_token = "<s></s>";
  WordPieceTokenizer custom({"[PAD]", "[UNK]", "<s>", "<s></s>", "a"}, o);
  EXPECT_EQ(custom.tokenize("a<s></s>a<s>a</s>"),
            (V{"a", "<s></s>", "a", "<s>", "a", "[UNK]", "[UNK]", "[UNK]", "[UNK]"}));
}

// The whole comparison that scripts/tokenizer_parity.py prepares (thousands of
// texts, optionally every code point); skipped unless FASTATTN_TOKENIZER_PARITY
// names its output.
TEST(WordPieceTest, MatchesParityFile) {
  const char* path = std::getenv("FASTATTN_TOKENIZER_PARITY");
  if (!path || !*path)
    GTEST_SKIP() << "set FASTATTN_TOKENIZER_PARITY to the output of scripts/tokenizer_parity.py";
  std::ifstream in(path);
  ASSERT_TRUE(in) << path;
  const auto j = nlohmann::json::parse(in);
  WordPieceOptions o;
  o.max_length = std::numeric_limits<int32_t>::max();  // Hugging Face does not truncate
  const auto tok = WordPieceTokenizer::from_file(j.at("vocab").get<std::string>(), o);
  size_t differ = 0;
  const auto& cases = j.at("cases");
  for (const auto& c : cases) {
    const auto text = c.at("text").get<std::string>();
    const auto want = c.at("ids").get<std::vector<int64_t>>();
    const auto got = tok.encode(text).ids;
    if (got != want && ++differ <= 20) {
      ADD_FAILURE() << "text " << nlohmann::json(text).dump() << "\n  Hugging Face "
                    << nlohmann::json(want).dump() << "\n  fastattn     "
                    << nlohmann::json(got).dump();
    }
  }
  EXPECT_EQ(differ, 0u);
  std::cout << "[          ] compared " << cases.size() << " texts with "
            << j.value("tokenizer", std::string("?")) << " (transformers "
            << j.value("transformers", std::string("?")) << ", Unicode "
            << j.value("unicode", std::string("?")) << "): " << differ << " differ\n";
}

// ---- BERT encoder (random weights) ------------------------------------------------------

namespace {

BertConfig tiny_config() {
  BertConfig c;
  c.vocab_size = 50;
  c.hidden_size = 24;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 3;
  c.intermediate_size = 40;
  c.max_position_embeddings = 64;
  return c;
}

// The same forward in plain ATen ops, one unpadded sequence (L,) -> (L, D).
torch::Tensor reference_forward(BertEncoderImpl& m, const torch::Tensor& ids) {
  auto W = state_tensors(m);
  const auto& c = m.config();
  const int64_t L = ids.size(0), D = c.hidden_size, H = c.num_attention_heads, E = D / H;
  auto ln = [&](const torch::Tensor& x, const std::string& p) {
    auto mu = x.mean(-1, true);
    auto var = (x - mu).pow(2).mean(-1, true);
    return (x - mu) / (var + c.layer_norm_eps).sqrt() * W.at(p + ".weight") + W.at(p + ".bias");
  };
  auto lin = [&](const torch::Tensor& x, const std::string& p) {
    return x.matmul(W.at(p + ".weight").t()) + W.at(p + ".bias");
  };
  auto x = W.at("embeddings.word_embeddings.weight").index_select(0, ids) +
           W.at("embeddings.position_embeddings.weight").slice(0, 0, L) +
           W.at("embeddings.token_type_embeddings.weight")[0];
  x = ln(x, "embeddings.LayerNorm");
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string p = "encoder.layer." + std::to_string(i) + ".";
    auto q = lin(x, p + "attention.self.query").view({L, H, E}).transpose(0, 1);
    auto k = lin(x, p + "attention.self.key").view({L, H, E}).transpose(0, 1);
    auto v = lin(x, p + "attention.self.value").view({L, H, E}).transpose(0, 1);
    auto a = torch::softmax(q.matmul(k.transpose(1, 2)) / std::sqrt(double(E)), -1).matmul(v);
    a = a.transpose(0, 1).reshape({L, D});
    x = ln(lin(a, p + "attention.output.dense") + x, p + "attention.output.LayerNorm");
    auto h = lin(x, p + "intermediate.dense");
    h = 0.5 * h * (1.0 + torch::erf(h / std::sqrt(2.0)));
    x = ln(lin(h, p + "output.dense") + x, p + "output.LayerNorm");
  }
  return x;
}

}  // namespace

TEST(BertTest, HuggingFaceParameterNames) {
  BertEncoder m(tiny_config());
  const auto names = state_tensors(*m);
  for (const char* n :
       {"embeddings.word_embeddings.weight", "embeddings.position_embeddings.weight",
        "embeddings.token_type_embeddings.weight", "embeddings.LayerNorm.weight",
        "encoder.layer.0.attention.self.query.weight", "encoder.layer.1.attention.self.value.bias",
        "encoder.layer.0.attention.output.dense.weight",
        "encoder.layer.0.attention.output.LayerNorm.bias",
        "encoder.layer.1.intermediate.dense.weight", "encoder.layer.1.output.dense.bias",
        "encoder.layer.1.output.LayerNorm.weight"}) {
    EXPECT_TRUE(names.count(n)) << n;
  }
  EXPECT_EQ(names.size(), 5u + 2 * 16u);  // embeddings: 3 tables + LayerNorm
}

TEST(BertTest, PaddedBatchMatchesPlainAtenReferenceInFloat64) {
  torch::manual_seed(3);
  BertEncoder m(tiny_config());
  m->to(torch::kDouble);
  m->eval();
  const std::vector<int64_t> lens = {17, 5, 1};
  auto ids = torch::randint(0, 50, {3, 17}, torch::kLong);
  torch::NoGradGuard g;
  auto out = m->forward(ids, torch::tensor(lens));  // (3, 17, 24)
  for (int64_t b = 0; b < 3; ++b) {
    auto ref = reference_forward(*m, ids[b].slice(0, 0, lens[b]));
    EXPECT_TRUE(torch::allclose(out[b].slice(0, 0, lens[b]), ref, 1e-10, 1e-10)) << "row " << b;
    // Padding does not leak: the row alone gives the same.
    auto alone = m->forward(ids[b].slice(0, 0, lens[b]).unsqueeze(0), torch::tensor({lens[b]}));
    EXPECT_TRUE(torch::allclose(alone[0], ref, 1e-10, 1e-10)) << "row " << b;
  }
  // Pooling: the mean over the valid rows, unit norm.
  auto e = mean_pool_normalize(out, torch::tensor(lens));
  auto mean1 = out[1].slice(0, 0, 5).mean(0);
  EXPECT_TRUE(torch::allclose(e[1], mean1 / mean1.norm(), 1e-12, 1e-12));
  EXPECT_NEAR(e.norm(2, 1).sub(1).abs().max().item<double>(), 0.0, 1e-12);
}

TEST(BertTest, ImprovedClusteredWithTopkOfAllKeysEqualsFull) {
  torch::manual_seed(4);
  BertEncoder m(tiny_config());
  m->to(torch::kDouble);
  m->eval();
  auto ids = torch::randint(0, 50, {2, 40}, torch::kLong);
  auto lens = torch::tensor({40, 29});
  torch::NoGradGuard g;
  auto full = m->forward(ids, lens);
  m->set_attention("improved-clustered", {{"clusters", 3}, {"topk", 40}, {"seed", 1}});
  EXPECT_EQ(m->attention_type(), "improved-clustered");
  auto approx = m->forward(ids, lens);
  for (int64_t b = 0; b < 2; ++b) {
    const int64_t L = lens[b].item<int64_t>();
    EXPECT_TRUE(torch::allclose(approx[b].slice(0, 0, L), full[b].slice(0, 0, L), 1e-9, 1e-9));
  }
  // Plain clustered with 3 clusters is an approximation: it differs.
  m->set_attention("clustered", {{"clusters", 3}, {"seed", 1}});
  EXPECT_GT((m->forward(ids, lens) - full).abs().max().item<double>(), 1e-3);
  // A bad type changes nothing.
  EXPECT_ANY_THROW(m->set_attention("no-such-type"));
  EXPECT_EQ(m->attention_type(), "clustered");
}

TEST(BertTest, LoadsWeightsByNameAndRejectsWrongFiles) {
  torch::manual_seed(5);
  TempDir dir;
  BertEncoder a(tiny_config()), b(tiny_config());
  auto tensors = state_tensors(*a);
  tensors["pooler.dense.weight"] = torch::zeros({24, 24});
  tensors["embeddings.position_ids"] = torch::arange(64).unsqueeze(0);
  save_safetensors(dir.path + "/ok.safetensors", tensors);
  const auto report = load_bert_weights(*b, dir.path + "/ok.safetensors");
  EXPECT_EQ(report.ignored.size(), 2u);
  for (const auto& [name, t] : state_tensors(*a)) {
    EXPECT_TRUE(t.equal(state_tensors(*b).at(name))) << name;
  }
  // With a prefix ("bert." as in BertForMaskedLM checkpoints).
  std::map<std::string, torch::Tensor> prefixed;
  for (const auto& [name, t] : state_tensors(*a)) prefixed["bert." + name] = t;
  save_safetensors(dir.path + "/prefixed.safetensors", prefixed);
  EXPECT_NO_THROW(load_bert_weights(*b, dir.path + "/prefixed.safetensors", "bert."));
  EXPECT_ERROR_CONTAINS(load_bert_weights(*b, dir.path + "/prefixed.safetensors"), "missing",
                        "embeddings.LayerNorm.bias");
  // A missing weight, an unknown tensor, a wrong shape.
  auto missing = state_tensors(*a);
  missing.erase("encoder.layer.1.output.dense.weight");
  save_safetensors(dir.path + "/missing.safetensors", missing);
  EXPECT_ERROR_CONTAINS(load_bert_weights(*b, dir.path + "/missing.safetensors"), "missing",
                        "encoder.layer.1.output.dense.weight");
  auto extra = state_tensors(*a);
  extra["cls.predictions.bias"] = torch::zeros({50});
  save_safetensors(dir.path + "/extra.safetensors", extra);
  EXPECT_ERROR_CONTAINS(load_bert_weights(*b, dir.path + "/extra.safetensors"),
                        "not BERT encoder weights", "cls.predictions.bias");
  auto shape = state_tensors(*a);
  shape["embeddings.word_embeddings.weight"] = torch::zeros({51, 24});
  save_safetensors(dir.path + "/shape.safetensors", shape);
  EXPECT_ERROR_CONTAINS(load_bert_weights(*b, dir.path + "/shape.safetensors"),
                        "embeddings.word_embeddings.weight", "shape");
  // A truncated file.
  std::ifstream in(dir.path + "/ok.safetensors", std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::ofstream(dir.path + "/cut.safetensors", std::ios::binary)
      << bytes.substr(0, bytes.size() - 100);
  EXPECT_ERROR_CONTAINS(load_bert_weights(*b, dir.path + "/cut.safetensors"), "cut.safetensors",
                        "truncated");
}

TEST(BertTest, ConfigFromJson) {
  TempDir dir;
  std::ofstream(dir.path + "/c.json") << R"({"hidden_size": 384, "num_attention_heads": 12,
    "num_hidden_layers": 6, "intermediate_size": 1536, "hidden_act": "gelu", "model_type": "bert"})";
  const auto c = BertConfig::from_json_file(dir.path + "/c.json");
  EXPECT_EQ(c.hidden_size, 384);
  EXPECT_EQ(c.num_hidden_layers, 6);
  std::ofstream(dir.path + "/relu.json") << R"({"hidden_act": "relu"})";
  EXPECT_ERROR_CONTAINS(BertConfig::from_json_file(dir.path + "/relu.json"), "hidden_act",
                        "not supported");
  std::ofstream(dir.path + "/heads.json") << R"({"hidden_size": 100, "num_attention_heads": 12})";
  EXPECT_ERROR_CONTAINS(BertConfig::from_json_file(dir.path + "/heads.json"), "divide");
}

// ---- corpus and neighbours ---------------------------------------------------------------

TEST(ApproxTest, ReadsDebianDescriptionsDeterministically) {
  TempDir dir;
  std::ofstream(dir.path + "/T") << "Package: zed\nDescription-md5: 1\nDescription-en: Zed\n"
                                    " one two three four five\n .\n six seven\n\n"
                                    "Package: alpha\nDescription-en: Alpha tool\n"
                                    " a b c d e\n f g\n\n"
                                    "Package: alpha-doc\nDescription-en: Alpha docs\n"
                                    " a b c d e\n f g\n\n"
                                    "Package: short\nDescription-en: Short\n x y\n\n"
                                    "Package: mid\nDescription: Mid (Packages form)\n"
                                    " m1 m2 m3 m4 m5 m6 m7 m8\nHomepage: http://x\n";
  CorpusOptions o;
  o.min_words = 5;
  o.passages = 10;
  auto p = read_debian_descriptions(dir.path + "/T", o);
  ASSERT_EQ(p.size(), 3u);  // sorted by name; alpha-doc repeats alpha; short is too short
  EXPECT_EQ(p[0].package, "alpha");
  EXPECT_EQ(p[0].text, "Alpha tool\na b c d e f g");
  EXPECT_EQ(p[1].package, "mid");
  EXPECT_EQ(p[2].package, "zed");
  EXPECT_EQ(p[2].text, "Zed\none two three four five\nsix seven");
  o.passages = 2;  // evenly spaced: indices 0 and 1 of 3
  p = read_debian_descriptions(dir.path + "/T", o);
  ASSERT_EQ(p.size(), 2u);
  EXPECT_EQ(p[0].package, "alpha");
  EXPECT_EQ(p[1].package, "mid");
  EXPECT_ERROR_CONTAINS(read_debian_descriptions(dir.path + "/none", o), "cannot open");
}

TEST(ApproxTest, NearestNeighbours) {
  auto e = torch::tensor({{1.0, 0.0}, {0.9, 0.1}, {0.0, 1.0}, {0.2, 0.8}});
  e = e / e.norm(2, 1, true);
  auto nn = nearest_neighbours(e, 1);
  EXPECT_TRUE(nn.flatten().equal(torch::tensor({1, 0, 3, 2}).to(torch::kLong)));
  EXPECT_ANY_THROW(nearest_neighbours(e, 4));
}

// ---- the real model ----------------------------------------------------------------------

namespace {

std::string minilm_dir_or_skip_reason(std::string& reason) {
  const auto dir = default_minilm_dir();
  for (const char* f : {"/model.safetensors", "/config.json", "/vocab.txt"}) {
    if (!file_exists(dir + f)) {
      reason = "MiniLM model not found at " + dir +
               " (run scripts/fetch_minilm.sh or set "
               "FASTATTN_MINILM_DIR)";
      return "";
    }
  }
  return dir;
}

#define MINILM_DIR_OR_SKIP(var)                                    \
  std::string skip_reason_;                                        \
  const std::string var = minilm_dir_or_skip_reason(skip_reason_); \
  if (var.empty()) GTEST_SKIP() << skip_reason_

const char* kReferenceScript = FASTATTN_SOURCE_DIR "/tests/reference/minilm_reference.py";

// Runs the Python reference on `strings`; false (with a reason) when
// /usr/bin/python3 with torch is not there.
bool run_reference(const std::string& model_dir, const std::vector<std::string>& strings,
                   int64_t forward, const std::string& dir, SafetensorsFile& out,
                   std::string& reason) {
  if (std::system("/usr/bin/python3 -c 'import torch' >/dev/null 2>&1") != 0) {
    reason = "/usr/bin/python3 with torch (python3-torch) is needed for the reference";
    return false;
  }
  std::ofstream(dir + "/strings.json") << nlohmann::json(strings).dump();
  const std::string cmd = "/usr/bin/python3 '" + std::string(kReferenceScript) + "' '" + model_dir +
                          "' '" + dir + "/strings.json' '" + dir + "/ref.safetensors' --forward " +
                          std::to_string(forward);
  EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
  out = load_safetensors(dir + "/ref.safetensors");
  return true;
}

std::vector<std::string> tricky_strings() {
  return {
      "Hello, world!",
      "The quick brown fox jumps over the lazy dog.",
      "Cr\xC3\xA8me br\xC3\xBBl\xC3\xA9"
      "e at the caf\xC3\xA9 na\xC3\xAFvely",
      "unaffable antidisestablishmentarianism supercalifragilisticexpialidocious",
      "e-mail: someone@example.org; URL https://www.debian.org/~user/index.html?a=1&b=2",
      "C++17, x86_64, libfoo-dev (>= 1.2.3~rc1), 100% [beta] {curly} <angle> #hash",
      std::string(120, 'x') + " after-a-long-word",
      "\xE4\xB8\xAD\xE6\x96\x87\xE5\xAD\x97 mixed with English "
      "\xED\x95\x9C\xEA\xB5\xAD\xEC\x96\xB4",
      "\xC3\x85ngstr\xC3\xB6m \xC5\x81\xC3\xB3\xC5\xBA \xC3\x98resund \xC3\x9F \xC3\xA6 \xC5\x93 "
      "\xC4\xB1 \xC4\xB0stanbul",
      "\xCE\x95\xCE\xBB\xCE\xBB\xCE\xB7\xCE\xBD\xCE\xB9\xCE\xBA\xCE\xAC "
      "\xD0\xA0\xD1\x83\xD1\x81\xD1\x81\xD0\xBA\xD0\xB8\xD0\xB9 "
      "\xD8\xA7\xD9\x84\xD8\xB9\xD8\xB1\xD8\xA8\xD9\x8A\xD8\xA9",
      "tab\there\nnew line\r\nzero\xE2\x80\x8Bwidth non\xC2\xA0"
      "breaking \xE2\x80\x9Cquotes\xE2\x80\x9D \xE2\x80\x94 dash\xE2\x80\xA6",
      "emoji \xF0\x9F\x98\x80 and \xEF\xAC\x81"
      "ligature \xE2\x84\xA2 \xC2\xBD \xE2\x91\xA0",
      "",
      "   ",
      // ΟΔΥΣΣΕΥΣ ΑΣ. ΣΑ: final and non-final sigmas.
      "\xCE\x9F\xCE\x94\xCE\xA5\xCE\xA3\xCE\xA3\xCE\x95\xCE\xA5\xCE\xA3 \xCE\x91\xCE\xA3. "
      "\xCE\xA3\xCE\x91",
      "fill the [MASK] here[SEP]and [mask] [CLS][PAD] [UNK]",
  };
}

}  // namespace

TEST(MiniLMTest, TokenizerMatchesReference) {
  MINILM_DIR_OR_SKIP(dir);
  auto strings = tricky_strings();
  // And real text: Debian descriptions, when the corpus is there.
  if (file_exists(default_corpus_path())) {
    CorpusOptions o;
    o.passages = 300;
    for (const auto& p : read_debian_descriptions(default_corpus_path(), o))
      strings.push_back(p.text);
  }
  WordPieceOptions o;
  o.max_length = 256;
  const auto tok = WordPieceTokenizer::from_file(dir + "/vocab.txt", o);
  EXPECT_EQ(tok.encode("hello world").ids, (std::vector<int64_t>{101, 7592, 2088, 102}));
  TempDir tmp;
  SafetensorsFile ref;
  std::string reason;
  if (!run_reference(dir, strings, 0, tmp.path, ref, reason)) GTEST_SKIP() << reason;
  int64_t truncated = 0;
  for (size_t i = 0; i < strings.size(); ++i) {
    const auto enc = tok.encode(strings[i]);
    truncated += enc.truncated > 0;
    const auto expected = ref.tensors.at("ids." + std::to_string(i));
    const std::vector<int64_t> want(expected.data_ptr<int64_t>(),
                                    expected.data_ptr<int64_t>() + expected.numel());
    EXPECT_EQ(enc.ids, want) << "string " << i << ": " << strings[i].substr(0, 200);
  }
  std::cout << "[          ] compared " << strings.size() << " strings (" << truncated
            << " truncated to 256 tokens)\n";
}

// Token ids of the all-MiniLM-L6-v2 vocabulary from transformers 5.24.0's
// pure-Python BERT tokenizer (BertTokenizerLegacy, do_lower_case=True; Python
// 3.11). The Rust tokenizer (transformers 5.x BertTokenizer) gives other ids
// for the first two (no final sigma) and the tenth (it keeps the unassigned
// U+0378).
TEST(MiniLMTest, TokenizerMatchesHuggingFace) {
  MINILM_DIR_OR_SKIP(dir);
  const auto tok = WordPieceTokenizer::from_file(dir + "/vocab.txt");
  const std::vector<std::pair<std::string, std::vector<int64_t>>> cases = {
      {"\xCE\x9F\xCE\x94\xCE\xA5\xCE\xA3\xCE\xA3\xCE\x95\xCE\xA5\xCE\xA3 \xCE\x9A\xCE\x91\xCE\x99 "
       "\xCE\x8C\xCE\xA3\xCE\x9F\xCE\xA3: \xCE\x91\xCE\xA3. \xCE\x91\xCE\xA3.\xCE\x92 "
       "\xCE\xA3\xCE\x91 \xCE\xA3",
       {101,  1169,  29722, 29735, 29733, 29733, 29723, 29735, 19579,
        1164, 14608, 18199, 1169,  29733, 15297, 1024,  1155,  19579,
        1012, 1155,  29733, 1012,  1156,  1173,  14608, 1173,  102}},
      {"\xCE\x91'\xCE\xA3 \xCE\xA3'\xCE\x91 1\xCE\xA3 \xCE\x91\xCE\xA3-\xCE\x92 "
       "\xCE\x91\xCE\xA3\xC2\xB7\xCE\x92 \xE2\x92\xB6\xCE\xA3",
       {101, 1155, 1005, 1172, 1173, 1005, 1155, 1015, 29733, 1155, 19579, 1011, 1156, 1155, 29733,
        1087, 1156, 100, 102}},
      {"hello[SEP]world [MASK] x[mask] [CLS][PAD] [UNK]!",
       {101, 7592, 102, 2088, 103, 1060, 1031, 7308, 1033, 101, 0, 100, 999, 102}},
      {"[unused1] [SEP ] [[SEP]] a[SEP]b [Sep]",
       {101, 1031, 15171, 2487, 1033, 1031, 19802, 1033, 1031, 102, 1033, 1037, 102, 1038, 1031,
        19802, 1033, 102}},
      {"Cr\xC3\xA8me Br\xC3\xBBl\xC3\xA9"
       "e na\xC3\xAFve \xC3\x85ngstr\xC3\xB6m \xC3\x98l stra\xC3\x9F"
       "e \xE1\xBA\x9E \xC3\xA6 \xC5\x93",
       {101, 13675, 21382, 7987, 9307, 2063, 15743, 17076, 15687, 1100, 2140, 2358, 27807, 1096,
        1097, 1107, 102}},
      {"e\xCC\x81t\xCC\x81 \xE2\x84\xAB \xE2\x84\xA6 \xE2\x84\xAA \xC2\xB5 \xC5\xBF "
       "\xC4\xB0stanbul \xC4\xB1 I\xCC\x87",
       {101, 3802, 1037, 1179, 1047, 1085, 100, 9960, 1104, 1045, 102}},
      {"\xEF\xAC\x81 \xEF\xAC\x82 \xEF\xAC\x80 \xEF\xAC\x83 \xC7\x84 \xC7\x85 \xC5\x89 \xC7\xB0 "
       "\xCE\x90 \xE1\xBE\xBC",
       {101, 1984, 1985, 100, 100, 100, 100, 100, 1046, 1163, 1155, 102}},
      {"\xE4\xB8\xAD\xE6\x96\x87\xE5\xAD\x97 mixed \xED\x95\x9C\xEA\xB5\xAD\xEC\x96\xB4 "
       "\xE3\x81\x82\xE3\x82\xA2 \xEF\xA4\x80 \xF0\xAF\xA0\x80",
       {101, 1746, 1861, 100, 3816, 1469, 30006, 30021, 29991, 30014, 30020, 29999, 30008, 1646,
        30219, 100, 100, 102}},
      {"tab\there\nnew\x0D\nline\x0Bvt\x0C"
       "ff\xC2\x85nel\xC2\xA0nbsp\xE2\x80\xA8ls\xE3\x80\x80ideo\xE2\x80\xAFnnbsp",
       {101,  21628, 2182, 2047, 2240, 2615, 24475, 2546,  11877, 1050,
        5910, 2361,  1048, 2015, 8909, 8780, 1050,  27698, 13102, 102}},
      {"zero\xE2\x80\x8Bwidth\xE2\x80\x8Djoiner\xEF\xBB\xBF"
       "bom\xC2\xADsoft\x07"
       "bel\x7F"
       "del\xEF\xBF\xBDrep\xEE\x80\x80pua\xCD\xB8",
       {101, 5717, 9148, 11927, 2232, 5558, 26455, 5092, 5244, 15794, 8671, 9247, 2890, 9397, 6692,
        102}},
      {"emoji \xF0\x9F\x98\x80 \xF0\x9F\x91\x8D\xF0\x9F\x8F\xBD "
       "\xF0\x9F\x91\xA8\xE2\x80\x8D\xF0\x9F\x91\xA9 \xF0\x9F\x87\xAB\xF0\x9F\x87\xB7 "
       "\xE2\x9D\xA4\xEF\xB8\x8F",
       {101, 7861, 29147, 2072, 100, 100, 100, 100, 100, 102}},
      {"\xE2\x80\x9Cquotes\xE2\x80\x9D \xE2\x80\x94 dash\xE2\x80\xA6 \xC2\xAB\xC2\xBB "
       "\xC2\xBF\xC2\xA1 \xE3\x80\x81\xE3\x80\x82 $5^x`y \xE2\x82\xAC\xC2\xA3 \xE2\x84\xA2 "
       "\xC2\xBD \xE2\x91\xA0",
       {101,  1523, 16614, 1524, 1517, 11454, 1529, 1077,  1090, 1094, 1067, 1635, 1636,
        1002, 1019, 1034,  1060, 1036, 1061,  1574, 29646, 1580, 1092, 100,  102}},
      {"\xE0\xA4\x95\xE0\xA4\xBE \xE0\xA5\x98 \xE0\xB8\x81\xE0\xB8\xB1\xE0\xB9\x88 "
       "\xD7\xA9\xD6\xB8\xD7\x81 \xD9\x85\xD9\x8E\xD8\xB1\xD8\xAD\xD8\xA8\xD9\x8B\xD8\xA7",
       {101, 1315, 29876, 1315, 1409, 1266, 1295, 17149, 29820, 29816, 25573, 102}},
  };
  for (const auto& [text, ids] : cases) EXPECT_EQ(tok.encode(text).ids, ids) << text;
  // Words of 100 and 101 code points (the second is [UNK]), and one of 101
  // once its accents are stripped.
  std::string long_e;
  for (int i = 0; i < 101; ++i) long_e += "e\xCC\x81";
  std::vector<int64_t> want = {101, 22038};  // xx ##xx ... ##xx
  want.insert(want.end(), 49, 20348);
  want.insert(want.end(), {100, 100, 102});
  EXPECT_EQ(tok.encode(std::string(100, 'x') + " " + std::string(101, 'x') + " " + long_e).ids,
            want);
}

TEST(MiniLMTest, EncoderMatchesFloat64Reference) {
  MINILM_DIR_OR_SKIP(dir);
  const std::vector<std::string> sentences = {
      "A man is eating food.",
      "The new movie is awesome and I would watch it again with my friends this weekend.",
      "Debian is a free operating system.", tricky_strings()[4]};
  TempDir tmp;
  SafetensorsFile ref;
  std::string reason;
  if (!run_reference(dir, sentences, static_cast<int64_t>(sentences.size()), tmp.path, ref, reason))
    GTEST_SKIP() << reason;
  SentenceEncoder enc(dir);
  const auto encodings = enc.encode(sentences);
  // float32 model, batched: embeddings to float32 tolerance.
  const auto e32 = enc.embed(encodings, 3);
  // float64 model: hidden states and embeddings tightly.
  enc.model()->to(torch::kDouble);
  const int64_t N = static_cast<int64_t>(sentences.size());
  int64_t L = 0;
  for (const auto& e : encodings) L = std::max<int64_t>(L, static_cast<int64_t>(e.ids.size()));
  auto ids = torch::zeros({N, L}, torch::kLong);
  auto lens = torch::empty({N}, torch::kLong);
  for (int64_t i = 0; i < N; ++i) {
    const auto& v = encodings[static_cast<size_t>(i)].ids;
    lens[i] = static_cast<int64_t>(v.size());
    ids[i].slice(0, 0, lens[i].item<int64_t>()) = torch::tensor(v);
  }
  torch::NoGradGuard g;
  const auto hidden = enc.model()->forward(ids, lens);
  const auto e64 = mean_pool_normalize(hidden, lens);
  for (int64_t i = 0; i < N; ++i) {
    const auto s = std::to_string(i);
    const auto want_ids = ref.tensors.at("ids." + s);
    ASSERT_EQ(want_ids.numel(), lens[i].item<int64_t>()) << s;
    const auto h_ref = ref.tensors.at("hidden." + s);
    const auto h = hidden[i].slice(0, 0, lens[i].item<int64_t>());
    EXPECT_LT((h - h_ref).abs().max().item<double>(), 1e-9) << "hidden states of sentence " << s;
    const auto e_ref = ref.tensors.at("embedding." + s);
    EXPECT_LT((e64[i] - e_ref).abs().max().item<double>(), 1e-10) << "embedding " << s;
    // float32: each component within 1e-5 (|e| ~ 0.05), cosine within 1e-6 of 1.
    EXPECT_LT((e32[i].to(torch::kDouble) - e_ref).abs().max().item<double>(), 1e-5) << s;
    EXPECT_GT((e32[i].to(torch::kDouble) * e_ref).sum().item<double>(), 1 - 1e-6) << s;
  }
}

TEST(MiniLMTest, ParaphrasesAreCloserThanUnrelatedSentences) {
  MINILM_DIR_OR_SKIP(dir);
  SentenceEncoder enc(dir);
  const std::vector<std::string> s = {
      "A man is playing a guitar.",
      "Someone plays an acoustic guitar.",
      "The stock market fell sharply today.",
      "Shares dropped steeply on the exchange today.",
      "This package contains the development headers of the compression library.",
      "Header files for developing against the zlib compression library."};
  const auto e = enc.embed(enc.encode(s), 4);
  const auto sim = e.matmul(e.t());
  for (int64_t i = 0; i < 6; i += 2) {
    for (int64_t j = 0; j < 6; ++j) {
      if (j / 2 == i / 2) continue;
      EXPECT_GT(sim[i][i + 1].item<float>(), sim[i][j].item<float>() + 0.2)
          << "pair " << i << " vs sentence " << j;
    }
  }
  // Order in the batch does not matter (sorting, padding).
  const auto e1 = enc.embed(enc.encode({s[4]}), 1);
  EXPECT_LT((e1[0] - e[4]).abs().max().item<float>(), 1e-5);
}

TEST(MiniLMTest, ImprovedClusteredStaysCloseOnRealText) {
  MINILM_DIR_OR_SKIP(dir);
  SentenceEncoder enc(dir);
  std::vector<std::string> texts;
  if (file_exists(default_corpus_path())) {
    CorpusOptions o;
    o.passages = 24;
    o.min_words = 60;
    for (const auto& p : read_debian_descriptions(default_corpus_path(), o))
      texts.push_back(p.text);
  } else {
    for (const auto& t : tricky_strings()) texts.push_back(t + " " + t + " " + t);
  }
  ApproxOptions opt;
  opt.neighbours = 3;
  opt.batch_size = 8;
  const auto report =
      compare_attention(enc, enc.encode(texts),
                        {{"improved-clustered-25",
                          "improved-clustered",
                          {{"clusters", 25}, {"topk", 32}, {"seed", 0}}},
                         {"clustered-5", "clustered", {{"clusters", 5}, {"seed", 0}}}},
                        opt);
  ASSERT_EQ(report.rows.size(), 3u);
  EXPECT_EQ(report.rows[0].label, "full");
  EXPECT_NEAR(report.rows[0].mean_cosine, 1.0, 1e-6);
  EXPECT_NEAR(report.rows[0].knn_overlap, 1.0, 1e-12);
  // The paper's pattern, loosely (the measured table is in docs/approx.md).
  EXPECT_GT(report.rows[1].mean_cosine, 0.97);
  EXPECT_GT(report.rows[1].mean_cosine, report.rows[2].mean_cosine);
  EXPECT_EQ(enc.model()->attention_type(), "full");
}
