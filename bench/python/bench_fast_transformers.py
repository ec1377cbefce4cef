#!/usr/bin/env python3
"""fastattn against the papers' reference implementation, fast-transformers
(`pytorch-fast-transformers`, its CPU extensions built against the same
torch), in one run: the same program, written against the fast-transformers
API, run once with `fast_transformers.attention` and once with
`fastattn.compat.fast_transformers.attention`.

For each attention: forward (no grad) and forward+backward of the inner
attention module on (N, L, H, E) inputs with the package's own masks
(causal types: TriangularCausalMask; the others: FullMask, all keys);
medians of wall-clock times after one warm-up, the two packages called in
turn. The ratio is
fast-transformers' time over fastattn's (> 1: fastattn is faster).

Build fast-transformers for this (CPU only; no downloads but PyPI):
  pip download --no-deps --no-binary :all: pytorch-fast-transformers
  env PATH=/usr/sbin:/usr/bin:/sbin:/bin .venv/bin/pip install --no-build-isolation --no-deps \
      --target /tmp/ft pytorch-fast-transformers-0.4.0.tar.gz
(its setup.py builds the CUDA extensions whenever an `nvcc` is on PATH: this
machine has one in /usr/local/bin as well as /usr/local/cuda/bin)
Usage:
  PYTHONPATH=/tmp/ft .venv/bin/python bench/python/bench_fast_transformers.py \
      [--threads 2] [--length 16384] [--heads 8] [--dim 64] [--only linear local-128]
"""

import argparse
import importlib
import json

import torch

import fastattn
from bench_sdpa_cpu import alternated, cpu_model

# name -> (class, kwargs, causal): the configurations of the papers' benchmarks.
CONFIGS = {
    "full": ("FullAttention", {}, False),
    "linear": ("LinearAttention", {"query_dimensions": None}, False),
    "causal-linear": ("CausalLinearAttention", {"query_dimensions": None}, True),
    "clustered-100": ("ClusteredAttention", {"clusters": 100}, False),
    "improved-clustered-100": ("ImprovedClusteredAttention", {"clusters": 100, "topk": 32},
                               False),
    "local-128": ("LocalAttention", {"local_context": 128}, False),
    "reformer": ("ReformerAttention", {"chunk_size": 32, "rounds": 4}, False),
    "exact-topk-32": ("ExactTopKAttention", {"topk": 32}, False),
}


def build(package, name, E):
    cls, kwargs, causal = CONFIGS[name]
    attention = importlib.import_module(package + ".attention")
    kwargs = {k: (E if v is None else v) for k, v in kwargs.items()}
    module = getattr(attention, cls)(**kwargs)
    module.eval()  # no attention dropout
    return module, causal


def masks(package, N, L, causal):
    masking = importlib.import_module(package + ".masking")
    attn = masking.TriangularCausalMask(L) if causal else masking.FullMask(L)
    lengths = masking.LengthMask(torch.full((N,), L, dtype=torch.int64), max_len=L)
    return attn, lengths, lengths


PACKAGES = ("fastattn.compat.fast_transformers", "fast_transformers")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--length", type=int, default=16384)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--only", nargs="+", choices=list(CONFIGS), help="these attentions only")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import fast_transformers  # fails here, clearly, when it is not on PYTHONPATH

    model, isa = cpu_model()
    N, L, H, E = args.batch, args.length, args.heads, args.dim
    print(f"torch {torch.__version__}, fastattn {fastattn.__version__} (CPU kernels "
          f"{fastattn.cpu_capability()}), fast-transformers {fast_transformers.__version__}, "
          f"{args.threads} threads, CPU: {model} ({isa}), N={N} L={L} H={H} E={E} float32")
    print(f"{'attention':>24} {'pass':>8} {'fastattn ms':>12} {'fast-tr. ms':>12} {'ratio':>7}")
    rows = []
    for name in args.only or list(CONFIGS):
        torch.manual_seed(0)
        q, k, v = (torch.randn(N, L, H, E, requires_grad=True) for _ in range(3))
        g = torch.randn(N, L, H, E)
        # The two packages alternate call by call (bench_sdpa_cpu.alternated).
        passes = {}
        for package in PACKAGES:
            module, causal = build(package, name, E)
            attn, ql, kl = masks(package, N, L, causal)

            def fwd(module=module, attn=attn, ql=ql, kl=kl):
                with torch.no_grad():
                    return module(q, k, v, attn, ql, kl)

            def fwd_bwd(module=module, attn=attn, ql=ql, kl=kl):
                return torch.autograd.grad(module(q, k, v, attn, ql, kl), (q, k, v), g,
                                           allow_unused=True)  # reformer: shared QK

            passes[package] = (fwd, fwd_bwd)
        for i, pass_ in enumerate(("fwd", "fwd+bwd")):
            fa, ft = alternated([passes[p][i] for p in PACKAGES], args.reps)
            rows.append(dict(attention=name, pass_=pass_, fastattn_ms=fa, fast_transformers_ms=ft,
                             ratio=ft / fa))
            print(f"{name:>24} {pass_:>8} {fa:>12.1f} {ft:>12.1f} {ft / fa:>7.1f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(torch=torch.__version__, cpu=model, isa=isa, threads=args.threads,
                           N=N, L=L, H=H, E=E, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
