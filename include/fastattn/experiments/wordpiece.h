// WordPiece tokenizer of BERT "uncased" models (what Hugging Face's
// BertTokenizer does with do_lower_case=True), reading a vocab.txt.
//
//   auto tok = fastattn::WordPieceTokenizer::from_file("vocab.txt");
//   auto enc = tok.encode("Héllo, world!");  // ids: [CLS] hello , world ! [SEP]
//
// Steps, on Unicode code points (the text is UTF-8; an invalid byte becomes
// U+FFFD, which the clean-up drops):
//  1. special tokens written in the text ("[SEP]", "[MASK]", "[CLS]", "[PAD]",
//     "[UNK]": the options' tokens that are in the vocabulary, matched exactly,
//     case-sensitively, the longest at the leftmost position) are words of
//     their own, kept whole: "a[SEP]b" -> a [SEP] b, while "[sep]" is
//     [ sep ]. The text between them goes through steps 2-6 piece by piece.
//     WordPieceOptions::split_special_tokens turns this step off.
//  2. clean-up: drop U+0000, U+FFFD and control characters (categories C*
//     but tab, newline, carriage return); whitespace (Zs, \t \n \r) becomes ' '.
//  3. spaces around CJK ideographs; split on whitespace (also U+2028, U+2029).
//  4. lower-case, decompose (NFD) and drop non-spacing marks (Mn), so accents
//     go: "Crème Brûlée" -> "creme brulee". Tables for every code point (not
//     only Latin) are generated from Python's unicodedata and str.lower() by
//     scripts/gen_unicode_tables.py (src/experiments/unicode_tables.inc); Hangul
//     syllables decompose to jamo algorithmically. A capital sigma becomes a
//     final sigma (ς, U+03C2) where str.lower() makes it one in the
//     whitespace-separated token (after a cased letter and not before one,
//     skipping case-ignorable code points: "ΑΣ." -> "ας.", "ΑΣΑ" -> "ασα"),
//     σ elsewhere; WordPieceOptions::final_sigma turns that rule off.
//  5. split off every punctuation character (categories P* and the ASCII
//     symbols !"#$%&'()*+,-./:;<=>?@[\]^_`{|}~) as its own word.
//  6. greedy longest-match word pieces from vocab.txt, continuation pieces
//     prefixed "##"; a word of more than max_chars_per_word code points (after
//     step 4), or one that cannot be covered, becomes [UNK].
//  7. encode(): [CLS] pieces [SEP], truncated to max_length tokens (the first
//     max_length - 2 pieces kept); the encoding says how many pieces were cut.
//
// Parity with Hugging Face: these are the steps of transformers' pure-Python
// BERT tokenizer (BertTokenizer up to 4.x, BertTokenizerLegacy in 5.x) with
// do_lower_case=True and a BERT vocabulary's special tokens. Its NFC
// normalisation before lower-casing needs no step here: NFD follows, and
// neither str.lower() nor the final sigma context depends on composition.
// With the all-MiniLM-L6-v2 vocabulary, the ids equal transformers 5.24's
// (Python 3.11) on 1.38 million texts: every code point alone and between
// letters, 200000 random texts mixing Greek sigmas, combining marks (Mn, Mc,
// Me), case-ignorable punctuation, special tokens whole and broken, whitespace
// and control characters, CJK, Hangul, emoji sequences, ligatures, Turkish I,
// ß, and words around the 100-character limit, and 64000 Debian package
// descriptions (scripts/tokenizer_parity.py; tests in tests/cpp/test_bert.cpp).
// What remains:
//  - The Unicode version is Python 3.11's (14.0): under a Python with another
//    version, Hugging Face differs on the code points assigned or changed
//    between the two (regenerate the tables with that Python to follow it).
//  - Hugging Face's Rust tokenizer (the `tokenizers` library: BertTokenizer in
//    transformers 5.x, BertTokenizerFast in 4.x) differs from its own Python
//    one: it lower-cases code point by code point, without the final sigma
//    (final_sigma = false gives that), keeps unassigned code points (category
//    Cn) that the Python one drops as control characters, and has older
//    category tables (759 assigned code points, mostly combining marks and
//    punctuation of recent Unicode versions and some CJK ideographs from
//    U+2B820, come out otherwise). fastattn follows the Python one.
//  - With a vocabulary that lacks the mask token, Hugging Face appends "[MASK]"
//    to it as a new token; here it is then not special ("[MASK]" in the text is
//    [ mask ]), and mask_id() is -1.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

namespace fastattn {

struct WordPieceOptions {
  bool lower_case = true;            // lower-case and strip accents (step 4)
  int64_t max_length = 512;          // encode(): tokens including [CLS] and [SEP], >= 2
  int64_t max_chars_per_word = 100;  // longer words become [UNK]
  std::string unk_token = "[UNK]";
  std::string cls_token = "[CLS]";
  std::string sep_token = "[SEP]";
  std::string pad_token = "[PAD]";
  std::string mask_token = "[MASK]";  // optional: special only when in the vocabulary
  // Step 1 off: special tokens written in the text are split like any text
  // (Hugging Face's split_special_tokens=True).
  bool split_special_tokens = false;
  // Step 4's final sigma rule (Python's str.lower()); false lower-cases Σ to σ
  // everywhere, as Hugging Face's Rust tokenizer does.
  bool final_sigma = true;
};

struct WordPieceEncoding {
  std::vector<int64_t> ids;  // [CLS] ... [SEP]
  int64_t truncated = 0;     // word pieces cut off to fit max_length
};

class WordPieceTokenizer {
 public:
  // One token a line; the id is the line number from 0. Throws on a missing
  // file, an empty or duplicate token, or special tokens missing from it.
  static WordPieceTokenizer from_file(const std::string& vocab_path,
                                      const WordPieceOptions& options = {});
  WordPieceTokenizer(std::vector<std::string> vocab, const WordPieceOptions& options = {});

  // Steps 1-5: the words, before word pieces (special tokens among them).
  std::vector<std::string> basic_tokenize(const std::string& text) const;
  // Steps 1-6: the word pieces (no [CLS]/[SEP] added, no truncation).
  std::vector<std::string> tokenize(const std::string& text) const;
  // Steps 1-7.
  WordPieceEncoding encode(const std::string& text) const;

  int64_t vocab_size() const { return static_cast<int64_t>(vocab_.size()); }
  // The id of a token; throws naming it when it is not in the vocabulary.
  int64_t id(const std::string& token) const;
  const std::string& token(int64_t id) const;
  int64_t unk_id() const { return unk_id_; }
  int64_t cls_id() const { return cls_id_; }
  int64_t sep_id() const { return sep_id_; }
  int64_t pad_id() const { return pad_id_; }
  int64_t mask_id() const { return mask_id_; }  // -1: the mask token is not in the vocabulary
  const WordPieceOptions& options() const { return options_; }

 private:
  struct Word {
    std::u32string text;
    int64_t special = -1;  // the id of a special token written in the text, else -1
  };
  struct Special {
    std::string token;
    std::u32string text;
    int64_t id;
  };
  void word_pieces(const std::u32string& word, std::vector<std::string>& out) const;
  std::vector<Word> basic_words(const std::string& text) const;
  void basic_segment(const std::u32string& text, size_t begin, size_t end,
                     std::vector<Word>& words) const;
  const Special* special_at(const std::u32string& text, size_t i) const;

  WordPieceOptions options_;
  std::vector<std::string> vocab_;
  std::unordered_map<std::string, int64_t> ids_;
  int64_t unk_id_ = 0, cls_id_ = 0, sep_id_ = 0, pad_id_ = 0, mask_id_ = -1;
  std::vector<Special> specials_;  // step 1's tokens, each once
};

// UTF-8 <-> code points. Decoding turns each invalid or truncated sequence
// (overlong forms, surrogates, > U+10FFFF) into one U+FFFD.
std::u32string utf8_decode(const std::string& s);
std::string utf8_encode(const std::u32string& s);

}  // namespace fastattn
