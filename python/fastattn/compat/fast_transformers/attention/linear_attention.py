"""fast_transformers.attention.linear_attention (implemented in _inner.py)."""

from ._inner import LinearAttention  # noqa: F401

__all__ = ['LinearAttention']
