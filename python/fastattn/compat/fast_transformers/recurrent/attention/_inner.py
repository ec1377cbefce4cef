"""fast_transformers.recurrent.attention: recurrent attention layers and the
inner recurrent attentions (full with a key/value cache, linear with a
constant-size state) and their cross-attention forms.

Inner self-attentions take ``(N, H, E)`` query/key, ``(N, H, M)`` value and a
state, and return ``((N, H, M), state)`` through ``fastattn.attention_step``;
the state is fastattn's (opaque: pass it back unchanged).
"""

from torch import nn

from ..... import attention as _attention
from ..... import attention_step as _attention_step
from ...attention import AttentionLayer, fastattn_masks
from ...attention._inner import attention_weights
from ...events import AttentionEvent, EventDispatcher

__all__ = ["RecurrentAttentionLayer", "RecurrentCrossAttentionLayer", "RecurrentFullAttention",
           "RecurrentLinearAttention", "RecurrentCrossFullAttention",
           "RecurrentCrossLinearAttention"]


class _RecurrentInner(nn.Module):
    kind = None
    reports_attention = False

    def __init__(self, event_dispatcher="", **params):
        super().__init__()
        self.params = {k: v for k, v in params.items() if v is not None}
        self.event_dispatcher = EventDispatcher.get(event_dispatcher)

    def forward(self, query, key, value, state=None, memory=None):
        state = memory if state is None else state
        out, state = _attention_step(self.kind, query, key, value, state, **self.params)
        if self.reports_attention and self.event_dispatcher.listening:
            # The weights (N, H, S) of the query over the cached keys.
            q, keys, params = query.unsqueeze(2), state[0], self.params
            self.event_dispatcher.dispatch(AttentionEvent(
                self, lambda: attention_weights("full", q, keys, **params).squeeze(2)))
        return out, state


class RecurrentFullAttention(_RecurrentInner):
    """``RecurrentFullAttention(softmax_temp=None, attention_dropout=0.1,
    event_dispatcher="")``: a key/value cache."""

    kind = "full"
    reports_attention = True

    def __init__(self, softmax_temp=None, attention_dropout=0.1, event_dispatcher=""):
        super().__init__(event_dispatcher, softmax_temp=softmax_temp)


class RecurrentLinearAttention(_RecurrentInner):
    """``RecurrentLinearAttention(query_dimensions, feature_map=None, eps=1e-6,
    event_dispatcher="")``: the causal linear state (S, Z)."""

    kind = "causal-linear"

    def __init__(self, query_dimensions, feature_map=None, eps=1e-6, event_dispatcher=""):
        from ...feature_maps import elu_feature_map

        fmap = (feature_map or elu_feature_map)(query_dimensions)
        super().__init__(event_dispatcher, eps=eps, **fmap.fastattn_params())
        self.feature_map = fmap


class _RecurrentCrossInner(nn.Module):
    """One query against the whole memory (fastattn's batch type with L = 1)."""

    kind = None

    reports_attention = False

    def __init__(self, event_dispatcher="", **params):
        super().__init__()
        self.params = {k: v for k, v in params.items() if v is not None}
        self.event_dispatcher = EventDispatcher.get(event_dispatcher)

    def forward(self, query, keys, values, key_lengths, state=None):
        # query (N, H, E); keys (N, S, H, E); values (N, S, H, M).
        if state is None:
            state = (keys.permute(0, 2, 1, 3).contiguous(), values.permute(0, 2, 1, 3).contiguous())
        k, v = state
        _, lengths, _ = fastattn_masks(None, key_lengths, k.shape[2], type(self).__name__)
        q = query.unsqueeze(2)
        out = _attention(self.kind, q, k, v, key_lengths=lengths, **self.params)
        if self.reports_attention and self.event_dispatcher.listening:
            # The weights (N, S, H) of the query over the memory.
            params = self.params
            self.event_dispatcher.dispatch(AttentionEvent(self, lambda: attention_weights(
                "full", q, k, key_lengths=lengths, **params).squeeze(2).transpose(1, 2)))
        return out.squeeze(2), state


class RecurrentCrossFullAttention(_RecurrentCrossInner):
    kind = "full"
    reports_attention = True

    def __init__(self, softmax_temp=None, attention_dropout=0.1, event_dispatcher=""):
        super().__init__(event_dispatcher, softmax_temp=softmax_temp)


class RecurrentCrossLinearAttention(_RecurrentCrossInner):
    kind = "linear"

    def __init__(self, query_dimensions, feature_map=None, eps=1e-6, event_dispatcher=""):
        from ...feature_maps import elu_feature_map

        fmap = (feature_map or elu_feature_map)(query_dimensions)
        super().__init__(event_dispatcher, eps=eps, **fmap.fastattn_params())
        self.feature_map = fmap


class RecurrentAttentionLayer(AttentionLayer):
    """``RecurrentAttentionLayer(attention, d_model, n_heads, d_keys=None,
    d_values=None, event_dispatcher="")``: the batch layer's weights;
    ``forward(query, key, value, state=None, memory=None)`` on ``(N, D)``."""

    def forward(self, query, key, value, state=None, memory=None):
        N, H = query.shape[0], self.n_heads
        q = self.query_projection(query).view(N, H, -1)
        k = self.key_projection(key).view(N, H, -1)
        v = self.value_projection(value).view(N, H, -1)
        out, state = self.inner_attention(q, k, v, state if state is not None else memory)
        return self.out_projection(out.reshape(N, -1)), state


class RecurrentCrossAttentionLayer(AttentionLayer):
    """``RecurrentCrossAttentionLayer(attention, d_model, n_heads, ...)``;
    ``forward(query, keys, values, key_lengths, state=None)``: query
    ``(N, D)``, keys/values ``(N, S, D)``; the projected memory is kept in
    the state."""

    def forward(self, query, keys, values, key_lengths, state=None):
        N, H = query.shape[0], self.n_heads
        q = self.query_projection(query).view(N, H, -1)
        if state is None:
            S = keys.shape[1]
            k = self.key_projection(keys).view(N, S, H, -1)
            v = self.value_projection(values).view(N, S, H, -1)
        else:
            k = v = None
        out, state = self.inner_attention(q, k, v, key_lengths, state=state)
        return self.out_projection(out.reshape(N, -1)), state


def _register():
    """The recurrent attentions under fast-transformers' keys and specs."""
    from ...attention_registry import (Callable, EventDispatcherInstance, Float, Int, Optional,
                                       RecurrentAttentionRegistry,
                                       RecurrentCrossAttentionRegistry)

    dispatcher = ("event_dispatcher", Optional(EventDispatcherInstance, ""))
    full = [("softmax_temp", Optional(Float)), ("attention_dropout", Optional(Float, 0.1)),
            dispatcher]
    linear = [("query_dimensions", Int), ("feature_map", Optional(Callable)),
              ("eps", Optional(Float, 1e-6)), dispatcher]
    RecurrentAttentionRegistry.register("full", RecurrentFullAttention, full)
    RecurrentAttentionRegistry.register("linear", RecurrentLinearAttention, linear)
    RecurrentAttentionRegistry.register("causal-linear", RecurrentLinearAttention, linear)
    RecurrentCrossAttentionRegistry.register("full", RecurrentCrossFullAttention, full)
    RecurrentCrossAttentionRegistry.register("linear", RecurrentCrossLinearAttention, linear)


_register()
