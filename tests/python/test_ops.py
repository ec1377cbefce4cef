"""Python tests of the fastattn operators through the fastattn package.

Checks full_attention against a float64 torch reference written here (masks,
causal with S != L aligned bottom-right, key lengths, bool and additive masks),
gradients against torch autograd of that reference, fastattn.attention against
full_attention, the registry's errors and attention_types().

Run: ctest -R python_tests (sets PYTHONPATH and FASTATTN_LIBRARY), or
  PYTHONPATH=python FASTATTN_LIBRARY=build/libfastattn.so /usr/bin/python3 -m pytest tests/python
"""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

import fastattn

# float64 kernels against a float64 reference: only rounding differences.
F64_TOL = 1e-10
# float32 output against the float64 reference: float32 rounding of the scores,
# exponentials and sums over S <= 131 terms of O(1) values.
F32_TOL = 2e-5


def reference(q, k, v, attn_mask=None, key_lengths=None, causal=False, softmax_temp=None):
    """softmax(q k^T * scale + additive) v with "true = keep" masks, in q's dtype.

    Rows that keep no key output zeros (with zero gradients).
    """
    N, H, L, E = q.shape
    S = k.shape[2]
    scale = softmax_temp if softmax_temp is not None else 1.0 / math.sqrt(E)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # (N, H, L, S)
    keep = torch.ones(N, 1, L, S, dtype=torch.bool)
    if causal:
        i = torch.arange(L).view(L, 1)
        j = torch.arange(S).view(1, S)
        keep = keep & (j <= i + (S - L))
    if key_lengths is not None:
        j = torch.arange(S).view(1, S)
        keep = keep & (j < key_lengths.view(N, 1)).view(N, 1, 1, S)
    if attn_mask is not None:
        m = attn_mask
        if m.dim() == 3:
            m = m.unsqueeze(1)
        if m.dtype == torch.bool:
            keep = keep & m
        else:
            scores = scores + m.to(scores.dtype)
            keep = keep & torch.isfinite(m)
    keep = keep.expand(N, H, L, S)
    any_kept = keep.any(-1, keepdim=True)
    # Fully masked rows get finite scores so softmax and its gradient stay NaN-free.
    scores = torch.where(keep, scores, torch.full_like(scores, -math.inf))
    scores = torch.where(any_kept, scores, torch.zeros_like(scores))
    probs = torch.softmax(scores, -1) * any_kept
    return torch.matmul(probs, v)


def make_inputs(N, H, L, S, E, M, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(N, H, L, E, generator=g, dtype=dtype)
    k = torch.randn(N, H, S, E, generator=g, dtype=dtype)
    v = torch.randn(N, H, S, M, generator=g, dtype=dtype)
    return q, k, v


def make_mask(kind, N, H, L, S, seed=1):
    """(attn_mask, key_lengths, causal) for a named mask case."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, S + 1, (N,), generator=g)
    lengths[0] = S
    if kind == "none":
        return None, None, False
    if kind == "causal":
        return None, None, True
    if kind == "key_lengths":
        return None, lengths, False
    if kind == "causal+key_lengths":
        return None, lengths, True
    if kind == "bool_LS":
        return torch.rand(L, S, generator=g) > 0.3, None, False
    if kind == "bool_NLS+causal":
        return torch.rand(N, L, S, generator=g) > 0.3, None, True
    if kind == "additive_NHLS":
        m = torch.randn(N, H, L, S, generator=g)
        m[torch.rand(N, H, L, S, generator=g) < 0.2] = -math.inf
        return m, None, False
    if kind == "empty_rows":  # a whole query row dropped by the boolean mask
        m = torch.rand(L, S, generator=g) > 0.3
        m[0] = False
        return m, lengths, False
    raise ValueError(kind)


SHAPES = [
    # N, H, L, S, E, M
    (2, 3, 17, 17, 8, 8),
    (1, 1, 97, 131, 33, 17),  # S > L, odd sizes, batch 1, one head
    (2, 2, 131, 97, 16, 5),  # L > S: causal rows i < L - S see no key
]
MASKS = [
    "none",
    "causal",
    "key_lengths",
    "causal+key_lengths",
    "bool_LS",
    "bool_NLS+causal",
    "additive_NHLS",
    "empty_rows",
]


def cast_mask(m, dtype):
    return m if m is None or m.dtype == torch.bool else m.to(dtype)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_full_attention_matches_reference(shape, mask, dtype):
    N, H, L, S, E, M = shape
    q, k, v = make_inputs(N, H, L, S, E, M)
    attn_mask, key_lengths, causal = make_mask(mask, N, H, L, S)
    ref = reference(q, k, v, attn_mask, key_lengths, causal)
    out = fastattn.full_attention(
        q.to(dtype), k.to(dtype), v.to(dtype), cast_mask(attn_mask, dtype), key_lengths, causal
    )
    assert out.shape == (N, H, L, M)
    assert out.dtype == dtype
    tol = F64_TOL if dtype == torch.float64 else F32_TOL
    err = (out.double() - ref).abs().max().item()
    assert err <= tol, "max abs error %g > %g" % (err, tol)


def test_full_attention_softmax_temp_and_empty_rows_are_zero():
    q, k, v = make_inputs(2, 2, 9, 5, 4, 3)
    out = fastattn.full_attention(q, k, v, causal=True, softmax_temp=0.3)
    ref = reference(q, k, v, causal=True, softmax_temp=0.3)
    assert (out - ref).abs().max().item() <= F64_TOL
    # L - S = 4 queries (rows 0..3) see no key under bottom-right causal alignment.
    assert torch.all(out[:, :, :4] == 0)
    assert torch.all(out[:, :, 4:].abs().sum(-1) > 0)


@pytest.mark.parametrize("mask", ["none", "causal+key_lengths", "additive_NHLS", "empty_rows"])
def test_full_attention_gradients_match_autograd_of_reference(mask):
    N, H, L, S, E, M = 2, 2, 23, 31, 7, 5
    q, k, v = make_inputs(N, H, L, S, E, M, seed=3)
    attn_mask, key_lengths, causal = make_mask(mask, N, H, L, S, seed=4)
    grad_out = torch.randn(N, H, L, M, dtype=torch.float64)

    def grads(fn):
        qs, ks, vs = (t.clone().requires_grad_(True) for t in (q, k, v))
        fn(qs, ks, vs, attn_mask, key_lengths, causal).backward(grad_out)
        return qs.grad, ks.grad, vs.grad

    got = grads(fastattn.full_attention)
    want = grads(reference)
    for name, a, b in zip("qkv", got, want):
        assert torch.isfinite(a).all(), "d%s has non-finite values" % name
        err = (a - b).abs().max().item()
        assert err <= 1e-9, "d%s: max abs error %g" % (name, err)


def test_full_attention_dropout_rate_scale_and_reproducibility():
    """Fused attention dropout (the C++ tests check it against the float64
    reference given the same mask): with q = 0 every weight is 1/S, so with
    V the identity an output element is 0 (dropped) or 1 / ((1 - p) S)."""
    N, H, L, S, p = 2, 2, 128, 128, 0.2
    q = torch.zeros(N, H, L, 4, dtype=torch.float64)
    k = torch.randn(N, H, S, 4, dtype=torch.float64)
    v = torch.eye(S, dtype=torch.float64).expand(N, H, S, S)
    out = fastattn.full_attention(q, k, v, dropout_p=p, dropout_seed=5)
    kept = out > 0
    assert torch.allclose(out[kept], torch.tensor(1 / ((1 - p) * S), dtype=torch.float64),
                          rtol=0, atol=1e-15)
    sd = (p * (1 - p) / kept.numel()) ** 0.5
    assert abs(kept.double().mean().item() - (1 - p)) < 5 * sd
    assert torch.equal(out, fastattn.full_attention(q, k, v, dropout_p=p, dropout_seed=5))
    torch.manual_seed(3)
    a = fastattn.full_attention(q, k, v, dropout_p=p)
    torch.manual_seed(3)
    assert torch.equal(a, fastattn.full_attention(q, k, v, dropout_p=p))
    assert not torch.equal(a, fastattn.full_attention(q, k, v, dropout_p=p))
    assert torch.equal(fastattn.full_attention(q, k, v, dropout_p=0.0, dropout_seed=9),
                       fastattn.full_attention(q, k, v))
    with pytest.raises(RuntimeError, match=r"dropout_p must be in \[0, 1\)"):
        fastattn.full_attention(q, k, v, dropout_p=1.0)


@pytest.mark.parametrize("type,params", [
    ("full", {}),
    ("improved-clustered", dict(clusters=3, topk=4, seed=1)),
    ("local", dict(window=7)),
    ("sparse-fixed", dict(stride=6, summary=2)),
    ("exact-topk", dict(topk=5)),
])
def test_attention_training_applies_attention_dropout(type, params):
    """The registry operator drops attention weights only with training=True;
    the mask's seed comes from torch's generator (manual_seed reproduces), and
    the recomputing backward (attention_forward / attention_backward, what
    torch.compile runs) replays it: its gradients equal the eager ones."""
    q, k, v = make_inputs(2, 2, 24, 24, 8, 6)
    p = 0.3
    plain = fastattn.attention(type, q, k, v, **params)
    assert torch.equal(fastattn.attention(type, q, k, v, attention_dropout=p, **params), plain)
    assert torch.equal(fastattn.attention(type, q, k, v, training=True, **params), plain)

    def run(g):
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        torch.manual_seed(7)
        out = fastattn.attention(type, qg, kg, vg, training=True, attention_dropout=p, **params)
        return (out,) + torch.autograd.grad(out, (qg, kg, vg), g)

    g = torch.randn(2, 2, 24, 6, dtype=torch.float64)
    eager = run(g)
    assert torch.equal(eager[0], run(g)[0])
    assert (eager[0] - plain).abs().max() > 0.1
    torch.manual_seed(7)
    params_json = json.dumps(dict(params, attention_dropout=p))
    out, rng = fastattn.ops.attention_forward(type, q, k, v, False, None, None, params_json, True)
    torch.rand(100)  # draws between the passes change nothing
    traced = (out,) + fastattn.ops.attention_backward(type, g, q, k, v, False, None, None,
                                                      params_json, rng, True)
    for name, a, b in zip(["out", "dq", "dk", "dv"], eager, traced):
        assert torch.allclose(a, b, rtol=0, atol=1e-12), name
    if type == "full":  # the fused kernel, with the seed drawn the same way
        torch.manual_seed(7)
        torch.testing.assert_close(eager[0], fastattn.full_attention(q, k, v, dropout_p=p),
                                   rtol=0, atol=1e-12)


def test_attention_dropout_refusals_name_the_parameter():
    q, k, v = make_inputs(1, 1, 8, 8, 4, 4)
    with pytest.raises(RuntimeError, match="attention_dropout"):
        fastattn.attention("full", q, k, v, training=True, attention_dropout=1.0)
    with pytest.raises(RuntimeError, match="attention_dropout"):
        fastattn.attention("linear", q, k, v, training=True, attention_dropout=0.1)


def test_attention_full_equals_full_attention():
    q, k, v = make_inputs(2, 3, 19, 29, 8, 6)
    attn_mask, key_lengths, causal = make_mask("causal+key_lengths", 2, 3, 19, 29)
    a = fastattn.attention("full", q, k, v, causal=causal, key_lengths=key_lengths)
    b = fastattn.full_attention(q, k, v, key_lengths=key_lengths, causal=causal)
    assert torch.equal(a, b)
    m, _, _ = make_mask("additive_NHLS", 2, 3, 19, 29)
    a = fastattn.attention("full", q, k, v, attn_mask=m, softmax_temp=0.2)
    b = fastattn.full_attention(q, k, v, attn_mask=m, softmax_temp=0.2)
    assert torch.equal(a, b)
    # Not trivially equal: another temperature changes the result.
    c = fastattn.attention("full", q, k, v, attn_mask=m, softmax_temp=0.5)
    assert not torch.allclose(a, c)


def test_attention_int_for_float_param_and_decorator():
    q, k, v = make_inputs(1, 2, 12, 12, 4, 4)
    a = fastattn.attention("full", q, k, v, softmax_temp=1)  # int accepted for a float
    b = fastattn.full_attention(q, k, v, softmax_temp=1.0)
    assert torch.equal(a, b)
    c = fastattn.attention("conditional-full:full", q, k, v, causal=True, length_limit=64)
    d = fastattn.full_attention(q, k, v, causal=True)
    assert (c - d).abs().max().item() <= F64_TOL


def test_attention_gradients_flow():
    q, k, v = make_inputs(1, 2, 11, 13, 4, 3, seed=5)
    grad_out = torch.randn(1, 2, 11, 3, dtype=torch.float64)

    def grads(fn):
        qs, ks, vs = (t.clone().requires_grad_(True) for t in (q, k, v))
        fn(qs, ks, vs).backward(grad_out)
        return qs.grad, ks.grad, vs.grad

    got = grads(lambda a, b, c: fastattn.attention("full", a, b, c, causal=True))
    want = grads(lambda a, b, c: reference(a, b, c, causal=True))
    for a, b in zip(got, want):
        assert a is not None
        assert (a - b).abs().max().item() <= 1e-9


def test_bad_type_name_is_named():
    q, k, v = make_inputs(1, 1, 4, 4, 2, 2)
    with pytest.raises(RuntimeError, match="no-such-attention"):
        fastattn.attention("no-such-attention", q, k, v)


def test_unknown_parameter_is_named():
    q, k, v = make_inputs(1, 1, 4, 4, 2, 2)
    with pytest.raises(RuntimeError, match="not_a_parameter") as info:
        fastattn.attention("full", q, k, v, not_a_parameter=3)
    assert "softmax_temp" in str(info.value)  # lists the valid ones


@pytest.mark.parametrize("value", [-1.0, 0, "big", True])
def test_bad_parameter_value_is_named(value):
    q, k, v = make_inputs(1, 1, 4, 4, 2, 2)
    with pytest.raises(RuntimeError, match="softmax_temp"):
        fastattn.attention("full", q, k, v, softmax_temp=value)


def test_python_side_parameter_errors():
    q, k, v = make_inputs(1, 1, 4, 4, 2, 2)
    with pytest.raises(TypeError, match="softmax_temp"):
        fastattn.attention("full", q, k, v, softmax_temp=[0.1])
    with pytest.raises(ValueError, match="softmax_temp"):
        fastattn.attention("full", q, k, v, softmax_temp=math.nan)


def test_bad_params_json_and_shapes():
    q, k, v = make_inputs(1, 1, 4, 4, 2, 2)
    with pytest.raises(RuntimeError, match="JSON"):
        fastattn.ops.attention("full", q, k, v, False, None, None, "{not json")
    with pytest.raises(RuntimeError, match="JSON object"):
        fastattn.ops.attention("full", q, k, v, False, None, None, "[1, 2]")
    with pytest.raises(RuntimeError, match=r"q must have shape"):
        fastattn.attention("full", q[0], k, v)


def test_attention_types_lists_full():
    raw = fastattn.ops.attention_types()  # no tensor argument: dispatches all the same
    assert isinstance(raw, str)
    d = fastattn.attention_types()
    types = {t["name"]: t for t in d["types"]}
    assert "full" in types
    assert types["full"]["description"]
    params = {p["name"]: p for p in types["full"]["params"]}
    assert params["softmax_temp"]["type"] == "float"
    assert params["softmax_temp"]["default"] is None
    assert params["attention_dropout"]["type"] == "float"
    assert params["attention_dropout"]["default"] == 0.0
    assert any(dec["name"].startswith("conditional-full:") for dec in d["decorators"])


def test_ops_is_torch_ops_namespace():
    assert fastattn.ops is torch.ops.fastattn
    q, k, v = make_inputs(1, 1, 5, 6, 3, 2)
    assert torch.equal(torch.ops.fastattn.full_attention(q, k, v), fastattn.full_attention(q, k, v))


def test_library_search_reports_missing_library():
    env = dict(os.environ, FASTATTN_LIBRARY="/nonexistent/libfastattn.so")
    r = subprocess.run(
        [sys.executable, "-c", "import fastattn"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert r.returncode != 0
    assert "ImportError" in r.stderr
    assert "/nonexistent/libfastattn.so" in r.stderr


def test_full_attention_lse_topk_reference_and_gradients():
    # out and lse against the reference, top_idx against torch.topk, and
    # gradients (through out and lse) by torch.autograd.gradcheck in float64.
    torch.manual_seed(4)
    q = torch.randn(1, 2, 5, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 7, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, 7, 3, dtype=torch.float64, requires_grad=True)
    lengths = torch.tensor([6])
    out, lse, idx = fastattn.ops.full_attention_lse_topk(q, k, v, lengths, 0.5, 3)
    scores = (q @ k.transpose(-1, -2) * 0.5).masked_fill(torch.arange(7) >= 6, -math.inf)
    assert torch.allclose(out, reference(q, k, v, key_lengths=lengths, softmax_temp=0.5),
                          atol=F64_TOL)
    assert torch.allclose(lse, torch.logsumexp(scores, -1), atol=F64_TOL)
    assert torch.equal(idx, scores.topk(3, -1).indices)
    w = torch.randn(1, 2, 5, 1, dtype=torch.float64)

    def f(q, k, v):
        o, l, _ = fastattn.ops.full_attention_lse_topk(q, k, v, lengths, 0.5, 3)
        return o + w * l.unsqueeze(-1)

    assert torch.autograd.gradcheck(f, (q, k, v))


def test_improved_clustered_attention_op_gradients():
    # The fused operator given clusters: gradcheck in float64 (the clusters
    # and top-k sets are piecewise constant, so small perturbations keep them).
    torch.manual_seed(5)
    q = torch.randn(2, 2, 9, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, 11, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, 11, 3, dtype=torch.float64, requires_grad=True)
    assignments = torch.randint(0, 3, (2, 2, 9))
    assignments[1, :, 7:] = -1  # padded queries
    counts = torch.stack([(assignments == c).sum(-1) for c in range(3)], -1)
    lengths = torch.tensor([11, 8])

    def f(q, k, v):
        return fastattn.ops.improved_clustered_attention(q, k, v, assignments, counts, 4,
                                                         lengths)

    out = f(q, k, v)
    assert out.shape == (2, 2, 9, 3)
    assert torch.all(out[1, :, 7:] == 0)
    assert torch.autograd.gradcheck(f, (q, k, v))
    with pytest.raises(RuntimeError, match="topk must be in"):
        fastattn.ops.improved_clustered_attention(q, k, v, assignments, counts, 12)


@pytest.mark.parametrize("type,params", [
    ("causal-linear", {}), ("full", {"softmax_temp": 0.3}), ("hard-retrieval", {}),
    ("causal-linear", {"feature_map": "favor", "n_features": 7}),
    ("causal-linear", {"feature_map": "generalized", "kernel_fn": "exp"}),
])
def test_attention_step_equals_causal_batch_rows(type, params):
    # Token by token through attention_step == the causal batch type, row by
    # row; the exponential maps with keys whose exponents grow along the
    # sequence (their running offset is rescaled, issue 66). The fixed-size
    # state stepped in place gives the same rows.
    torch.manual_seed(6)
    q = torch.randn(2, 3, 9, 4, dtype=torch.float64)
    k = torch.randn(2, 3, 9, 4, dtype=torch.float64) * torch.linspace(0.3, 3, 9).view(9, 1)
    v = torch.randn(2, 3, 9, 5, dtype=torch.float64)
    batch = fastattn.attention(type, q, k, v, causal=True, **params)
    state = None
    fixed = fastattn.attention_step_state(type, q[:, :, 0], v[:, :, 0], 9, **params)
    for t in range(9):
        out, state = fastattn.attention_step(type, q[:, :, t], k[:, :, t], v[:, :, t], state,
                                             **params)
        assert out.shape == (2, 3, 5)
        err = float((out - batch[:, :, t]).abs().max() / (1 + batch[:, :, t].abs().max()))
        assert err <= 1e-10, f"{type} {params} position {t}: {err}"
        in_place = fastattn.attention_step_(type, q[:, :, t], k[:, :, t], v[:, :, t], fixed,
                                            **params)
        assert torch.allclose(in_place, out, rtol=0, atol=1e-12)
    assert all(isinstance(s, torch.Tensor) for s in state)
    shifted = params.get("feature_map") == "favor" or params.get("kernel_fn") == "exp"
    if type == "causal-linear":
        assert len(state) == (3 if shifted else 2)


@pytest.mark.parametrize("type", ["full", "linear"])
def test_attention_backward_under_inference_mode(type):
    # Compiled graphs may run the backward operator in inference mode, with
    # inference tensors: it must still differentiate (it returned zeros).
    torch.manual_seed(4)
    q, k, v = (torch.randn(2, 2, 5, 3, dtype=torch.float64) for _ in range(3))
    lengths = torch.tensor([5, 3])
    args = (False, lengths, None, "{}")
    out, rng = fastattn.ops.attention_forward(type, q, k, v, *args)
    g = torch.randn_like(out)
    ref = fastattn.ops.attention_backward(type, g, q, k, v, *args, rng)
    with torch.inference_mode():
        qi, ki, vi, gi, li = (t.clone() for t in (q, k, v, g, lengths))
        got = fastattn.ops.attention_backward(type, gi, qi, ki, vi, False, li, None, "{}", rng)
    for a, b in zip(ref, got):
        assert a.abs().max() > 0
        assert torch.equal(a, b)


def test_attention_step_errors_name_the_problem():
    q = torch.randn(1, 2, 4)
    with pytest.raises(RuntimeError, match="causal-linear, full"):
        fastattn.attention_step("linear", q, q, q)
    with pytest.raises(RuntimeError, match="q must have shape"):
        fastattn.attention_step("full", q[0], q, q)
    with pytest.raises(RuntimeError, match="bogus"):
        fastattn.attention_step("full", q, q, q, bogus=1)
    # A cache state of the wrong shape or dtype is named (eagerly too).
    _, state = fastattn.attention_step("full", q, q, q)
    with pytest.raises(RuntimeError, match="state V must have shape"):
        fastattn.attention_step("full", q, q, q, [state[0], state[1][..., :2]])
    with pytest.raises(RuntimeError, match="state K must be Double"):
        fastattn.attention_step("full", q.double(), q.double(), q.double(), state)
    # The functional step takes the two tensors it returned, not a fixed state.
    fixed = fastattn.attention_step_state("full", q, q, 2)
    with pytest.raises(RuntimeError, match="got 3 tensors .*attention_step_"):
        fastattn.attention_step("full", q, q, q, fixed)
    with pytest.raises(RuntimeError, match="capacity must be >= 1"):
        fastattn.attention_step_state("full", q, q, 0)
    with pytest.raises(RuntimeError, match="in-place state must hold"):
        fastattn.attention_step_("full", q, q, q, fixed[:2])
    with pytest.raises(RuntimeError, match="in-place state must hold"):
        fastattn.attention_step_("causal-linear", q, q, q, fixed)
    fastattn.attention_step_("full", q, q, q, fixed)
    fastattn.attention_step_("full", q, q, q, fixed)
    with pytest.raises(RuntimeError, match="the state is full: it holds 2 positions"):
        fastattn.attention_step_("full", q, q, q, fixed)


@pytest.mark.parametrize("type", ["causal-linear", "full"])
def test_attention_step_gradients(type):
    # The functional step is differentiable (gradcheck through two steps);
    # the in-place one refuses gradients rather than dropping them.
    torch.manual_seed(5)
    x = [torch.randn(1, 2, 3, dtype=torch.float64, requires_grad=True) for _ in range(3)]

    def two_steps(q, k, v):
        _, state = fastattn.attention_step(type, q * 0.5, k * 0.5, v * 0.5)
        out, _ = fastattn.attention_step(type, q, k, v, state)
        return out

    assert torch.autograd.gradcheck(two_steps, x)
    state = fastattn.attention_step_state(type, x[0].detach(), x[2].detach(), 2)
    with pytest.raises(RuntimeError, match="no gradients: run it under torch.no_grad"):
        fastattn.attention_step_(type, *x, state)
    with torch.no_grad():
        fastattn.attention_step_(type, *x, state)


def test_attention_step_cache_grows_by_doubling():
    # 100 eager steps of a cache type: a handful of buffers (16, 34, 70, 142
    # rows), not one copy of the cache per step.
    x = torch.randn(1, 2, 100, 4)
    state, buffers = None, set()
    for t in range(100):
        _, state = fastattn.attention_step("full", x[:, :, t], x[:, :, t], x[:, :, t], state)
        assert state[0].shape == (1, 2, t + 1, 4)
        buffers.add(state[0].data_ptr())
    assert len(buffers) == 4


@pytest.mark.parametrize("type,params", [("causal-linear", {}), ("full", {}),
                                         ("hard-retrieval", {})])
def test_attention_step_state_is_not_modified(type, params):
    # A state stepped twice (two branches from one prefix) gives independent
    # continuations, and stepping never changes a state it was given.
    torch.manual_seed(3)
    x = [torch.randn(2, 3, 4, dtype=torch.float64) for _ in range(5)]
    _, state = fastattn.attention_step(type, x[0], x[0], x[0], None, **params)
    copies = [s.clone() for s in state]
    out_a, next_a = fastattn.attention_step(type, x[1], x[2], x[3], state, **params)
    out_b, next_b = fastattn.attention_step(type, x[1], x[4], x[4], state, **params)
    for s, c in zip(state, copies):
        assert torch.equal(s, c)
    a_copies = [s.clone() for s in next_a]
    again, _ = fastattn.attention_step(type, x[1], x[2], x[3], state, **params)
    assert torch.equal(again, out_a)
    for s, c in zip(next_a, a_copies):
        assert torch.equal(s, c)
    if type != "causal-linear":  # caches: each branch holds its own key at row 1
        assert torch.equal(next_a[0][:, :, 1], x[2])
        assert torch.equal(next_b[0][:, :, 1], x[4])


def readme_python_blocks():
    readme = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")
    text = open(readme).read()
    return [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]


@pytest.mark.parametrize("index", range(len(readme_python_blocks())))
def test_readme_python_example_runs(index):
    # The README's Python blocks, run as written (keeps the README true).
    block = readme_python_blocks()[index]
    if "torch.compile" in block and not hasattr(torch.library, "register_fake"):
        pytest.skip("torch.compile with fastattn needs torch >= 2.4")
    exec(compile(block, "README.md", "exec"), {})


@pytest.mark.parametrize("type,params", [("full", "{}"), ("reformer", '{"seed": 1, "chunk_size": 4}'),
                                         ("linear", "{}"), ("causal-linear", "{}"),
                                         ("local", '{"window": 3}'),
                                         ("clustered", '{"clusters": 2, "seed": 1}'),
                                         ("improved-clustered", '{"clusters": 2, "topk": 3, "seed": 1}'),
                                         ("exact-topk", '{"topk": 3}'),
                                         ("hard-retrieval", '{"seed": 2}')])
def test_registry_keeps_the_row_layout_of_strided_inputs(type, params):
    # The fake implementation (and inductor, which asserts it) promises the
    # output in q's row layout and each gradient in its input's: q, k, v are
    # often (N, L, H, E) projections viewed as (N, H, L, E), and then the
    # output is (N, L, H, M) memory, so that transposing it back is a view.
    # Reformer's autograd gave q's gradient q's strides whatever was promised.
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 8, 3, 4).transpose(1, 2) for _ in range(3))  # (N, H, L, E) views
    assert not q.is_contiguous()
    ops = torch.ops.fastattn
    causal = type.startswith("causal")
    out, rng = ops.attention_forward(type, q, k, v, causal, None, None, params)
    assert out.transpose(1, 2).is_contiguous(), (type, out.stride())
    grad_out = torch.randn_like(out)
    grads = ops.attention_backward(type, grad_out, q, k, v, causal, None, None, params, rng)
    qc, kc, vc = q.contiguous(), k.contiguous(), v.contiguous()
    dense_out, _ = ops.attention_forward(type, qc, kc, vc, causal, None, None, params)
    assert dense_out.is_contiguous()
    dense = ops.attention_backward(type, grad_out, qc, kc, vc, causal, None, None, params, rng)
    torch.testing.assert_close(out, dense_out, rtol=1e-5, atol=1e-6)
    for g, d, x in zip(grads, dense, (q, k, v)):
        assert g.shape == x.shape and g.stride() == x.stride(), (type, g.stride())
        assert d.is_contiguous(), (type, d.stride())
        torch.testing.assert_close(g, d, rtol=1e-5, atol=1e-6)


def test_eager_backward_does_not_rerun_the_forward():
    # Eagerly, `attention` keeps the type's autograd graph from the forward:
    # the backward differentiates it rather than running the forward again
    # (which the traced attention_backward operator does).
    q, k, v = (t.requires_grad_(True) for t in make_inputs(1, 2, 16, 16, 4, 4, seed=2))
    with torch.profiler.profile() as prof:
        out = fastattn.attention("full", q, k, v, causal=True)
        out.backward(torch.ones_like(out))
    names = [e.name for e in prof.events()]
    assert names.count("fastattn::full_attention_forward") == 1, names
    assert names.count("fastattn::full_attention_backward") == 1, names


@pytest.mark.parametrize("type,params", [("full", {}), ("linear", {}), ("causal-linear", {}),
                                         ("clustered", {"clusters": 3, "seed": 1}),
                                         ("reformer", {"seed": 1, "chunk_size": 4}),
                                         ("local", {"window": 3})])
@pytest.mark.parametrize("wanted", ["qkv", "k", "qv"])
def test_eager_gradients_equal_the_traced_operators(type, params, wanted):
    # The eager graph and the traced pair (attention_forward, then
    # attention_backward recomputing the forward) give the same output and
    # gradients, for strided inputs and for any subset of inputs that
    # requires a gradient (the others get none).
    torch.manual_seed(0)
    base = [torch.randn(2, 12, 3, 4, dtype=torch.float64) for _ in range(3)]
    q, k, v = (b.transpose(1, 2) for b in base)  # the layers' (N, H, L, E) views
    causal = type.startswith("causal")
    params_json = fastattn._params_json(params)
    lengths = torch.tensor([12, 9])
    out, rng = fastattn.ops.attention_forward(type, q, k, v, causal, lengths, None, params_json)
    g = torch.randn_like(out)
    want = fastattn.ops.attention_backward(type, g, q, k, v, causal, lengths, None, params_json,
                                           rng)
    leaves = [t.detach().clone().requires_grad_(name in wanted) for t, name in zip((q, k, v), "qkv")]
    got_out = fastattn.attention(type, *leaves, causal=causal, key_lengths=lengths, **params)
    torch.testing.assert_close(got_out, out, rtol=1e-12, atol=1e-12)
    assert got_out.stride() == out.stride()
    for retained in (True, False):  # a retained graph runs its backward again
        for t in leaves:
            t.grad = None
        got_out.backward(g, retain_graph=retained)
        for t, name, w in zip(leaves, "qkv", want):
            if name not in wanted:
                assert t.grad is None
                continue
            assert t.grad.stride() == t.stride(), (type, name, t.grad.stride())
            torch.testing.assert_close(t.grad, w, rtol=1e-9, atol=1e-10)
