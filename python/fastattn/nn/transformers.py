"""Transformer encoder and decoder layers and stacks, and their recurrent twins.

A batch module and its recurrent twin have the same submodules and weight
names, so ``recurrent.load_state_dict(batch.state_dict())`` works both ways.
Each layer is post-norm by default (as the papers' models: x = norm(x +
sublayer(x))); ``norm_first=True`` makes it pre-norm.
"""

import torch
from torch import nn
import torch.nn.functional as F

from .attention import AttentionLayer, RecurrentAttentionLayer, RecurrentCrossAttentionLayer

__all__ = [
    "TransformerEncoderLayer",
    "TransformerEncoder",
    "TransformerDecoderLayer",
    "TransformerDecoder",
    "RecurrentTransformerEncoderLayer",
    "RecurrentTransformerEncoder",
    "RecurrentTransformerDecoderLayer",
    "RecurrentTransformerDecoder",
]

_ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu}


def _activation(name, where):
    if name not in _ACTIVATIONS:
        raise ValueError("%s: activation must be one of %s, got %r"
                         % (where, ", ".join(_ACTIVATIONS), name))
    return _ACTIVATIONS[name]


def _check_layer(layer, expected, name, where):
    if not isinstance(layer, expected):
        raise TypeError("%s: %s must be a %s, got %s"
                        % (where, name, expected.__name__, type(layer).__name__))


class _FeedForwardBlock(nn.Module):
    """What every layer has besides its attention: the feed-forward network,
    the norms and dropout (``linear1``, ``linear2``, ``norm1`` .. ``normK``,
    ``dropout``)."""

    def __init__(self, d_model, d_ff, dropout, activation, norm_first, n_norms):
        super().__init__()
        where = type(self).__name__
        d_ff = d_ff or 4 * d_model
        self.linear1 = nn.Linear(d_model, d_ff)
        self.linear2 = nn.Linear(d_ff, d_model)
        for i in range(1, n_norms + 1):
            setattr(self, "norm%d" % i, nn.LayerNorm(d_model))
        self.dropout = nn.Dropout(dropout)
        self.activation = activation
        self._act = _activation(activation, where)
        self.norm_first = bool(norm_first)
        self.d_model = d_model

    def _sublayer(self, x, norm, fn):
        """x + fn(x) with the layer's norm placement and dropout."""
        if self.norm_first:
            return x + self.dropout(fn(norm(x)))
        return norm(x + self.dropout(fn(x)))

    def _feed_forward(self, x):
        return self.linear2(self.dropout(self._act(self.linear1(x))))

    def _check_input(self, name, x, dims):
        if not isinstance(x, torch.Tensor) or x.dim() != dims or x.shape[-1] != self.d_model:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            layout = "(N, L, %d)" % self.d_model if dims == 3 else "(N, %d)" % self.d_model
            raise ValueError("%s: %s must be %s, got %s" % (type(self).__name__, name, layout, shape))


class TransformerEncoderLayer(_FeedForwardBlock):
    """Self-attention and a feed-forward network, each with a residual and a norm.

    Args:
        attention: an :class:`~fastattn.nn.AttentionLayer` (self-attention).
        d_model: D.
        d_ff: the feed-forward width (default 4·D).
        dropout: after each sublayer and inside the feed-forward network.
        activation: ``"relu"``, ``"gelu"`` or ``"silu"``.
        norm_first: pre-norm instead of post-norm.

    ``forward(x, attn_mask=None, key_lengths=None, causal=False)``: x
    ``(N, L, D)`` -> ``(N, L, D)``. ``key_lengths`` marks padding.
    """

    def __init__(self, attention, d_model, d_ff=None, dropout=0.1, activation="relu",
                 norm_first=False):
        super().__init__(d_model, d_ff, dropout, activation, norm_first, 2)
        _check_layer(attention, AttentionLayer, "attention", type(self).__name__)
        self.attention = attention

    def forward(self, x, attn_mask=None, key_lengths=None, causal=False):
        self._check_input("x", x, 3)
        x = self._sublayer(x, self.norm1, lambda y: self.attention(
            y, y, y, attn_mask=attn_mask, key_lengths=key_lengths, causal=causal))
        return self._sublayer(x, self.norm2, self._feed_forward)


class RecurrentTransformerEncoderLayer(_FeedForwardBlock):
    """The recurrent twin of a causal :class:`TransformerEncoderLayer`: one
    token at a time. ``attention`` is a :class:`~fastattn.nn.RecurrentAttentionLayer`.

    ``forward(x, state=None)``: x ``(N, D)`` -> ``(x (N, D), state)``.
    """

    def __init__(self, attention, d_model, d_ff=None, dropout=0.1, activation="relu",
                 norm_first=False):
        super().__init__(d_model, d_ff, dropout, activation, norm_first, 2)
        _check_layer(attention, RecurrentAttentionLayer, "attention", type(self).__name__)
        self.attention = attention

    def forward(self, x, state=None):
        self._check_input("x", x, 2)
        out = {}

        def attend(y):
            y, out["state"] = self.attention(y, y, y, state=state)
            return y

        x = self._sublayer(x, self.norm1, attend)
        return self._sublayer(x, self.norm2, self._feed_forward), out["state"]


class TransformerDecoderLayer(_FeedForwardBlock):
    """Causal self-attention, cross-attention to a memory, and a feed-forward
    network, each with a residual and a norm (``norm1``, ``norm2``, ``norm3``).

    Args:
        self_attention, cross_attention: :class:`~fastattn.nn.AttentionLayer`\\ s.
        d_model, d_ff, dropout, activation, norm_first: as the encoder layer.

    ``forward(x, memory, x_mask=None, x_lengths=None, memory_mask=None,
    memory_lengths=None, causal=True)``: x ``(N, L, D)``, memory ``(N, S, D_m)``
    -> ``(N, L, D)``. The self-attention is causal unless ``causal=False``.
    """

    def __init__(self, self_attention, cross_attention, d_model, d_ff=None, dropout=0.1,
                 activation="relu", norm_first=False):
        super().__init__(d_model, d_ff, dropout, activation, norm_first, 3)
        where = type(self).__name__
        _check_layer(self_attention, AttentionLayer, "self_attention", where)
        _check_layer(cross_attention, AttentionLayer, "cross_attention", where)
        self.self_attention = self_attention
        self.cross_attention = cross_attention

    def forward(self, x, memory, x_mask=None, x_lengths=None, memory_mask=None,
                memory_lengths=None, causal=True):
        self._check_input("x", x, 3)
        x = self._sublayer(x, self.norm1, lambda y: self.self_attention(
            y, y, y, attn_mask=x_mask, key_lengths=x_lengths, causal=causal))
        x = self._sublayer(x, self.norm2, lambda y: self.cross_attention(
            y, memory, memory, attn_mask=memory_mask, key_lengths=memory_lengths))
        return self._sublayer(x, self.norm3, self._feed_forward)


class RecurrentTransformerDecoderLayer(_FeedForwardBlock):
    """The recurrent twin of :class:`TransformerDecoderLayer`.

    ``self_attention`` is a :class:`~fastattn.nn.RecurrentAttentionLayer`,
    ``cross_attention`` a :class:`~fastattn.nn.RecurrentCrossAttentionLayer`.
    ``forward(x, memory, memory_lengths=None, state=None)``: x ``(N, D)`` ->
    ``(x (N, D), state)``.
    """

    def __init__(self, self_attention, cross_attention, d_model, d_ff=None, dropout=0.1,
                 activation="relu", norm_first=False):
        super().__init__(d_model, d_ff, dropout, activation, norm_first, 3)
        where = type(self).__name__
        _check_layer(self_attention, RecurrentAttentionLayer, "self_attention", where)
        _check_layer(cross_attention, RecurrentCrossAttentionLayer, "cross_attention", where)
        self.self_attention = self_attention
        self.cross_attention = cross_attention

    def forward(self, x, memory, memory_lengths=None, state=None):
        self._check_input("x", x, 2)
        self_state, cross_state = state if state is not None else (None, None)
        out = {}

        def attend_self(y):
            y, out["self"] = self.self_attention(y, y, y, state=self_state)
            return y

        def attend_memory(y):
            y, out["cross"] = self.cross_attention(y, memory, memory_lengths, state=cross_state)
            return y

        x = self._sublayer(x, self.norm1, attend_self)
        x = self._sublayer(x, self.norm2, attend_memory)
        return self._sublayer(x, self.norm3, self._feed_forward), (out["self"], out["cross"])


class _Stack(nn.Module):
    """Layers applied in order (``layers``), then an optional final ``norm``."""

    def __init__(self, layers, norm_layer=None, layer_type=None):
        super().__init__()
        layers = list(layers)
        if not layers:
            raise ValueError("%s: layers must not be empty" % type(self).__name__)
        for i, layer in enumerate(layers):
            _check_layer(layer, layer_type, "layers[%d]" % i, type(self).__name__)
        self.layers = nn.ModuleList(layers)
        self.norm = norm_layer

    def _finish(self, x):
        return x if self.norm is None else self.norm(x)

    def _states(self, state):
        if state is None:
            return [None] * len(self.layers)
        if len(state) != len(self.layers):
            raise ValueError("%s: state must hold one entry per layer (%d), got %d"
                             % (type(self).__name__, len(self.layers), len(state)))
        return state


class TransformerEncoder(_Stack):
    """A stack of :class:`TransformerEncoderLayer`\\ s and an optional final norm.

    ``forward(x, attn_mask=None, key_lengths=None, causal=False)``.
    """

    def __init__(self, layers, norm_layer=None):
        super().__init__(layers, norm_layer, TransformerEncoderLayer)

    def forward(self, x, attn_mask=None, key_lengths=None, causal=False):
        for layer in self.layers:
            x = layer(x, attn_mask=attn_mask, key_lengths=key_lengths, causal=causal)
        return self._finish(x)


class RecurrentTransformerEncoder(_Stack):
    """The recurrent twin of :class:`TransformerEncoder`.

    ``forward(x, state=None)``: x ``(N, D)`` -> ``(x, state)``, state a list
    with one entry per layer.
    """

    def __init__(self, layers, norm_layer=None):
        super().__init__(layers, norm_layer, RecurrentTransformerEncoderLayer)

    def forward(self, x, state=None):
        new_state = []
        for layer, s in zip(self.layers, self._states(state)):
            x, s = layer(x, state=s)
            new_state.append(s)
        return self._finish(x), new_state


class TransformerDecoder(_Stack):
    """A stack of :class:`TransformerDecoderLayer`\\ s and an optional final norm.

    ``forward(x, memory, x_mask=None, x_lengths=None, memory_mask=None,
    memory_lengths=None, causal=True)``.
    """

    def __init__(self, layers, norm_layer=None):
        super().__init__(layers, norm_layer, TransformerDecoderLayer)

    def forward(self, x, memory, x_mask=None, x_lengths=None, memory_mask=None,
                memory_lengths=None, causal=True):
        for layer in self.layers:
            x = layer(x, memory, x_mask=x_mask, x_lengths=x_lengths, memory_mask=memory_mask,
                      memory_lengths=memory_lengths, causal=causal)
        return self._finish(x)


class RecurrentTransformerDecoder(_Stack):
    """The recurrent twin of :class:`TransformerDecoder`.

    ``forward(x, memory, memory_lengths=None, state=None)`` -> ``(x, state)``.
    """

    def __init__(self, layers, norm_layer=None):
        super().__init__(layers, norm_layer, RecurrentTransformerDecoderLayer)

    def forward(self, x, memory, memory_lengths=None, state=None):
        new_state = []
        for layer, s in zip(self.layers, self._states(state)):
            x, s = layer(x, memory, memory_lengths=memory_lengths, state=s)
            new_state.append(s)
        return self._finish(x), new_state
