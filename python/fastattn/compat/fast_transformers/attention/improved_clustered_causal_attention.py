"""fast_transformers.attention.improved_clustered_causal_attention (implemented in _inner.py)."""

from ._inner import ImprovedClusteredCausalAttention  # noqa: F401

__all__ = ['ImprovedClusteredCausalAttention']
