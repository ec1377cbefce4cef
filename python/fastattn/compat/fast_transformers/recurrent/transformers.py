"""fast_transformers.recurrent.transformers: the encoder and decoder one
token at a time, with the batch modules' weight names."""

import torch

from ....nn.transformers import _FeedForwardBlock
from ..masking import LengthMask
from ..transformers import Stack

__all__ = ["RecurrentTransformerEncoderLayer", "RecurrentTransformerEncoder",
           "RecurrentTransformerDecoderLayer", "RecurrentTransformerDecoder"]


class RecurrentTransformerEncoderLayer(_FeedForwardBlock):
    """``forward(x, state=None, memory=None)``: x ``(N, D)`` -> ``(x, state)``."""

    def __init__(self, attention, d_model, d_ff=None, dropout=0.1, activation="relu",
                 event_dispatcher=""):
        super().__init__(d_model, d_ff, dropout, activation, False, 2)
        self.attention = attention

    def forward(self, x, state=None, memory=None):
        state = memory if state is None else state
        out = {}

        def attend(y):
            y, out["state"] = self.attention(y, y, y, state)
            return y

        x = self._sublayer(x, self.norm1, attend)
        return self._sublayer(x, self.norm2, self._feed_forward), out["state"]


class RecurrentTransformerEncoder(Stack):
    """``forward(x, state=None, memory=None)`` -> ``(x, state)`` (a list per layer)."""

    def forward(self, x, state=None, memory=None):
        state = memory if state is None else state
        state = state if state is not None else [None] * len(self.layers)
        new_state = []
        for layer, s in zip(self.layers, state):
            x, s = layer(x, s)
            new_state.append(s)
            self._report(x)
        return self._normed(x), new_state


class RecurrentTransformerDecoderLayer(_FeedForwardBlock):
    """``forward(x, memory, memory_length_mask=None, state=None)`` -> ``(x, state)``."""

    def __init__(self, self_attention, cross_attention, d_model, d_ff=None, dropout=0.1,
                 activation="relu", event_dispatcher=""):
        super().__init__(d_model, d_ff, dropout, activation, False, 3)
        self.self_attention = self_attention
        self.cross_attention = cross_attention

    def forward(self, x, memory, memory_length_mask=None, state=None):
        N, S = memory.shape[0], memory.shape[1]
        if memory_length_mask is None:
            memory_length_mask = LengthMask(memory.new_full((N,), S, dtype=torch.int64))
        self_state, cross_state = state if state is not None else (None, None)
        out = {}

        def attend_self(y):
            y, out["self"] = self.self_attention(y, y, y, self_state)
            return y

        def attend_memory(y):
            y, out["cross"] = self.cross_attention(y, memory, memory, memory_length_mask,
                                                   state=cross_state)
            return y

        x = self._sublayer(x, self.norm1, attend_self)
        x = self._sublayer(x, self.norm2, attend_memory)
        return self._sublayer(x, self.norm3, self._feed_forward), [out["self"], out["cross"]]


class RecurrentTransformerDecoder(Stack):
    """``forward(x, memory, memory_length_mask=None, state=None)`` -> ``(x, state)``."""

    def forward(self, x, memory, memory_length_mask=None, state=None):
        state = state if state is not None else [None] * len(self.layers)
        new_state = []
        for layer, s in zip(self.layers, state):
            x, s = layer(x, memory, memory_length_mask=memory_length_mask, state=s)
            new_state.append(s)
            self._report(x)
        return self._normed(x), new_state

