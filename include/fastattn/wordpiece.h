// WordPiece tokenizer of BERT "uncased" models (what Hugging Face's
// BertTokenizer does with do_lower_case=True), reading a vocab.txt.
//
//   auto tok = fastattn::WordPieceTokenizer::from_file("vocab.txt");
//   auto enc = tok.encode("Héllo, world!");  // ids: [CLS] hello , world ! [SEP]
//
// Steps, on Unicode code points (the text is UTF-8; an invalid byte becomes
// U+FFFD, which the clean-up drops):
//  1. clean-up: drop U+0000, U+FFFD and control characters (categories C*
//     but tab, newline, carriage return); whitespace (Zs, \t \n \r) becomes ' '.
//  2. spaces around CJK ideographs; split on whitespace.
//  3. lower-case, decompose (NFD) and drop non-spacing marks (Mn), so accents
//     go: "Crème Brûlée" -> "creme brulee". Tables for every code point (not
//     only Latin) are generated from Python's unicodedata by
//     scripts/gen_unicode_tables.py (src/io/unicode_tables.inc); Hangul
//     syllables decompose to jamo algorithmically.
//  4. split off every punctuation character (categories P* and the ASCII
//     symbols !"#$%&'()*+,-./:;<=>?@[\]^_`{|}~) as its own word.
//  5. greedy longest-match word pieces from vocab.txt, continuation pieces
//     prefixed "##"; a word of more than max_chars_per_word code points, or one
//     that cannot be covered, becomes [UNK].
//  6. encode(): [CLS] pieces [SEP], truncated to max_length tokens (the first
//     max_length - 2 pieces kept); the encoding says how many pieces were cut.
//
// Known differences from Hugging Face: lower-casing is per code point (no
// Greek final sigma rule); special tokens written in the text ("[SEP]") are not
// recognised as such; the Unicode version is Python 3.11's (14.0).
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

namespace fastattn {

struct WordPieceOptions {
  bool lower_case = true;            // lower-case and strip accents (step 3)
  int64_t max_length = 512;          // encode(): tokens including [CLS] and [SEP], >= 2
  int64_t max_chars_per_word = 100;  // longer words become [UNK]
  std::string unk_token = "[UNK]";
  std::string cls_token = "[CLS]";
  std::string sep_token = "[SEP]";
  std::string pad_token = "[PAD]";
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

  // Steps 1-4: the words, before word pieces.
  std::vector<std::string> basic_tokenize(const std::string& text) const;
  // Steps 1-5: the word pieces (no [CLS]/[SEP], no truncation).
  std::vector<std::string> tokenize(const std::string& text) const;
  // Steps 1-6.
  WordPieceEncoding encode(const std::string& text) const;

  int64_t vocab_size() const { return static_cast<int64_t>(vocab_.size()); }
  // The id of a token; throws naming it when it is not in the vocabulary.
  int64_t id(const std::string& token) const;
  const std::string& token(int64_t id) const;
  int64_t unk_id() const { return unk_id_; }
  int64_t cls_id() const { return cls_id_; }
  int64_t sep_id() const { return sep_id_; }
  int64_t pad_id() const { return pad_id_; }
  const WordPieceOptions& options() const { return options_; }

 private:
  void word_pieces(const std::u32string& word, std::vector<std::string>& out) const;
  std::vector<std::u32string> basic_words(const std::string& text) const;

  WordPieceOptions options_;
  std::vector<std::string> vocab_;
  std::unordered_map<std::string, int64_t> ids_;
  int64_t unk_id_ = 0, cls_id_ = 0, sep_id_ = 0, pad_id_ = 0;
};

// UTF-8 <-> code points. Decoding turns each invalid or truncated sequence
// (overlong forms, surrogates, > U+10FFFF) into one U+FFFD.
std::u32string utf8_decode(const std::string& s);
std::string utf8_encode(const std::u32string& s);

}  // namespace fastattn
