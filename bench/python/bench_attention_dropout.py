"""Fused attention dropout's cost (issue 64): full attention's forward+backward
with dropout_p = 0.1 against dropout_p = 0 (fastattn.full_attention), and
against torch's SDPA with the same dropout_p (CPU: its math backend, which
materialises the weights to drop them); then the other types with fused
dropout, through the registry operator in training (fastattn.attention(type,
..., training=True, attention_dropout=p) against attention_dropout=0, the
type's clustering or hashing included in both). N = 1, H = 8, E = 64,
float32, in one run. Times: min and median of the repetitions, seconds per
forward+backward.

  .venv/bin/python bench/python/bench_attention_dropout.py [--lengths 1024 4096]
      [--types improved-clustered:16384 local:16384] [--threads 2]
"""
import argparse
import platform
import time

import torch
import torch.nn.functional as F

import fastattn


def inputs(L):
    """q, k, v (1, 8, L, 64) that want gradients, and an output gradient."""
    torch.manual_seed(0)
    return [torch.randn(1, 8, L, 64, requires_grad=True) for _ in range(3)], torch.randn(1, 8, L, 64)


def step(x, g, fn):
    """One forward+backward of fn(q, k, v) at g."""
    def run():
        for t in x:
            t.grad = None
        fn(*x).backward(g)
    return run


def timed(fn, reps):
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    ts.sort()
    return ts[0], ts[len(ts) // 2]


# The types' parameters: the papers' settings (Vyas et al.: 100 clusters,
# top-32 keys; a window of 128), fixed seeds so both runs cluster alike.
TYPE_PARAMS = {
    "improved-clustered": dict(clusters=100, topk=32, seed=1),
    "clustered": dict(clusters=100, seed=1),
    "local": dict(window=128),
}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--types", nargs="*", default=["improved-clustered:16384", "local:16384"],
                   help="type:L pairs run through the registry operator")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor())
    print("# %s, %d threads, torch %s" % (cpu, args.threads, torch.__version__))
    print("| L | fastattn p=0 | fastattn p=%g | ratio | SDPA p=%g | fastattn / SDPA |"
          % (args.dropout, args.dropout))
    print("|---|---|---|---|---|---|")
    for L in args.lengths:
        x, g = inputs(L)
        base = timed(step(x, g, lambda q, k, v: fastattn.full_attention(q, k, v)), args.reps)
        drop = timed(step(x, g, lambda q, k, v: fastattn.full_attention(
            q, k, v, dropout_p=args.dropout)), args.reps)
        sdpa = (float("nan"), float("nan"))
        if hasattr(F, "scaled_dot_product_attention"):  # torch >= 2.0
            sdpa = timed(step(x, g, lambda q, k, v: F.scaled_dot_product_attention(
                q, k, v, dropout_p=args.dropout)), args.reps)
        print("| %d | %.3f (%.3f) | %.3f (%.3f) | %.2fx | %.3f (%.3f) | %.2fx |"
              % (L, base[0], base[1], drop[0], drop[1], drop[0] / base[0], sdpa[0], sdpa[1],
                 drop[0] / sdpa[0]))
    if args.types:
        print()
        print("| type | L | attention_dropout=0 | attention_dropout=%g | ratio |" % args.dropout)
        print("|---|---|---|---|---|")
    for spec in args.types:
        name, L = spec.rsplit(":", 1)
        L = int(L)
        params = TYPE_PARAMS.get(name, {})
        x, g = inputs(L)
        base, drop = (timed(step(x, g, lambda q, k, v, p=pdrop: fastattn.attention(
            name, q, k, v, training=True, attention_dropout=p, **params)), args.reps)
            for pdrop in (0.0, args.dropout))
        print("| %s | %d | %.3f (%.3f) | %.3f (%.3f) | %.2fx |"
              % (name, L, base[0], base[1], drop[0], drop[1], drop[0] / base[0]))


if __name__ == "__main__":
    main()
