#!/usr/bin/env python3
"""Full attention with few queries over many keys (clustered attention's
centroid pass): fastattn's full_attention_forward / _backward operators on q
(N, H, L, E) over k, v (N, H, S, E), median and minimum of --reps calls.
By default every operand is a view of an (N, L, H, E) buffer, as the layers
pass them; --contiguous gives (N, H, L, E) copies instead
(git show 5f604de:docs/benchmarks.md, "Few queries over many keys").

  PYTHONPATH=python FASTATTN_LIBRARY=build/libfastattn.so /usr/bin/python3 \\
      bench/python/bench_centroids.py [--queries 100] [--keys 16384] [--contiguous]
"""

import argparse
import time

import torch

import fastattn  # noqa: F401  (registers torch.ops.fastattn)


def timed(fn, reps):
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    times.sort()
    return times[len(times) // 2], times[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--queries", type=int, default=100)
    ap.add_argument("--keys", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--contiguous", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    H, E = args.heads, args.dim

    def operand(rows):
        x = torch.randn(1, rows, H, E).transpose(1, 2)
        return x.contiguous() if args.contiguous else x

    q, k, v = operand(args.queries), operand(args.keys), operand(args.keys)
    scale = E ** -0.5
    ops = torch.ops.fastattn
    out, lse = ops.full_attention_forward(q, k, v, None, None, False, scale)
    g = torch.randn_like(out)
    fwd = timed(lambda: ops.full_attention_forward(q, k, v, None, None, False, scale), args.reps)
    bwd = timed(lambda: ops.full_attention_backward(g, q, k, v, out, lse, None, None, False,
                                                    scale), args.reps)
    layout = "contiguous" if args.contiguous else "(N, L, H, E) views"
    print(f"L={args.queries} S={args.keys} H={H} E={E} {layout}: forward {fwd[0]:.1f} ms "
          f"(min {fwd[1]:.1f}), backward {bwd[0]:.1f} ms (min {bwd[1]:.1f})")


if __name__ == "__main__":
    main()
