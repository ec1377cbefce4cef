"""Tests of the drop-in's extension API (issue 63): custom attention through
fast_transformers.attention_registry and the builders, events
(fast_transformers.events) and weight mappers (fast_transformers.weight_mapper).
References in float64.

Run: PYTHONPATH=python FASTATTN_LIBRARY=build/libfastattn.so /usr/bin/python3 -m pytest \\
      tests/python/test_compat_fast_transformers_api.py
"""

import copy

import pytest
import torch
from torch import nn

from fastattn.compat.fast_transformers.attention import AttentionLayer, FullAttention
from fastattn.compat.fast_transformers.attention_registry import (
    AttentionRegistry, Bool, Callable, Choice, EventDispatcherInstance, Float, Int, Optional,
    RecurrentAttentionRegistry, Spec)
from fastattn.compat.fast_transformers.attention_registry.registry import Registry
from fastattn.compat.fast_transformers.builders import (AttentionBuilder, RecurrentEncoderBuilder,
                                                        TransformerEncoderBuilder)
from fastattn.compat.fast_transformers.events import (AttentionEvent, EventDispatcher,
                                                      IntermediateOutput, QKVEvent)
from fastattn.compat.fast_transformers.events.filters import (event_class, from_layer,
                                                              layer_name_contains)
from fastattn.compat.fast_transformers.masking import LengthMask
from fastattn.compat.fast_transformers.weight_mapper import (HugginfaceBertEncoderMapper,
                                                             PytorchMapper)

pytestmark = pytest.mark.usefixtures("float64_and_seeded")


def softmax_reference(q, k, lengths=None, temp=None):
    """(N, H, L, S) softmax weights of q (N, L, H, E) over k (N, S, H, E), float64."""
    q, k = q.double(), k.double()
    temp = temp if temp is not None else q.shape[-1] ** -0.5
    scores = torch.einsum("nlhe,nshe->nhls", q, k) * temp
    if lengths is not None:
        keep = torch.arange(k.shape[1])[None, :] < lengths[:, None]
        scores = scores.masked_fill(~keep[:, None, None, :], float("-inf"))
    return scores.softmax(-1)


class ScaledFull(nn.Module):
    """A user's attention: softmax attention times ``my_scale``."""

    def __init__(self, my_scale=2.0, softmax_temp=None, event_dispatcher=""):
        super().__init__()
        self.my_scale = my_scale
        self.softmax_temp = softmax_temp

    def forward(self, queries, keys, values, attn_mask, query_lengths, key_lengths):
        a = softmax_reference(queries, keys, key_lengths.lengths, self.softmax_temp)
        return self.my_scale * torch.einsum("nhls,nshd->nlhd", a, values.double())


def register_once(registry, key, cls, params):
    if key not in registry:
        registry.register(key, cls, params)


def test_specs_convert_and_refuse_as_the_reference_does():
    assert Int.get("3") == 3 and Float.get(2) == 2.0 and Bool.get(1) is True
    assert not Int.check("three") and not Int.check(None)
    assert Optional(Int, 5).get(None) == 5 and Optional(Int, 5).get(7) == 7
    assert Optional(Int, 5) == Optional(Int, 5) and Optional(Int, 5) != Optional(Int, 6)
    assert Choice(["a", "b"]).get("a") == "a"
    with pytest.raises(ValueError, match="'c' is not in"):
        Choice(["a", "b"]).get("c")
    with pytest.raises(ValueError, match="is not a callable"):
        Callable.get(3)
    assert EventDispatcherInstance.check("") and EventDispatcherInstance.check(EventDispatcher())
    assert not EventDispatcherInstance.check(3)
    assert Spec(int) != Spec(int)  # a custom spec equals only itself
    assert repr(Optional(Float, 0.1)) == "Optional[Float, 0.1]"


def test_registry_refuses_duplicates_and_conflicting_specs():
    r = Registry()
    r.register("a", ScaledFull, [("my_scale", Optional(Float, 2.0))])
    with pytest.raises(ValueError, match="a is already registered"):
        r.register("a", ScaledFull, [])
    with pytest.raises(ValueError, match="my_scale is already registered with spec"):
        r.register("b", ScaledFull, [("my_scale", Int)])
    assert "b" not in r  # a refused registration leaves nothing behind
    with pytest.raises(ValueError, match="parameters must be \\(name, spec\\) pairs"):
        r.register("c", ScaledFull, ["my_scale"])
    assert r.keys == ["a"] and r["a"] == (ScaledFull, ["my_scale"])
    with pytest.raises(ValueError, match="attention parameter 'my_scale'"):
        r.validate_parameter("my_scale", "big")


def test_every_reference_key_is_registered():
    assert set(AttentionBuilder().available_attentions) >= {
        "full", "linear", "causal-linear", "clustered", "improved-clustered",
        "causal-improved-clustered", "reformer", "exact-topk", "conditional-full", "local"}
    assert set(RecurrentAttentionRegistry.keys) >= {"full", "linear", "causal-linear"}


def test_a_registered_custom_attention_is_built_by_name():
    register_once(AttentionRegistry, "test-scaled-full", ScaledFull,
                  [("my_scale", Optional(Float, 2.0)), ("softmax_temp", Optional(Float)),
                   ("event_dispatcher", Optional(EventDispatcherInstance, ""))])
    builder = TransformerEncoderBuilder.from_kwargs(
        n_layers=2, n_heads=2, query_dimensions=4, value_dimensions=4,
        feed_forward_dimensions=16, attention_type="test-scaled-full", my_scale="3")
    assert builder.my_scale == 3.0  # validated and converted when set
    model = builder.get().eval()
    inner = [m for m in model.modules() if isinstance(m, ScaledFull)]
    assert len(inner) == 2 and all(m.my_scale == 3.0 for m in inner)
    # Its layer computes what it says: 3 x softmax attention.
    layer = AttentionLayer(inner[0], 8, 2)
    ours = AttentionLayer(FullAttention(attention_dropout=0.0), 8, 2)
    ours.load_state_dict(layer.state_dict())
    x = torch.randn(2, 6, 8)
    lengths = LengthMask(torch.tensor([6, 4]))
    want = ours.eval()(x, x, x, None, lengths, lengths)
    proj = ours.out_projection
    got = layer(x, x, x, None, lengths, lengths)
    torch.testing.assert_close(got - proj.bias, 3 * (want - proj.bias), rtol=1e-10, atol=1e-12)
    # Through a composition, and beside fastattn's types.
    cond = AttentionBuilder.from_kwargs(length_limit=4, my_scale=5.0).get(
        "conditional-full:test-scaled-full").eval()
    q = torch.randn(1, 6, 2, 4)
    long_ = cond(q, q, q, None, LengthMask(torch.tensor([6])), LengthMask(torch.tensor([6])))
    torch.testing.assert_close(long_, 5 * torch.einsum(
        "nhls,nshd->nlhd", softmax_reference(q, q), q), rtol=1e-10, atol=1e-12)
    short = cond(q[:, :3], q[:, :3], q[:, :3], None, LengthMask(torch.tensor([3])),
                 LengthMask(torch.tensor([3])))
    torch.testing.assert_close(short, torch.einsum(
        "nhls,nshd->nlhd", softmax_reference(q[:, :3], q[:, :3]), q[:, :3]),
        rtol=1e-10, atol=1e-12)


def test_builders_name_what_is_wrong():
    builder = TransformerEncoderBuilder()
    with pytest.raises(ValueError, match="attention parameter 'clusters'"):
        builder.clusters = "many"
    with pytest.raises(AttributeError, match="unknown argument 'not_a_parameter'"):
        builder.not_a_parameter = 1
    with pytest.raises(ValueError, match="n_heads must be an int >= 1, got 0"):
        builder.n_heads = 0
    with pytest.raises(ValueError, match="activation must be one of"):
        builder.activation = "tanh"
    builder.attention_type = "clustered"
    with pytest.raises(ValueError, match="'clustered' needs the parameter 'clusters' \\(Int\\)"):
        builder.get()
    with pytest.raises(ValueError, match="Invalid attention_type argument 'full,linear'"):
        AttentionBuilder.from_kwargs(query_dimensions=4).get("full,linear")
    with pytest.raises(ValueError, match="Unknown attention type 'nope'; available: full"):
        AttentionBuilder().get("nope")
    # Defaults are the reference registry's.
    assert (builder.bits, builder.topk, builder.attention_dropout) == (63, 32, 0.1)


def test_recurrent_builders_take_registered_recurrent_attentions():
    class Echo(nn.Module):
        def __init__(self, event_dispatcher=""):
            super().__init__()

        def forward(self, query, key, value, state=None, memory=None):
            return value, state

    register_once(RecurrentAttentionRegistry, "test-echo", Echo, [])
    model = RecurrentEncoderBuilder.from_kwargs(n_layers=1, n_heads=2, query_dimensions=4,
                                                value_dimensions=4,
                                                attention_type="test-echo").get()
    assert isinstance(model.layers[0].attention.inner_attention, Echo)


def small_encoder(dispatcher, **kw):
    return TransformerEncoderBuilder.from_kwargs(
        n_layers=2, n_heads=2, query_dimensions=4, value_dimensions=4,
        feed_forward_dimensions=16, event_dispatcher=dispatcher, **kw).get()


def test_attention_events_carry_the_weights_the_model_used():
    dispatcher = EventDispatcher()
    model = small_encoder(dispatcher, final_normalization=False, dropout=0.0).eval()
    events = []
    dispatcher.listen(AttentionEvent, lambda e: events.append(e))
    dispatcher.listen(QKVEvent, lambda e: events.append(e))  # (a handler listens once)
    x, lengths = torch.randn(2, 7, 8), torch.tensor([7, 5])
    model(x, length_mask=LengthMask(lengths))
    assert [type(e) for e in events] == [QKVEvent, AttentionEvent] * 2
    for qkv, att in zip(events[::2], events[1::2]):
        assert att.source is qkv.source.inner_attention
        a = att.attention_matrix
        assert a.shape == (2, 2, 7, 7)
        torch.testing.assert_close(a, softmax_reference(qkv.queries, qkv.keys, lengths),
                                   rtol=1e-10, atol=1e-12)


def test_attention_events_match_the_dropout_the_forward_drew():
    dispatcher = EventDispatcher()
    inner = FullAttention(attention_dropout=0.3, event_dispatcher=dispatcher).train()
    seen = []
    dispatcher.listen(AttentionEvent, seen.append)
    q, k, v = torch.randn(2, 9, 2, 4), torch.randn(2, 9, 2, 4), torch.randn(2, 9, 2, 3)
    out = inner(q, k, v)
    a = seen[0].attention_matrix  # read after the forward (and after more draws)
    torch.rand(5)
    torch.testing.assert_close(torch.einsum("nhls,nshd->nlhd", a, v), out,
                               rtol=1e-10, atol=1e-12)
    assert (a == 0).any()  # weights were dropped


def test_no_listener_builds_no_event_and_no_matrix(monkeypatch):
    from fastattn.compat.fast_transformers.attention import _inner

    calls = []
    monkeypatch.setattr(_inner, "attention_weights", lambda *a, **k: calls.append(1))
    dispatcher = EventDispatcher()
    model = small_encoder(dispatcher).eval()
    x = torch.randn(1, 5, 8)
    model(x)
    assert calls == []
    got = []
    dispatcher.listen(QKVEvent, got.append)  # listening, but not to attention
    model(x)
    assert len(got) == 2 and calls == []


def test_intermediate_outputs_and_filters():
    dispatcher = EventDispatcher()
    model = small_encoder(dispatcher, final_normalization=False, dropout=0.0).eval()
    outputs, layer1, not_qkv = [], [], []
    dispatcher.listen(IntermediateOutput, outputs.append)
    dispatcher.listen(layer_name_contains(model, "layers.1") & QKVEvent, layer1.append)
    dispatcher.listen(~from_layer(model) & ~event_class(QKVEvent), not_qkv.append)
    x = torch.randn(2, 5, 8)
    y = model(x)
    assert len(outputs) == 2 and all(e.source is model for e in outputs)
    torch.testing.assert_close(outputs[-1].x, y, rtol=0, atol=0)
    assert [e.source for e in layer1] == [model.layers[1].attention]
    assert all(isinstance(e, AttentionEvent) for e in not_qkv) and len(not_qkv) == 2
    dispatcher.remove(outputs.append)
    dispatcher.clear()
    model(x)
    assert len(outputs) == 2 and len(layer1) == 1


def test_dispatchers_by_key_and_across_copies():
    assert EventDispatcher.get("") is EventDispatcher.get("")
    named = EventDispatcher.get("test-named")
    model = small_encoder("test-named")
    assert model.layers[0].attention.event_dispatcher is named
    assert copy.deepcopy(model).layers[0].attention.event_dispatcher is named
    mine = EventDispatcher()
    assert EventDispatcher.get(mine) is mine
    with pytest.raises(TypeError, match="event_dispatcher must be an EventDispatcher"):
        EventDispatcher.get(3)


def test_recurrent_full_attention_reports_its_weights():
    from fastattn.compat.fast_transformers.recurrent.attention import RecurrentFullAttention

    dispatcher = EventDispatcher()
    inner = RecurrentFullAttention(event_dispatcher=dispatcher)
    seen = []
    dispatcher.listen(AttentionEvent, seen.append)
    q, k, v = torch.randn(3, 2, 2, 4), torch.randn(3, 2, 2, 4), torch.randn(3, 2, 2, 4)
    state = None
    for t in range(3):
        out, state = inner(q[t], k[t], v[t], state)
    a = seen[-1].attention_matrix
    assert a.shape == (2, 2, 3)
    want = softmax_reference(q[2][:, None], k.permute(1, 0, 2, 3))[:, :, 0]
    torch.testing.assert_close(a, want, rtol=1e-10, atol=1e-12)


def test_pytorch_encoder_weights_map_in_and_back():
    src = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, dropout=0.0, batch_first=True),
        num_layers=2, norm=nn.LayerNorm(16), enable_nested_tensor=False).eval()
    ours = TransformerEncoderBuilder.from_kwargs(
        n_layers=2, n_heads=4, query_dimensions=4, value_dimensions=4,
        feed_forward_dimensions=32, dropout=0.0, attention_type="full").get().eval()
    ours.load_state_dict(PytorchMapper().map(src.state_dict()))
    x = torch.randn(3, 10, 16)
    lengths = torch.tensor([10, 7, 3])
    pad = torch.arange(10)[None, :] >= lengths[:, None]
    want = src(x, src_key_padding_mask=pad)
    got = ours(x, length_mask=LengthMask(lengths))
    keep = ~pad
    torch.testing.assert_close(got[keep], want[keep], rtol=1e-10, atol=1e-10)
    back = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, dropout=0.0, batch_first=True),
        num_layers=2, norm=nn.LayerNorm(16), enable_nested_tensor=False)
    back.load_state_dict(PytorchMapper().unmap(ours.state_dict()))
    for key, value in src.state_dict().items():
        torch.testing.assert_close(back.state_dict()[key], value, rtol=0, atol=0)


def test_bert_encoder_weights_map_in_and_back():
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=32, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    bert = transformers.BertModel(config).double().eval()
    ours = TransformerEncoderBuilder.from_kwargs(
        n_layers=2, n_heads=4, query_dimensions=4, value_dimensions=4,
        feed_forward_dimensions=32, dropout=0.0, activation="gelu",
        final_normalization=False, attention_type="full").get().eval()
    ours.load_state_dict(HugginfaceBertEncoderMapper().map(bert.encoder.state_dict()))
    for m in ours.modules():
        if isinstance(m, nn.LayerNorm):
            m.eps = config.layer_norm_eps
    x = torch.randn(2, 9, 16)
    want = bert.encoder(x).last_hidden_state
    torch.testing.assert_close(ours(x), want, rtol=1e-9, atol=1e-9)
    back = HugginfaceBertEncoderMapper().unmap(ours.state_dict())
    assert set(back) == set(bert.encoder.state_dict())
    for key, value in bert.encoder.state_dict().items():
        torch.testing.assert_close(back[key], value, rtol=0, atol=0)
