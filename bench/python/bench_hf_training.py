"""Training a Hugging Face BERT through fastattn (issue 64): a
BertForSequenceClassification built from BertConfig's defaults (attention
dropout 0.1, hidden dropout 0.1) learns a small synthetic task with
attn_implementation 'sdpa', 'fastattn-full' and 'fastattn-improved-clustered'
in one run, from the same initial weights and batches; the loss curves
(means over windows of steps) are printed side by side, so fastattn's fused
attention dropout can be compared with sdpa's within the noise of dropout.

The task: sequences of random tokens, the label whether the first marker
token appears before the second (a dependency across the sequence).

  .venv/bin/python bench/python/bench_hf_training.py [--steps 300] [--batch 8] [--length 128]
      [--layers 12] [--threads 2] [--seeds 1]

With --seeds K each implementation trains K times, run s from initial
weights, dropout stream, batches and (improved-clustered) hashing seed all
drawn from s; a cell is then the mean over the runs and (min-max), so the
spread of sdpa's own runs is the noise the others are compared with.

(--layers below 12 shortens the default config's depth for a quick check;
the issue's figure uses the default.)
"""
import argparse
import platform
import sys
import time

import torch
import transformers

import fastattn.hf

IMPLS = ("sdpa", "fastattn-full", "fastattn-improved-clustered")


def batches(steps, batch, length, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    a, b = 1000, 1001  # the two markers
    for _ in range(steps):
        ids = torch.randint(2000, vocab, (batch, length), generator=g)
        pa = torch.randint(1, length, (batch,), generator=g)
        pb = torch.randint(1, length - 1, (batch,), generator=g)
        pb = pb + (pb >= pa).long()  # distinct positions
        ids[torch.arange(batch), pa] = a
        ids[torch.arange(batch), pb] = b
        ids[:, 0] = 101  # [CLS]
        yield ids, (pa < pb).long()


def train(impl, args, cfg, seed):
    # Its own hashing generator: draws from the global one would move every
    # later dropout mask away from the other implementations'.
    cfg.fastattn_params = {"improved-clustered": {"clusters": 16, "topk": 32, "seed": seed}}
    torch.manual_seed(2 * seed)
    model = transformers.BertForSequenceClassification(cfg)
    model.set_attn_implementation(impl)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    torch.manual_seed(2 * seed + 1)  # the dropout streams start alike
    losses, t0 = [], time.perf_counter()
    for ids, labels in batches(args.steps, args.batch, args.length, cfg.vocab_size, seed):
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, time.perf_counter() - t0


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--length", type=int, default=128)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--window", type=int, default=25)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seeds", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    fastattn.hf.register(["full", "improved-clustered"])
    cfg = transformers.BertConfig(num_hidden_layers=args.layers, num_labels=2)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor())
    print("# %s, %d threads, torch %s, transformers %s; BertConfig() defaults, %d layers, "
          "attention dropout %g; %d steps of %d x %d tokens, AdamW lr %g, %d seed(s)"
          % (cpu, args.threads, torch.__version__, transformers.__version__,
             cfg.num_hidden_layers, cfg.attention_probs_dropout_prob, args.steps, args.batch,
             args.length, args.lr, args.seeds))
    curves = {i: [] for i in IMPLS}
    seconds = {i: 0.0 for i in IMPLS}
    for seed in range(args.seeds):
        for impl in IMPLS:
            losses, took = train(impl, args, cfg, seed)
            curves[impl].append(losses)
            seconds[impl] += took
            tail = losses[-args.window:]
            print("# seed %d %s: last %d steps' mean loss %.4f, %.0f s"
                  % (seed, impl, len(tail), sum(tail) / len(tail), took),
                  file=sys.stderr, flush=True)
    w = args.window

    def cell(impl, s):
        means = [sum(c[s:s + w]) / len(c[s:s + w]) for c in curves[impl]]
        mean = sum(means) / len(means)
        return "%.4f" % mean if len(means) == 1 else "%.3f (%.3f-%.3f)" % (
            mean, min(means), max(means))

    print("| steps | " + " | ".join(IMPLS) + " |")
    print("|---|" + "---|" * len(IMPLS))
    for s in range(0, args.steps, w):
        print("| %d-%d | " % (s + 1, min(s + w, args.steps))
              + " | ".join(cell(i, s) for i in IMPLS) + " |")
    print("| seconds a run | " + " | ".join("%.0f" % (seconds[i] / args.seeds) for i in IMPLS)
          + " |")


if __name__ == "__main__":
    main()
