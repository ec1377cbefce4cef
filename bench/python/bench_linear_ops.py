#!/usr/bin/env python3
"""Before/after of fastattn library builds on the elu linear attention
operators: forward and backward kernels (`elu_linear_attention_forward` /
`_backward`) at N=1, H=8, E=M=64, float32, non-causal and causal, on
contiguous (N, H, L, E) inputs and on the layers' (N, L, H, E) views. Each
library runs in its own process, the libraries alternate --rounds times (this
is how the notebook compared builds on a noisy machine: git show
5f604de:docs/benchmarks.md).

Usage (Debian's torch, libraries built against it):
  /usr/bin/python3 bench/python/bench_linear_ops.py --library /tmp/before.so /tmp/after.so
"""

import argparse
import subprocess
import sys
import time


def measure(library, length, threads, reps):
    import torch
    torch.ops.load_library(library)
    torch.set_num_threads(threads)
    ops = torch.ops.fastattn
    N, H, E = 1, 8, 64

    def min_median_ms(f):
        f()
        f()
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t)
        ts.sort()
        return f"{ts[0] * 1e3:.1f}/{ts[len(ts) // 2] * 1e3:.1f}"

    cells = []
    for layout in ("contiguous", "views"):
        def make():
            if layout == "contiguous":
                return torch.randn(N, H, length, E)
            return torch.randn(N, length, H, E).transpose(1, 2)
        q, k, v, g = make(), make(), make(), make()
        for causal in (False, True):
            # Builds after 4bc2396 return (out, den, state) and take the state last.
            out, den, *state = ops.elu_linear_attention_forward(q, k, v, None, causal, 1e-6)
            fwd = min_median_ms(
                lambda: ops.elu_linear_attention_forward(q, k, v, None, causal, 1e-6))
            bwd = min_median_ms(lambda: ops.elu_linear_attention_backward(
                g, q, k, v, out, den, None, causal, 1e-6, *state))
            cell = f"{layout}/{'causal' if causal else 'full'} fwd {fwd} bwd {bwd}"
            if state and state[0].numel():  # the same backward recomputing the state
                cell += " (recomputing: " + min_median_ms(lambda: ops.elu_linear_attention_backward(
                    g, q, k, v, out, den, None, causal, 1e-6)) + ")"
            cells.append(cell)
    print(f"{library}: " + " | ".join(cells), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--library", nargs="+", required=True, help="libfastattn.so builds to compare")
    ap.add_argument("--length", type=int, default=16384)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=20, help="timed calls per cell (min, median)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        measure(args.child, args.length, args.threads, args.reps)
        return
    print(f"ms, min/median of {args.reps}; L={args.length}, {args.threads} threads")
    for _ in range(args.rounds):
        for library in args.library:
            subprocess.run([sys.executable, __file__, "--library", library, "--child", library,
                            "--length", str(args.length), "--threads", str(args.threads),
                            "--reps", str(args.reps)], check=True)


if __name__ == "__main__":
    main()
