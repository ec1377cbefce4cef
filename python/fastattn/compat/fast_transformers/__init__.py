"""fast-transformers 0.4's public API on fastattn (docs/python.md, "compat").

    import fastattn.compat.fast_transformers as fast_transformers
    from fastattn.compat.fast_transformers.builders import TransformerEncoderBuilder

Submodules as in fast-transformers: ``builders``, ``attention``,
``masking``, ``feature_maps``, ``transformers``, ``recurrent.attention``,
``recurrent.transformers``. :func:`install` makes ``import fast_transformers``
(and its submodules) resolve to this package, for programs that cannot be
edited.
"""

import sys

from . import attention, builders, feature_maps, masking, transformers  # noqa: F401
from .recurrent import attention as _recurrent_attention  # noqa: F401
from .recurrent import transformers as _recurrent_transformers  # noqa: F401

__all__ = ["attention", "builders", "feature_maps", "masking", "transformers", "recurrent",
           "install"]


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
