"""fast_transformers.attention.causal_linear_attention (implemented in _inner.py)."""

from ._inner import CausalLinearAttention  # noqa: F401

__all__ = ['CausalLinearAttention']
