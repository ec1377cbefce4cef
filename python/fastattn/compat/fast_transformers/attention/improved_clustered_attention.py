"""fast_transformers.attention.improved_clustered_attention (implemented in _inner.py)."""

from ._inner import ImprovedClusteredAttention  # noqa: F401

__all__ = ['ImprovedClusteredAttention']
