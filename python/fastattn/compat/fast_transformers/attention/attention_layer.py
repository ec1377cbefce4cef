"""fast_transformers.attention.attention_layer (implemented in _inner.py)."""

from ._inner import AttentionLayer  # noqa: F401

__all__ = ['AttentionLayer']
