"""fast_transformers.attention.clustered_attention (implemented in _inner.py)."""

from ._inner import ClusteredAttention  # noqa: F401

__all__ = ['ClusteredAttention']
