"""fast_transformers.recurrent.attention.self_attention.linear_attention."""

from .._inner import RecurrentLinearAttention  # noqa: F401

__all__ = ['RecurrentLinearAttention']
