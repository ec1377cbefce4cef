"""fast_transformers.recurrent.attention.self_attention.full_attention."""

from .._inner import RecurrentFullAttention  # noqa: F401

__all__ = ['RecurrentFullAttention']
