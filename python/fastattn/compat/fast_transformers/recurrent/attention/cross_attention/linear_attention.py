"""fast_transformers.recurrent.attention.cross_attention.linear_attention."""

from .._inner import RecurrentCrossLinearAttention  # noqa: F401

__all__ = ['RecurrentCrossLinearAttention']
