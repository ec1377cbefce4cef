"""The dense-attention engine through its internal operators
(``torch.ops.fastattn._dense_attention_forward`` / ``_backward``, issue 62).

- On the CPU: windows, causal alignment and packed sequences against a plain
  float64 softmax written here, forward and backward.
- On meta tensors (torch >= 2.4): float16 / bfloat16 inputs take the route to
  PyTorch's flash attention ops, whose meta kernels check the arguments fastattn
  passes (layouts, windows, packed offsets) and give the shapes and dtypes the
  GPU will; the C++ tests cover the CPU route in depth
  (tests/cpp/test_dense_attention.cpp).
"""

import pytest
import torch

import fastattn  # noqa: F401  (loads the operators)

ops = torch.ops.fastattn
HAS_FLASH_OPS = hasattr(torch.ops.aten, "_flash_attention_forward") and tuple(
    int(x) for x in torch.__version__.split(".")[:2]) >= (2, 4)


def operators_called(fn):
    """The names of the operators fn dispatches (PyTorch's profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events()}


def reference(q, k, v, scale, causal, left, right):
    """Plain softmax over the keys the engine's rules keep, float64."""
    L, S = q.shape[-2], k.shape[-2]
    p = torch.arange(L).view(L, 1) + (S - L)
    j = torch.arange(S).view(1, S)
    keep = torch.ones(L, S, dtype=torch.bool)
    if causal:
        keep &= j <= p
    if left >= 0:
        keep &= j >= p - left
    if right >= 0:
        keep &= j <= p + right
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    s = s.masked_fill(~keep, float("-inf"))
    lse = s.logsumexp(-1)
    w = (s - lse.unsqueeze(-1)).exp().nan_to_num(0.0)
    return w @ v.double(), lse


@pytest.mark.parametrize("L,S", [(6, 6), (4, 9), (9, 4)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("left,right", [(-1, -1), (2, -1), (1, 1), (3, 0)])
def test_cpu_route_equals_a_plain_softmax(L, S, causal, left, right):
    g = torch.Generator().manual_seed(L * 31 + S)
    q, k = (torch.randn(2, 3, n, 4, generator=g, dtype=torch.float64) for n in (L, S))
    v = torch.randn(2, 3, S, 5, generator=g, dtype=torch.float64)
    out, lse = ops._dense_attention_forward(q, k, v, 0.6, causal, left, right)
    ref_out, ref_lse = reference(q, k, v, 0.6, causal, left, right)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-12)
    dead = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), dead)
    torch.testing.assert_close(lse[~dead], ref_lse[~dead], rtol=0, atol=1e-12)
    # Backward against autograd through the reference.
    x = [t.clone().requires_grad_(True) for t in (q, k, v)]
    go = torch.randn(out.shape, generator=g, dtype=torch.float64)
    want = torch.autograd.grad(reference(*x, 0.6, causal, left, right)[0], x, go)
    got = ops._dense_attention_backward(go, q, k, v, out, lse, 0.6, causal, left, right)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11)


def test_cpu_route_packed_sequences():
    g = torch.Generator().manual_seed(2)
    lens = [(3, 5), (0, 2), (4, 4)]
    cq = torch.tensor([0, 3, 3, 7])
    ck = torch.tensor([0, 5, 7, 11])
    q = torch.randn(7, 2, 4, generator=g, dtype=torch.float64)
    k = torch.randn(11, 2, 4, generator=g, dtype=torch.float64)
    v = torch.randn(11, 2, 3, generator=g, dtype=torch.float64)
    out, lse = ops._dense_attention_forward(q, k, v, 0.5, True, -1, -1, None, cq, ck)
    assert out.shape == (7, 2, 3) and lse.shape == (2, 7)
    for b, (nl, ns) in enumerate(lens):
        if nl == 0:
            continue
        qs = q[cq[b]:cq[b + 1]].transpose(0, 1)
        ks, vs = (t[ck[b]:ck[b + 1]].transpose(0, 1) for t in (k, v))
        ro, rl = reference(qs, ks, vs, 0.5, True, -1, -1)
        torch.testing.assert_close(out[cq[b]:cq[b + 1]].transpose(0, 1), ro, rtol=0, atol=1e-12)
        torch.testing.assert_close(lse[:, cq[b]:cq[b + 1]], rl, rtol=0, atol=1e-12)


@pytest.mark.skipif(not HAS_FLASH_OPS, reason="PyTorch's flash ops with windows need torch >= 2.4")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_meta_tensors_take_the_flash_route(dtype):
    N, H, L, S, E = 2, 3, 5, 7, 64
    q = torch.empty(N, H, L, E, device="meta", dtype=dtype)
    k = torch.empty(N, H, S, E, device="meta", dtype=dtype)
    v = torch.empty(N, H, S, E, device="meta", dtype=dtype)
    out, lse = ops._dense_attention_forward(q, k, v, 0.125, True, 3, 0)
    assert out.shape == (N, H, L, E) and out.dtype == dtype
    assert lse.shape == (N, H, L) and lse.dtype == torch.float32
    dq, dk, dv = ops._dense_attention_backward(out, q, k, v, out, lse, 0.125, True, 3, 0)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert dq.dtype == dk.dtype == dv.dtype == dtype
    # Packed sequences: flash's own layout, lse (H, Tq).
    qp = torch.empty(9, H, E, device="meta", dtype=dtype)
    kp = torch.empty(11, H, E, device="meta", dtype=dtype)
    cq = torch.tensor([0, 4, 9], device="meta")
    ck = torch.tensor([0, 6, 11], device="meta")
    out, lse = ops._dense_attention_forward(qp, kp, kp, 0.125, False, -1, -1, None, cq, ck)
    assert out.shape == (9, H, E) and lse.shape == (H, 9)
    grads = ops._dense_attention_backward(out, qp, kp, kp, out, lse, 0.125, False, -1, -1, None,
                                          cq, ck)
    assert [g.shape for g in grads] == [qp.shape, kp.shape, kp.shape]


@pytest.mark.skipif(not HAS_FLASH_OPS, reason="PyTorch's fused attention ops need torch >= 2.4")
@pytest.mark.parametrize("dtype,E,M", [(torch.float32, 12, 20), (torch.float16, 64, 32)])
@pytest.mark.parametrize("causal", [False, True])
def test_meta_tensors_take_the_memory_efficient_route(dtype, E, M, causal):
    """Plain calls flash refuses (float32; v narrower than q) go to PyTorch's
    memory-efficient attention: its lse (N, H, L rounded up to 32) comes back
    as (N, H, L), and the backward takes it padded again."""
    N, H, L, S = 2, 3, 5, 7
    q = torch.empty(N, H, L, E, device="meta", dtype=dtype)
    k = torch.empty(N, H, S, E, device="meta", dtype=dtype)
    v = torch.empty(N, H, S, M, device="meta", dtype=dtype)
    out, lse = ops._dense_attention_forward(q, k, v, 0.3, causal)
    assert out.shape == (N, H, L, M) and out.dtype == dtype
    assert lse.shape == (N, H, L) and lse.dtype == torch.float32
    dq, dk, dv = ops._dense_attention_backward(out, q, k, v, out, lse, 0.3, causal)
    assert [(g.shape, g.dtype) for g in (dq, dk, dv)] == [(t.shape, dtype) for t in (q, k, v)]
    called = operators_called(lambda: ops._dense_attention_backward(
        out, q, k, v, *ops._dense_attention_forward(q, k, v, 0.3, causal), 0.3, causal))
    assert {"aten::_efficient_attention_forward", "aten::_efficient_attention_backward"} <= called
    assert "aten::_flash_attention_forward" not in called


PATTERNS = [("strided", [3, 0]), ("strided", [2, 3]), ("fixed", [4, 2, 0, 0]),
            ("fixed", [4, 1, 3, 1]), ("fixed", [3, 2, 2, 0])]


@pytest.mark.parametrize("pattern,params", PATTERNS)
@pytest.mark.parametrize("causal", [False, True])
def test_block_sparse_on_the_engine_equals_the_operator(pattern, params, causal):
    """The pattern as pieces merged by logsumexp (CPU route), forward and
    gradients, against fastattn's block-sparse operator, float64."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 4, n, 3, generator=g, dtype=torch.float64, requires_grad=True)
               for n in (10, 13, 13))
    go = torch.randn(2, 4, 10, 3, generator=g, dtype=torch.float64)
    got = ops._block_sparse_on_engine(q, k, v, 0.7, pattern, params, causal)
    want = ops.block_sparse_attention(q, k, v, pattern, params, None, causal, 0.7)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), go),
                    torch.autograd.grad(want, (q, k, v), go)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.mark.skipif(not HAS_FLASH_OPS, reason="PyTorch's flash ops with windows need torch >= 2.4")
@pytest.mark.parametrize("pattern,params", PATTERNS)
@pytest.mark.parametrize("causal", [False, True])
def test_block_sparse_pieces_take_the_flash_route_on_meta_tensors(pattern, params, causal):
    """The gathers, packed flash calls (forward and backward) and merges of a
    composed pattern on meta tensors: the shapes and dtypes the GPU gets."""
    q, k, v = (torch.empty(2, 4, n, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)
               for n in (24, 30, 30))
    result = {}

    def run():
        result["out"] = ops._block_sparse_on_engine(q, k, v, 0.125, pattern, params, causal)
        result["grads"] = torch.autograd.grad(result["out"], (q, k, v),
                                              torch.empty_like(result["out"]))

    called = operators_called(run)
    assert {"aten::_flash_attention_forward", "aten::_flash_attention_backward"} <= called
    assert not any(name.startswith("fastattn::block_sparse_attention") for name in called)
    out, grads = result["out"], result["grads"]
    assert out.shape == (2, 4, 24, 64) and out.dtype == torch.bfloat16
    assert [(x.shape, x.dtype) for x in grads] == [(t.shape, t.dtype) for t in (q, k, v)]


def test_bad_windows_name_the_argument():
    q = torch.randn(1, 1, 3, 2)
    with pytest.raises(RuntimeError, match="window_left"):
        ops._dense_attention_forward(q, q, q, 1.0, False, -5, -1)
