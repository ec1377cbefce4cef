"""fast_transformers.recurrent: token-by-token forms of the attentions and
transformers (``recurrent.attention`` with ``self_attention`` and
``cross_attention``, ``recurrent.transformers``)."""

from . import _utils, attention, transformers  # noqa: F401
