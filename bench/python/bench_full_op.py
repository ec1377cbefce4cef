#!/usr/bin/env python3
"""One process, one case: fastattn's fused full attention operator (or, with
--sdpa, torch's scaled_dot_product_attention) on (1, H, L, E) float32 or bfloat16, the
median time and GFLOP/s as `fastattn bench` counts them (--dtype bfloat16:
fastattn's bfloat16 kernel where the level is amx or avx512_bf16, SDPA's own bfloat16 path). Several builds are
compared by running it once per library, alternating (git show 5f604de:docs/benchmarks.md):

  for r in 1 2 3; do for lib in /tmp/before.so /tmp/after.so; do
    PYTHONPATH=python FASTATTN_LIBRARY=$lib /usr/bin/python3 bench/python/bench_full_op.py --length 4096
  done; done
  .venv/bin/python bench/python/bench_full_op.py --length 4096 --sdpa   # torch 2.x only
"""

import argparse
import statistics
import time

import torch


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--backward", action="store_true", help="time forward+backward")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--sdpa", action="store_true", help="time torch's SDPA instead")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    L, H, E = args.length, args.heads, args.dim
    dtype = getattr(torch, args.dtype)
    q, k, v = (
        torch.randn(1, H, L, E, dtype=dtype).requires_grad_(args.backward) for _ in range(3)
    )
    if args.sdpa:
        import torch.nn.functional as F

        def attend():
            return F.scaled_dot_product_attention(q, k, v, is_causal=args.causal)
    else:
        import fastattn  # noqa: F401  (loads the operators)

        def attend():
            return torch.ops.fastattn.full_attention(q, k, v, causal=args.causal)

    def call():
        if args.backward:
            attend().sum().backward()
        else:
            with torch.no_grad():
                attend()

    call()
    times = []
    for _ in range(args.reps):
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
    t = statistics.median(times)
    flops = 4.0 * H * L * L * E * (3.5 if args.backward else 1.0) / (2 if args.causal else 1)
    name = "sdpa" if args.sdpa else "fastattn"
    pass_ = "fwd+bwd" if args.backward else "fwd"
    print(f"{name} L={L} {pass_}{' causal' if args.causal else ''}: "
          f"{t * 1e3:.1f} ms {flops / t / 1e9:.0f} GFLOP/s")


if __name__ == "__main__":
    main()
