#!/usr/bin/env python3
"""Decoding one token: fastattn's full attention with one query per head over
a cache of S keys (N = 1, H = 8, E = M = 64, no mask), mean of --calls calls,
at each CPU capability given, alternating in one process (docs/benchmarks.md,
"Decoding one token over a bfloat16 cache"):

  PYTHONPATH=python /usr/bin/python3 bench/python/bench_decode_levels.py --length 4096 \\
      --dtype bfloat16 --levels amx avx512

(the default --levels: the level in use and avx512).
"""

import argparse
import time

import torch

import fastattn


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=4096, help="cache length S")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    ap.add_argument("--levels", nargs="+", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    if args.levels is None:
        args.levels = [fastattn.cpu_capability(), "avx512"]
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    q = torch.randn(1, 8, 1, 64, dtype=dtype)
    k, v = (torch.randn(1, 8, args.length, 64, dtype=dtype) for _ in range(2))
    for _ in range(args.rounds):
        for level in args.levels:
            fastattn.set_cpu_capability(level)
            with torch.no_grad():
                fastattn.full_attention(q, k, v)
                t = time.perf_counter()
                for _ in range(args.calls):
                    fastattn.full_attention(q, k, v)
            us = (time.perf_counter() - t) / args.calls * 1e6
            print(f"{level} S={args.length} {args.dtype}: {us:.1f} us")


if __name__ == "__main__":
    main()
