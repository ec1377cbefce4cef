"""fast_transformers.builders.base: the builders' common base."""

from ._builders import BaseBuilder  # noqa: F401

__all__ = ['BaseBuilder']
