#!/usr/bin/env python3
"""Every registered attention type in bfloat16 against float32 on the CPU:
forward and forward+backward through fastattn.attention on the same values,
the two dtypes alternating call by call, and their ratio (bfloat16 time over
float32 time: below 1, bfloat16 is faster). Types that cannot run without
causal masking run causal (docs/benchmarks.md).

  PYTHONPATH=python FASTATTN_LIBRARY=build/libfastattn.so /usr/bin/python3 \\
      bench/python/bench_dtypes.py [--length 4096] [--only linear local] [--reps 3]
"""

import argparse

import torch

import fastattn
from bench_sdpa_cpu import alternated


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3, help="timed calls per cell (median)")
    ap.add_argument("--only", nargs="+", help="these types (default: every registered one)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    types = {t["name"]: t["capabilities"] for t in fastattn.attention_types()["types"]}
    N, L, H, E = 1, args.length, args.heads, args.dim
    print(f"fastattn {fastattn.__version__} (CPU kernels {fastattn.cpu_capability()}), "
          f"torch {torch.__version__}, {args.threads} threads, N={N} L={L} H={H} E={E}; "
          f"ms, medians of {args.reps}")
    print(f"{'type':>26} {'pass':>8} {'float32':>9} {'bfloat16':>9} {'bf16/f32':>9}")
    for name in args.only or sorted(types):
        causal = not types[name]["bidirectional"]
        torch.manual_seed(0)
        # The same (bfloat16-representable) values in both dtypes.
        base = [torch.randn(N, L, H, E).to(torch.bfloat16).transpose(1, 2) for _ in range(4)]
        cells = {}
        for dtype in (torch.float32, torch.bfloat16):
            q, k, v = (x.to(dtype).requires_grad_() for x in base[:3])
            g = base[3].to(dtype)

            def fwd(q=q, k=k, v=v):
                with torch.no_grad():
                    fastattn.attention(name, q, k, v, causal=causal)

            def fwd_bwd(q=q, k=k, v=v, g=g):
                out = fastattn.attention(name, q, k, v, causal=causal)
                torch.autograd.grad(out, (q, k, v), g, allow_unused=True)

            cells[dtype] = (fwd, fwd_bwd)
        for i, pass_ in enumerate(("fwd", "fwd+bwd")):
            f32, bf16 = alternated([cells[torch.float32][i], cells[torch.bfloat16][i]], args.reps)
            print(f"{name:>26} {pass_:>8} {f32:>9.1f} {bf16:>9.1f} {bf16 / f32:>9.2f}", flush=True)


if __name__ == "__main__":
    main()
