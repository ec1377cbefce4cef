"""fast_transformers.builders.transformer_builders."""

from ._builders import (  # noqa: F401
    TransformerEncoderBuilder, RecurrentEncoderBuilder, TransformerDecoderBuilder,
    RecurrentDecoderBuilder)

__all__ = ['TransformerEncoderBuilder', 'RecurrentEncoderBuilder', 'TransformerDecoderBuilder',
           'RecurrentDecoderBuilder']
