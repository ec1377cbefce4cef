// WordPiece tokenizer (include/fastattn/experiments/wordpiece.h). Cost: O(characters) for
// the basic steps (times the 5 special tokens for step 1); word pieces are a
// greedy longest match, O(w^2) hash look-ups for a word of w <=
// max_chars_per_word code points.
// Tests: ./build/fastattn_tests --gtest_filter='WordPiece*:MiniLM*'
#include "fastattn/experiments/wordpiece.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <fstream>

namespace fastattn {

namespace {

struct CodeRange {
  char32_t lo, hi;
};
struct FoldEntry {
  char32_t cp;
  uint8_t n;
  char32_t out[3];
};

#include "experiments/unicode_tables.inc"

template <size_t K>
bool in_ranges(const CodeRange (&table)[K], char32_t c) {
  auto it = std::upper_bound(std::begin(table), std::end(table), c,
                             [](char32_t v, const CodeRange& r) { return v < r.lo; });
  return it != std::begin(table) && c <= (it - 1)->hi;
}

bool is_whitespace(char32_t c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || in_ranges(kWhitespaceRanges, c);
}
bool is_control(char32_t c) { return in_ranges(kControlRanges, c); }  // tab etc. excluded
bool is_cjk(char32_t c) { return in_ranges(kCjkRanges, c); }
bool is_case_ignorable(char32_t c) { return in_ranges(kCaseIgnorableRanges, c); }
bool is_cased(char32_t c) { return in_ranges(kCasedRanges, c); }  // and not case-ignorable
bool is_punctuation(char32_t c) {
  if ((c >= 33 && c <= 47) || (c >= 58 && c <= 64) || (c >= 91 && c <= 96) ||
      (c >= 123 && c <= 126))
    return true;
  return in_ranges(kPunctuationRanges, c);
}
// What Python's str.split() also splits on once the clean-up has run
// (line and paragraph separators, categories Zl and Zp).
bool is_split_space(char32_t c) { return c == ' ' || c == 0x2028 || c == 0x2029; }

// Lower-case, NFD, drop Mn: appends the result for one code point.
void fold(char32_t c, std::u32string& out) {
  if (c < 0x80) {
    out.push_back(c >= 'A' && c <= 'Z' ? c + 32 : c);
    return;
  }
  if (c >= 0xAC00 && c <= 0xD7A3) {  // Hangul syllable -> L V (T) jamo
    const char32_t s = c - 0xAC00;
    out.push_back(0x1100 + s / 588);
    out.push_back(0x1161 + (s % 588) / 28);
    if (s % 28) out.push_back(0x11A7 + s % 28);
    return;
  }
  auto it = std::lower_bound(std::begin(kFoldMap), std::end(kFoldMap), c,
                             [](const FoldEntry& e, char32_t v) { return e.cp < v; });
  if (it != std::end(kFoldMap) && it->cp == c) {
    out.append(it->out, it->out + it->n);
  } else {
    out.push_back(c);
  }
}

// Whether the capital sigma at w[k] lower-cases to final sigma (U+03C2) in the
// whitespace-separated token w[begin, end), as Python's str.lower() decides
// (Unicode's Final_Sigma condition): skipping case-ignorable code points, a
// cased one comes before it and none comes after it. Each scan stops at the
// first code point that is not case-ignorable, so the cost over a token is
// linear in its length.
bool final_sigma_at(const std::u32string& w, size_t begin, size_t end, size_t k) {
  size_t b = k;
  while (b > begin && is_case_ignorable(w[b - 1])) --b;
  if (b == begin || !is_cased(w[b - 1])) return false;
  size_t a = k + 1;
  while (a < end && is_case_ignorable(w[a])) ++a;
  return a == end || !is_cased(w[a]);
}

}  // namespace

std::u32string utf8_decode(const std::string& s) {
  std::u32string out;
  out.reserve(s.size());
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  size_t i = 0;
  while (i < n) {
    const unsigned char b = p[i];
    int len = 0;
    char32_t c = 0, min = 0;
    if (b < 0x80) {
      out.push_back(b);
      ++i;
      continue;
    } else if ((b & 0xE0) == 0xC0) {
      len = 2, c = b & 0x1F, min = 0x80;
    } else if ((b & 0xF0) == 0xE0) {
      len = 3, c = b & 0x0F, min = 0x800;
    } else if ((b & 0xF8) == 0xF0) {
      len = 4, c = b & 0x07, min = 0x10000;
    } else {
      out.push_back(0xFFFD);
      ++i;
      continue;
    }
    int k = 1;
    for (; k < len && i + k < n && (p[i + k] & 0xC0) == 0x80; ++k) c = (c << 6) | (p[i + k] & 0x3F);
    if (k < len || c < min || c > 0x10FFFF || (c >= 0xD800 && c <= 0xDFFF)) {
      out.push_back(0xFFFD);
      i += k;  // skip the broken sequence as one character
    } else {
      out.push_back(c);
      i += len;
    }
  }
  return out;
}

std::string utf8_encode(const std::u32string& s) {
  std::string out;
  out.reserve(s.size());
  for (char32_t c : s) {
    if (c < 0x80) {
      out.push_back(static_cast<char>(c));
    } else if (c < 0x800) {
      out.push_back(static_cast<char>(0xC0 | (c >> 6)));
      out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
    } else if (c < 0x10000) {
      out.push_back(static_cast<char>(0xE0 | (c >> 12)));
      out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
      out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
    } else {
      out.push_back(static_cast<char>(0xF0 | (c >> 18)));
      out.push_back(static_cast<char>(0x80 | ((c >> 12) & 0x3F)));
      out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
      out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
    }
  }
  return out;
}

WordPieceTokenizer WordPieceTokenizer::from_file(const std::string& vocab_path,
                                                 const WordPieceOptions& options) {
  std::ifstream in(vocab_path, std::ios::binary);
  TORCH_CHECK(in, "WordPiece vocabulary '", vocab_path, "': cannot open");
  std::vector<std::string> vocab;
  std::string line;
  while (std::getline(in, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    vocab.push_back(line);
  }
  TORCH_CHECK(!in.bad(), "WordPiece vocabulary '", vocab_path, "': read error");
  try {
    return WordPieceTokenizer(std::move(vocab), options);
  } catch (const c10::Error& e) {
    // A throw, not TORCH_CHECK(false, ...): LibTorch 1.13's Debug build does
    // not see the latter as leaving the function (-Wreturn-type).
    C10_THROW_ERROR(
        Error, c10::str("WordPiece vocabulary '", vocab_path, "': ", e.what_without_backtrace()));
  }
}

WordPieceTokenizer::WordPieceTokenizer(std::vector<std::string> vocab,
                                       const WordPieceOptions& options)
    : options_(options), vocab_(std::move(vocab)) {
  TORCH_CHECK(options_.max_length >= 2,
              "WordPieceOptions.max_length must be >= 2 ([CLS], [SEP]), got ", options_.max_length);
  TORCH_CHECK(options_.max_chars_per_word >= 1,
              "WordPieceOptions.max_chars_per_word must be >= 1, got ",
              options_.max_chars_per_word);
  TORCH_CHECK(!vocab_.empty(), "the vocabulary is empty");
  ids_.reserve(vocab_.size());
  for (size_t i = 0; i < vocab_.size(); ++i) {
    TORCH_CHECK(!vocab_[i].empty(), "vocabulary line ", i + 1, " is empty");
    TORCH_CHECK(ids_.emplace(vocab_[i], static_cast<int64_t>(i)).second, "vocabulary line ", i + 1,
                ": token '", vocab_[i], "' appears twice (first on line ", ids_.at(vocab_[i]) + 1,
                ")");
  }
  unk_id_ = id(options_.unk_token);
  cls_id_ = id(options_.cls_token);
  sep_id_ = id(options_.sep_token);
  pad_id_ = id(options_.pad_token);
  auto mask = ids_.find(options_.mask_token);
  if (mask != ids_.end()) mask_id_ = mask->second;
  for (const std::string* t : {&options_.unk_token, &options_.cls_token, &options_.sep_token,
                               &options_.pad_token, &options_.mask_token}) {
    if (!ids_.count(*t)) continue;  // only the mask token is optional
    bool seen = false;
    for (const auto& sp : specials_) seen = seen || sp.token == *t;
    if (!seen) specials_.push_back({*t, utf8_decode(*t), ids_.at(*t)});
  }
}

int64_t WordPieceTokenizer::id(const std::string& token) const {
  auto it = ids_.find(token);
  TORCH_CHECK(it != ids_.end(), "token '", token, "' is not in the vocabulary (", vocab_.size(),
              " tokens)");
  return it->second;
}

const std::string& WordPieceTokenizer::token(int64_t id) const {
  TORCH_CHECK(id >= 0 && id < vocab_size(), "token id ", id, " is out of range [0, ", vocab_size(),
              ")");
  return vocab_[static_cast<size_t>(id)];
}

const WordPieceTokenizer::Special* WordPieceTokenizer::special_at(const std::u32string& text,
                                                                  size_t i) const {
  const Special* best = nullptr;
  for (const auto& sp : specials_) {
    if (text.compare(i, sp.text.size(), sp.text) == 0 &&
        (!best || sp.text.size() > best->text.size()))
      best = &sp;
  }
  return best;
}

std::vector<WordPieceTokenizer::Word> WordPieceTokenizer::basic_words(
    const std::string& text) const {
  std::vector<Word> words;
  const std::u32string cps = utf8_decode(text);
  // 1: special tokens written in the text are words of their own; the text
  // between them goes through steps 2-5 piece by piece.
  size_t from = 0;
  if (!options_.split_special_tokens) {
    for (size_t i = 0; i < cps.size();) {
      const Special* sp = special_at(cps, i);
      if (!sp) {
        ++i;
        continue;
      }
      basic_segment(cps, from, i, words);
      words.push_back({sp->text, sp->id});
      i += sp->text.size();
      from = i;
    }
  }
  basic_segment(cps, from, cps.size(), words);
  return words;
}

void WordPieceTokenizer::basic_segment(const std::u32string& text, size_t begin, size_t end,
                                       std::vector<Word>& words) const {
  // 2-3: clean-up and CJK spacing, on the raw code points.
  std::u32string clean;
  for (size_t k = begin; k < end; ++k) {
    const char32_t c = text[k];
    if (c == 0 || c == 0xFFFD || is_control(c)) continue;
    if (is_whitespace(c)) {
      clean.push_back(' ');
    } else if (is_cjk(c)) {
      clean.push_back(' ');
      clean.push_back(c);
      clean.push_back(' ');
    } else {
      clean.push_back(c);
    }
  }
  std::u32string folded, word;
  auto flush = [&] {
    if (!word.empty()) words.push_back({std::move(word), -1});
    word.clear();
  };
  const bool sigma_rule = options_.lower_case && options_.final_sigma;
  size_t i = 0;
  while (i < clean.size()) {
    if (is_split_space(clean[i])) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < clean.size() && !is_split_space(clean[j])) ++j;
    // 4: lower-case and strip accents, for the whole whitespace-separated
    // token (the final sigma depends on its neighbours in it).
    folded.clear();
    for (size_t k = i; k < j; ++k) {
      if (!options_.lower_case) {
        folded.push_back(clean[k]);
      } else if (clean[k] == 0x3A3 && sigma_rule) {
        folded.push_back(final_sigma_at(clean, i, j, k) ? 0x3C2 : 0x3C3);
      } else {
        fold(clean[k], folded);
      }
    }
    // 5: punctuation characters are words of their own.
    for (char32_t c : folded) {
      if (is_punctuation(c)) {
        flush();
        words.push_back({std::u32string(1, c), -1});
      } else {
        word.push_back(c);
      }
    }
    flush();
    i = j;
  }
}

std::vector<std::string> WordPieceTokenizer::basic_tokenize(const std::string& text) const {
  std::vector<std::string> out;
  for (const auto& w : basic_words(text)) out.push_back(utf8_encode(w.text));
  return out;
}

void WordPieceTokenizer::word_pieces(const std::u32string& word,
                                     std::vector<std::string>& out) const {
  if (static_cast<int64_t>(word.size()) > options_.max_chars_per_word) {
    out.push_back(options_.unk_token);
    return;
  }
  const size_t before = out.size();
  size_t start = 0;
  while (start < word.size()) {
    size_t end = word.size();
    bool found = false;
    while (start < end) {
      std::string piece = utf8_encode(word.substr(start, end - start));
      if (start > 0) piece = "##" + piece;
      if (ids_.count(piece)) {
        out.push_back(std::move(piece));
        found = true;
        break;
      }
      --end;
    }
    if (!found) {  // the word cannot be covered: all of it is [UNK]
      out.resize(before);
      out.push_back(options_.unk_token);
      return;
    }
    start = end;
  }
}

std::vector<std::string> WordPieceTokenizer::tokenize(const std::string& text) const {
  std::vector<std::string> out;
  for (const auto& w : basic_words(text)) {
    if (w.special >= 0) {
      out.push_back(vocab_[static_cast<size_t>(w.special)]);
    } else {
      word_pieces(w.text, out);
    }
  }
  return out;
}

WordPieceEncoding WordPieceTokenizer::encode(const std::string& text) const {
  const auto pieces = tokenize(text);
  WordPieceEncoding enc;
  const size_t keep = std::min(pieces.size(), static_cast<size_t>(options_.max_length - 2));
  enc.truncated = static_cast<int64_t>(pieces.size() - keep);
  enc.ids.reserve(keep + 2);
  enc.ids.push_back(cls_id_);
  for (size_t i = 0; i < keep; ++i) enc.ids.push_back(ids_.at(pieces[i]));
  enc.ids.push_back(sep_id_);
  return enc;
}

}  // namespace fastattn
