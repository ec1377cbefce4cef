#!/usr/bin/env python3
"""Expected token ids from Hugging Face's pure-Python BERT tokenizer, for the
parity check of fastattn's WordPiece tokenizer (include/fastattn/experiments/wordpiece.h):

    .venv/bin/python scripts/tokenizer_parity.py VOCAB.txt OUT.json \\
        [--random N] [--seed S] [--corpus FILE] [--paragraphs N] [--every-code-point]
    FASTATTN_TOKENIZER_PARITY=OUT.json ./build/fastattn_tests \\
        --gtest_filter='WordPieceTest.MatchesParityFile'

The tokenizer is transformers' BertTokenizerLegacy (5.x) or BertTokenizer
(4.x, where it is the Python one) with do_lower_case=True. OUT.json holds the
vocabulary path, the versions (transformers, Python, Unicode) and the cases:
{"text": ..., "ids": [CLS ... SEP], "fast_ids": ...}, where fast_ids (only where
they differ) are those of the Rust tokenizer (the `tokenizers` library:
BertTokenizer in 5.x, BertTokenizerFast in 4.x), for information; fastattn
matches the Python one.

The texts: a fixed list of edge cases (Greek sigmas, special tokens written in
the text, accents, CJK, controls, whitespace variants, emoji, ligatures,
Turkish I, long words), N random texts (default 20000) mixing those
ingredients, paragraphs of a corpus file (e.g. the Debian descriptions that
scripts/fetch_minilm.sh fetches) and, with --every-code-point, every code point
alone and between letters (1.1 million texts; a large file).
"""
import argparse
import json
import platform
import random
import sys
import unicodedata

SIGMA = "\u03a3"

EDGE_CASES = [
    "hello world",
    "ΟΔΥΣΣΕΥΣ", "Σ", "ΑΣ", "ΑΣ.", "ΑΣ.Β", "ΑΣΑ", "Α'Σ", "Σ'Α", "ΑΣ'", "ΑΣ\u0301", "Α\u0301Σ",
    "ΌΣΟΣ ΚΑΙ ΌΣΑ", "ΣΣ ΣΑΣ", "1Σ", "aΣ", "ΑΣ1", "ΑΣ-Β", "ΑΣ:Β", "ΑΣ\u00b7Β", "Α\u00adΣ", "ΑΣ中",
    "ΑΣ[SEP]Β", "\u1f08Σ \u24b6Σ \u2160Σ \u02b0Σ \u0345Σ",
    "hello[SEP]world [MASK] x[mask] [CLS][PAD] [UNK]!", "[unused1] [SEP ] [[SEP]] a[SEP]b",
    "[SEP][SEP]", "[MASK", "MASK]", "[Sep] [sep]", " [CLS] x [SEP] ", "caf\u00e9[MASK]na\u00efve",
    "Cr\u00e8me Br\u00fbl\u00e9e na\u00efve \u00c5ngstr\u00f6m \u00d8l stra\u00dfe \u1e9e \u00e6 \u0153",
    "e\u0301t\u0301 \u212b \u2126 \u212a \u00b5 \u017f",
    "\u0130stanbul \u0131 I\u0307 \u015e\u011f",
    "\ufb01 \ufb02 \ufb00 \ufb03 \ufb13 \u01c4 \u01c5 \u01c6 \u0149 \u01f0 \u0390 \u1fbc \u1f88",
    "\u4e2d\u6587\u5b57 mixed \ud55c\uad6d\uc5b4 \u3042\u30a2 \uf900 \U0002f800 \u3400",
    "tab\there\nnew\r\nline\x0bvt\x0cff\x1cfs\x85nel\u00a0nbsp\u2028ls\u2029ps\u3000ideo\u202fnnbsp",
    "zero\u200bwidth\u200djoiner\ufeffbom\u00adsoft\u180emvs",
    "nul\x00bel\x07esc\x1bdel\x7frep\ufffdpua\ue000unassigned\u0378",
    "emoji \U0001F600 \U0001F44D\U0001F3FD \U0001F468\u200d\U0001F469\u200d\U0001F467 "
    "\U0001F1EB\U0001F1F7 \u2764\ufe0f",
    "\u201cquotes\u201d \u2014 dash\u2026 \u00ab\u00bb \u00bf\u00a1 \u300c\u300d\u3001\u3002 $5^x`y "
    "\u20ac\u00a3 \u00b0\u00b1 \u2122 \u00bd \u2460",
    "\u0915\u094d\u0937 \u0915\u093e \u0958 \u0e01\u0e31\u0e48 \u05e9\u05b8\u05c1 "
    "\u0645\u064e\u0631\u062d\u0628\u064b\u0627",
    "a" * 100, "a" * 101, "e\u0301" * 101, "\ud55c" * 34, "\ud55c" * 33 + "a",
    "x " + "ab" * 60 + " y",
    "",
    "   ",
]

INGREDIENTS = (
    list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")
    + list("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~")
    + list("\u00e0\u00e9\u00ee\u00f5\u00fc\u00c0\u00c9\u00ce\u00d5\u00dc\u00df\u1e9e\u0141\u0142"
           "\u0152\u0153\u0132\u0133\u01c4\u01c5\u01c6\u0149\u01f0")
    + list("\u0391\u0392\u0393\u0394\u0395\u039f\u03a0\u03a1\u03a3\u03a4\u03a5\u03a9"
           "\u03b1\u03b2\u03b3\u03c3\u03c2\u03c9\u03ac\u03ad\u0386\u0388\u0390\u03b0")
    + [SIGMA] * 12 + ["\u03a3\u03a3", "\u0391\u03a3", "\u038c\u03a3"]
    + ["\u0345", "\u0300", "\u0301", "\u0308", "\u0327", "\u0338", "\u093e", "\u0903", "\u20dd",
       "\u0488", "\u0344", "\u0340"]
    + ["'", ".", ":", "\u00b7", "\u2019", "\u02bc", "\u02b0", "\u0387", "\u00ad", "\u200d",
       "\u200c", "\ufe0f", "\U000e0001", "\u2018", "\u2024", "\ufe55", "\uff07", "\uff0e",
       "\u00a8", "\u00b4", "\u1fef", "\u1ffd", "\u0374", "\u037e", "\u2027"]
    + [" ", "  ", "\t", "\n", "\r", "\r\n", "\x0b", "\x0c", "\x1c", "\x1f", "\x85", "\xa0",
       "\u1680", "\u2000", "\u2003", "\u200a", "\u2028", "\u2029", "\u202f", "\u205f", "\u3000",
       "\u180e", "\u200b", "\ufeff"]
    + ["\x00", "\x07", "\x1b", "\x7f", "\ufffd", "\ue000", "\u0378", "\uffff", "\U0010ffff"]
    + list("\u4e2d\u6587\uf900\U0002f800\u3400\u9fff\u2e80\u3005\u3042\u30a2\ud55c\u1100\u1161"
           "\u11a8\u3131\uff71")
    + ["\U0001F600", "\U0001F44D\U0001F3FD", "\U0001F468\u200d\U0001F469", "\U0001F1EB\U0001F1F7",
       "\u2764\ufe0f", "\U0001F3FB"]
    + list("\u201c\u201d\u2014\u2013\u2026\u00ab\u00bb\u00bf\u00a1\u300c\u3001\u3002\u00a7\u2020"
           "\u2022\u2032\u20ac\u00a3\u00b0\u00b1\u00d7\u00a9\u2122\u00bd\u2460\u216b\u2170"
           "\u24d0\u24b6")
    + list("\u0130\u0131\u015e\u015f\u011e\u011f\ufb01\ufb02\ufb00\ufb03\ufb13\u212a\u212b\u2126"
           "\uff21\uff41\u210c\U00010400\U00010428\u13a0\uab70\u1c90\u10d0\u01c8\u1ffc\u1f88"
           "\u00b5\u017f")
    + list("\u0662\u0645\u0631\u064b\u0651\u05b7\u05d0\u0e01\u0e31\u0e48\u0915\u094d\u0958"
           "\u0b95\u0bcd")
    + ["[SEP]", "[MASK]", "[CLS]", "[PAD]", "[UNK]", "[sep]", "[Sep]", "[SE", "P]", "SEP", "[",
       "]", "[MASK", "MASK]", "[[SEP]]", "[unused0]"] * 3
)


def random_texts(n, seed):
    rng = random.Random(seed)
    letters = [c for c in INGREDIENTS if len(c) == 1 and c.isalpha()]
    out = []
    for i in range(n):
        if i % 10 == 9:  # a word around the 100-character limit
            pool = rng.sample(letters, rng.randint(1, 4))
            pool += ["\u0301"] if rng.random() < 0.3 else []
            pool += ["\ud55c"] if rng.random() < 0.2 else []
            word = "".join(rng.choice(pool) for _ in range(rng.randint(90, 110)))
            out.append(rng.choice(["", "x ", "[SEP]"]) + word + rng.choice(["", " y", "!", "[MASK]"]))
        else:
            out.append("".join(rng.choice(INGREDIENTS) for _ in range(rng.randint(1, 25))))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("vocab")
    ap.add_argument("out")
    ap.add_argument("--random", type=int, default=20000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--corpus", help="a text file; its blank-line separated paragraphs")
    ap.add_argument("--paragraphs", type=int, default=5000)
    ap.add_argument("--every-code-point", action="store_true")
    args = ap.parse_args()

    import transformers
    try:
        from transformers.models.bert.tokenization_bert_legacy import BertTokenizerLegacy as Slow
        from transformers import BertTokenizer as Fast
    except ImportError:  # transformers 4.x
        from transformers import BertTokenizer as Slow
        from transformers import BertTokenizerFast as Fast
    slow = Slow(vocab_file=args.vocab, do_lower_case=True)
    try:
        fast = Fast(vocab_file=args.vocab, do_lower_case=True)
        if fast.convert_tokens_to_ids("[CLS]") != slow.cls_token_id:  # 5.x: takes the dict
            raise TypeError
    except TypeError:
        from transformers.models.bert.tokenization_bert import load_vocab
        fast = Fast(vocab=load_vocab(args.vocab), do_lower_case=True)

    texts = list(EDGE_CASES) + random_texts(args.random, args.seed)
    if args.corpus:
        with open(args.corpus, encoding="utf-8", errors="replace") as f:
            paras = [p for p in f.read().split("\n\n") if p.strip()]
        texts += paras[:args.paragraphs]
    if args.every_code_point:
        for cp in range(0x110000):
            if not 0xD800 <= cp <= 0xDFFF:
                c = chr(cp)
                texts.append(f"{c}x {c} Ab{c}")

    cases, fast_differs = [], 0
    fast_ids = fast(texts, add_special_tokens=True)["input_ids"]
    for text, f in zip(texts, fast_ids):
        ids = slow(text)["input_ids"]
        case = {"text": text, "ids": ids}
        if f != ids:
            case["fast_ids"] = f
            fast_differs += 1
        cases.append(case)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump({"vocab": args.vocab, "tokenizer": type(slow).__name__,
                   "transformers": transformers.__version__, "python": platform.python_version(),
                   "unicode": unicodedata.unidata_version, "cases": cases}, f, ensure_ascii=True)
    print(f"{len(cases)} texts ({type(slow).__name__}, transformers {transformers.__version__}, "
          f"Unicode {unicodedata.unidata_version}); the Rust tokenizer ({type(fast).__name__}) "
          f"differs on {fast_differs}", file=sys.stderr)


if __name__ == "__main__":
    main()
