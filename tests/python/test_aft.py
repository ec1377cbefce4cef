"""AFT (Zhai et al. 2021): ``fastattn.aft_attention``, the ``aft-simple`` /
``aft-full`` registry types and the fast-transformers drop-in's
``AFTFullAttention`` / ``AFTSimpleAttention``, against a float64 reference
of the paper's formula (fast-transformers 0.4.0 has no AFT: no fixture).

Run: PYTHONPATH=python FASTATTN_LIBRARY=build/libfastattn.so /usr/bin/python3 -m pytest \\
      tests/python/test_aft.py
"""

import pytest
import torch

import fastattn
from fastattn.compat.fast_transformers.attention import AFTFullAttention, AFTSimpleAttention
from fastattn.compat.fast_transformers.builders import TransformerEncoderBuilder
from fastattn.compat.fast_transformers.masking import FullMask, LengthMask, TriangularCausalMask

pytestmark = pytest.mark.usefixtures("float64_and_seeded")


def reference(q, k, v, w=None, lengths=None, causal=False):
    """sigmoid(q_t) * sum_s softmax_s(k_s + w_ts) v_s per channel; (N, H, L|S, E)."""
    N, H, L, E = q.shape
    S = k.shape[2]
    s = torch.arange(S)
    keep = torch.ones(N, 1, L, S, dtype=torch.bool)
    if lengths is not None:
        keep = keep & (s[None, :] < lengths[:, None]).view(N, 1, 1, S)
    if causal:
        keep = keep & (s[None, :] <= torch.arange(L)[:, None] + S - L)
    w = torch.zeros(L, S, dtype=q.dtype) if w is None else w
    x = k.unsqueeze(2) + w.expand(N, H, L, S).masked_fill(~keep, float("-inf")).unsqueeze(-1)
    seen = keep.any(-1)[..., None, None]
    p = torch.softmax(x.masked_fill(~seen, 0.0), dim=3).masked_fill(~seen, 0.0)
    return torch.sigmoid(q) * (p * v.unsqueeze(2)).sum(3)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("bias", [None, "shared", "per-head"])
def test_operator_matches_reference_and_gradcheck(causal, bias):
    N, H, L, S, E = 2, 2, 5, 7, 3
    q, k, v = (torch.randn(N, H, n, E, requires_grad=True) for n in (L, S, S))
    w = None
    if bias is not None:
        w = torch.randn(*((L, S) if bias == "shared" else (H, L, S)), requires_grad=True)
    lengths = torch.tensor([7, 3])
    out = fastattn.aft_attention(q, k, v, w, lengths, causal)
    assert torch.allclose(out, reference(q, k, v, w, lengths, causal), atol=1e-12)
    inputs = (q, k, v) + ((w,) if w is not None else ())
    assert torch.autograd.gradcheck(
        lambda *t: fastattn.aft_attention(*t[:3], t[3] if len(t) > 3 else None, lengths, causal),
        inputs)


def test_registry_type_is_the_operator():
    q, k, v = (torch.randn(2, 3, 6, 4) for _ in range(3))
    lengths = torch.tensor([6, 2])
    out = fastattn.attention("aft-simple", q, k, v, causal=True, key_lengths=lengths)
    assert torch.allclose(out, fastattn.aft_attention(q, k, v, None, lengths, True), atol=1e-12)
    with pytest.raises(RuntimeError, match="aft-simple: values: got values of width M = 5, "
                                           "which aft-simple does not take"):
        fastattn.attention("aft-simple", q, k, torch.randn(2, 3, 6, 5))


def test_drop_in_full_matches_the_papers_formula_and_learns_its_bias():
    N, L, H, E = 2, 6, 2, 4
    attn = AFTFullAttention(max_sequence_length=8, aft_parameterization=3).double()
    q, k, v = (torch.randn(N, L, H, E) for _ in range(3))
    lengths = torch.tensor([6, 4])
    w = attn.u[:L] @ attn.v[:L].t()
    t = (lambda x: x.transpose(1, 2))
    out = attn(q, k, v, TriangularCausalMask(L), LengthMask(torch.tensor([L, L])),
               LengthMask(lengths, max_len=L))
    ref = reference(t(q), t(k), t(v), w, lengths, causal=True)
    assert torch.allclose(out, t(ref), atol=1e-12)
    out.square().sum().backward()
    assert attn.u.grad.abs().sum() > 0 and attn.v.grad.abs().sum() > 0

    # A general mask joins the bias as -inf.
    keep = torch.rand(L, L) > 0.3
    keep[:, 0] = True
    out = attn(q, k, v, FullMask(keep), None, None)
    ref = reference(t(q), t(k), t(v), w.masked_fill(~keep, float("-inf")))
    assert torch.allclose(out, t(ref), atol=1e-12)
    with pytest.raises(ValueError, match="max_sequence_length = 8"):
        attn(*(torch.randn(1, 9, H, E) for _ in range(3)), None, None, None)


def test_drop_in_simple_and_its_refusals():
    N, L, H, E = 2, 5, 2, 3
    attn = AFTSimpleAttention()
    q, k, v = (torch.randn(N, L, H, E) for _ in range(3))
    t = (lambda x: x.transpose(1, 2))
    for mask, causal in ((None, False), (FullMask(L), False), (TriangularCausalMask(L), True)):
        out = attn(q, k, v, mask, None, None)
        assert torch.allclose(out, t(reference(t(q), t(k), t(v), causal=causal)), atol=1e-12)
    with pytest.raises(ValueError, match="general attention masks"):
        attn(q, k, v, FullMask(torch.rand(L, L) > 0.5), None, None)
    with pytest.raises(ValueError, match="same dimensionality"):
        attn(q, k, torch.randn(N, L, H, E + 1), None, None, None)


@pytest.mark.parametrize("kind", ["aft-simple", "aft-full"])
def test_builders_build_aft_by_name(kind):
    params = dict(max_sequence_length=16, aft_parameterization=4) if kind == "aft-full" else {}
    model = TransformerEncoderBuilder.from_kwargs(
        attention_type=kind, n_layers=2, n_heads=2, query_dimensions=4, value_dimensions=4,
        feed_forward_dimensions=16, **params).get().double()
    x = torch.randn(2, 10, 8, requires_grad=True)
    y = model(x, attn_mask=TriangularCausalMask(10))
    y.sum().backward()
    assert y.shape == x.shape and torch.isfinite(x.grad).all()
    inner = model.layers[0].attention.inner_attention
    assert isinstance(inner, AFTFullAttention if kind == "aft-full" else AFTSimpleAttention)
    if kind == "aft-full":
        assert inner.u.grad is not None


def test_nn_attention_owns_and_trains_aft_fulls_bias():
    import fastattn.nn as fnn

    attn = fnn.Attention("aft-full", max_sequence_length=12, aft_parameterization=3, seed=2)
    assert sorted(n for n, _ in attn.named_parameters()) == ["u", "v"]
    attn.train()
    q, k, v = (torch.randn(2, 2, 7, 4) for _ in range(3))
    lengths = torch.tensor([7, 5])
    out = attn(q, k, v, key_lengths=lengths, causal=True)
    w = attn.u[:7] @ attn.v[:7].t()
    assert torch.allclose(out, reference(q, k, v, w, lengths, causal=True), atol=1e-12)
    out.sum().backward()
    assert attn.u.grad.abs().sum() > 0 and attn.v.grad.abs().sum() > 0
    # The last 3 queries over all 7 keys: the causal rows 4..6 of the whole.
    rows = attn(q[:, :, 4:], k, v, key_lengths=lengths, causal=True)
    assert torch.allclose(rows, out[:, :, 4:], atol=1e-12)
    with pytest.raises(ValueError, match="max_sequence_length = 12"):
        attn(*(torch.randn(1, 1, 13, 4) for _ in range(3)))
    with pytest.raises(ValueError, match="aft_parameterization must be an int in"):
        fnn.Attention("aft-full", aft_parameterization=0)
    # A model built by name trains it.
    enc = fnn.build_encoder(n_layers=1, n_heads=2, query_dimensions=4, attention_type="aft-full",
                            attention_params=dict(max_sequence_length=16))
    enc(torch.randn(2, 9, 8), causal=True).sum().backward()
    assert all(p.grad is not None for n, p in enc.named_parameters() if n.endswith((".u", ".v")))


HAVE_CUDA = bool(fastattn.build_info.get("cuda")) and torch.cuda.is_available()


@pytest.mark.skipif(not HAVE_CUDA, reason="needs a CUDA build of fastattn and a GPU")
@pytest.mark.parametrize("bias", [None, "shared"])
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_matches_the_cpu(causal, bias):
    """The split form on CUDA tensors (cuBLAS), AFT-simple included, against
    the CPU's outputs and gradients in float32."""
    N, H, L, S, E = 2, 3, 130, 130, 16
    q, k, v = (torch.randn(N, H, n, E, dtype=torch.float32) for n in (L, S, S))
    w = None if bias is None else torch.randn(L, S, dtype=torch.float32)
    lengths = torch.tensor([130, 77])
    results = []
    for device in ("cpu", "cuda"):
        ins = [t.to(device).requires_grad_() for t in (q, k, v) + ((w,) if w is not None else ())]
        out = fastattn.aft_attention(*ins[:3], ins[3] if w is not None else None,
                                     lengths.to(device), causal)
        out.square().sum().backward()
        results.append([out.detach().cpu()] + [t.grad.cpu() for t in ins])
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
