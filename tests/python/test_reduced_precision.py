"""float16 and bfloat16 on the CPU: every fastattn operator against itself in
float64 on the same values.

The CPU kernels compute in float32, on widened copies (src/ops/op_util.h,
in_float32) or, where a kernel reads and writes bfloat16 itself, on widened
tiles of its rows, and round each result once; saved softmax statistics stay
float32, as on CUDA. Each case below holds its discrete inputs fixed (cluster
assignments, top-k sets, LSH buckets, token indices), so the reduced-precision
run and the float64 run compute the same function: outputs and gradients agree
within 4 units of the dtype's rounding of the largest value (2^-8 bfloat16,
2^-11 float16). A result left in float32, or statistics saved in the reduced
dtype, fail the dtype checks.

Run: ctest -R python_tests, or
  PYTHONPATH=python FASTATTN_LIBRARY=build/libfastattn.so /usr/bin/python3 -m pytest \
      tests/python/test_reduced_precision.py
"""

import pytest
import torch

import fastattn
import fastattn.nn

ops = torch.ops.fastattn
N, H, L, E, M = 2, 3, 45, 40, 24
C, K = 5, 7  # clusters, keys per cluster
LENGTHS = torch.tensor([L, L - 13])
REDUCED = [(torch.bfloat16, 4.0 / 256), (torch.float16, 4.0 / 2048)]


def fixed_indices():
    g = torch.Generator().manual_seed(7)
    assignments = torch.randint(-1, C, (N, H, L), generator=g)
    counts = torch.stack([(assignments == c).sum(-1) for c in range(C)], -1)
    topk = torch.randint(0, L - 13, (N, H, C, K), generator=g)
    topk[..., -1] = -1  # an empty slot
    buckets = torch.randint(0, 4, (N, H, 2, L), generator=g)
    tokens = torch.randint(-1, L, (N, 17), generator=g)
    return assignments, counts, topk, buckets, tokens


ASSIGN, COUNTS, TOPK, BUCKETS, TOKENS = fixed_indices()


def first(x):
    return x[0] if isinstance(x, (tuple, list)) else x


# name -> fn(q, k, v, w) with w a float input of the case's dtype (mass or a
# mask), returning a tensor or a tuple whose float entries are compared.
CASES = {
    "full_attention causal lengths": lambda q, k, v, w: ops.full_attention(
        q, k, v, None, LENGTHS, True, None),
    "full_attention additive mask": lambda q, k, v, w: ops.full_attention(
        q, k, v, w[0, 0], None, False, 0.2),
    "full_attention_lse_topk": lambda q, k, v, w: ops.full_attention_lse_topk(
        q, k, v, LENGTHS, None, 5),
    "causal_linear_product": lambda q, k, v, w: ops.causal_linear_product(q, k, v),
    "elu_linear_attention": lambda q, k, v, w: ops.elu_linear_attention(
        q, k, v, LENGTHS, False, 1e-6),
    "elu_linear_attention causal": lambda q, k, v, w: ops.elu_linear_attention(
        q, k, v, None, True, 1e-6),
    "elu_feature_map": lambda q, k, v, w: ops.elu_feature_map(q),
    "clustered_topk_attention": lambda q, k, v, w: ops.clustered_topk_attention(
        q, k, v, TOPK, w[:, :, 0, :C].abs(), ASSIGN, LENGTHS, 0.3),
    "improved_clustered_attention": lambda q, k, v, w: ops.improved_clustered_attention(
        q, k, v, ASSIGN, COUNTS, K, LENGTHS, None),
    "hard_retrieval_attention": lambda q, k, v, w: ops.hard_retrieval_attention(
        q, k, v, None, LENGTHS, True, False, None, 0),
    "block_sparse_attention local": lambda q, k, v, w: ops.block_sparse_attention(
        q, k, v, "local", [9], LENGTHS, True, None),
    "block_sparse_attention fixed": lambda q, k, v, w: ops.block_sparse_attention(
        q, k, v, "fixed", [6, 2, 0, 0], None, False, None),
    "reformer_attention": lambda q, k, v, w: ops.reformer_attention(
        q, v, BUCKETS, LENGTHS, 8, False, True, None),
    "gather_tokens": lambda q, k, v, w: ops.gather_tokens(q, TOKENS),
}


def inputs(dtype):
    """q, k, v (leaves with gradients) and w, all bfloat16-representable."""
    g = torch.Generator().manual_seed(3)

    def rounded(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(torch.bfloat16).to(dtype)

    q, k, v = rounded(N, H, L, E), rounded(N, H, L, E), rounded(N, H, L, M)
    w = rounded(N, H, L, L)
    return [t.requires_grad_() for t in (q, k, v)] + [w]


def run(name, dtype):
    """The case's float outputs, then the gradients of sum(out * weights)."""
    q, k, v, w = inputs(dtype)
    res = CASES[name](q, k, v, w)
    res = list(res) if isinstance(res, (tuple, list)) else [res]
    floats = [r for r in res if r.is_floating_point()]
    g = torch.Generator().manual_seed(5)
    loss = sum((r.double() * torch.randn(r.shape, generator=g, dtype=torch.float64)).sum()
               for r in floats)
    loss.backward()
    grads = [x.grad if x.grad is not None else torch.zeros_like(x) for x in (q, k, v)]
    ints = [r for r in res if not r.is_floating_point()]
    return [r.detach() for r in floats], grads, ints


@pytest.mark.parametrize("dtype,tol", REDUCED, ids=["bf16", "f16"])
@pytest.mark.parametrize("name", list(CASES))
def test_operator_matches_float64(name, dtype, tol):
    want_out, want_grads, want_ints = run(name, torch.float64)
    got_out, got_grads, got_ints = run(name, dtype)
    for w_int, g_int in zip(want_ints, got_ints):
        assert torch.equal(w_int, g_int), f"{name}: integer output differs"
    labels = [f"output {i}" for i in range(len(want_out))] + ["grad q", "grad k", "grad v"]
    for label, want, got in zip(labels, want_out + want_grads, got_out + got_grads):
        # lse of full_attention_lse_topk: float32 statistics, as on CUDA.
        stats = name == "full_attention_lse_topk" and label == "output 1"
        assert got.dtype == (torch.float32 if stats else dtype), f"{name} {label}: {got.dtype}"
        scale = want.abs().max().item() if want.numel() else 0.0
        err = (got.double() - want).abs().max().item() if want.numel() else 0.0
        assert err <= tol * (1.0 + scale), f"{name} {label}: error {err:.3g}, largest {scale:.3g}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_hashing_matches_float64(dtype):
    """The codes are signs / argmaxes of products: the same on the same values
    unless a product is within float32 rounding of a tie (not on these)."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(N, H, L, E, generator=g, dtype=torch.float64).to(torch.bfloat16)
    planes = torch.randn(31, E + 1, generator=g, dtype=torch.float64).to(torch.bfloat16)
    rotations = torch.randn(2, E, 4, generator=g, dtype=torch.float64).to(torch.bfloat16)
    assert torch.equal(ops.hash_queries(x.to(dtype), planes.to(dtype)),
                       ops.hash_queries(x.double(), planes.double()))
    assert torch.equal(ops.lsh_hash(x.to(dtype), rotations.to(dtype)),
                       ops.lsh_hash(x.double(), rotations.double()))


# Operators whose CPU kernels read and write bfloat16 themselves (float32
# arithmetic on widened tiles): forward and backward ops, their arguments after
# q, k, v (forward) and after grad_out, q, k, v, out, stats (backward; the
# forward's further saved tensors last).
NATIVE_BF16 = {
    "elu_linear_attention": (ops.elu_linear_attention_forward, ops.elu_linear_attention_backward,
                             lambda causal: (LENGTHS, causal, 1e-6)),
}


@pytest.mark.parametrize("name", list(NATIVE_BF16))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("layers", [False, True], ids=["contiguous", "layers"])
def test_bfloat16_kernels_are_the_float32_kernels_rounded(name, causal, layers):
    """Bit for bit at every level this CPU runs: the float32 operator on the
    widened inputs (same strides), each result rounded to bfloat16, the
    statistics float32; gradients from the bfloat16 output, as autograd
    passes it. The layers' (N, L, H, E) views and vector tails (E = 40,
    M = 24 at the avx2 and avx512 levels: a tail of 8) included."""
    forward, backward, rest = NATIVE_BF16[name]
    g = torch.Generator().manual_seed(11)

    def bf16(D):
        shape = (N, L, H, D) if layers else (N, H, L, D)
        x = torch.randn(*shape, generator=g).to(torch.bfloat16)
        return x.transpose(1, 2) if layers else x

    q, k, v, grad = bf16(E), bf16(E), bf16(M), bf16(M)
    saved = fastattn.cpu_capability()
    try:
        for level in fastattn.supported_cpu_capabilities():
            fastattn.set_cpu_capability(level)
            out, *stats = forward(q, k, v, *rest(causal))
            want_out, *want_stats = forward(q.float(), k.float(), v.float(), *rest(causal))
            assert out.dtype == torch.bfloat16
            assert all(s.dtype == torch.float32 for s in stats), level
            assert out.stride() == want_out.stride(), level
            assert torch.equal(out, want_out.to(torch.bfloat16)), f"{name} out at {level}"
            for a, b in zip(stats, want_stats):
                assert torch.equal(a, b), f"{name} statistics at {level}"
            got = backward(grad, q, k, v, out, stats[0], *rest(causal), *stats[1:])
            want = backward(grad.float(), q.float(), k.float(), v.float(), out.float(), stats[0],
                            *rest(causal), *stats[1:])
            for label, a, b in zip(("grad q", "grad k", "grad v"), got, want):
                assert a.dtype == torch.bfloat16 and a.stride() == b.stride(), f"{label} {level}"
                assert torch.equal(a, b.to(torch.bfloat16)), f"{name} {label} at {level}"
    finally:
        fastattn.set_cpu_capability(saved)


def test_saved_statistics_are_float32():
    q, k, v, _ = inputs(torch.bfloat16)
    out, lse = ops.full_attention_forward(q, k, v, None, None, False, 0.2)
    assert (out.dtype, lse.dtype) == (torch.bfloat16, torch.float32)
    out, den, state = ops.elu_linear_attention_forward(q, k, v, None, False, 1e-6)
    assert (out.dtype, den.dtype, state.dtype) == (torch.bfloat16, torch.float32, torch.float32)


def test_mixed_dtypes_are_refused():
    q, k, v, _ = inputs(torch.bfloat16)
    with pytest.raises(RuntimeError, match="k must have q's dtype"):
        ops.full_attention(q, k.float(), v, None, None, False, None)
    with pytest.raises(RuntimeError, match="float32, float64, float16 or bfloat16 on the CPU"):
        ops.full_attention(q.int(), k.int(), v.int(), None, None, False, None)


def test_layer_runs_in_bfloat16():
    """An nn layer cast to bfloat16: output and gradients in bfloat16, close to
    the float64 layer on the same values."""
    torch.manual_seed(0)
    layer = fastattn.nn.AttentionLayer("full", d_model=32, n_heads=4).to(torch.bfloat16)
    x = torch.randn(2, 20, 32, dtype=torch.float64).to(torch.bfloat16)
    want = layer.double()(x.double())  # the same (bfloat16-representable) weights
    got = layer.to(torch.bfloat16)(x)
    assert got.dtype == torch.bfloat16
    scale = want.abs().max().item()
    assert (got.double() - want).abs().max().item() <= 8.0 / 256 * (1 + scale)
