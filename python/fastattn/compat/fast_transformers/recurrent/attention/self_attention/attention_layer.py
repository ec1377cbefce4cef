"""fast_transformers.recurrent.attention.self_attention.attention_layer."""

from .._inner import RecurrentAttentionLayer  # noqa: F401

__all__ = ['RecurrentAttentionLayer']
