"""Attention modules: an attention type as a module, the multi-head layer with
its projections, and the layers' recurrent twins for token-by-token decoding.

Layouts: the inner :class:`Attention` works on fastattn's head-major tensors
``(N, H, L, E)``; the layers take and return ``(N, L, D)`` sequences (and
``(N, D)`` tokens for the recurrent twins), D = ``d_model``.
"""

import functools

import torch
from torch import nn

from .. import aft_attention as _aft_attention
from .. import attention as _attention
from .. import attention_step as _attention_step
from .. import _capabilities
from .. import attention_types as _attention_types
from .feature_maps import FeatureMap
from .masking import resolve_masks

__all__ = [
    "Attention",
    "AttentionLayer",
    "RecurrentAttentionLayer",
    "RecurrentCrossAttentionLayer",
    "STEP_TYPES",
]

#: Types with a recurrent (token-by-token) form through ``fastattn.attention_step``
#: (declared by the registry).
STEP_TYPES = tuple(sorted(n for n, c in _capabilities().items() if c["recurrent"]))
# Types whose modules hold learned parameters. The registry operator builds a
# fresh instance for every call, so those parameters would be re-initialised
# each time and never trained: refused in training mode, except aft-full,
# whose position bias this module owns (below).
_LEARNED_TYPES = tuple(n for n, c in _capabilities().items()
                       if c["learned"] and n != "aft-full")


@functools.lru_cache(maxsize=None)
def _specs():
    return {t["name"]: {p["name"] for p in t["params"]} for t in _attention_types()["types"]}


def _check_type(kind, params, where):
    """The type's name and parameter names against the registry (values are
    checked by the registry at the first call, where the tensor dims are known)."""
    if not isinstance(kind, str):
        raise TypeError("%s: attention type must be a str, got %s" % (where, type(kind).__name__))
    base = kind.rsplit(":", 1)[-1]  # decorators: "conditional-full:full"
    specs = _specs()
    if base not in specs:
        raise ValueError(
            "%s: unknown attention type '%s'; registered: %s"
            % (where, kind, ", ".join(sorted(specs)))
        )
    if ":" not in kind:
        unknown = sorted(set(params) - specs[base])
        if unknown:
            raise ValueError(
                "%s: attention type '%s' has no parameter %s; its parameters: %s"
                % (where, kind, ", ".join(repr(u) for u in unknown),
                   ", ".join(sorted(specs[base])) or "none")
            )


def aft_position_bias(u, v, L, S, causal, where):
    """AFT-full's bias ``u v^T`` for L queries over S keys, (L, S): rows
    ``u[S-L:S]`` under causal (the queries are the last L positions),
    ``u[:L]`` otherwise; columns ``v[:S]``. ``where`` names the caller in errors."""
    if max(L, S) > u.shape[0]:
        raise ValueError("%s: sequences up to max_sequence_length = %d positions, got L = %d "
                         "queries and S = %d keys" % (where, u.shape[0], L, S))
    first = S - L if causal else 0
    if first < 0:
        raise ValueError("%s: causal attention of more queries (L = %d) than keys (S = %d)"
                         % (where, L, S))
    return u[first:first + L] @ v[:S].t()


class Attention(nn.Module):
    """One registered attention type as a module (no parameters of its own,
    but ``aft-full``'s learned position bias ``u``, ``v``, which trains here).

    Args:
        type: the type's name (``fastattn.attention_types()`` lists them).
        feature_map: for ``linear`` / ``causal-linear``, a
            :class:`~fastattn.nn.feature_maps.FeatureMap` object or a name.
        **params: the type's parameters, e.g. ``clusters=100, topk=32``.

    ``forward(q, k, v, attn_mask=None, key_lengths=None, causal=False)`` takes
    ``(N, H, L, E)``, ``(N, H, S, E)``, ``(N, H, S, M)`` and returns
    ``(N, H, L, M)``; masks as :func:`fastattn.nn.masking.resolve_masks`.
    In training mode (``module.train()``) the type runs its training form:
    ``attention_dropout`` (a parameter of the softmax types but
    ``hard-retrieval`` so far) drops attention weights.
    """

    def __init__(self, type="full", feature_map=None, **params):
        super().__init__()
        if isinstance(feature_map, FeatureMap):
            params = dict(feature_map.params(), **params)
        elif feature_map is not None:
            params = dict(params, feature_map=feature_map)
        _check_type(type, params, "Attention")
        self.type = type
        self.params = params
        if type == "aft-full":
            self._init_aft_bias(**params)

    def _init_aft_bias(self, max_sequence_length=1024, aft_parameterization=64, seed=None):
        """aft-full's learned position bias w = u v^T as this module's
        parameters ``u``, ``v`` (the C++ type's names, N(0, 0.01²))."""
        for name, value, top in (("max_sequence_length", max_sequence_length, 65536),
                                 ("aft_parameterization", aft_parameterization, 1024)):
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= top:
                raise ValueError("Attention('aft-full'): %s must be an int in [1, %d], got %r"
                                 % (name, top, value))
        g = torch.Generator().manual_seed(seed) if seed is not None else None
        shape = (max_sequence_length, aft_parameterization)
        self.u = nn.Parameter(torch.randn(shape, generator=g) * 0.01)
        self.v = nn.Parameter(torch.randn(shape, generator=g) * 0.01)

    def _aft_full(self, queries, keys, values, attn_mask, key_lengths, causal):
        where = "Attention('aft-full')"
        if attn_mask is not None:
            raise ValueError("%s: attn_mask: got an attn_mask, which aft-full does not take "
                             "(it takes only the causal mask and key_lengths)" % where)
        w = aft_position_bias(self.u, self.v, queries.shape[2], keys.shape[2], causal, where)
        return _aft_attention(queries, keys, values, w.to(queries.device, queries.dtype),
                              key_lengths, causal)

    def forward(self, queries, keys, values, attn_mask=None, key_lengths=None, causal=False):
        if self.training and self.type.rsplit(":", 1)[-1] in _LEARNED_TYPES:
            raise RuntimeError(
                "Attention('%s'): this type has learned parameters, which fastattn's Python "
                "operator re-initialises at every call; it cannot be trained from Python yet. "
                "Use it in eval() mode, or train it from C++ (fastattn::ClusterFormerAttention)."
                % self.type
            )
        attn_mask, key_lengths, causal = resolve_masks(attn_mask, key_lengths, causal,
                                                       "Attention('%s')" % self.type)
        if self.type == "aft-full":
            return self._aft_full(queries, keys, values, attn_mask, key_lengths, causal)
        return _attention(self.type, queries, keys, values, causal=causal,
                          key_lengths=key_lengths, attn_mask=attn_mask, training=self.training,
                          **self.params)

    def step(self, query, key, value, state=None):
        """One recurrent step: ``(N, H, E)``, ``(N, H, E)``, ``(N, H, M)`` -> ``((N, H, M), state)``."""
        return _attention_step(self.type, query, key, value, state, **self.params)

    def extra_repr(self):
        return ", ".join(["'%s'" % self.type] + ["%s=%r" % kv for kv in self.params.items()])


def _as_attention(attention, where):
    if isinstance(attention, str):
        return Attention(attention)
    if isinstance(attention, nn.Module):
        return attention
    raise TypeError(
        "%s: attention must be a type name or an Attention module, got %s"
        % (where, type(attention).__name__)
    )


def _positive(value, name, where):
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError("%s: %s must be a positive int, got %r" % (where, name, value))
    return value


class _Projections(nn.Module):
    """The four projections of multi-head attention (shared by the batch layer
    and its recurrent twins, so that their ``state_dict`` keys agree)."""

    def __init__(self, attention, d_model, n_heads, d_keys=None, d_values=None, d_model_keys=None,
                 bias=True):
        super().__init__()
        where = type(self).__name__
        _positive(d_model, "d_model", where)
        _positive(n_heads, "n_heads", where)
        if d_keys is None:
            if d_model % n_heads:
                raise ValueError("%s: d_model=%d is not divisible by n_heads=%d; give d_keys"
                                 % (where, d_model, n_heads))
            d_keys = d_model // n_heads
        d_values = d_values if d_values is not None else d_keys
        d_model_keys = d_model_keys if d_model_keys is not None else d_model
        _positive(d_keys, "d_keys", where)
        _positive(d_values, "d_values", where)
        _positive(d_model_keys, "d_model_keys", where)
        self.inner_attention = _as_attention(attention, where)
        self.query_projection = nn.Linear(d_model, d_keys * n_heads, bias=bias)
        self.key_projection = nn.Linear(d_model_keys, d_keys * n_heads, bias=bias)
        self.value_projection = nn.Linear(d_model_keys, d_values * n_heads, bias=bias)
        self.out_projection = nn.Linear(d_values * n_heads, d_model, bias=bias)
        self.n_heads = n_heads
        self.d_model = d_model
        self.d_model_keys = d_model_keys

    def _check(self, name, x, dims, width):
        if not isinstance(x, torch.Tensor) or x.dim() != dims or x.shape[-1] != width:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            layout = "(N, L, %d)" % width if dims == 3 else "(N, %d)" % width
            raise ValueError("%s: %s must be %s, got %s" % (type(self).__name__, name, layout, shape))

    def _heads(self, projection, x):
        """(..., D) -> (N, H, [L,] d) head-major."""
        y = projection(x)
        if x.dim() == 3:
            return y.view(x.shape[0], x.shape[1], self.n_heads, -1).transpose(1, 2)
        return y.view(x.shape[0], self.n_heads, -1)

    def _merge(self, out):
        """(N, H, [L,] M) -> (N, [L,] D)."""
        if out.dim() == 4:
            out = out.transpose(1, 2)
        return self.out_projection(out.reshape(*out.shape[:-2], -1))


class AttentionLayer(_Projections):
    """Multi-head attention around any fastattn type.

    Args:
        attention: a type name or an :class:`Attention` module.
        d_model: the width D of the sequences.
        n_heads: H.
        d_keys: E, the per-head width of queries and keys (default D / H).
        d_values: M, the per-head width of values (default ``d_keys``).
        d_model_keys: the width of the key/value sequences (cross-attention
            from another model width; default D).
        bias: the projections' bias.

    Weights: ``query_projection``, ``key_projection``, ``value_projection``,
    ``out_projection`` (``nn.Linear``), and ``inner_attention``.

    ``forward(queries, keys=None, values=None, attn_mask=None, key_lengths=None,
    causal=False)``: queries ``(N, L, D)``, keys and values ``(N, S, D)``
    (default: the queries, self-attention); returns ``(N, L, D)``.
    """

    def forward(self, queries, keys=None, values=None, attn_mask=None, key_lengths=None,
                causal=False):
        keys = queries if keys is None else keys
        values = keys if values is None else values
        self._check("queries", queries, 3, self.d_model)
        self._check("keys", keys, 3, self.d_model_keys)
        self._check("values", values, 3, self.d_model_keys)
        q = self._heads(self.query_projection, queries)
        k = self._heads(self.key_projection, keys)
        v = self._heads(self.value_projection, values)
        out = self.inner_attention(q, k, v, attn_mask=attn_mask, key_lengths=key_lengths,
                                   causal=causal)
        return self._merge(out)


class RecurrentAttentionLayer(_Projections):
    """The recurrent twin of a causal self-attention :class:`AttentionLayer`.

    Same arguments and weight names: ``load_state_dict`` of a trained batch
    layer works. The type needs a step form (:data:`STEP_TYPES`: causal-linear
    and aft-simple with a constant-size state, full and hard-retrieval with a
    key/value cache). Step t of ``forward`` gives row t of the batch layer run with
    ``causal=True`` on the tokens 0..t.

    ``forward(query, key=None, value=None, state=None)``: ``(N, D)`` tokens;
    returns ``(out (N, D), state)``. Start with ``state=None``.
    """

    def __init__(self, attention, d_model, n_heads, d_keys=None, d_values=None, bias=True):
        super().__init__(attention, d_model, n_heads, d_keys, d_values, bias=bias)
        kind = getattr(self.inner_attention, "type", None)
        if kind is None or kind.rsplit(":", 1)[-1] not in STEP_TYPES:
            raise ValueError(
                "RecurrentAttentionLayer: attention type %r has no recurrent form; types with "
                "one: %s" % (kind, ", ".join(STEP_TYPES))
            )

    def forward(self, query, key=None, value=None, state=None):
        key = query if key is None else key
        value = key if value is None else value
        for name, x in (("query", query), ("key", key), ("value", value)):
            self._check(name, x, 2, self.d_model)
        out, state = self.inner_attention.step(self._heads(self.query_projection, query),
                                               self._heads(self.key_projection, key),
                                               self._heads(self.value_projection, value), state)
        return self._merge(out), state


class RecurrentCrossAttentionLayer(_Projections):
    """The recurrent twin of a cross-attention :class:`AttentionLayer`: one
    query token at a time against a fixed memory.

    Same arguments and weight names as :class:`AttentionLayer`. The memory's
    keys and values are projected at the first step and kept in the state.
    Any type that runs with one query works (full, linear, clustered, ...).

    ``forward(query, memory, memory_lengths=None, state=None)``: query
    ``(N, D)``, memory ``(N, S, D_keys)``; returns ``(out (N, D), state)``.
    """

    def forward(self, query, memory, memory_lengths=None, state=None):
        self._check("query", query, 2, self.d_model)
        if state is None:
            self._check("memory", memory, 3, self.d_model_keys)
            state = (self._heads(self.key_projection, memory),
                     self._heads(self.value_projection, memory))
        k, v = state
        q = self._heads(self.query_projection, query).unsqueeze(2)  # (N, H, 1, E)
        out = self.inner_attention(q, k, v, key_lengths=memory_lengths)
        return self._merge(out.squeeze(2)), state
