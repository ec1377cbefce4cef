"""fast_transformers.recurrent.attention: the recurrent attention layers
and inner attentions, module for module as in fast-transformers
(``self_attention``, ``cross_attention``); the implementations are in
``_inner.py``."""

from . import cross_attention, self_attention  # noqa: F401
from ._inner import (RecurrentAttentionLayer, RecurrentCrossAttentionLayer,  # noqa: F401
                     RecurrentCrossFullAttention, RecurrentCrossLinearAttention,
                     RecurrentFullAttention, RecurrentLinearAttention)

__all__ = ["RecurrentAttentionLayer", "RecurrentCrossAttentionLayer", "RecurrentFullAttention",
           "RecurrentLinearAttention", "RecurrentCrossFullAttention",
           "RecurrentCrossLinearAttention"]
