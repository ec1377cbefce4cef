"""fast_transformers.builders: transformers from keyword arguments.

``TransformerEncoderBuilder``, ``RecurrentEncoderBuilder``,
``TransformerDecoderBuilder``, ``RecurrentDecoderBuilder`` and
``AttentionBuilder``: ``from_kwargs(**kwargs)`` / ``from_dictionary(d)``
(``strict=True`` refuses unknown names), attributes settable afterwards
(``builder.attention_type = "linear"``), ``get()`` builds the model. The
``attention_type`` names are fast-transformers': full, linear,
causal-linear, clustered, improved-clustered, improved-causal, reformer,
exact-topk, local, and ``conditional-full:<type>``; the recurrent builders
take full, linear and causal-linear.
"""

import torch

from ..attention import (AttentionLayer, CausalLinearAttention, ClusteredAttention,
                        ConditionalFullAttention, ExactTopKAttention, FullAttention,
                        ImprovedClusteredAttention, ImprovedClusteredCausalAttention,
                        LinearAttention, LocalAttention, ReformerAttention)
from ..recurrent.attention import (RecurrentAttentionLayer, RecurrentCrossAttentionLayer,
                                  RecurrentCrossFullAttention, RecurrentCrossLinearAttention,
                                  RecurrentFullAttention, RecurrentLinearAttention)
from ..recurrent.transformers import (RecurrentTransformerDecoder,
                                     RecurrentTransformerDecoderLayer,
                                     RecurrentTransformerEncoder,
                                     RecurrentTransformerEncoderLayer)
from ..transformers import (TransformerDecoder, TransformerDecoderLayer, TransformerEncoder,
                           TransformerEncoderLayer)

__all__ = ["AttentionBuilder", "RecurrentAttentionBuilder", "RecurrentCrossAttentionBuilder",
           "TransformerEncoderBuilder", "RecurrentEncoderBuilder", "TransformerDecoderBuilder",
           "RecurrentDecoderBuilder"]

# The attention parameters every builder takes, with their defaults.
_ATTENTION_PARAMS = dict(softmax_temp=None, attention_dropout=0.1, query_dimensions=64,
                         feature_map=None, eps=1e-6, clusters=100, iterations=10, bits=63,
                         hash_bias=True, topk=32, chunk_size=32, rounds=4, masked=False,
                         local_context=32, length_limit=512, event_dispatcher="")


def _batch_attention(kind, p):
    if kind.startswith("conditional-full:"):
        other = _batch_attention(kind.split(":", 1)[1], p)
        return ConditionalFullAttention(other, p["length_limit"], p["softmax_temp"],
                                        p["attention_dropout"])
    makers = {
        "full": lambda: FullAttention(p["softmax_temp"], p["attention_dropout"]),
        "linear": lambda: LinearAttention(p["query_dimensions"], p["feature_map"], p["eps"]),
        "causal-linear": lambda: CausalLinearAttention(p["query_dimensions"], p["feature_map"],
                                                       p["eps"]),
        "clustered": lambda: ClusteredAttention(p["clusters"], p["iterations"], p["bits"],
                                                p["hash_bias"], p["softmax_temp"],
                                                p["attention_dropout"]),
        "improved-clustered": lambda: ImprovedClusteredAttention(
            p["clusters"], p["iterations"], p["bits"], p["hash_bias"], p["topk"],
            p["softmax_temp"], p["attention_dropout"]),
        "improved-causal": lambda: ImprovedClusteredCausalAttention(
            p["clusters"], p["iterations"], p["bits"], p["hash_bias"], p["topk"],
            p["softmax_temp"], p["attention_dropout"]),
        "reformer": lambda: ReformerAttention(p["chunk_size"], p["bits"], p["rounds"], p["masked"],
                                              p["softmax_temp"], p["attention_dropout"]),
        "exact-topk": lambda: ExactTopKAttention(p["topk"], p["softmax_temp"],
                                                 p["attention_dropout"]),
        "local": lambda: LocalAttention(p["local_context"], p["softmax_temp"],
                                        p["attention_dropout"]),
    }
    return _make(makers, kind)


def _recurrent_attention(kind, p):
    linear = lambda: RecurrentLinearAttention(p["query_dimensions"], p["feature_map"], p["eps"])  # noqa: E731
    return _make({"full": lambda: RecurrentFullAttention(p["softmax_temp"], p["attention_dropout"]),
                  "linear": linear, "causal-linear": linear}, kind)


def _recurrent_cross_attention(kind, p):
    return _make({
        "full": lambda: RecurrentCrossFullAttention(p["softmax_temp"], p["attention_dropout"]),
        "linear": lambda: RecurrentCrossLinearAttention(p["query_dimensions"], p["feature_map"],
                                                        p["eps"]),
    }, kind)


def _make(makers, kind):
    if kind not in makers:
        raise ValueError("attention_type %r is not available here; valid: %s"
                         % (kind, ", ".join(sorted(makers))))
    return makers[kind]()


class _Builder:
    _DEFAULTS = {}

    def __init__(self):
        object.__setattr__(self, "_values", dict(self._DEFAULTS))

    @classmethod
    def from_kwargs(cls, strict=True, **kwargs):
        builder = cls()
        for key, value in kwargs.items():
            if key in cls._DEFAULTS:
                setattr(builder, key, value)
            elif strict:
                raise ValueError("%s: unknown argument %r; valid: %s"
                                 % (cls.__name__, key, ", ".join(sorted(cls._DEFAULTS))))
        return builder

    @classmethod
    def from_dictionary(cls, dictionary, strict=True):
        return cls.from_kwargs(strict=strict, **dictionary)

    def __getattr__(self, key):
        values = self.__dict__.get("_values", {})
        if key in values:
            return values[key]
        raise AttributeError("%s has no attribute %r" % (type(self).__name__, key))

    def __setattr__(self, key, value):
        if key not in self._DEFAULTS:
            raise AttributeError("%s: unknown argument %r; valid: %s"
                                 % (type(self).__name__, key, ", ".join(sorted(self._DEFAULTS))))
        self._values[key] = value

    def _layer_sizes(self):
        v = self._values
        d_model = v["n_heads"] * v["value_dimensions"]
        return d_model, dict(d_keys=v["query_dimensions"], d_values=v["value_dimensions"])

    def _final_norm(self, d_model):
        return torch.nn.LayerNorm(d_model) if self._values["final_normalization"] else None


_MODEL = dict(n_layers=4, n_heads=4, value_dimensions=64, feed_forward_dimensions=1024,
              dropout=0.1, activation="relu", final_normalization=True, **_ATTENTION_PARAMS)


# fast-transformers' name for the common base (builders/base.py).
BaseBuilder = _Builder


class AttentionBuilder(_Builder):
    """``AttentionBuilder.from_kwargs(**params).get(attention_type)``: an inner attention."""

    _DEFAULTS = dict(_ATTENTION_PARAMS)

    def get(self, attention_type):
        return _batch_attention(attention_type, self._values)


class RecurrentAttentionBuilder(AttentionBuilder):
    def get(self, attention_type):
        return _recurrent_attention(attention_type, self._values)


class RecurrentCrossAttentionBuilder(AttentionBuilder):
    def get(self, attention_type):
        return _recurrent_cross_attention(attention_type, self._values)


class TransformerEncoderBuilder(_Builder):
    """A TransformerEncoder of ``n_layers`` layers of ``attention_type``."""

    _DEFAULTS = dict(_MODEL, attention_type="full")
    _attention, _layer, _attention_layer, _stack = (
        staticmethod(_batch_attention), TransformerEncoderLayer, AttentionLayer, TransformerEncoder)

    def get(self):
        v = self._values
        d_model, dims = self._layer_sizes()
        layers = [
            self._layer(self._attention_layer(self._attention(v["attention_type"], v), d_model,
                                              v["n_heads"], **dims),
                        d_model, v["feed_forward_dimensions"], v["dropout"], v["activation"])
            for _ in range(v["n_layers"])
        ]
        return self._stack(layers, self._final_norm(d_model))


class RecurrentEncoderBuilder(TransformerEncoderBuilder):
    """The recurrent twin of TransformerEncoderBuilder's model (same weights)."""

    _attention, _layer, _attention_layer, _stack = (
        staticmethod(_recurrent_attention), RecurrentTransformerEncoderLayer,
        RecurrentAttentionLayer, RecurrentTransformerEncoder)


class TransformerDecoderBuilder(_Builder):
    """A TransformerDecoder with ``self_attention_type`` and ``cross_attention_type``."""

    _DEFAULTS = dict(_MODEL, self_attention_type="full", cross_attention_type="full")
    _self, _cross = staticmethod(_batch_attention), staticmethod(_batch_attention)
    _self_layer, _cross_layer = AttentionLayer, AttentionLayer
    _layer, _stack = TransformerDecoderLayer, TransformerDecoder

    def get(self):
        v = self._values
        d_model, dims = self._layer_sizes()
        layers = [
            self._layer(
                self._self_layer(self._self(v["self_attention_type"], v), d_model, v["n_heads"],
                                 **dims),
                self._cross_layer(self._cross(v["cross_attention_type"], v), d_model,
                                  v["n_heads"], **dims),
                d_model, v["feed_forward_dimensions"], v["dropout"], v["activation"])
            for _ in range(v["n_layers"])
        ]
        return self._stack(layers, self._final_norm(d_model))


class RecurrentDecoderBuilder(TransformerDecoderBuilder):
    """The recurrent twin of TransformerDecoderBuilder's model (same weights)."""

    _self, _cross = staticmethod(_recurrent_attention), staticmethod(_recurrent_cross_attention)
    _self_layer, _cross_layer = RecurrentAttentionLayer, RecurrentCrossAttentionLayer
    _layer, _stack = RecurrentTransformerDecoderLayer, RecurrentTransformerDecoder
