"""fast_transformers.builders: transformers and attentions from keyword
arguments, by name, through the attention registries.

``AttentionBuilder`` / ``RecurrentAttentionBuilder`` /
``RecurrentCrossAttentionBuilder`` hold attention parameters (the names and
specs registered in ``attention_registry``: a value is validated, and
converted to its canonical form, when it is set) and build a registered
attention by key: ``get("full")``, or a composition ``get("a:b,c")`` (b
and c built, then passed to a's constructor: ``conditional-full:linear``).
The transformer builders (``TransformerEncoderBuilder``,
``RecurrentEncoderBuilder``, ``TransformerDecoderBuilder``,
``RecurrentDecoderBuilder``) hold the model's parameters and pass every
other name to their attention builder(s), so a user's registered attention
and its parameters are built like fastattn's. ``from_kwargs(**kwargs)`` /
``from_dictionary(d)`` / ``from_namespace(args)``: ``strict`` (default
True, False for namespaces) refuses names no builder knows.
"""

import torch

from ..attention import AttentionLayer
from ..attention_registry import (AttentionRegistry, RecurrentAttentionRegistry,
                                  RecurrentCrossAttentionRegistry)
from ..recurrent.attention import RecurrentAttentionLayer, RecurrentCrossAttentionLayer
from ..recurrent.transformers import (RecurrentTransformerDecoder,
                                      RecurrentTransformerDecoderLayer,
                                      RecurrentTransformerEncoder,
                                      RecurrentTransformerEncoderLayer)
from ..transformers import (TransformerDecoder, TransformerDecoderLayer, TransformerEncoder,
                            TransformerEncoderLayer)

__all__ = ["BaseBuilder", "AttentionBuilder", "RecurrentAttentionBuilder",
           "RecurrentCrossAttentionBuilder", "TransformerEncoderBuilder",
           "RecurrentEncoderBuilder", "TransformerDecoderBuilder", "RecurrentDecoderBuilder"]


class BaseBuilder:
    """Builders set from a dictionary, keyword arguments or an argparse
    namespace; ``get()`` builds."""

    @classmethod
    def from_kwargs(cls, **kwargs):
        strict = kwargs.pop("strict", True)
        return cls.from_dictionary(kwargs, strict=strict)

    @classmethod
    def from_namespace(cls, args, strict=False):
        return cls.from_dictionary(vars(args), strict=strict)

    @classmethod
    def from_dictionary(cls, dictionary, strict=True):
        builder = cls()
        for key, value in dictionary.items():
            try:
                setattr(builder, key, value)
            except AttributeError:
                if strict:
                    raise ValueError("%s: unknown argument %r; valid: %s"
                                     % (cls.__name__, key, ", ".join(builder._names())))
        return builder

    def _names(self):
        return []

    def get(self):
        raise NotImplementedError(type(self).__name__ + ".get")


class BaseAttentionBuilder(BaseBuilder):
    """Attention parameters for one registry; ``get(attention_type)``."""

    def __init__(self, registry):
        object.__setattr__(self, "_registry", registry)
        object.__setattr__(self, "_parameters", {})

    @property
    def available_attentions(self):
        """The keys this builder builds."""
        return self._registry.keys

    def validate_attention_type(self, attention_type):
        """Whether every key in ``attention_type`` (``a:b,c``) is registered."""
        return isinstance(attention_type, str) and all(
            all(t in self._registry for t in part.split(","))
            for part in attention_type.split(":"))

    def _names(self):
        return sorted(self._registry._specs)

    def __setattr__(self, key, value):
        if key.startswith("_"):
            return object.__setattr__(self, key, value)
        if not self._registry.contains_parameter(key):
            raise AttributeError("%r is not a valid attention parameter name; valid: %s"
                                 % (key, ", ".join(self._names())))
        self._parameters[key] = self._registry.validate_parameter(key, value)

    def __getattr__(self, key):
        if key.startswith("_"):
            raise AttributeError(key)
        if key in self._parameters:
            return self._parameters[key]
        if self._registry.contains_parameter(key):  # unset: its spec's default
            try:
                return self._registry.validate_parameter(key, None)
            except ValueError:
                return None
        raise AttributeError("%s has no attention parameter %r" % (type(self).__name__, key))

    def __repr__(self):
        return "%s.from_kwargs(\n%s\n)" % (type(self).__name__, ",\n".join(
            "    %s=%r" % item for item in self._parameters.items()))

    def get(self, attention_type):
        """Builds ``attention_type``: a registered key, or a composition
        ``a:b,c`` (right to left: b and c built, then given to a)."""
        if not isinstance(attention_type, str):
            raise ValueError("attention_type must be a string, got %r" % (attention_type,))
        built = []
        for part in reversed(attention_type.split(":")):
            built = [self._construct(key, built) for key in part.split(",")]
        if len(built) != 1:
            raise ValueError("Invalid attention_type argument %r: it builds %d attentions, "
                             "not one" % (attention_type, len(built)))
        return built[0]

    def _construct(self, key, decorated):
        if key not in self._registry:
            raise ValueError("Unknown attention type %r; available: %s"
                             % (key, ", ".join(self.available_attentions)))
        cls, names = self._registry[key]
        kwargs = {}
        for name in names:
            value = self._parameters.get(name)
            try:
                kwargs[name] = self._registry.validate_parameter(name, value)
            except ValueError:
                if value is not None:
                    raise
                raise ValueError("attention_type %r needs the parameter %r (%r); set it on the "
                                 "builder" % (key, name, self._registry._specs[name])) from None
        return cls(*decorated, **kwargs)


class AttentionBuilder(BaseAttentionBuilder):
    """Batch attentions (``AttentionRegistry``)."""

    def __init__(self):
        super().__init__(AttentionRegistry)


class RecurrentAttentionBuilder(BaseAttentionBuilder):
    """Recurrent self attentions (``RecurrentAttentionRegistry``)."""

    def __init__(self):
        super().__init__(RecurrentAttentionRegistry)


class RecurrentCrossAttentionBuilder(BaseAttentionBuilder):
    """Recurrent cross attentions (``RecurrentCrossAttentionRegistry``)."""

    def __init__(self):
        super().__init__(RecurrentCrossAttentionRegistry)


def _positive_int(name):
    def check(value):
        if isinstance(value, bool) or int(value) != value or int(value) < 1:
            raise ValueError("%s must be an int >= 1, got %r" % (name, value))
        return int(value)
    return check


def _activation(value):
    if value not in ("relu", "gelu"):
        raise ValueError("activation must be one of 'relu', 'gelu', got %r" % (value,))
    return value


def _dropout(value):
    value = float(value)
    if not 0.0 <= value < 1.0:
        raise ValueError("dropout must be in [0, 1), got %r" % (value,))
    return value


def _dispatcher(value):
    from ..events import EventDispatcher

    if not isinstance(value, (str, EventDispatcher)):
        raise ValueError("event_dispatcher must be an EventDispatcher or a string key, got %r"
                         % (value,))
    return value


class BaseTransformerBuilder(BaseBuilder):
    """A model's own parameters (``_OWN``: name -> (default, check)); every
    other name goes to the attention builders (``_attention_builders``)."""

    _OWN = dict(n_layers=(4, _positive_int("n_layers")), n_heads=(4, _positive_int("n_heads")),
                feed_forward_dimensions=(1024, _positive_int("feed_forward_dimensions")),
                query_dimensions=(64, _positive_int("query_dimensions")),
                value_dimensions=(64, _positive_int("value_dimensions")),
                model_dimensions=(None, _positive_int("model_dimensions")),
                dropout=(0.1, _dropout), activation=("relu", _activation),
                final_normalization=(True, bool), event_dispatcher=("", _dispatcher))

    def __init__(self, builders):
        object.__setattr__(self, "_values", {k: d for k, (d, _) in self._OWN.items()})
        object.__setattr__(self, "_builders", builders)

    def _names(self):
        names = set(self._OWN)
        for builder in self._builders.values():
            names.update(builder._names())
        return sorted(names)

    def __setattr__(self, key, value):
        if key.startswith("_"):
            return object.__setattr__(self, key, value)
        own = key in self._OWN
        if own:
            checked = self._OWN[key][1](value)
            if key.endswith("attention_type"):
                self._check_type(key, checked)
            self._values[key] = checked
        taken = own
        for builder in self._builders.values():
            if not builder._registry.contains_parameter(key):
                continue
            try:
                setattr(builder, key, value)
                taken = True
            except ValueError:
                if not own:
                    raise
        if not taken:
            raise AttributeError("%s: unknown argument %r; valid: %s"
                                 % (type(self).__name__, key, ", ".join(self._names())))

    def __getattr__(self, key):
        if key.startswith("_"):
            raise AttributeError(key)
        if key in self._values:
            value = self._values[key]
            return self._default(key) if value is None else value
        for builder in self._builders.values():
            if builder._registry.contains_parameter(key):
                return getattr(builder, key)
        raise AttributeError("%s has no parameter %r" % (type(self).__name__, key))

    def _default(self, key):
        if key == "model_dimensions":
            return self.n_heads * self.value_dimensions
        if key.startswith("cross_"):
            return self._values[key[len("cross_"):]] if key != "cross_model_dimensions" \
                else self.cross_n_heads * self.cross_value_dimensions
        return None

    def _check_type(self, key, value):
        which = key[:-len("_attention_type")] if key != "attention_type" else "attention"
        builder = self._builders[which]
        if not builder.validate_attention_type(value):
            raise ValueError("%s %r is not available; valid: %s"
                             % (key, value, ", ".join(builder.available_attentions)))

    def _attention(self, which, attention_type):
        builder = self._builders[which]
        # The model's own values of the names the attentions share.
        for name in ("query_dimensions", "event_dispatcher"):
            if builder._registry.contains_parameter(name) and name not in builder._parameters:
                setattr(builder, name, getattr(self, name))
        builder.event_dispatcher = self.event_dispatcher
        return builder.get(attention_type)

    def _final_norm(self):
        d_model = self.model_dimensions
        return torch.nn.LayerNorm(d_model) if self.final_normalization else None


def _attention_type(value):
    if not isinstance(value, str):
        raise ValueError("attention types are strings, got %r" % (value,))
    return value


class _EncoderBuilder(BaseTransformerBuilder):
    _OWN = dict(BaseTransformerBuilder._OWN, attention_type=("full", _attention_type))
    _registry_builder = AttentionBuilder
    _layer, _attention_layer, _stack = (TransformerEncoderLayer, AttentionLayer,
                                        TransformerEncoder)

    def __init__(self):
        super().__init__({"attention": self._registry_builder()})

    @property
    def attention(self):
        """The attention builder."""
        return self._builders["attention"]

    def get(self):
        d_model, ed = self.model_dimensions, self.event_dispatcher
        layers = [
            self._layer(self._attention_layer(
                self._attention("attention", self.attention_type), d_model, self.n_heads,
                d_keys=self.query_dimensions, d_values=self.value_dimensions,
                event_dispatcher=ed),
                d_model, self.feed_forward_dimensions, self.dropout, self.activation,
                event_dispatcher=ed)
            for _ in range(self.n_layers)]
        return self._stack(layers, self._final_norm(), event_dispatcher=ed)


class TransformerEncoderBuilder(_EncoderBuilder):
    """A TransformerEncoder of ``n_layers`` layers of ``attention_type``."""


class RecurrentEncoderBuilder(_EncoderBuilder):
    """The recurrent twin of TransformerEncoderBuilder's model (same weights)."""

    _registry_builder = RecurrentAttentionBuilder
    _layer, _attention_layer, _stack = (RecurrentTransformerEncoderLayer, RecurrentAttentionLayer,
                                        RecurrentTransformerEncoder)


class _DecoderBuilder(BaseTransformerBuilder):
    _OWN = dict(BaseTransformerBuilder._OWN, self_attention_type=("full", _attention_type),
                cross_attention_type=("full", _attention_type),
                cross_n_heads=(None, _positive_int("cross_n_heads")),
                cross_query_dimensions=(None, _positive_int("cross_query_dimensions")),
                cross_value_dimensions=(None, _positive_int("cross_value_dimensions")),
                cross_model_dimensions=(None, _positive_int("cross_model_dimensions")))
    _self_builder, _cross_builder = AttentionBuilder, AttentionBuilder
    _self_layer, _cross_layer = AttentionLayer, AttentionLayer
    _layer, _stack = TransformerDecoderLayer, TransformerDecoder

    def __init__(self):
        super().__init__({"self": self._self_builder(), "cross": self._cross_builder()})

    @property
    def self_attention(self):
        """The self attention's builder."""
        return self._builders["self"]

    @property
    def cross_attention(self):
        """The cross attention's builder."""
        return self._builders["cross"]

    def get(self):
        d_model, ed = self.model_dimensions, self.event_dispatcher
        layers = []
        for _ in range(self.n_layers):
            self_layer = self._self_layer(
                self._attention("self", self.self_attention_type), d_model, self.n_heads,
                d_keys=self.query_dimensions, d_values=self.value_dimensions,
                event_dispatcher=ed)
            cross_layer = self._cross_layer(
                self._attention("cross", self.cross_attention_type), d_model,
                self.cross_n_heads, d_keys=self.cross_query_dimensions,
                d_values=self.cross_value_dimensions, d_model_keys=self.cross_model_dimensions,
                event_dispatcher=ed)
            layers.append(self._layer(self_layer, cross_layer, d_model,
                                      self.feed_forward_dimensions, self.dropout,
                                      self.activation, event_dispatcher=ed))
        return self._stack(layers, self._final_norm(), event_dispatcher=ed)


class TransformerDecoderBuilder(_DecoderBuilder):
    """A TransformerDecoder with ``self_attention_type`` and ``cross_attention_type``."""


class RecurrentDecoderBuilder(_DecoderBuilder):
    """The recurrent twin of TransformerDecoderBuilder's model (same weights)."""

    _self_builder, _cross_builder = RecurrentAttentionBuilder, RecurrentCrossAttentionBuilder
    _self_layer, _cross_layer = RecurrentAttentionLayer, RecurrentCrossAttentionLayer
    _layer, _stack = RecurrentTransformerDecoderLayer, RecurrentTransformerDecoder
