"""fast_transformers.attention.local_attention (implemented in _inner.py)."""

from ._inner import LocalAttention  # noqa: F401

__all__ = ['LocalAttention']
