#!/usr/bin/env python3
"""fastattn full attention against PyTorch's scaled_dot_product_attention, on
the CPU, under the same torch, in one run: what a Python user would otherwise
call.

For each length: forward, and forward+backward, non-causal and causal;
medians of wall-clock times after one warm-up; the ratio is SDPA's time over
fastattn's (> 1: fastattn is faster). Outputs are compared first (float64
reference of the first length) so that both compute the same thing.

Usage (in the pip environment, `make pip-env`; FASTATTN_CPU_CAPABILITY and
ATEN_CPU_CAPABILITY choose lower instruction sets for either side):
  .venv/bin/python bench/python/bench_sdpa_cpu.py [--threads 2] [--lengths 512 1024 4096 16384]
      [--heads 8] [--dim 64] [--dtype float32|bfloat16] [--json out.json]
"""

import argparse
import contextlib
import json
import platform
import statistics
import time

import torch
import torch.nn.functional as F

import fastattn


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return platform.processor(), ""
    model = next((l.split(":", 1)[1].strip() for l in lines if l.startswith("model name")), "")
    flags = next((l.split(":", 1)[1].split() for l in lines if l.startswith("flags")), [])
    isa = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile") if f in flags]
    return model, " ".join(isa)


def alternated(fns, reps):
    """Median ms of each of fns, called in turn reps times after one warm-up
    each (comparisons alternate so that no side alone pays for a process's
    first calls: on a VM whose host takes free memory back, those ran at
    about twice the steady time)."""
    for fn in fns:
        fn()
    times = [[] for _ in fns]
    for _ in range(reps):
        for fn, t in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            t.append((time.perf_counter() - t0) * 1e3)
    return [statistics.median(t) for t in times]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 4096, 16384])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    model, isa = cpu_model()
    level = fastattn.cpu_capability()
    print(f"torch {torch.__version__}, fastattn {fastattn.__version__}, {args.threads} threads, "
          f"CPU: {model} ({isa}), fastattn CPU kernels: {level}, torch CPU capability: "
          f"{torch.backends.cpu.get_cpu_capability()}, N={args.batch} H={args.heads} "
          f"E={args.dim} {args.dtype}")

    # Same result first (small length, float64 against SDPA in float64).
    q, k, v = (torch.randn(1, 2, 300, 32, dtype=torch.float64) for _ in range(3))
    for causal in (False, True):
        torch.testing.assert_close(
            fastattn.full_attention(q, k, v, causal=causal),
            F.scaled_dot_product_attention(q, k, v, is_causal=causal), rtol=1e-10, atol=1e-10)

    rows = []
    print(f"{'L':>6} {'causal':>6} {'pass':>9} {'fastattn ms':>12} {'sdpa ms':>10} {'sdpa/fastattn':>14}")
    for L in args.lengths:
        reps = 5 if L <= 4096 else 2
        shape = (args.batch, args.heads, L, args.dim)
        q, k, v = (torch.randn(shape, dtype=dtype, requires_grad=True) for _ in range(3))
        g = torch.randn(shape, dtype=dtype)
        for causal in (False, True):
            def fa():
                return fastattn.full_attention(q, k, v, causal=causal)

            def sd():
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

            for name, run in (("fwd", lambda f: lambda: f()),
                              ("fwd+bwd", lambda f: lambda: torch.autograd.grad(f(), (q, k, v), g))):
                # The two sides alternate call by call (alternated).
                with torch.no_grad() if name == "fwd" else contextlib.nullcontext():
                    t_fa, t_sd = alternated([run(fa), run(sd)], reps)
                rows.append(dict(L=L, causal=causal, pass_=name, fastattn_ms=t_fa, sdpa_ms=t_sd,
                                 ratio=t_sd / t_fa))
                print(f"{L:>6} {str(causal):>6} {name:>9} {t_fa:>12.1f} {t_sd:>10.1f} "
                      f"{t_sd / t_fa:>14.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(torch=torch.__version__, cpu=model, isa=isa, threads=args.threads,
                           cpu_capability=level, dtype=args.dtype,
                           heads=args.heads, dim=args.dim, batch=args.batch, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
