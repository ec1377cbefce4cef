"""fast_transformers.attention_registry: register attention modules for the
builders (``registry``: the three registries; ``spec``: the parameter specs).

    from fast_transformers.attention_registry import AttentionRegistry, Optional, Int
    AttentionRegistry.register("my-attention", MyAttention,
                               [("my_width", Optional(Int, 16))])
    TransformerEncoderBuilder.from_kwargs(attention_type="my-attention", my_width=8).get()

fastattn's attentions are registered under fast-transformers' keys when
``fast_transformers.attention`` is imported (this package's ``__init__``
does so).
"""

from . import registry, spec  # noqa: F401
from .registry import (AttentionRegistry, RecurrentAttentionRegistry,  # noqa: F401
                       RecurrentCrossAttentionRegistry, Registry)
from .spec import (Bool, Callable, Choice, EventDispatcherInstance, Float, Int,  # noqa: F401
                   Optional, Spec)

__all__ = ["AttentionRegistry", "RecurrentAttentionRegistry", "RecurrentCrossAttentionRegistry",
           "Spec", "Choice", "Optional", "Int", "Float", "Bool", "Callable",
           "EventDispatcherInstance"]
