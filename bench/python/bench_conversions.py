#!/usr/bin/env python3
"""What a float32 copy of a bfloat16 operand costs under the torch it runs
with: `Tensor.to` into fresh memory against `copy_` into a buffer in use
(git show 5f604de:docs/benchmarks.md, "bfloat16 through the float32 kernels
without fresh copies"). Medians of --reps calls.

  /usr/bin/python3 bench/python/bench_conversions.py     # Debian's LibTorch
  .venv/bin/python bench/python/bench_conversions.py     # pip's torch
"""

import argparse
import statistics
import timeit

import torch


def timed(fn, reps):
    fn()  # warm-up
    return statistics.median(timeit.repeat(fn, number=1, repeat=reps)) * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    shape = (1, args.length, args.heads, args.dim)
    x = torch.randn(shape).to(torch.bfloat16).transpose(1, 2)  # the layers' (N, H, L, E) view
    y = torch.randn(shape).transpose(1, 2)
    wide = torch.empty(shape).transpose(1, 2)
    narrow = torch.empty(shape, dtype=torch.bfloat16).transpose(1, 2)
    print(f"torch {torch.__version__}, {shape} (N, L, H, E) viewed as (N, H, L, E), "
          f"{args.threads} threads, ms:")
    print(f"  bfloat16 -> float32, to (fresh):     {timed(lambda: x.to(torch.float32), args.reps):6.1f}")
    print(f"  bfloat16 -> float32, copy_ (in use): {timed(lambda: wide.copy_(x), args.reps):6.1f}")
    print(f"  float32 -> bfloat16, to (fresh):     {timed(lambda: y.to(torch.bfloat16), args.reps):6.1f}")
    print(f"  float32 -> bfloat16, copy_ (in use): {timed(lambda: narrow.copy_(y), args.reps):6.1f}")


if __name__ == "__main__":
    main()
