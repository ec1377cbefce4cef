"""Token-by-token decoding cost of the recurrent step routes, in one run.

    PYTHONPATH=python python3 bench/python/bench_steps.py [--steps 4096] [--threads 2]

For ``full`` and ``causal-linear`` (N=1, H=8, E=M=64, float32) times T steps
of: ``fastattn.attention_step`` (eager: the cache grows by doubling),
the functional operator ``ops.attention_step`` alone (a cache step copies
the t cached rows), and ``fastattn.attention_step_`` on a fixed-size state.
Prints total seconds and the largest difference of the last outputs.
"""
import argparse
import time

import torch

import fastattn


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    N, H, E, T = 1, 8, 64, a.steps
    q, k, v = (torch.randn(N, H, T, E) for _ in range(3))
    print("torch %s, %d threads, %d steps, N=%d H=%d E=M=%d float32"
          % (torch.__version__, a.threads, T, N, H, E))
    for type in ("full", "causal-linear"):
        with torch.no_grad():
            t0 = time.perf_counter()
            state = None
            for t in range(T):
                eager, state = fastattn.attention_step(type, q[:, :, t], k[:, :, t], v[:, :, t],
                                                       state)
            t1 = time.perf_counter()
            state = []
            for t in range(T):
                functional, state = fastattn.ops.attention_step(
                    type, q[:, :, t], k[:, :, t], v[:, :, t], state, "{}")
            t2 = time.perf_counter()
            fixed = fastattn.attention_step_state(type, q[:, :, 0], v[:, :, 0], T)
            for t in range(T):
                in_place = fastattn.attention_step_(type, q[:, :, t], k[:, :, t], v[:, :, t],
                                                    fixed)
            t3 = time.perf_counter()
        diff = max((eager - functional).abs().max().item(), (eager - in_place).abs().max().item())
        print("%-14s attention_step %7.2f s   ops.attention_step %7.2f s   attention_step_ "
              "%7.2f s   max diff %.1e" % (type, t1 - t0, t2 - t1, t3 - t2, diff))


if __name__ == "__main__":
    main()
