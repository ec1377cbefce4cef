"""Tests of fastattn.compat.fast_transformers: programs written against the
published fast-transformers 0.4 API (its README quick start and docs pages)
run unchanged, and give what fastattn's own modules give with the same
weights; masks; recurrent twins; errors for what cannot be matched.

Run: ctest -R python_tests, or
  PYTHONPATH=python FASTATTN_LIBRARY=build/libfastattn.so /usr/bin/python3 -m pytest \
      tests/python/test_compat_fast_transformers.py
"""

import os
import subprocess
import sys
import warnings

import pytest
import torch

import fastattn
import fastattn.nn as fnn
from fastattn.compat.fast_transformers.attention import FullAttention, \
    ExactTopKAttention, ImprovedClusteredAttention, LinearAttention, LocalAttention, \
    ReformerAttention
from fastattn.compat.fast_transformers.builders import (RecurrentDecoderBuilder,
                                                        RecurrentEncoderBuilder,
                                                        TransformerDecoderBuilder,
                                                        TransformerEncoderBuilder)
from fastattn.compat.fast_transformers.feature_maps import (ActivationFunctionFeatureMap, Favor,
                                                            elu_feature_map)
from fastattn.compat.fast_transformers.masking import FullMask, LengthMask, TriangularCausalMask
from test_ops import reference


# Modules and tensors in float64, seed 0 (tests/python/conftest.py).
pytestmark = pytest.mark.usefixtures("float64_and_seeded")


def quick_start_builder():
    # The README's quick start, smaller.
    return TransformerEncoderBuilder.from_kwargs(
        n_layers=2, n_heads=4, query_dimensions=8, value_dimensions=8,
        feed_forward_dimensions=64)


def test_quick_start_program_runs_every_attention_type():
    builder = quick_start_builder()
    x = torch.rand(2, 40, 4 * 8)
    lengths = LengthMask(torch.tensor([40, 23]), max_len=40)
    for kind in ["full", "linear", "clustered", "improved-clustered", "reformer", "exact-topk",
                 "local", "conditional-full:improved-clustered"]:
        builder.attention_type = kind
        builder.clusters = 5
        builder.local_context = 8
        model = builder.get().eval()
        y = model(x, length_mask=lengths)
        assert y.shape == x.shape and torch.isfinite(y).all(), kind
    for kind in ["causal-linear", "improved-causal"]:
        builder.attention_type = kind
        y = builder.get().eval()(x, attn_mask=TriangularCausalMask(40), length_mask=lengths)
        assert torch.isfinite(y).all(), kind


def test_encoder_equals_fastattn_nn_with_the_same_weights():
    builder = quick_start_builder()
    builder.attention_type = "full"
    builder.dropout = 0.0
    model = builder.get().eval()
    ours = fnn.build_encoder(n_layers=2, n_heads=4, query_dimensions=8,
                             feed_forward_dimensions=64).eval()
    assert list(model.state_dict()) == list(ours.state_dict())
    ours.load_state_dict(model.state_dict())
    x = torch.rand(3, 17, 32)
    lengths = torch.tensor([17, 9, 1])
    want = ours(x, key_lengths=lengths)
    got = model(x, length_mask=LengthMask(lengths))
    assert (got - want).abs().max() < 1e-12


def test_inner_attention_layout_and_masks_match_the_reference():
    attention = FullAttention(softmax_temp=0.3).eval()
    q, k, v = torch.randn(2, 7, 3, 5), torch.randn(2, 9, 3, 5), torch.randn(2, 9, 3, 4)
    keep = torch.rand(7, 9) > 0.3
    lengths = torch.tensor([9, 6])

    def ref(**masks):
        out = reference(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                        softmax_temp=0.3, **masks)
        return out.transpose(1, 2)

    got = attention(q, k, v, FullMask(keep), LengthMask(torch.tensor([7, 7])),
                    LengthMask(lengths, max_len=9))
    assert got.shape == (2, 7, 3, 4)
    assert (got - ref(attn_mask=keep, key_lengths=lengths)).abs().max() < 1e-12
    got = attention(q, k, v, FullMask(7, 9), None, None)
    assert (got - ref()).abs().max() < 1e-12


def test_key_lengths_take_any_mask_as_the_reference_does():
    """A FullMask as key_lengths: a length mask gives key lengths, one that
    keeps keys out of order joins the attention mask (fast-transformers adds
    any mask's additive matrix there)."""
    attention = FullAttention(softmax_temp=0.3).eval()
    q, k, v = torch.randn(2, 7, 3, 5), torch.randn(2, 9, 3, 5), torch.randn(2, 9, 3, 4)
    keep = torch.rand(7, 9) > 0.3

    def ref(**masks):
        out = reference(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                        softmax_temp=0.3, **masks)
        return out.transpose(1, 2)

    prefix = LengthMask(torch.tensor([9, 4]), max_len=9).bool_matrix
    got = attention(q, k, v, FullMask(keep), None, FullMask(prefix))
    assert (got - ref(attn_mask=keep, key_lengths=torch.tensor([9, 4]))).abs().max() < 1e-12
    scattered = torch.rand(2, 9) > 0.4
    scattered[:, 0] = True
    got = attention(q, k, v, FullMask(keep), None, FullMask(scattered))
    both = keep.unsqueeze(0) & scattered.unsqueeze(1)  # (N, L, S)
    assert (got - ref(attn_mask=both.unsqueeze(1))).abs().max() < 1e-12
    # With causal (fastattn's: aligned bottom-right when L != S).
    got = attention(q, k, v, TriangularCausalMask(7), None, FullMask(scattered))
    causal = torch.ones(7, 9, dtype=torch.bool).tril(2)
    want = ref(attn_mask=(causal.unsqueeze(0) & scattered.unsqueeze(1)).unsqueeze(1))
    assert (got - want).abs().max() < 1e-12
    with pytest.raises(ValueError, match=r"key_lengths must be an \(N, S = 9\) mask"):
        attention(q, k, v, None, None, FullMask(torch.ones(2, 8, dtype=torch.bool)))
    with pytest.raises(TypeError, match="key_lengths must be a fast_transformers mask"):
        attention(q, k, v, None, None, torch.tensor([3, 4]))


def test_mask_semantics_are_the_reference_ones():
    # .lengths of a mask that is not a length mask raises ValueError.
    with pytest.raises(ValueError, match="not a length mask"):
        FullMask(torch.tensor([[True, False, True]])).lengths
    assert FullMask(torch.tensor([[True, True, False]])).lengths.tolist() == [2]
    # lower_triangular: lengths 1, 2, ..., N only.
    assert not LengthMask(torch.tensor([3, 1]), max_len=4).lower_triangular
    assert not LengthMask(torch.tensor([1, 1])).lower_triangular
    assert LengthMask(torch.tensor([1, 2, 3])).lower_triangular
    assert not FullMask(torch.tensor([[True, False], [True, False]])).lower_triangular
    assert FullMask(torch.ones(4, 4, dtype=torch.bool).tril()).lower_triangular
    assert TriangularCausalMask(5).lower_triangular
    assert not FullMask(torch.tensor([[False, True], [True, True]])).lower_triangular


def test_the_reference_module_tree_imports_each_name_where_it_lives():
    import importlib

    tree = {
        "attention.attention_layer": ["AttentionLayer"],
        "attention.full_attention": ["FullAttention"],
        "attention.linear_attention": ["LinearAttention"],
        "attention.causal_linear_attention": ["CausalLinearAttention"],
        "attention.clustered_attention": ["ClusteredAttention"],
        "attention.improved_clustered_attention": ["ImprovedClusteredAttention"],
        "attention.improved_clustered_causal_attention": ["ImprovedClusteredCausalAttention"],
        "attention.reformer_attention": ["ReformerAttention"],
        "attention.conditional_full_attention": ["ConditionalFullAttention"],
        "attention.exact_topk_attention": ["ExactTopKAttention"],
        "attention.local_attention": ["LocalAttention"],
        "builders.base": ["BaseBuilder"],
        "builders.attention_builders": ["AttentionBuilder", "RecurrentAttentionBuilder",
                                        "RecurrentCrossAttentionBuilder"],
        "builders.transformer_builders": ["TransformerEncoderBuilder", "RecurrentEncoderBuilder",
                                          "TransformerDecoderBuilder", "RecurrentDecoderBuilder"],
        "feature_maps.base": ["FeatureMap", "ActivationFunctionFeatureMap", "elu_feature_map"],
        "feature_maps.fourier_features": ["RandomFourierFeatures", "SmoothedRandomFourierFeatures",
                                          "Favor", "GeneralizedRandomFeatures"],
        "masking": ["BaseMask", "FullMask", "LengthMask", "TriangularCausalMask"],
        "transformers": ["TransformerEncoderLayer", "TransformerEncoder",
                         "TransformerDecoderLayer", "TransformerDecoder"],
        "recurrent.attention.self_attention.attention_layer": ["RecurrentAttentionLayer"],
        "recurrent.attention.self_attention.full_attention": ["RecurrentFullAttention"],
        "recurrent.attention.self_attention.linear_attention": ["RecurrentLinearAttention"],
        "recurrent.attention.cross_attention.attention_layer": ["RecurrentCrossAttentionLayer"],
        "recurrent.attention.cross_attention.full_attention": ["RecurrentCrossFullAttention"],
        "recurrent.attention.cross_attention.linear_attention": ["RecurrentCrossLinearAttention"],
        "recurrent.transformers": ["RecurrentTransformerEncoderLayer",
                                   "RecurrentTransformerEncoder",
                                   "RecurrentTransformerDecoderLayer",
                                   "RecurrentTransformerDecoder"],
        "recurrent._utils": ["check_state"],
        "utils": ["make_mirror"],
    }
    root = "fastattn.compat.fast_transformers"
    for module, names in tree.items():
        m = importlib.import_module(root + "." + module)
        package = importlib.import_module(root + "." + module.rsplit(".", 1)[0]) \
            if "." in module else None
        for name in names:
            assert hasattr(m, name), (module, name)
            # The package re-exports the same object (one class, not two).
            if package is not None and hasattr(package, name):
                assert getattr(package, name) is getattr(m, name), (module, name)


def test_make_mirror_and_check_state():
    from fastattn.compat.fast_transformers.recurrent._utils import check_state
    from fastattn.compat.fast_transformers.utils import make_mirror

    batch = TransformerEncoderBuilder.from_kwargs(
        n_layers=1, n_heads=2, query_dimensions=4, value_dimensions=4,
        feed_forward_dimensions=16, attention_type="causal-linear").get()
    twin = RecurrentEncoderBuilder.from_kwargs(
        n_layers=1, n_heads=2, query_dimensions=4, value_dimensions=4,
        feed_forward_dimensions=16, attention_type="causal-linear").get()
    make_mirror(batch, twin)
    pairs = dict(twin.named_parameters())
    assert pairs and all(pairs[n] is p for n, p in batch.named_parameters())
    assert check_state(state=1) == 1 and check_state() is None
    with pytest.warns(DeprecationWarning, match="memory"):
        assert check_state(memory=2) == 2


def test_masks_views():
    m = LengthMask(torch.tensor([3, 1]), max_len=4)
    assert m.bool_matrix.tolist() == [[True, True, True, False], [True, False, False, False]]
    assert m.lengths.tolist() == [3, 1] and not m.all_ones
    assert torch.equal(m.additive_matrix[1], torch.tensor([0.0, -float("inf"), -float("inf"),
                                                           -float("inf")], dtype=torch.float32))
    c = TriangularCausalMask(3)
    assert c.lower_triangular and c.lengths.tolist() == [1, 2, 3]
    f = FullMask(2, 5)
    assert f.shape == (2, 5) and f.all_ones
    assert FullMask(c.bool_matrix).lower_triangular
    # The encoders' default FullMask(L) is never materialised (10^12 bools here).
    big = FullMask(10**6)
    assert big.all_ones and big.shape == (10**6, 10**6) and fnn.FullMask(N=10**6).all_ones


def test_recurrent_encoder_program_decodes_the_causal_rows():
    # A fast-transformers-style generation loop: train-time model with
    # causal-linear attention, the recurrent builder with the same kwargs,
    # load_state_dict, one position per call.
    kwargs = dict(n_layers=2, n_heads=2, query_dimensions=6, value_dimensions=6,
                  feed_forward_dimensions=24, attention_type="causal-linear", dropout=0.0)
    model = TransformerEncoderBuilder.from_kwargs(**kwargs).get().eval()
    recurrent = RecurrentEncoderBuilder.from_kwargs(**kwargs).get().eval()
    recurrent.load_state_dict(model.state_dict())
    x = torch.rand(2, 12, 12)
    want = model(x, attn_mask=TriangularCausalMask(12))
    memory = None
    for i in range(12):
        y, memory = recurrent(x[:, i], memory)
        assert (y - want[:, i]).abs().max() < 1e-9, i


def test_recurrent_decoder_program_decodes_the_causal_rows():
    kwargs = dict(n_layers=2, n_heads=2, query_dimensions=4, value_dimensions=4,
                  feed_forward_dimensions=16, self_attention_type="full",
                  cross_attention_type="linear", dropout=0.0)
    model = TransformerDecoderBuilder.from_kwargs(**kwargs).get().eval()
    recurrent = RecurrentDecoderBuilder.from_kwargs(**kwargs).get().eval()
    recurrent.load_state_dict(model.state_dict())
    x, memory = torch.rand(2, 8, 8), torch.rand(2, 11, 8)
    mlen = LengthMask(torch.tensor([11, 6]))
    want = model(x, memory, x_mask=TriangularCausalMask(8), memory_length_mask=mlen)
    state = None
    for i in range(8):
        y, state = recurrent(x[:, i], memory, memory_length_mask=mlen, state=state)
        assert (y - want[:, i]).abs().max() < 1e-9, i


def test_feature_map_factories_are_fastattn_feature_maps():
    q, k, v = torch.randn(1, 6, 2, 8), torch.randn(1, 6, 2, 8), torch.randn(1, 6, 2, 8)
    favor = LinearAttention(8, feature_map=Favor.factory(n_dims=16))
    ours = fnn.Attention("linear", feature_map="favor", n_features=16, orthogonal=False)
    want = ours(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    assert (favor(q, k, v, None, None, None) - want).abs().max() < 1e-12
    elu = LinearAttention(8, feature_map=elu_feature_map)
    assert torch.equal(elu(q, k, v, None, None, None), LinearAttention(8)(q, k, v, None, None,
                                                                          None))
    with pytest.raises(ValueError, match="elu\\(x\\) \\+ 1 .* and relu"):
        ActivationFunctionFeatureMap.factory(lambda x: x * x)(8)


def test_what_cannot_be_matched_is_named():
    with pytest.raises(ValueError, match="unknown argument 'n_layer'.*n_layers"):
        TransformerEncoderBuilder.from_kwargs(n_layer=2)
    builder = TransformerEncoderBuilder.from_kwargs(n_layer=2, strict=False)
    with pytest.raises(ValueError, match="attention_type 'linformer' is not available.*full"):
        builder.attention_type = "linformer"
    with pytest.raises(ValueError, match="attention_type 'clustered' is not available.*full"):
        RecurrentEncoderBuilder.from_kwargs(attention_type="clustered")


def test_attention_dropout_is_applied_in_training():
    """fast-transformers' attention_dropout, fused in fastattn's types: what
    fastattn.attention(training=True) computes under the same seed, and
    nothing dropped in evaluation."""
    q, k, v = (torch.randn(2, 32, 2, 8, generator=torch.Generator().manual_seed(i))
               for i in range(3))
    for inner, kind, params in [
            (FullAttention(attention_dropout=0.2), "full", {}),
            (ImprovedClusteredAttention(clusters=3, topk=4, attention_dropout=0.2),
             "improved-clustered", dict(clusters=3, topk=4, iterations=10, bits=32,
                                        hash_bias=True)),
            (LocalAttention(5, attention_dropout=0.2), "local", dict(window=5)),
            (ExactTopKAttention(topk=5, attention_dropout=0.2), "exact-topk", dict(topk=5)),
            (ReformerAttention(chunk_size=4, bits=2, attention_dropout=0.2), "reformer",
             dict(chunk_size=4, n_buckets=4, rounds=4, masked=False))]:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            torch.manual_seed(3)
            got = inner.train()(q, k, v)
        torch.manual_seed(3)
        want = fastattn.attention(kind, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                  training=True, attention_dropout=0.2, **params)
        torch.testing.assert_close(got, want.transpose(1, 2), rtol=0, atol=0)
        torch.manual_seed(3)
        evaluated = inner.eval()(q, k, v)
        assert (got - evaluated).abs().max() > 1e-2, kind


def test_hashing_parameters_mean_what_they_mean_in_fast_transformers():
    from fastattn.compat.fast_transformers.attention import ReformerAttention
    # fast-transformers 0.4: `bits` Gaussian directions, argmax over [xP; -xP]:
    # 2·bits buckets (not 2**bits, which made 256 where it has 16).
    assert ReformerAttention(bits=8).params["n_buckets"] == 16
    assert ReformerAttention(bits=1).params["n_buckets"] == 2
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="bits must be an int >= 1"):
            ReformerAttention(bits=bad)
    # Its builders' registry defaults: 63 bits for every hashing type.
    builder = quick_start_builder()
    assert builder.bits == 63
    builder.attention_type = "reformer"
    inner = [m for m in builder.get().modules() if isinstance(m, ReformerAttention)]
    assert inner and all(m.params["n_buckets"] == 126 for m in inner)


def test_install_makes_import_fast_transformers_resolve_here():
    program = (
        "import fastattn.compat.fast_transformers as ft; ft.install()\n"
        "import fast_transformers\n"
        "from fast_transformers.builders import TransformerEncoderBuilder\n"
        "from fast_transformers.masking import LengthMask\n"
        "from fast_transformers.recurrent.transformers import RecurrentTransformerEncoder\n"
        "from fast_transformers.attention.full_attention import FullAttention\n"
        "from fast_transformers.recurrent.attention.cross_attention.linear_attention import "
        "RecurrentCrossLinearAttention\n"
        "from fast_transformers.feature_maps.fourier_features import Favor\n"
        "import fastattn.compat.fast_transformers.attention as fa\n"
        "assert fast_transformers is ft and FullAttention is fa.FullAttention\n"
        "import torch\n"
        "m = TransformerEncoderBuilder.from_kwargs(n_layers=1, n_heads=2, query_dimensions=4,"
        " value_dimensions=4).get()\n"
        "print(tuple(m(torch.rand(1, 5, 8), length_mask=LengthMask(torch.tensor([3]))).shape))\n"
    )
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                         env=dict(os.environ), timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "(1, 5, 8)"
