"""fast_transformers.attention.reformer_attention (implemented in _inner.py)."""

from ._inner import ReformerAttention  # noqa: F401

__all__ = ['ReformerAttention']
