"""Greedy decoding through Hugging Face (issue 64, item 4): a random
Llama-style decoder (4 layers, hidden 512, 8 heads, float32) generates
`--new` tokens after a prompt of each `--prompts` length with a static cache,
with attn_implementation 'sdpa' and 'fastattn-full', in one run. Per token:
the time between the first and the last step's logits (a logits processor
stamps each step), over new - 1 steps: the decoding steps alone, without the
prompt's prefill; min (median) over the repetitions. The tokens of both must
be identical.

  .venv/bin/python bench/python/bench_hf_decode.py [--prompts 1024 4096] [--new 64] [--threads 2]
"""
import argparse
import platform
import time

import torch
import transformers

import fastattn.hf


def model_for(impl, max_len):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=1000, hidden_size=512, num_hidden_layers=4,
                                   num_attention_heads=8, num_key_value_heads=8,
                                   intermediate_size=1376, max_position_embeddings=max_len,
                                   pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.set_attn_implementation(impl)
    return model


class Stamps(transformers.LogitsProcessor):
    """The time of each generation step's logits."""

    def __init__(self):
        self.times = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


def generate(model, ids, new, stamps=None):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                              cache_implementation="static", pad_token_id=0,
                              logits_processor=transformers.LogitsProcessorList(
                                  [stamps] if stamps else []))


def per_token_ms(model, ids, new, reps):
    """min and median over reps of the decoding steps' time per token (ms)."""
    generate(model, ids, new)
    ts = []
    for _ in range(reps):
        stamps = Stamps()
        generate(model, ids, new, stamps)
        ts.append((stamps.times[-1] - stamps.times[0]) / (len(stamps.times) - 1) * 1e3)
    ts.sort()
    return ts[0], ts[len(ts) // 2]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    fastattn.hf.register(["full"])
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor())
    print("# %s, %d threads, torch %s, transformers %s"
          % (cpu, args.threads, torch.__version__, transformers.__version__))
    print("| prompt | sdpa ms/token | fastattn-full ms/token | fastattn / sdpa | tokens equal |")
    print("|---|---|---|---|---|")
    for P in args.prompts:
        ids = torch.randint(3, 1000, (1, P), generator=torch.Generator().manual_seed(P))
        per_token, tokens = {}, {}
        for impl in ("sdpa", "fastattn-full"):
            model = model_for(impl, P + args.new + 8)
            tokens[impl] = generate(model, ids, args.new)
            per_token[impl] = per_token_ms(model, ids, args.new, args.reps)
        s, f = per_token["sdpa"], per_token["fastattn-full"]
        print("| %d | %.2f (%.2f) | %.2f (%.2f) | %.2fx | %s |"
              % (P, s[0], s[1], f[0], f[1], f[0] / s[0],
                 bool(torch.equal(tokens["sdpa"], tokens["fastattn-full"]))))


if __name__ == "__main__":
    main()
