"""fast_transformers.transformers: encoder and decoder layers and stacks.

fast-transformers' post-norm layers with its argument names, defaults, masks
and weight names (``linear1``, ``linear2``, ``norm1``.., ``dropout``,
``attention`` / ``self_attention`` / ``cross_attention``, ``layers``,
``norm``), built on fastattn.nn's feed-forward block.
"""

import torch
from torch import nn

from ...nn.transformers import _FeedForwardBlock
from .events import EventDispatcher, IntermediateOutput
from .masking import FullMask, LengthMask

__all__ = ["TransformerEncoderLayer", "TransformerEncoder", "TransformerDecoderLayer",
           "TransformerDecoder"]


class Stack(nn.Module):
    """Layers and an optional final norm; dispatches an IntermediateOutput
    after each layer (before the norm), as fast-transformers' stacks do."""

    def __init__(self, layers, norm_layer=None, event_dispatcher=""):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.norm = norm_layer
        self.event_dispatcher = EventDispatcher.get(event_dispatcher)

    def _report(self, x):
        if self.event_dispatcher.listening:
            self.event_dispatcher.dispatch(IntermediateOutput(self, x))

    def _normed(self, x):
        return x if self.norm is None else self.norm(x)


def default_masks(x, attn_mask, length_mask):
    """fast-transformers' defaults: every key kept, every sequence full."""
    N, L = x.shape[:2]
    if attn_mask is None:
        attn_mask = FullMask(L, device=x.device)
    if length_mask is None:
        length_mask = LengthMask(x.new_full((N,), L, dtype=torch.int64))
    return attn_mask, length_mask


class TransformerEncoderLayer(_FeedForwardBlock):
    """``TransformerEncoderLayer(attention, d_model, d_ff=None, dropout=0.1,
    activation="relu", event_dispatcher="")``; ``forward(x, attn_mask=None,
    length_mask=None)``."""

    def __init__(self, attention, d_model, d_ff=None, dropout=0.1, activation="relu",
                 event_dispatcher=""):
        super().__init__(d_model, d_ff, dropout, activation, False, 2)
        self.attention = attention

    def forward(self, x, attn_mask=None, length_mask=None):
        attn_mask, length_mask = default_masks(x, attn_mask, length_mask)
        x = self._sublayer(x, self.norm1, lambda y: self.attention(
            y, y, y, attn_mask=attn_mask, query_lengths=length_mask, key_lengths=length_mask))
        return self._sublayer(x, self.norm2, self._feed_forward)


class TransformerEncoder(Stack):
    """``TransformerEncoder(layers, norm_layer=None, event_dispatcher="")``."""

    def forward(self, x, attn_mask=None, length_mask=None):
        attn_mask, length_mask = default_masks(x, attn_mask, length_mask)
        for layer in self.layers:
            x = layer(x, attn_mask=attn_mask, length_mask=length_mask)
            self._report(x)
        return self._normed(x)


class TransformerDecoderLayer(_FeedForwardBlock):
    """``TransformerDecoderLayer(self_attention, cross_attention, d_model,
    d_ff=None, dropout=0.1, activation="relu", event_dispatcher="")``;
    ``forward(x, memory, x_mask=None, x_length_mask=None, memory_mask=None,
    memory_length_mask=None)``. As in fast-transformers the self-attention is
    causal only when ``x_mask`` is a TriangularCausalMask."""

    def __init__(self, self_attention, cross_attention, d_model, d_ff=None, dropout=0.1,
                 activation="relu", event_dispatcher=""):
        super().__init__(d_model, d_ff, dropout, activation, False, 3)
        self.self_attention = self_attention
        self.cross_attention = cross_attention

    def forward(self, x, memory, x_mask=None, x_length_mask=None, memory_mask=None,
                memory_length_mask=None):
        x_mask, x_length_mask = default_masks(x, x_mask, x_length_mask)
        N, L = x.shape[:2]
        S = memory.shape[1]
        if memory_mask is None:
            memory_mask = FullMask(L, S, device=x.device)
        if memory_length_mask is None:
            memory_length_mask = LengthMask(x.new_full((N,), S, dtype=torch.int64))
        x = self._sublayer(x, self.norm1, lambda y: self.self_attention(
            y, y, y, attn_mask=x_mask, query_lengths=x_length_mask, key_lengths=x_length_mask))
        x = self._sublayer(x, self.norm2, lambda y: self.cross_attention(
            y, memory, memory, attn_mask=memory_mask, query_lengths=x_length_mask,
            key_lengths=memory_length_mask))
        return self._sublayer(x, self.norm3, self._feed_forward)


class TransformerDecoder(Stack):
    """``TransformerDecoder(layers, norm_layer=None, event_dispatcher="")``."""

    def forward(self, x, memory, x_mask=None, x_length_mask=None, memory_mask=None,
                memory_length_mask=None):
        for layer in self.layers:
            x = layer(x, memory, x_mask=x_mask, x_length_mask=x_length_mask,
                      memory_mask=memory_mask, memory_length_mask=memory_length_mask)
            self._report(x)
        return self._normed(x)
