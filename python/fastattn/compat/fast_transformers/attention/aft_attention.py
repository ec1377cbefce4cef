"""fast_transformers.attention.aft_attention (implemented in _inner.py)."""

from ._inner import AFTFullAttention, AFTSimpleAttention  # noqa: F401

__all__ = ['AFTFullAttention', 'AFTSimpleAttention']
