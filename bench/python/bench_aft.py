#!/usr/bin/env python3
"""AFT (Zhai et al. 2021): fastattn.aft_attention against the same formula
in plain PyTorch, in one run (there is no fused peer: SDPA has no AFT, and
fast-transformers' AFT is not in its 0.4.0 release).

The PyTorch baselines are the efficient forms the paper describes, written
as a user would:
  simple:        sigmoid(q) * (softmax(k, over s) * v).sum(s)
  simple causal: the causal softmax by cumulative sums, exp(k - max k)
                 (as fast-transformers' later sources stabilise it)
  full:          exp(w - max w) @ (exp(k - max k) * v) / exp(w - max w) @ exp(k - max k)
                 (two matrix products; causal: w masked to -inf above the diagonal)
Inputs (N, H, L, E) float32, w (L, S) shared by the heads; forward (no grad)
and forward+backward (a sum's gradient to q, k, v and w); medians of
alternated calls after a warm-up. Ratio = PyTorch / fastattn (> 1: fastattn
faster).

Usage:
  PYTHONPATH=python FASTATTN_LIBRARY=... .venv/bin/python bench/python/bench_aft.py \
      [--threads 2] [--lengths 1024 4096 16384] [--heads 8] [--dim 64]
"""

import argparse

import torch

import fastattn
from bench_sdpa_cpu import alternated, cpu_model


def torch_simple(q, k, v, w, causal):
    if not causal:
        return torch.sigmoid(q) * (torch.softmax(k, dim=2) * v).sum(2, keepdim=True)
    e = torch.exp(k - k.amax(2, keepdim=True))
    return torch.sigmoid(q) * (e * v).cumsum(2) / e.cumsum(2)


def torch_full(q, k, v, w, causal):
    if causal:
        L, S = w.shape
        w = w.masked_fill(torch.ones(L, S, dtype=torch.bool).triu(1), float("-inf"))
    ew = torch.exp(w - w.amax(1, keepdim=True))
    ek = torch.exp(k - k.amax(2, keepdim=True))
    return torch.sigmoid(q) * torch.matmul(ew, ek * v) / torch.matmul(ew, ek)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--full-max", type=int, default=4096, help="longest L for AFT-full")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, isa = cpu_model()
    print("# %s (%s), %d threads, torch %s, N=1 H=%d E=%d float32"
          % (model, isa, args.threads, torch.__version__, args.heads, args.dim))
    print("| variant | L | fwd fastattn / torch ms (ratio) | fwd+bwd fastattn / torch ms (ratio) |")
    print("|---|---|---|---|")
    for name, baseline, with_bias in (("simple", torch_simple, False),
                                      ("full", torch_full, True)):
        for causal in (False, True):
            for L in args.lengths:
                if with_bias and L > args.full_max:
                    continue
                g = torch.Generator().manual_seed(0)
                q, k, v = (torch.randn(1, args.heads, L, args.dim, generator=g)
                           for _ in range(3))
                w = torch.randn(L, L, generator=g) * 0.1 if with_bias else None

                def ours(*t):
                    return fastattn.aft_attention(*t[:3], t[3] if with_bias else None,
                                                  None, causal)

                def theirs(*t):
                    return baseline(*t[:3], t[3] if with_bias else None, causal)

                ref = theirs(q, k, v, w)
                err = (ours(q, k, v, w) - ref).abs().max().item()
                inputs = [t.clone().requires_grad_() for t in (q, k, v)]
                if with_bias:
                    inputs.append(w.clone().requires_grad_())

                def fwd(f):
                    def run():
                        with torch.no_grad():
                            f(q, k, v, w)
                    return run

                def fwd_bwd(f):
                    def run():
                        f(*inputs).sum().backward()
                    return run

                a, b = alternated([fwd(ours), fwd(theirs)], args.reps)
                c, d = alternated([fwd_bwd(ours), fwd_bwd(theirs)], args.reps)
                print("| %s%s | %d | %.2f / %.2f (%.1fx) | %.2f / %.2f (%.1fx) |  max |diff| %.1e"
                      % (name, " causal" if causal else "", L, a, b, b / a, c, d, d / c, err))


if __name__ == "__main__":
    main()
