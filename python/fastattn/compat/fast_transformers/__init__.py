"""fast-transformers 0.4's public API on fastattn (docs/python.md, "compat").

    import fastattn.compat.fast_transformers as fast_transformers
    from fastattn.compat.fast_transformers.builders import TransformerEncoderBuilder

Its modules are fast-transformers' public tree, module for module:
``attention`` (``attention_layer``, ``full_attention``, ``linear_attention``,
...), ``builders`` (``base``, ``attention_builders``, ``transformer_builders``),
``feature_maps`` (``base``, ``fourier_features``), ``masking``,
``transformers``, ``recurrent`` (``attention.self_attention``,
``attention.cross_attention``, ``transformers``), ``attention_registry``
(``registry``, ``spec``), ``events`` (``event``, ``event_dispatcher``,
``filters``), ``weight_mapper``, ``utils``; each name
where fast-transformers puts it. :func:`install` makes ``import
fast_transformers`` (and every submodule) resolve to this package, for
programs that cannot be edited.
"""

import sys

from . import attention, attention_registry, builders, events, feature_maps  # noqa: F401
from . import masking, recurrent, transformers, utils, weight_mapper  # noqa: F401

__all__ = ["attention", "attention_registry", "builders", "events", "feature_maps", "masking",
           "transformers", "recurrent", "utils", "weight_mapper", "install"]


def install():
    """Registers this package as ``fast_transformers`` in ``sys.modules``, so
    that ``import fast_transformers.builders`` etc. load it. Refuses when a
    real fast_transformers is already imported."""
    existing = sys.modules.get("fast_transformers")
    if existing is not None and existing is not sys.modules[__name__]:
        raise RuntimeError("fastattn.compat.fast_transformers.install: another fast_transformers "
                           "(%s) is already imported" % getattr(existing, "__file__", existing))
    prefix = __name__ + "."
    for name, module in list(sys.modules.items()):
        if name == __name__ or name.startswith(prefix):
            sys.modules["fast_transformers" + name[len(__name__):]] = module
