#!/usr/bin/env python3
"""GPU benchmarks of fastattn's CUDA operators against PyTorch, in one run.

The three speed targets of issue 10 (docs/benchmarks.md, "CUDA operators"):
  1. fused full attention within 2x of PyTorch's scaled_dot_product_attention
     (flash backend), forward and forward+backward;
  2. causal linear attention (elu feature map, fused) forward+backward faster
     than full attention from L = 2k, and at least 5x faster at L = 16k;
  3. improved-clustered attention (100 clusters, top 32 keys; hashing and
     clustering included) faster than flash attention from L = 16k.

Usage (on a machine with a CUDA GPU and the library built against its
PyTorch, see docs/cuda.md):
  python3 bench/cuda/bench_cuda.py --library build-gpu/libfastattn.so \
      [--dtype bfloat16] [--heads 8] [--batch 1] [--dims 64 128] [--json out.json]
Times are medians of CUDA-event timings after warm-up.
"""

import argparse
import json
import statistics
import sys

import torch
import torch.nn.functional as F


def timed(fn, warmup=3, min_reps=5, budget_s=1.0):
    """Median milliseconds of fn() over at least min_reps runs (CUDA events)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    total = 0.0
    while len(times) < min_reps or (total < budget_s * 1e3 and len(times) < 100):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
        total += times[-1]
    return statistics.median(times)


def flash(q, k, v, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def fwd_bwd(forward, inputs):
    """A callable running forward and backward of sum(out * g)."""
    out = forward(*inputs)
    grad = torch.randn_like(out)

    def run():
        for x in inputs:
            x.grad = None
        out = forward(*inputs)
        out.backward(grad)

    return run


def qkv(n, h, length, e, dtype, grad):
    return [
        torch.randn(n, h, length, e, device="cuda", dtype=dtype).requires_grad_(grad)
        for _ in range(3)
    ]


def bench_full(args, ops, rows):
    for e in args.dims:
        for length in args.lengths:
            for causal in (False, True):
                x = qkv(args.batch, args.heads, length, e, args.dtype, False)
                ours = timed(lambda: ops.full_attention(x[0], x[1], x[2], None, None, causal, None))
                ref = timed(lambda: flash(x[0], x[1], x[2], causal))
                xg = qkv(args.batch, args.heads, length, e, args.dtype, True)
                ours_fb = timed(
                    fwd_bwd(lambda q, k, v: ops.full_attention(q, k, v, None, None, causal, None), xg)
                )
                ref_fb = timed(fwd_bwd(lambda q, k, v: flash(q, k, v, causal), xg))
                rows.append(dict(bench="full", E=e, L=length, causal=causal, fastattn_fwd_ms=ours,
                                 flash_fwd_ms=ref, fastattn_fwd_bwd_ms=ours_fb,
                                 flash_fwd_bwd_ms=ref_fb, ratio_fwd=ours / ref,
                                 ratio_fwd_bwd=ours_fb / ref_fb))
                print(rows[-1], flush=True)


def bench_linear(args, ops, rows):
    for e in args.dims:
        for length in args.lengths:
            xg = qkv(args.batch, args.heads, length, e, args.dtype, True)
            lin = timed(fwd_bwd(lambda q, k, v: ops.elu_linear_attention(q, k, v, None, True, 1e-6), xg))
            full = timed(
                fwd_bwd(lambda q, k, v: ops.full_attention(q, k, v, None, None, True, None), xg)
            )
            ref = timed(fwd_bwd(lambda q, k, v: flash(q, k, v, True), xg))
            rows.append(dict(bench="causal-linear", E=e, L=length, linear_fwd_bwd_ms=lin,
                             fastattn_full_fwd_bwd_ms=full, flash_fwd_bwd_ms=ref,
                             speedup_vs_fastattn_full=full / lin, speedup_vs_flash=ref / lin))
            print(rows[-1], flush=True)


def bench_clustered(args, ops, rows):
    bits, clusters, topk, iterations = 63, 100, 32, 10
    for e in args.dims:
        for length in args.clustered_lengths:
            x = qkv(args.batch, args.heads, length, e, args.dtype, False)
            planes = torch.randn(bits, e + 1, device="cuda", dtype=args.dtype)

            def improved():
                codes = ops.hash_queries(x[0], planes)
                assignments, counts = ops.cluster_codes(codes, None, clusters, iterations, 0)
                return ops.improved_clustered_attention(x[0], x[1], x[2], assignments, counts,
                                                        topk, None, None)

            ours = timed(improved)
            ref = timed(lambda: flash(x[0], x[1], x[2], False))
            rows.append(dict(bench="improved-clustered", E=e, L=length, clusters=clusters,
                             topk=topk, fastattn_ms=ours, flash_ms=ref, speedup=ref / ours))
            print(rows[-1], flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--library", required=True, help="path to libfastattn.so")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--clustered-lengths", type=int, nargs="+",
                   default=[4096, 8192, 16384, 32768, 65536])
    p.add_argument("--only", nargs="+", default=["full", "linear", "clustered"])
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args()
    args.dtype = getattr(torch, args.dtype)
    if not torch.cuda.is_available():
        sys.exit("bench_cuda.py: no CUDA device")
    torch.ops.load_library(args.library)
    ops = torch.ops.fastattn
    torch.manual_seed(0)
    rows = []
    device = torch.cuda.get_device_name()
    print("device:", device, "torch", torch.__version__, flush=True)
    if "full" in args.only:
        bench_full(args, ops, rows)
    if "linear" in args.only:
        bench_linear(args, ops, rows)
    if "clustered" in args.only:
        bench_clustered(args, ops, rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=device, torch=torch.__version__, dtype=str(args.dtype),
                           batch=args.batch, heads=args.heads, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
