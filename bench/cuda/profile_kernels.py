#!/usr/bin/env python3
"""Runs the kernels worth profiling once each, between cudaProfilerStart and
cudaProfilerStop, for Nsight Compute (scripts/gpu_session.sh, step 4):

  ncu --profile-from-start off --section SpeedOfLight --section Occupancy \\
      --section LaunchStats python3 bench/cuda/profile_kernels.py --library ...

The cases (N=1, H=8, E=M=64): full attention forward (bfloat16 and float16,
L=16384) and backward (bfloat16, L=4096); causal elu linear attention forward
and backward (bfloat16, L=16384); improved-clustered attention's hashing,
clustering and attention (bfloat16, L=16384, 100 clusters, top 32); hard
retrieval forward (bfloat16, L=4096). Everything is made and warmed up
before the profiled range.
"""

import argparse

import torch


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--library", required=True)
    args = p.parse_args()
    torch.ops.load_library(args.library)
    ops = torch.ops.fastattn
    torch.manual_seed(0)

    def qkv(length, dtype):
        return [torch.randn(1, 8, length, 64, device="cuda", dtype=dtype) for _ in range(3)]

    temp = 0.125
    cases = []
    for dtype in (torch.bfloat16, torch.float16):
        q, k, v = qkv(16384, dtype)
        cases.append(lambda q=q, k=k, v=v: ops.full_attention_forward(q, k, v, None, None, False,
                                                                      temp))
    q, k, v = qkv(4096, torch.bfloat16)
    out, lse = ops.full_attention_forward(q, k, v, None, None, False, temp)
    go = torch.randn_like(out)
    cases.append(lambda: ops.full_attention_backward(go, q, k, v, out, lse, None, None, False, temp))

    ql, kl, vl = qkv(16384, torch.bfloat16)
    lout, den, _ = ops.elu_linear_attention_forward(ql, kl, vl, None, True, 1e-6)
    lgo = torch.randn_like(lout)
    cases.append(lambda: ops.elu_linear_attention_forward(ql, kl, vl, None, True, 1e-6))
    cases.append(lambda: ops.elu_linear_attention_backward(lgo, ql, kl, vl, lout, den, None, True,
                                                           1e-6))

    planes = torch.randn(63, 65, device="cuda", dtype=torch.bfloat16)

    def improved():
        codes = ops.hash_queries(ql, planes)
        assignments, counts = ops.cluster_codes(codes, None, 100, 10, 0)
        return ops.improved_clustered_attention(ql, kl, vl, assignments, counts, 32, None, None)

    cases.append(improved)
    cases.append(lambda: ops.hard_retrieval_attention_forward(q, k, v, None, None, False, False,
                                                              temp, 0, False))
    for fn in cases:  # warm-up: lazy initialisation, caches
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for fn in cases:
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print("profiled %d cases" % len(cases))


if __name__ == "__main__":
    main()
