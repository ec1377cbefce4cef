"""fast_transformers.recurrent.attention.cross_attention.attention_layer."""

from .._inner import RecurrentCrossAttentionLayer  # noqa: F401

__all__ = ['RecurrentCrossAttentionLayer']
