"""fast_transformers.attention.full_attention (implemented in _inner.py)."""

from ._inner import FullAttention  # noqa: F401

__all__ = ['FullAttention']
