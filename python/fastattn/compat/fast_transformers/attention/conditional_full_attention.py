"""fast_transformers.attention.conditional_full_attention (implemented in _inner.py)."""

from ._inner import ConditionalFullAttention  # noqa: F401

__all__ = ['ConditionalFullAttention']
