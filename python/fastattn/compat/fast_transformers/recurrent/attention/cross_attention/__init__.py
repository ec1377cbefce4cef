"""fast_transformers.recurrent.attention.cross_attention: the recurrent cross attention
layer and its inner attentions (implemented in ../_inner.py)."""

from . import attention_layer, full_attention, linear_attention  # noqa: F401
from .attention_layer import RecurrentCrossAttentionLayer  # noqa: F401
from .full_attention import RecurrentCrossFullAttention  # noqa: F401
from .linear_attention import RecurrentCrossLinearAttention  # noqa: F401

__all__ = ['RecurrentCrossAttentionLayer', 'RecurrentCrossFullAttention',
           'RecurrentCrossLinearAttention']
