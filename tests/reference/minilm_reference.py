#!/usr/bin/python3
"""Independent reference for the MiniLM tests (tests/cpp/test_bert.cpp): BERT
uncased tokenization written from Python's unicodedata, and a float64 forward
of the BERT encoder in plain torch operations from the same safetensors file
(read by the small parser below, not by fastattn).

    /usr/bin/python3 tests/reference/minilm_reference.py MODEL_DIR STRINGS.json OUT.safetensors [--forward K]

STRINGS.json is a list of strings. OUT holds, for every string i, "ids.i"
(int64, [CLS] ... [SEP], at most 256 tokens) and, for the first K strings
(default all), "hidden.i" (float64, (L, 384): last hidden states) and
"embedding.i" (float64, (384,): mean-pooled, L2-normalised).
"""
import json
import struct
import sys
import unicodedata

import torch

MAX_LEN = 256


# ---- safetensors ------------------------------------------------------------------

DTYPES = {"F32": (torch.float32, 4), "F64": (torch.float64, 8), "I64": (torch.int64, 8)}


def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype, size = DTYPES[info["dtype"]]
        b, e = info["data_offsets"]
        buf = bytearray(data[8 + n + b:8 + n + e])
        out[name] = torch.frombuffer(buf, dtype=dtype).reshape(info["shape"]) if e > b else \
            torch.zeros(info["shape"], dtype=dtype)
    return out


def write_safetensors(path, tensors):
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        kind = {torch.float64: "F64", torch.int64: "I64", torch.float32: "F32"}[t.dtype]
        raw = t.numpy().tobytes()
        header[name] = {"dtype": kind, "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


# ---- tokenizer (Hugging Face BertTokenizer semantics, do_lower_case=True) ------------

def is_whitespace(c):
    return c in " \t\n\r" or unicodedata.category(c) == "Zs"


def is_control(c):
    return c not in "\t\n\r" and unicodedata.category(c).startswith("C")


def is_punctuation(c):
    cp = ord(c)
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True
    return unicodedata.category(c).startswith("P")


def is_cjk(cp):
    return (0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF or 0x20000 <= cp <= 0x2A6DF
            or 0x2A700 <= cp <= 0x2B73F or 0x2B740 <= cp <= 0x2B81F or 0x2B820 <= cp <= 0x2CEAF
            or 0xF900 <= cp <= 0xFAFF or 0x2F800 <= cp <= 0x2FA1F)


SPECIAL = ("[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]")


def split_special(text):
    """Text pieces and special tokens written in it (kept whole), left to right."""
    out, start, i = [], 0, 0
    while i < len(text):
        hit = max((t for t in SPECIAL if text.startswith(t, i)), key=len, default=None)
        if hit is None:
            i += 1
            continue
        out += [(text[start:i], False), (hit, True)]
        i += len(hit)
        start = i
    out.append((text[start:], False))
    return out


def basic_tokenize(text):
    words = []
    for piece, special in split_special(text):
        words += [piece] if special else basic_tokenize_text(piece)
    return words


def basic_tokenize_text(text):
    out = []
    for c in text:
        cp = ord(c)
        if cp == 0 or cp == 0xFFFD or is_control(c):
            continue
        if is_whitespace(c):
            out.append(" ")
        elif is_cjk(cp):
            out += [" ", c, " "]
        else:
            out.append(c)
    words = []
    for token in "".join(out).split():
        # str.lower() of the whole token: a capital sigma's final form depends on
        # its neighbours.
        token = "".join(ch for ch in unicodedata.normalize("NFD", token.lower())
                        if unicodedata.category(ch) != "Mn")
        cur = ""
        for ch in token:
            if is_punctuation(ch):
                if cur:
                    words.append(cur)
                words.append(ch)
                cur = ""
            else:
                cur += ch
        if cur:
            words.append(cur)
    return words


def wordpiece(word, vocab):
    if word in SPECIAL:
        return [word]
    if len(word) > 100:
        return ["[UNK]"]
    pieces, start = [], 0
    while start < len(word):
        end = len(word)
        piece = None
        while start < end:
            sub = word[start:end] if start == 0 else "##" + word[start:end]
            if sub in vocab:
                piece = sub
                break
            end -= 1
        if piece is None:
            return ["[UNK]"]
        pieces.append(piece)
        start = end
    return pieces


def encode(text, vocab):
    pieces = [p for w in basic_tokenize(text) for p in wordpiece(w, vocab)]
    pieces = pieces[:MAX_LEN - 2]
    return [vocab["[CLS]"]] + [vocab[p] for p in pieces] + [vocab["[SEP]"]]


# ---- encoder ----------------------------------------------------------------------

def layer_norm(x, w, b, eps):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * w + b


def forward(ids, W, cfg):
    L = len(ids)
    D, H = cfg["hidden_size"], cfg["num_attention_heads"]
    E = D // H
    eps = cfg["layer_norm_eps"]
    ids = torch.tensor(ids)
    x = W["embeddings.word_embeddings.weight"][ids] + W["embeddings.position_embeddings.weight"][:L] \
        + W["embeddings.token_type_embeddings.weight"][0]
    x = layer_norm(x, W["embeddings.LayerNorm.weight"], W["embeddings.LayerNorm.bias"], eps)
    for i in range(cfg["num_hidden_layers"]):
        p = f"encoder.layer.{i}."

        def lin(h, name):
            return h @ W[p + name + ".weight"].T + W[p + name + ".bias"]

        q = lin(x, "attention.self.query").view(L, H, E).transpose(0, 1)
        k = lin(x, "attention.self.key").view(L, H, E).transpose(0, 1)
        v = lin(x, "attention.self.value").view(L, H, E).transpose(0, 1)
        a = torch.softmax(q @ k.transpose(1, 2) / E ** 0.5, dim=-1) @ v  # (H, L, E)
        a = a.transpose(0, 1).reshape(L, D)
        x = layer_norm(lin(a, "attention.output.dense") + x, W[p + "attention.output.LayerNorm.weight"],
                       W[p + "attention.output.LayerNorm.bias"], eps)
        h = lin(x, "intermediate.dense")
        h = 0.5 * h * (1.0 + torch.erf(h / 2 ** 0.5))
        x = layer_norm(lin(h, "output.dense") + x, W[p + "output.LayerNorm.weight"],
                       W[p + "output.LayerNorm.bias"], eps)
    e = x.mean(0)
    return x, e / e.norm()


def main():
    args = sys.argv[1:]
    n_forward = None
    if "--forward" in args:
        i = args.index("--forward")
        n_forward = int(args[i + 1])
        del args[i:i + 2]
    model_dir, strings_path, out_path = args
    with open(model_dir + "/vocab.txt", encoding="utf-8") as f:
        vocab = {line.rstrip("\n"): i for i, line in enumerate(f)}
    with open(strings_path, encoding="utf-8") as f:
        strings = json.load(f)
    with open(model_dir + "/config.json") as f:
        cfg = json.load(f)
    out = {}
    W = None
    for i, s in enumerate(strings):
        ids = encode(s, vocab)
        out[f"ids.{i}"] = torch.tensor(ids, dtype=torch.int64)
        if n_forward is None or i < n_forward:
            if W is None:
                W = {k: v.double() for k, v in read_safetensors(model_dir + "/model.safetensors").items()
                     if v.dtype == torch.float32}
            with torch.no_grad():
                hidden, emb = forward(ids, W, cfg)
            out[f"hidden.{i}"] = hidden
            out[f"embedding.{i}"] = emb
    write_safetensors(out_path, out)


if __name__ == "__main__":
    main()
