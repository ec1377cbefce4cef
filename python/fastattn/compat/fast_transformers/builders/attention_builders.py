"""fast_transformers.builders.attention_builders."""

from ._builders import (  # noqa: F401
    AttentionBuilder, BaseAttentionBuilder, RecurrentAttentionBuilder,
    RecurrentCrossAttentionBuilder)

__all__ = ['BaseAttentionBuilder', 'AttentionBuilder', 'RecurrentAttentionBuilder',
           'RecurrentCrossAttentionBuilder']
