#!/usr/bin/env python3
"""The layers' layout in place against contiguous copies, in one run.

Every attention layer projects to (N, L, H·E) and hands the attention
(N, H, L, E) views of it (a transpose); the result goes back through the
opposite transpose and a reshape. For each type this times, through the
registry operator (`fastattn.attention`, what the Python modules call):

- in place: the views as they are (kernels with row strides read them and
  write the output in the (N, L, H, M) order, docs/architecture.md "Row
  layouts");
- copies: q, k, v made contiguous first and the result made contiguous in
  the (N, L, H, M) order after, which is what every operator did before the
  row-layout kernels (and still does for types without them).

Forward (no grad) and forward+backward (a sum of the (N, L, H·M) output),
medians after a warm-up; ratio = copies / in place (> 1: in place faster).

--kernels: instead, the elu_linear_attention forward and backward operators
alone on contiguous inputs and on the (N, L, H, E) views, the four calls
alternating --reps times at L = --lengths[0] (default 16384), medians.
Usage: .venv/bin/python bench/python/bench_row_layouts.py [--threads 2]
           [--types linear causal-linear full] [--lengths 1024 16384] [--kernels]
"""

import argparse
import statistics
import time

import torch

import fastattn
from bench_sdpa_cpu import cpu_model, timed

# The length each type is timed at when --lengths is not given: full
# attention is quadratic.
DEFAULT_LENGTHS = {"linear": [1024, 16384], "causal-linear": [1024, 16384], "full": [1024, 4096]}


def run(type, x, copies, backward):
    """One call of `type` on the (N, L, H, E) projections x (three tensors)."""
    N, L, H, E = x[0].shape
    q, k, v = (t.transpose(1, 2) for t in x)
    if copies:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = fastattn.attention(type, q, k, v, causal=type.startswith("causal"))
    out = out.transpose(1, 2)
    out = (out.contiguous() if copies else out).reshape(N, L, H * E)
    if backward:
        out.sum().backward()


def kernels(L, H, E, reps):
    """The linear attention operators alone: contiguous against the views."""
    torch.manual_seed(0)
    views = [torch.randn(1, L, H, E).transpose(1, 2) for _ in range(3)]
    dense = [t.contiguous() for t in views]
    fw = torch.ops.fastattn.elu_linear_attention_forward
    bw = torch.ops.fastattn.elu_linear_attention_backward
    print("| pass | causal | contiguous ms | views ms |")
    print("|---|---|---:|---:|")
    for causal in (False, True):
        out_d, den_d, state_d = fw(*dense, None, causal, 1e-6)
        out_v, den_v, state_v = fw(*views, None, causal, 1e-6)
        grad = torch.randn_like(out_d)
        calls = {
            ("fwd", "contiguous"): lambda: fw(*dense, None, causal, 1e-6),
            ("fwd", "views"): lambda: fw(*views, None, causal, 1e-6),
            ("bwd", "contiguous"): lambda: bw(grad, *dense, out_d, den_d, None, causal, 1e-6,
                                              state_d),
            ("bwd", "views"): lambda: bw(grad, *views, out_v, den_v, None, causal, 1e-6, state_v),
        }
        times = {key: [] for key in calls}
        for _ in range(reps):
            for key, call in calls.items():
                t0 = time.perf_counter()
                call()
                times[key].append((time.perf_counter() - t0) * 1e3)
        for name in ("fwd", "bwd"):
            print(f"| {name} | {causal} | {statistics.median(times[name, 'contiguous']):.1f} | "
                  f"{statistics.median(times[name, 'views']):.1f} |", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--types", nargs="+", default=list(DEFAULT_LENGTHS))
    ap.add_argument("--lengths", type=int, nargs="+", help="default: per type, see the source")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--kernels", action="store_true", help="the linear operators alone")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, isa = cpu_model()
    print(f"torch {torch.__version__}, fastattn {fastattn.__version__} (CPU kernels "
          f"{fastattn.cpu_capability()}), {args.threads} threads, CPU: {model} ({isa}), "
          f"N=1 H={args.heads} E={args.dim} float32")
    if args.kernels:
        kernels((args.lengths or [16384])[0], args.heads, args.dim, args.reps)
        return
    print("| type | L | pass | copies ms | in place ms | copies / in place |")
    print("|---|---:|---|---:|---:|---:|")
    for type in args.types:
        for L in args.lengths or DEFAULT_LENGTHS.get(type, [1024]):
            torch.manual_seed(0)
            x = [torch.randn(1, L, args.heads, args.dim) for _ in range(3)]
            xg = [t.clone().requires_grad_() for t in x]
            for name, inputs, backward in (("fwd", x, False), ("fwd+bwd", xg, True)):
                ms = []
                for copies in (True, False):
                    with torch.set_grad_enabled(backward):
                        ms.append(timed(lambda: run(type, inputs, copies, backward), args.reps))
                print(f"| {type} | {L} | {name} | {ms[0]:.1f} | {ms[1]:.1f} | "
                      f"{ms[0] / ms[1]:.2f} |", flush=True)


if __name__ == "__main__":
    main()
