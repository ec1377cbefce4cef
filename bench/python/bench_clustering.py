#!/usr/bin/env python3
"""Clustered attention's hashing and clustering operators alone:
hash_queries on (N, L, H, E) queries viewed as (N, H, L, E) (as the layers
pass them) and contiguous, then cluster_codes on their codes for 0..10 Lloyd
iterations; best of --repeat timeit runs of --number calls each, in ms
(git show 5f604de:docs/benchmarks.md, "Clustering and hashing, float32").

  PYTHONPATH=python FASTATTN_LIBRARY=build/libfastattn.so /usr/bin/python3 \\
      bench/python/bench_clustering.py [--length 16384] [--clusters 100] [--bits 32]
"""

import argparse
import timeit

import torch

import fastattn  # noqa: F401  (registers torch.ops.fastattn)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--bits", type=int, default=32)
    ap.add_argument("--clusters", type=int, default=100)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--number", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ops = torch.ops.fastattn
    torch.manual_seed(0)
    q = torch.randn(1, args.length, args.heads, args.dim).transpose(1, 2)
    planes = torch.randn(args.bits, args.dim + 1)

    def ms(fn):
        return min(timeit.repeat(fn, number=args.number, repeat=args.repeat)) / args.number * 1e3

    qc = q.contiguous()
    print(f"hash_queries: layers' view {ms(lambda: ops.hash_queries(q, planes)):.2f} ms, "
          f"contiguous {ms(lambda: ops.hash_queries(qc, planes)):.2f} ms")
    codes = ops.hash_queries(q, planes)
    cells = [f"{it}: {ms(lambda: ops.cluster_codes(codes, None, args.clusters, it, 0)):.2f}"
             for it in range(11)]
    print("cluster_codes ms by iterations: " + ", ".join(cells))


if __name__ == "__main__":
    main()
