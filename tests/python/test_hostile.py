"""Hostile parameters and inputs, each case in a worker subprocess.

A server or a training job that calls fastattn must never be taken down or
have its memory eaten because of one parameter. The cases run in a separate
Python process (restarted after a death), so an abort, a segfault or a hang
is a failed test here, not a dead test runner. The worker caps its address
space (a few GiB above what it holds after importing torch) and reports how
much its peak resident memory grew during each case.

Each case must either return a finite output of the right shape, or raise
RuntimeError whose message names what it is about: the parameter (out of
range values), the type, or the dtype that came and the ones it takes.
Families (issue 27): sizes set by a parameter beyond the inputs (reformer
chunk_size / n_buckets, clustered types' clusters), parameters that are
model sizes (rounds, n_features, ClusterFormer's clusters), feature maps
that overflow (generalized exp, eps below the dtype's range), large scores
(improved-clustered), overflow near the dtype's range (an error saying so),
dtypes, and every numeric parameter of every type at the ends of its range,
one past them and far past them, in float32 and float64 with gradients
(issue 66: a case with "grad" runs the backward too, whose gradients must be
finite unless the call raises).

Run: part of `make test` (ctest's python_tests and the pip suite), or
  PYTHONPATH=python FASTATTN_LIBRARY=build/libfastattn.so /usr/bin/python3 -m pytest tests/python/test_hostile.py
"""

import json
import os
import select
import subprocess
import sys
import textwrap

import pytest
import torch

import fastattn

# Peak resident memory a case on these tiny inputs may add (MiB). The
# runaway cases allocated gigabytes; a clamped one allocates kilobytes, and
# torch's first use of an operator a few MiB.
MAX_GROWTH_MIB = 256
CASE_TIMEOUT_S = 60

_WORKER = textwrap.dedent(
    r"""
    import json, resource, sys, time
    import torch
    import fastattn

    def vm_bytes():
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
        return 0

    # A ceiling a few GiB above what the process holds now: a runaway
    # allocation fails (and must be reported as an error) instead of taking
    # the machine's memory.
    cap = vm_bytes() + (4 << 30)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    torch.set_num_threads(2)
    DT = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32,
          "f64": torch.float64, "i64": torch.int64}

    def peak_mib():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0

    print("ready", flush=True)
    for line in sys.stdin:
        c = json.loads(line)
        before, t0 = peak_mib(), time.time()
        try:
            g = torch.Generator().manual_seed(c.get("seed", 0))
            N, H, L, E = c.get("shape", [1, 2, 9, 4])
            dt = DT[c.get("dtype", "f32")]
            def make():
                x = torch.randn(N, H, L, E, generator=g, dtype=torch.float64) * c.get("scale", 1.0)
                return x.to(dt)
            q, k, v = make(), make(), make()
            # Sign patterns: "abs" and "-abs" make relu features all positive
            # or all zero.
            signs = c.get("signs", {})
            if signs.get("q"): q = q.abs() if signs["q"] == "abs" else -q.abs()
            if signs.get("k"): k = k.abs() if signs["k"] == "abs" else -k.abs()
            grad = c.get("grad", False)
            q, k, v = (t.detach().requires_grad_(grad) for t in (q, k, v))
            if c.get("step"):
                state, outs = None, []
                for t in range(L):
                    o, state = fastattn.attention_step(c["type"], q[:, :, t], k[:, :, t],
                                                       v[:, :, t], state, **c.get("params", {}))
                    outs.append(o)
                out = torch.stack(outs, 2)
            else:
                out = fastattn.attention(c["type"], q, k, v, causal=c.get("causal", False),
                                         **c.get("params", {}))
            res = {"status": "ok", "shape": list(out.shape),
                   "finite": bool(torch.isfinite(out.double()).all())}
            if grad and out.requires_grad:
                go = torch.randn(out.shape, generator=g, dtype=torch.float64).to(dt)
                grads = torch.autograd.grad(out, (q, k, v), go, allow_unused=True)
                grads = [x.double() for x in grads if x is not None]
                res["grad_finite"] = all(bool(torch.isfinite(x).all()) for x in grads)
                res["grad_max"] = max((float(x.abs().max()) for x in grads if x.numel()),
                                      default=0.0)
        except Exception as e:
            res = {"status": "error", "kind": type(e).__name__, "msg": str(e).split("\n")[0][:600]}
        res["growth_mib"] = peak_mib() - before
        res["seconds"] = time.time() - t0
        print(json.dumps(res), flush=True)
    """
)


class Worker:
    """A subprocess that runs cases; restarted after it dies or hangs."""

    def __init__(self):
        self.proc = None

    def _start(self):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(os.environ),
        )
        line = self.proc.stdout.readline()
        assert line.strip() == "ready", "worker did not start: " + self.proc.stderr.read()[-2000:]

    def run(self, case):
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        self.proc.stdin.write(json.dumps(case) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], CASE_TIMEOUT_S)
        if not ready:
            self.proc.kill()
            self.proc.wait()
            self.proc = None
            return {"status": "timeout"}
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            err = self.proc.stderr.read()[-1000:]
            rc = self.proc.returncode
            self.proc = None
            return {"status": "died", "rc": rc, "stderr": err}
        return json.loads(line)

    def close(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def worker():
    w = Worker()
    yield w
    w.close()


def check(worker, case, *, ok=None, error=None, shape=None):
    """Runs `case`; asserts no death, hang or runaway memory, and then:
    ok=True: a finite output (of `shape`, default (N, H, L, E));
    error=[words]: a RuntimeError whose message holds every word;
    neither: either a finite output or an error naming the type or a parameter.
    Returns the result."""
    r = worker.run(case)
    what = json.dumps(case)
    assert r["status"] not in ("died", "timeout"), "%s: %s" % (what, r)
    assert r["growth_mib"] <= MAX_GROWTH_MIB, "%s: peak memory grew by %.0f MiB" % (
        what,
        r["growth_mib"],
    )
    if r["status"] == "ok":
        assert error is None, "%s: expected an error naming %s, got an output" % (what, error)
        assert r["finite"], "%s: output not finite, without an error saying so" % what
        if case.get("grad"):
            assert r.get("grad_finite", True), (
                "%s: gradient not finite, without an error saying so" % what)
        N, H, L, E = case.get("shape", [1, 2, 9, 4])
        assert r["shape"] == (shape or [N, H, L, E]), what
    else:
        assert ok is None, "%s: expected an output, got %s" % (what, r["msg"])
        assert r["kind"] == "RuntimeError", "%s: %s" % (what, r)
        if error is not None:
            for word in error:
                assert word in r["msg"], "%s: %r not in the message: %s" % (what, word, r["msg"])
        else:
            names = [case["type"]] + list(case.get("params", {}))
            assert any(n in r["msg"] for n in names), "%s: names none of %s: %s" % (
                what,
                names,
                r["msg"],
            )
    return r


TYPES = [t["name"] for t in fastattn.attention_types()["types"]]
SPECS = {t["name"]: t["params"] for t in fastattn.attention_types()["types"]}
# Types that compute causal attention only, or refuse it.
CAUSAL_ONLY = {"causal-linear", "causal-improved-clustered"}
NOT_CAUSAL = {"linear", "clustered", "improved-clustered", "exact-topk"}


def causal_for(name):
    return name in CAUSAL_ONLY


# ---- sizes set by a parameter: clamped to what the inputs need -------------


@pytest.mark.parametrize("chunk_size", [100000, 2**40, 2**62])
@pytest.mark.parametrize("causal", [False, True])
def test_reformer_huge_chunk_size_is_clamped(worker, chunk_size, causal):
    # Used to end the process in std::bad_alloc (buffers sized by chunk_size).
    check(
        worker,
        {"type": "reformer", "params": {"chunk_size": chunk_size}, "causal": causal},
        ok=True,
    )


def test_reformer_huge_bucket_count_is_clamped(worker):
    # n_buckets = 2^24 drew a (rounds, E, 2^23) rotation matrix: 4.6 GB for L = 9.
    check(worker, {"type": "reformer", "params": {"n_buckets": 2**24}}, ok=True)


@pytest.mark.parametrize(
    "name", ["clustered", "improved-clustered", "causal-improved-clustered", "exact-topk"]
)
@pytest.mark.parametrize("value", [10**6, 2**31, 2**62])
def test_clustered_huge_counts_are_clamped(worker, name, value):
    # "clamped to L" was documented, but gigabytes were allocated first.
    param = "topk" if name == "exact-topk" else "clusters"
    check(worker, {"type": name, "params": {param: value}, "causal": causal_for(name)}, ok=True)


# ---- parameters that are model sizes: bounded, refused by name --------------


@pytest.mark.parametrize(
    "name,params,words",
    [
        ("reformer", {"rounds": 2**31}, ["rounds", "1024"]),
        ("clusterformer", {"clusters": 2**31}, ["clusters", "65536"]),
        ("linear", {"feature_map": "favor", "n_features": 2**31}, ["n_features", "65536"]),
        ("causal-linear", {"feature_map": "rff", "n_features": 2**40}, ["n_features"]),
    ],
)
def test_model_sizes_beyond_their_bound_are_refused_by_name(worker, name, params, words):
    check(worker, {"type": name, "params": params, "causal": causal_for(name)}, error=words)


def test_clusterformer_more_clusters_than_tokens(worker):
    # Blocks beyond the tokens are not built.
    check(worker, {"type": "clusterformer", "params": {"clusters": 65536}}, ok=True)


# ---- numerically hostile: stabilised, or refused saying so ------------------


@pytest.mark.parametrize("name", ["linear", "causal-linear"])
@pytest.mark.parametrize("scale", [10, 30, 100, 1e5])
@pytest.mark.parametrize("dtype", ["f32", "f64"])
def test_generalized_exp_feature_map_is_stabilised(worker, name, scale, dtype):
    # exp(w·x') overflowed from a standard deviation of ~10: NaN output.
    params = {"feature_map": "generalized", "kernel_fn": "exp"}
    case = {"type": name, "params": params, "scale": scale, "dtype": dtype,
            "causal": causal_for(name)}
    check(worker, case, ok=True)


@pytest.mark.parametrize("name", ["linear", "causal-linear"])
@pytest.mark.parametrize("feature_map", ["relu", "generalized"])
def test_eps_below_the_dtype_range_does_not_give_nan(worker, name, feature_map):
    # eps = 1e-300 rounded to 0 in float32; a query with all-zero relu
    # features then divided 0 by 0.
    params = {"feature_map": feature_map, "eps": 1e-300}
    check(worker, {"type": name, "params": params, "causal": causal_for(name)}, ok=True)


@pytest.mark.parametrize("dtype,scale", [("f32", 1e5), ("f32", 1e8), ("f64", 1e10)])
def test_improved_clustered_large_scores(worker, dtype, scale):
    # exp(s - lse) came out as exp(+rounding error) = inf at |s| ~ 1e10.
    check(worker, {"type": "improved-clustered", "scale": scale, "dtype": dtype}, ok=True)


@pytest.mark.parametrize("name", TYPES)
def test_overflow_near_the_dtype_range_is_an_error_saying_so(worker, name):
    # q·k past float32's range: no type can give a finite answer, but none
    # may return inf or NaN without saying so.
    case = {"type": name, "scale": 1e20, "dtype": "f32", "causal": causal_for(name)}
    r = check(worker, case)
    if r["status"] == "error":
        assert "overflowed" in r["msg"] or name in r["msg"], r["msg"]


@pytest.mark.parametrize("name", ["full", "local", "sparse-fixed", "reformer"])
def test_softmax_temp_past_float32_range(worker, name):
    case = {"type": name, "params": {"softmax_temp": 1e40}, "dtype": "f32",
            "causal": causal_for(name)}
    r = check(worker, case)
    if r["status"] == "error":
        assert "overflowed" in r["msg"] and "softmax_temp" in r["msg"], r["msg"]


def test_recurrent_generalized_exp_steps(worker):
    # The step form of causal-linear with exp features at a scale that
    # overflowed the batch form.
    params = {"feature_map": "generalized", "kernel_fn": "exp"}
    r = check(worker, {"type": "causal-linear", "params": params, "scale": 30, "step": True})
    if r["status"] == "error":
        assert "overflowed" in r["msg"], r["msg"]


# ---- dtypes: one rule, one message ------------------------------------------


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("dtype,word", [("f16", "Half"), ("i64", "Long")])
def test_unsupported_dtypes_say_what_is_taken(worker, name, dtype, word):
    # float16 gave "elu_cpu" not implemented for 'Half' (linear),
    # addmm_impl_cpu_ (clusterformer), bmm (exact-topk) under LibTorch 1.13.
    case = {"type": name, "dtype": dtype, "causal": causal_for(name)}
    check(worker, case, error=["float32, float64 or bfloat16 on the CPU", word])


@pytest.mark.parametrize("name", TYPES)
def test_bfloat16_runs_every_type(worker, name):
    check(worker, {"type": name, "dtype": "bf16", "causal": causal_for(name)}, ok=True)


@pytest.mark.parametrize("name", [n for n in TYPES if fastattn.capabilities()[n]["recurrent"]])
def test_bfloat16_steps_every_recurrent_type(worker, name):
    check(worker, {"type": name, "dtype": "bf16", "step": True}, ok=True)


# ---- every numeric parameter at the ends of its range and past them ---------


def edge_values(spec):
    """(value, in_range) pairs at and around the spec's range, and far past it."""
    is_int = spec["type"] == "int"
    lo, hi = spec.get("min"), spec.get("max")
    out = []
    if lo is not None:
        out.append((int(lo) if is_int else lo, not spec.get("min_exclusive", False)))
        out.append((int(lo) - 1 if is_int else lo - 1e-9, False))
    if hi is not None:
        out.append((int(hi) if is_int else hi, not spec.get("max_exclusive", False)))
        out.append((int(hi) + 1 if is_int else hi + 1e-9, False))
    far = [2**31, 2**62, 2**63 - 1] if is_int else [1e-300, 1e30, 1e300]
    for v in far:
        ok = (lo is None or v >= lo) and (hi is None or v <= hi)
        out.append((v, ok))
    return out


# In-range values run in float32 and float64 with gradients; a value out of
# range is refused before any arithmetic, once.
EDGE_CASES = [
    (name, spec["name"], value, in_range, dtype)
    for name in TYPES
    for spec in SPECS[name]
    if spec["type"] in ("int", "float")
    for value, in_range in edge_values(spec)
    for dtype in (["f32", "f64"] if in_range else ["f32"])
]


@pytest.mark.parametrize(
    "name,param,value,in_range,dtype",
    EDGE_CASES,
    ids=["%s-%s-%r-%s" % (c[0], c[1], c[2], c[4]) for c in EDGE_CASES],
)
def test_every_numeric_parameter_at_and_past_its_range(worker, name, param, value, in_range,
                                                       dtype):
    case = {"type": name, "params": {param: value}, "causal": causal_for(name), "dtype": dtype,
            "grad": True}
    if not in_range:
        check(worker, case, error=[param])
        return
    r = check(worker, case)
    if r["status"] == "error":
        # A value in range may be refused with the other parameters (a
        # combination: summary > stride, n_features with the elu map), or
        # for softmax_temp = 1e30 by overflow -- never for an allocation.
        assert "could not allocate" not in r["msg"], r["msg"]


# ---- gradients (issue 66) ------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("stride", [2**62, 2**63 - 1])
def test_sparse_strided_huge_stride_backward(worker, causal, stride):
    # The backward of stride 2**63 - 1 died of a segmentation fault (its plans'
    # position arithmetic wrapped around); the forward's output was wrong.
    check(worker, {"type": "sparse-strided", "params": {"stride": stride}, "causal": causal,
                   "dtype": "f64", "grad": True}, ok=True)


@pytest.mark.parametrize("name", ["local", "sparse-fixed"])
@pytest.mark.parametrize("causal", [False, True])
def test_block_sparse_huge_sizes_backward(worker, name, causal):
    param = "window" if name == "local" else "stride"
    params = {param: 2**63 - 1}
    if name == "sparse-fixed":
        params.update(summary=2**62, per_head_summary=True)
    check(worker, {"type": name, "params": params, "causal": causal, "shape": [1, 3, 9, 4],
                   "grad": True}, ok=True, shape=[1, 3, 9, 4])


@pytest.mark.parametrize("name", ["full", "clustered", "improved-clustered", "hard-retrieval",
                                  "local", "clusterformer", "reformer", "sparse-fixed",
                                  "exact-topk", "sparse-strided"])
@pytest.mark.parametrize("temp", [1e30, 1e300])
@pytest.mark.parametrize("dtype", ["f32", "f64"])
def test_huge_softmax_temp_gradients_are_finite_or_refused(worker, name, temp, dtype):
    # inf or NaN in dq, dk, dv with finite inputs and outputs, and no error.
    r = check(worker, {"type": name, "params": {"softmax_temp": temp}, "dtype": dtype,
                       "grad": True})
    if r["status"] == "error":
        assert "overflowed" in r["msg"] and "softmax_temp" in r["msg"], r["msg"]


@pytest.mark.parametrize("name,params", [
    ("linear", {"feature_map": "relu"}),
    ("linear", {"feature_map": "relu", "eps": 1e-45}),
    ("causal-linear", {"feature_map": "relu"}),
    ("causal-linear", {"feature_map": "relu", "eps": 1e-45}),
    ("causal-linear", {"feature_map": "relu", "eps": 1e-300}),
])
@pytest.mark.parametrize("dtype", ["f32", "f64"])
def test_all_zero_key_features_give_zero_gradients(worker, name, params, dtype):
    # Every key's relu features are 0: the output is 0 whatever q, k, v are
    # (0 / eps, as the forward defines it), so every gradient is exactly 0.
    # NaN came out of dv (linear) and dq (causal-linear, eps = 1e-45).
    r = check(worker, {"type": name, "params": params, "causal": causal_for(name),
                       "dtype": dtype, "grad": True, "signs": {"q": "abs", "k": "-abs"}},
              ok=True)
    assert r["grad_max"] == 0.0, r


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("dtype", ["f32", "f64"])
def test_gradients_near_the_dtype_range(worker, name, dtype):
    # Inputs whose scores come near the dtype's range: finite gradients or the
    # overflow error, never inf or NaN handed back.
    scale = 1e18 if dtype == "f32" else 1e150
    r = check(worker, {"type": name, "scale": scale, "dtype": dtype, "grad": True,
                       "causal": causal_for(name)})
    if r["status"] == "error":
        assert "overflowed" in r["msg"] or name in r["msg"], r["msg"]
