"""fast_transformers.builders.attention_builders."""

from ._builders import (  # noqa: F401
    AttentionBuilder, RecurrentAttentionBuilder, RecurrentCrossAttentionBuilder)

__all__ = ['AttentionBuilder', 'RecurrentAttentionBuilder', 'RecurrentCrossAttentionBuilder']
