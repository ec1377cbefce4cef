#!/usr/bin/env python3
"""The registry operator's eager backward against its recomputing one, in one run.

`fastattn.attention(type, ...)` (what fastattn.nn, the fast-transformers
compatibility layer and fastattn.hf call) is one operator with its own
backward (docs/architecture.md, "The registry operator is opaque"). Two
backward paths, timed here on the same inputs, forward+backward (the
gradient of a fixed random linear loss with respect to q, k and v):

- eager: `fastattn.attention` on plain tensors keeps the type's autograd
  graph from the forward and differentiates it;
- recompute: `ops.attention_forward` then `ops.attention_backward`, the pair
  a compiled graph runs (and what eager calls ran before): the backward runs
  the type's forward again with autograd, then differentiates it.

Inputs are the layers' (N, L, H, E) projections viewed as (N, H, L, E).
Medians after a warm-up, the two paths alternating; ratio = recompute / eager.
Usage: .venv/bin/python bench/python/bench_eager_backward.py [--threads 2]
           [--length 16384] [--reps 3] [--types linear clustered ...]
"""

import argparse
import json
import statistics
import time

import torch

import fastattn
from bench_sdpa_cpu import cpu_model

# Type -> (parameters, causal): the fast-transformers benchmark's settings.
TYPES = {
    "linear": ({}, False),
    "causal-linear": ({}, True),
    "clustered": ({"clusters": 100, "seed": 1}, False),
    "improved-clustered": ({"clusters": 100, "topk": 32, "seed": 1}, False),
    "local": ({"window": 128}, False),
    "reformer": ({"chunk_size": 32, "rounds": 4, "seed": 1}, False),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--length", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--types", nargs="+", choices=list(TYPES), default=list(TYPES))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, isa = cpu_model()
    N, L, H, E = 1, args.length, args.heads, args.dim
    print(f"torch {torch.__version__}, fastattn {fastattn.__version__} (CPU kernels "
          f"{fastattn.cpu_capability()}), {args.threads} threads, CPU: {model} ({isa}), "
          f"N={N} L={L} H={H} E={E} float32")
    print(f"{'type':>20} {'eager ms':>10} {'recompute ms':>13} {'ratio':>7}")
    for type in args.types:
        params, causal = TYPES[type]
        params_json = json.dumps(params)
        torch.manual_seed(0)
        q, k, v = (torch.randn(N, L, H, E).transpose(1, 2) for _ in range(3))
        g = torch.randn(N, L, H, E).transpose(1, 2)

        def eager():
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            out = fastattn.attention(type, *leaves, causal=causal, **params)
            return torch.autograd.grad(out, leaves, g)

        def recompute():
            out, rng = fastattn.ops.attention_forward(type, q, k, v, causal, None, None,
                                                      params_json)
            return fastattn.ops.attention_backward(type, g, q, k, v, causal, None, None,
                                                   params_json, rng)

        times = {eager: [], recompute: []}
        for fn in times:  # warm-up
            fn()
        for _ in range(args.reps):
            for fn in times:
                t0 = time.perf_counter()
                fn()
                times[fn].append((time.perf_counter() - t0) * 1e3)
        e, r = statistics.median(times[eager]), statistics.median(times[recompute])
        print(f"{type:>20} {e:>10.1f} {r:>13.1f} {r / e:>7.2f}", flush=True)


if __name__ == "__main__":
    main()
