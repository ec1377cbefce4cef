"""fast_transformers.recurrent.attention.self_attention: the recurrent self attention
layer and its inner attentions (implemented in ../_inner.py)."""

from . import attention_layer, full_attention, linear_attention  # noqa: F401
from .attention_layer import RecurrentAttentionLayer  # noqa: F401
from .full_attention import RecurrentFullAttention  # noqa: F401
from .linear_attention import RecurrentLinearAttention  # noqa: F401

__all__ = ['RecurrentAttentionLayer', 'RecurrentFullAttention', 'RecurrentLinearAttention']
