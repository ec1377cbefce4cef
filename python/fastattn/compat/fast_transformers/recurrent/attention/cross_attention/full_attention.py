"""fast_transformers.recurrent.attention.cross_attention.full_attention."""

from .._inner import RecurrentCrossFullAttention  # noqa: F401

__all__ = ['RecurrentCrossFullAttention']
