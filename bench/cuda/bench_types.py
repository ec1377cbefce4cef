#!/usr/bin/env python3
"""Every attention type on the GPU against PyTorch's SDPA, in one run.

For each dtype, each registered type (through ``fastattn.attention``, the
registry operator users call) and each sequence length: the forward time, the
forward+backward time, and the peak GPU memory of each above the inputs'.
The reference rows ``sdpa-flash`` and ``sdpa-flash-causal`` are
``torch.nn.functional.scaled_dot_product_attention`` with the flash backend on
inputs of the same shape, ``sdpa-default`` and ``sdpa-default-causal`` the
backend SDPA picks itself (what a user gets: cuDNN or flash). Each type runs
once per --routes entry, the dense-attention engine's route
(FASTATTN_DENSE_ENGINE: ``auto`` composes the types on PyTorch's fused
kernels, ``never`` keeps fastattn's own CUDA kernels; issue 62), recorded as
the row's ``route``. Issue 24's and 62's targets are read off these rows
(docs/benchmarks.md, "CUDA operators").

Robust to what a first run on a GPU may bring: each (dtype, type) group runs
in a child process; a child that dies or reports a CUDA error (which poisons
the CUDA context) is recorded for its group and a new child goes on with the
rest. A length whose forward+backward took longer than --slow-ms ends its
group's longer lengths; --deadline ends the run, keeping every row so far.

Usage (see scripts/gpu_session.sh):
  python3 bench/cuda/bench_types.py --library build-gpu/libfastattn.so --jsonl out.jsonl
  python3 bench/cuda/bench_types.py --device cpu --lengths 64 --library ...   # smoke test
Rows are JSON lines; times are medians (CUDA events on the GPU).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

# Types that only make sense causally run with causal=True and compare with
# causal flash; the others run without a mask.
CAUSAL_TYPES = {"causal-linear", "causal-improved-clustered"}
# Parameters away from the defaults: the papers' settings.
PARAMS = {
    "clustered": dict(clusters=100),
    "improved-clustered": dict(clusters=100, topk=32),
    "causal-improved-clustered": dict(clusters=100, topk=32),
}
REFERENCES = ("sdpa-flash", "sdpa-flash-causal", "sdpa-default", "sdpa-default-causal")


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--library", required=True, help="path to libfastattn.so")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16"])
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384, 65536])
    p.add_argument("--types", nargs="+", help="default: every registered type")
    p.add_argument("--routes", nargs="+", default=["auto", "never"],
                   choices=["auto", "always", "never"],
                   help="dense-engine routes each type runs under (FASTATTN_DENSE_ENGINE)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--slow-ms", type=float, default=1500.0,
                   help="a forward+backward slower than this skips the group's longer lengths")
    p.add_argument("--budget-ms", type=float, default=150.0,
                   help="timing stops after this many ms of runs (at least --reps runs)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--deadline", type=float, default=0.0,
                   help="seconds from now after which no new case starts (0: none)")
    p.add_argument("--jsonl", required=True, help="append the rows here")
    p.add_argument("--child", help=argparse.SUPPRESS)
    return p.parse_args()


def emit(path, row):
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


def child(args):
    import torch
    import torch.nn.functional as F

    os.environ["FASTATTN_LIBRARY"] = args.library
    import fastattn

    cuda = args.device.startswith("cuda")
    dev = torch.device(args.device)
    torch.manual_seed(0)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def timed(fn):
        """(median ms, first-run ms) of fn."""
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        first = (time.perf_counter() - t0) * 1e3
        times = []
        while len(times) < args.reps or (sum(times) < args.budget_ms and len(times) < 50):
            if first > args.slow_ms and times:
                break
            if cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                torch.cuda.synchronize()
                times.append(a.elapsed_time(b))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    def peak(fn):
        """MiB allocated above what was allocated before fn (GPU only)."""
        if not cuda:
            return None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20

    def make_forward(name):
        if name in REFERENCES:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            causal = name.endswith("causal")

            def fwd(q, k, v):
                if not cuda or "default" in name:
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

            return fwd
        causal = name in CAUSAL_TYPES
        params = PARAMS.get(name, {})
        return lambda q, k, v: fastattn.attention(name, q, k, v, causal=causal, **params)

    for group in args.child.split(","):
        dtype_name, name = group.split(":", 1)
        name = name.split("@")[0]  # the route: this child's FASTATTN_DENSE_ENGINE
        dtype = getattr(torch, dtype_name)
        emit(args.jsonl, dict(group_start=group))
        forward = make_forward(name)
        for length in args.lengths:
            row = dict(type=name, dtype=dtype_name, L=length, N=args.batch, H=args.heads,
                       E=args.dim, params=PARAMS.get(name, {}))
            if name not in REFERENCES:
                row["route"] = os.environ.get("FASTATTN_DENSE_ENGINE", "auto")
            if args.deadline and time.time() > args.deadline:
                row["skipped"] = "deadline"
                emit(args.jsonl, row)
                continue
            try:
                shape = (args.batch, args.heads, length, args.dim)
                x = [torch.randn(shape, device=dev, dtype=dtype) for _ in range(3)]
                with torch.no_grad():
                    row["fwd_ms"] = timed(lambda: forward(*x))
                    row["fwd_peak_mib"] = peak(lambda: forward(*x))
                xg = [t.clone().requires_grad_(True) for t in x]
                grad = torch.randn(shape, device=dev, dtype=dtype)

                def fwd_bwd():
                    for t in xg:
                        t.grad = None
                    forward(*xg).backward(grad)

                row["fwd_bwd_ms"] = timed(fwd_bwd)
                row["fwd_bwd_peak_mib"] = peak(fwd_bwd)
                del x, xg, grad
            except Exception as e:  # recorded; a CUDA error ends this child
                msg = "%s: %s" % (type(e).__name__, str(e).strip().splitlines()[0][:400])
                row["error"] = msg
                emit(args.jsonl, row)
                if cuda and ("CUDA" in msg or "cuda" in msg) and "out of memory" not in msg:
                    sys.exit(3)
                if cuda:
                    torch.cuda.empty_cache()
                break
            emit(args.jsonl, row)
            if row["fwd_bwd_ms"] > args.slow_ms:
                break
        emit(args.jsonl, dict(group_end=group))


def parent(args):
    import torch

    os.environ["FASTATTN_LIBRARY"] = args.library
    import fastattn

    names = args.types or [t["name"] for t in fastattn.attention_types()["types"]]
    # The references once, then every type under each route (one child
    # environment per route: the engine reads FASTATTN_DENSE_ENGINE once).
    runs = [(None, ["%s:%s" % (d, n) for d in args.dtypes for n in REFERENCES])]
    runs += [(r, ["%s:%s@%s" % (d, n, r) for d in args.dtypes for n in names])
             for r in args.routes]
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device
    emit(args.jsonl, dict(device=device, torch=torch.__version__, fastattn=fastattn.__version__,
                          lengths=args.lengths, routes=args.routes,
                          groups=sum(len(g) for _, g in runs)))
    argv = [a for a in sys.argv[1:]]
    if args.deadline and args.deadline < 1e9:  # relative: make it absolute for the children
        i = argv.index("--deadline")
        argv[i + 1] = str(time.time() + args.deadline)
    deadline = float(argv[argv.index("--deadline") + 1]) if args.deadline else 0.0
    for route, groups in runs:
        env = dict(os.environ)
        if route:
            env["FASTATTN_DENSE_ENGINE"] = route
        run_groups(args, argv, groups, deadline, env)


def run_groups(args, argv, groups, deadline, env):
    """Children over the groups until each is done or has failed."""
    while groups:
        # A child that hangs (a kernel that never ends) is killed 60 s after the deadline.
        limit = max(60.0, deadline - time.time() + 60.0) if deadline else None
        try:
            rc = subprocess.call([sys.executable, __file__] + argv + ["--child", ",".join(groups)],
                                 timeout=limit, env=env)
        except subprocess.TimeoutExpired:
            emit(args.jsonl, dict(group=groups[0], child_exit="killed after %.0f s" % limit))
            break
        done, started = set(), None
        with open(args.jsonl) as f:
            for line in f:
                row = json.loads(line)
                if "group_start" in row:
                    started = row["group_start"]
                elif "group_end" in row:
                    done.add(row["group_end"])
        pending = [g for g in groups if g not in done]
        if rc != 0 and pending:
            # The group in progress died (or hit a CUDA error); the rest go on.
            failed = started if started in pending else pending[0]
            emit(args.jsonl, dict(group=failed, child_exit=rc))
            pending.remove(failed)
        elif rc != 0 or pending == groups:
            break
        groups = pending


def main():
    args = parse()
    if args.child:
        child(args)
    else:
        parent(args)


if __name__ == "__main__":
    main()
