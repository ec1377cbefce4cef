"""fast_transformers.builders: transformers from keyword arguments.

Module for module as in fast-transformers (``base``, ``attention_builders``,
``transformer_builders``); the implementations are in ``_builders.py``.
"""

from . import attention_builders, base, transformer_builders  # noqa: F401
from ._builders import (AttentionBuilder, BaseBuilder, RecurrentAttentionBuilder,  # noqa: F401
                        RecurrentCrossAttentionBuilder, RecurrentDecoderBuilder,
                        RecurrentEncoderBuilder, TransformerDecoderBuilder,
                        TransformerEncoderBuilder)

__all__ = ["AttentionBuilder", "RecurrentAttentionBuilder", "RecurrentCrossAttentionBuilder",
           "TransformerEncoderBuilder", "RecurrentEncoderBuilder", "TransformerDecoderBuilder",
           "RecurrentDecoderBuilder"]
