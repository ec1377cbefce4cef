"""fast_transformers.attention.exact_topk_attention (implemented in _inner.py)."""

from ._inner import ExactTopKAttention  # noqa: F401

__all__ = ['ExactTopKAttention']
