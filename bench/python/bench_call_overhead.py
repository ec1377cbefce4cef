"""Per-call cost of a tiny attention call: fastattn's registry operator
(fastattn.attention), its direct operator (fastattn.full_attention) and
PyTorch's SDPA on one query over 16 keys, where the call's path, not the
arithmetic, is the time (issue 65: the registry operator no dearer than SDPA).

    .venv/bin/python bench/python/bench_call_overhead.py [--threads 2] [--calls 2000]

Prints the median over repeats of the mean time per call, in microseconds,
for inputs without gradients and under torch.inference_mode.
"""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import fastattn


def per_call_us(fn, calls, repeats):
    for _ in range(50):
        fn()
    means = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        means.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(means)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--keys", type=int, default=16)
    ap.add_argument("--dim", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    shape = (1, args.heads, 1, args.dim)
    q = torch.randn(*shape, generator=g)
    k = torch.randn(1, args.heads, args.keys, args.dim, generator=g)
    v = torch.randn(1, args.heads, args.keys, args.dim, generator=g)
    torch.testing.assert_close(fastattn.attention("full", q, k, v),
                               F.scaled_dot_product_attention(q, k, v))
    cases = [
        ("fastattn.attention('full')", lambda: fastattn.attention("full", q, k, v)),
        ("fastattn.full_attention", lambda: fastattn.full_attention(q, k, v)),
        ("SDPA", lambda: F.scaled_dot_product_attention(q, k, v)),
    ]
    print(f"torch {torch.__version__}, {args.threads} threads, q (1, {args.heads}, 1, "
          f"{args.dim}) over {args.keys} keys, float32; µs a call (median of "
          f"{args.repeats} x {args.calls})")
    print(f"{'call':30s} {'no grad':>9s} {'inference':>10s}")
    for name, fn in cases:
        plain = per_call_us(fn, args.calls, args.repeats)
        with torch.inference_mode():
            inference = per_call_us(fn, args.calls, args.repeats)
        print(f"{name:30s} {plain:9.1f} {inference:10.1f}")


if __name__ == "__main__":
    main()
