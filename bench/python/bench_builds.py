#!/usr/bin/env python3
"""Builds of fastattn against each other on the fast-transformers benchmark's
configurations (bench_fast_transformers.py CONFIGS, through
fastattn.compat.fast_transformers): forward (no grad) and forward+backward of
the inner attention module on (N, L, H, E) inputs, each library in its own
process, the libraries alternating --rounds times (on this noisy VM, the way
the notebook compared a change's before and after: git show
5f604de:docs/benchmarks.md).

Usage (Debian's torch; libraries built against it, e.g. copies of
build/libfastattn.so before and after a change):
  /usr/bin/python3 bench/python/bench_builds.py --library /tmp/before.so /tmp/after.so \
      [--only clustered-100 local-128] [--length 16384] [--reps 5] [--rounds 3] \
      [--dtype bfloat16]
"""

import argparse
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def measure(args):
    import torch
    torch.set_num_threads(args.threads)
    from bench_fast_transformers import CONFIGS, build, masks
    from bench_sdpa_cpu import timed
    package = "fastattn.compat.fast_transformers"
    N, L, H, E = 1, args.length, args.heads, args.dim
    cells = []
    for name in args.only or [c for c in CONFIGS if c not in ("full", "exact-topk-32")]:
        torch.manual_seed(0)
        dtype = getattr(torch, args.dtype)
        q, k, v = (torch.randn(N, L, H, E, dtype=dtype, requires_grad=True) for _ in range(3))
        g = torch.randn(N, L, H, E, dtype=dtype)
        module, causal = build(package, name, E)
        attn, ql, kl = masks(package, N, L, causal)

        def fwd():
            with torch.no_grad():
                module(q, k, v, attn, ql, kl)

        def fwd_bwd():
            torch.autograd.grad(module(q, k, v, attn, ql, kl), (q, k, v), g, allow_unused=True)

        cells.append(f"{name} {timed(fwd, args.reps):.1f} / {timed(fwd_bwd, args.reps):.1f}")
    print(f"{os.path.basename(args.child)}: " + " | ".join(cells), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--library", nargs="+", required=True, help="libfastattn.so builds to compare")
    ap.add_argument("--only", nargs="+", help="configurations (default: all but full, exact-topk)")
    ap.add_argument("--length", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--reps", type=int, default=5, help="timed calls per cell (median)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        measure(args)
        return
    print(f"fwd / fwd+bwd ms, medians of {args.reps}; L={args.length}, {args.threads} threads, "
          f"{args.dtype}")
    python_dir = os.path.join(HERE, "..", "..", "python")
    for _ in range(args.rounds):
        for library in args.library:
            env = dict(os.environ, FASTATTN_LIBRARY=library,
                       PYTHONPATH=os.pathsep.join([python_dir, HERE]))
            cmd = [sys.executable, __file__, "--library", library, "--child", library,
                   "--length", str(args.length), "--heads", str(args.heads), "--dim",
                   str(args.dim), "--threads", str(args.threads), "--reps", str(args.reps),
                   "--dtype", args.dtype]
            if args.only:
                cmd += ["--only", *args.only]
            subprocess.run(cmd, check=True, env=env)


if __name__ == "__main__":
    main()
