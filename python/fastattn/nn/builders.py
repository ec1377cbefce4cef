"""Encoders and decoders from keyword arguments or a config (dict, JSON text
or JSON file).

    enc = build_encoder(n_layers=4, n_heads=8, query_dimensions=64,
                        attention_type="improved-clustered",
                        attention_params={"clusters": 100, "topk": 32})
    twin = build_encoder(config_of_enc, recurrent=True)  # same state_dict keys

Every key (defaults in brackets):

- ``n_layers`` [4], ``n_heads`` [4], ``query_dimensions`` [64] (E per head),
  ``value_dimensions`` [query_dimensions] (M per head), ``d_model``
  [n_heads·value_dimensions], ``feed_forward_dimensions`` [4·d_model],
  ``dropout`` [0.1], ``activation`` ["relu"], ``norm_first`` [False],
  ``final_norm`` [True], ``recurrent`` [False];
- encoder: ``attention_type`` ["full"], ``attention_params`` [{}];
- decoder: ``self_attention_type`` ["full"], ``self_attention_params`` [{}],
  ``cross_attention_type`` ["full"], ``cross_attention_params`` [{}],
  ``memory_dimensions`` [d_model] (the width of the encoder's output).
"""

import json
import os

from torch import nn

from .attention import (
    Attention,
    AttentionLayer,
    RecurrentAttentionLayer,
    RecurrentCrossAttentionLayer,
)
from .transformers import (
    RecurrentTransformerDecoder,
    RecurrentTransformerDecoderLayer,
    RecurrentTransformerEncoder,
    RecurrentTransformerEncoderLayer,
    TransformerDecoder,
    TransformerDecoderLayer,
    TransformerEncoder,
    TransformerEncoderLayer,
)

__all__ = ["build_encoder", "build_decoder", "load_config"]

_COMMON = dict(n_layers=4, n_heads=4, query_dimensions=64, value_dimensions=None, d_model=None,
               feed_forward_dimensions=None, dropout=0.1, activation="relu", norm_first=False,
               final_norm=True, recurrent=False)
_ENCODER = dict(_COMMON, attention_type="full", attention_params=None)
_DECODER = dict(_COMMON, self_attention_type="full", self_attention_params=None,
                cross_attention_type="full", cross_attention_params=None, memory_dimensions=None)


def load_config(config, defaults, where, overrides=None):
    """A config as a dict: a dict, JSON text, or the path of a JSON file,
    updated with ``overrides``; unknown keys are refused by name, missing ones
    take their defaults."""
    if config is None:
        config = {}
    elif isinstance(config, (str, os.PathLike)):
        text = str(config)
        if not text.lstrip().startswith("{"):
            with open(text) as f:
                text = f.read()
        try:
            config = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError("%s: the config is not valid JSON: %s" % (where, e)) from None
    if not isinstance(config, dict):
        raise TypeError("%s: config must be a dict, JSON text or a JSON file's path, got %s"
                        % (where, type(config).__name__))
    config = dict(config, **(overrides or {}))
    unknown = sorted(set(config) - set(defaults))
    if unknown:
        raise ValueError("%s: unknown config key %s; valid keys: %s"
                         % (where, ", ".join(repr(k) for k in unknown), ", ".join(sorted(defaults))))
    out = dict(defaults)
    out.update(config)
    if out["value_dimensions"] is None:
        out["value_dimensions"] = out["query_dimensions"]
    if out["d_model"] is None:
        out["d_model"] = out["n_heads"] * out["value_dimensions"]
    if not isinstance(out["n_layers"], int) or out["n_layers"] < 1:
        raise ValueError("%s: n_layers must be a positive int, got %r" % (where, out["n_layers"]))
    return out


def _layer_args(c):
    return dict(d_model=c["d_model"], d_ff=c["feed_forward_dimensions"], dropout=c["dropout"],
                activation=c["activation"], norm_first=c["norm_first"])


def _attention(kind, params, c, layer, **extra):
    return layer(Attention(kind, **(params or {})), c["d_model"], c["n_heads"],
                 d_keys=c["query_dimensions"], d_values=c["value_dimensions"], **extra)


def build_encoder(config=None, **kwargs):
    """A :class:`~fastattn.nn.TransformerEncoder` (or, with ``recurrent=True``,
    its :class:`~fastattn.nn.RecurrentTransformerEncoder` twin) from a config
    and/or keyword arguments (the keywords win). Keys: the module docstring."""
    c = load_config(config, _ENCODER, "build_encoder", kwargs)
    recurrent = bool(c["recurrent"])
    attention = RecurrentAttentionLayer if recurrent else AttentionLayer
    layer = RecurrentTransformerEncoderLayer if recurrent else TransformerEncoderLayer
    stack = RecurrentTransformerEncoder if recurrent else TransformerEncoder
    layers = [layer(_attention(c["attention_type"], c["attention_params"], c, attention),
                    **_layer_args(c)) for _ in range(c["n_layers"])]
    return stack(layers, nn.LayerNorm(c["d_model"]) if c["final_norm"] else None)


def build_decoder(config=None, **kwargs):
    """A :class:`~fastattn.nn.TransformerDecoder` (or its recurrent twin with
    ``recurrent=True``) from a config and/or keyword arguments."""
    c = load_config(config, _DECODER, "build_decoder", kwargs)
    recurrent = bool(c["recurrent"])
    self_layer = RecurrentAttentionLayer if recurrent else AttentionLayer
    cross_layer = RecurrentCrossAttentionLayer if recurrent else AttentionLayer
    layer = RecurrentTransformerDecoderLayer if recurrent else TransformerDecoderLayer
    stack = RecurrentTransformerDecoder if recurrent else TransformerDecoder
    memory = c["memory_dimensions"] or c["d_model"]
    layers = [
        layer(_attention(c["self_attention_type"], c["self_attention_params"], c, self_layer),
              _attention(c["cross_attention_type"], c["cross_attention_params"], c, cross_layer,
                         d_model_keys=memory),
              **_layer_args(c))
        for _ in range(c["n_layers"])
    ]
    return stack(layers, nn.LayerNorm(c["d_model"]) if c["final_norm"] else None)
