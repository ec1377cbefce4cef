"""fastattn's attention types as Hugging Face ``transformers`` attention backends.

``import fastattn.hf`` registers every registered fastattn type with
``transformers.AttentionInterface`` as ``"fastattn-<type>"`` (and with
``transformers.masking_utils.AttentionMaskInterface``, so that the models
build their masks for it), after which any model whose attention goes through
the interface runs on it::

    import fastattn.hf  # registers fastattn-full, fastattn-improved-clustered, ...

    config = AutoConfig.from_pretrained(path)
    config.fastattn_params = {"seed": 0, "clusters": 25}
    model = AutoModel.from_pretrained(path, config=config,
                                      attn_implementation="fastattn-improved-clustered")
    model.set_attn_implementation("fastattn-full")  # or switch a loaded model

``transformers`` is an optional dependency (``pip install 'fastattn[hf]'``):
``import fastattn`` never imports it, and ``import fastattn.hf`` without it
raises ImportError saying what to install.

Type parameters, per model: the config's ``fastattn_params`` dict (saved with
the config; set it on the config before loading, or on ``model.config`` after:
the attention reads it at every call). Flat entries are defaults for every
type that has a parameter of that name; an entry whose value is a dict is the
section of the type it names, used only when the model runs that type (over
the flat entries)::

    config.fastattn_params = {"seed": 0,
                              "improved-clustered": {"clusters": 25, "topk": 32},
                              "local": {"window": 64}}

The model's ``scaling`` becomes ``softmax_temp`` unless the parameters give
one. fastattn validates the parameters (an unknown name or a bad value raises
its RuntimeError naming the type and parameter).

Masks: Hugging Face's mask (bool ``(B, 1, L, S)``, True keeps, or an additive
float mask) is decomposed into fastattn's ``key_lengths`` (right padding)
plus ``causal`` (query i sees key j iff ``j <= i + (S - L)``) when it is
exactly that; any other mask (left padding, sliding windows, packed
sequences, ...) goes to the type as ``attn_mask`` where the type takes one
(``full``; ``hard-retrieval`` a bool one), else raises ValueError naming the
type and the mask. See :data:`CAPABILITIES` and docs/python.md, "Hugging Face".
"""

import weakref

import torch

#: The transformers release from which the BERT family routes its attention
#: through AttentionInterface (T5 from 5.15); Llama-style decoders already do
#: on 4.x releases that have both interfaces (tested: 4.56), with a warning.
MIN_TRANSFORMERS = "5.0"

try:
    import transformers
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
except ImportError as _error:  # transformers absent, or too old for its attention interfaces
    _have = None
    try:
        import transformers as _tf

        _have = getattr(_tf, "__version__", "unknown")
    except ImportError:
        pass
    raise ImportError(
        "fastattn.hf needs Hugging Face transformers >= %s (with AttentionInterface and "
        "masking_utils.AttentionMaskInterface)%s: pip install 'transformers>=%s' "
        "(or pip install 'fastattn[hf]'). `import fastattn` itself works without it."
        % (MIN_TRANSFORMERS,
           "; found transformers %s" % _have if _have else ", which is not installed",
           MIN_TRANSFORMERS)
    ) from _error


def _release(version):
    try:
        return tuple(int(p) for p in version.split(".")[:2])
    except ValueError:
        return (0, 0)


if _release(transformers.__version__) < _release(MIN_TRANSFORMERS):
    import warnings

    warnings.warn(
        "fastattn.hf: transformers %s: only models whose attention goes through "
        "AttentionInterface use fastattn (Llama-style decoders do; the BERT family does from "
        "transformers 5.0, T5 from 5.15); the others keep their own attention whatever "
        "attn_implementation says. pip install 'transformers>=%s'."
        % (transformers.__version__, MIN_TRANSFORMERS), stacklevel=2)

from . import attention as _attention
from . import full_attention as _full_attention
from . import _capabilities
from . import _param_names
from . import _registry_params as _registry

__all__ = [
    "MIN_TRANSFORMERS",
    "PREFIX",
    "CAPABILITIES",
    "register",
    "registered",
    "implementation_name",
    "attention_forward",
    "mask_function",
    "masks_from_hf",
    "type_params",
]

#: The prefix of the names under which the types are registered.
PREFIX = "fastattn-"

#: What each registered type can do behind a Hugging Face model, read from
#: its registry entry (``fastattn.capabilities()``; tests/cpp/test_capabilities.cpp
#: and tests/python/test_hf.py hold every type to it):
#:
#: - ``causal``: causal attention (decoders); ``bidirectional``: without it
#:   (encoders);
#: - ``attn_mask``: the masks other than right padding and causal it takes:
#:   ``"any"`` (bool or additive float, also T5-style ``position_bias``),
#:   ``"bool"``, or ``None``;
#: - ``incremental``: causal attention of fewer queries than keys (L < S, the
#:   KV-cache decoding of ``generate``) giving the rows of the full causal
#:   computation: True, False, or ``"stride"`` (only with an explicit
#:   ``stride`` parameter: its default depends on L).
CAPABILITIES = {
    name: dict(causal=c["causal"], bidirectional=c["bidirectional"],
               attn_mask=None if c["attn_mask"] == "none" else c["attn_mask"],
               incremental={"yes": True, "no": False}.get(c["incremental"], c["incremental"]))
    for name, c in _capabilities().items()
}

# Types whose modules hold learned parameters: the operator builds a fresh
# instance per call, so they cannot be trained from Python (as fastattn.nn).
_LEARNED_TYPES = tuple(n for n, c in _capabilities().items() if c["learned"])
# The types with a form in the other direction, for the suggestions in errors.
_CAUSAL_TWIN = {n: c["causal_form"] for n, c in _capabilities().items() if c["causal_form"]}
_BIDIRECTIONAL_TWIN = {n: c["bidirectional_form"] for n, c in _capabilities().items()
                       if c["bidirectional_form"]}


def _base(kind):
    """The type that decides what a (possibly decorated) type can do."""
    return kind.rsplit(":", 1)[-1]


def implementation_name(kind):
    """The ``attn_implementation`` name of a fastattn type: ``"fastattn-" + kind``."""
    return PREFIX + kind


# ---------------------------------------------------------------------------
# Parameters


def type_params(config, kind):
    """The parameters of type ``kind`` from ``config.fastattn_params`` (see the
    module docstring).

    Flat entries are defaults for every type: each goes to the types that
    have a parameter of that name (``seed`` reaches the clustered types, not
    ``full``); a name that no registered type has raises ValueError (a typo).
    A dict entry is the section of the type it names, given to that type
    as it is (over the flat ones), so fastattn checks every name in it.
    """
    raw = getattr(config, "fastattn_params", None) if config is not None else None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise TypeError("%s%s: config.fastattn_params must be a dict, got %s"
                        % (PREFIX, kind, type(raw).__name__))
    types, decorators = _registry()
    every = set().union(*types.values(), *decorators.values())
    mine = _param_names(kind)
    params = {}
    for name, value in raw.items():
        if isinstance(value, dict):
            if _base(name) not in types:
                raise ValueError(
                    "%s%s: config.fastattn_params has a section %r, which is not a fastattn "
                    "type (a dict value holds the parameters of the type it names); types: %s"
                    % (PREFIX, kind, name, ", ".join(sorted(types))))
        elif name not in every:
            raise ValueError(
                "%s%s: config.fastattn_params has %r, which is a parameter of no fastattn type; "
                "parameters: %s" % (PREFIX, kind, name, ", ".join(sorted(every))))
        elif name in mine:
            params[name] = value
    params.update(raw.get(kind) or {})
    return params


# ---------------------------------------------------------------------------
# Masks


def _describe(mask):
    return "a %s %s mask" % (tuple(mask.shape), str(mask.dtype).replace("torch.", ""))


def _what_pattern(keep):
    """A few words on why a keep mask (B, L', S) is not right padding + causal."""
    first_kept = keep.any(-1)
    starts_masked = first_kept & ~keep[..., 0]
    if bool(starts_masked.any()):
        return ("keys masked before kept ones (left padding, e.g. a tokenizer with "
                "padding_side='left', or a sliding window)")
    return ("a pattern other than right padding and causal (a window, packed sequences, "
            "a custom mask)")


def _as_keep(mask):
    """A bool keep mask from HF's bool or additive float mask, or (None, bias)
    for a float mask that is a bias (values other than 0 and the -inf / dtype
    minimum that masks)."""
    if mask.dtype == torch.bool:
        return mask, None
    if not mask.is_floating_point():
        raise ValueError("fastattn: attention mask of dtype %s: expected bool (True keeps) or an "
                         "additive float mask" % mask.dtype)
    keep = mask == 0
    dropped = mask <= torch.finfo(mask.dtype).min / 2  # -inf, or the dtype's minimum (eager)
    if bool((keep | dropped).all()):
        return keep, None
    return None, mask


def masks_from_hf(mask, L, S, is_causal=True):
    """fastattn's ``(key_lengths, causal, attn_mask)`` from a Hugging Face mask.

    Args:
        mask: None, or a bool ``(B|1, 1|H, L|1, S)`` keep mask, or an additive
            float one (0 keeps; -inf or the dtype's minimum drops; other values
            are a bias). 2-D ``(L, S)`` and 3-D ``(B, L, S)`` masks are read as
            ``(1, 1, L, S)`` and ``(B, 1, L, S)``.
        L, S: the query and key lengths.
        is_causal: the module's causality: used when ``mask`` is None, and to
            choose between causal and not where the mask is both (L = 1).

    Returns:
        ``(key_lengths (B,) int64 or None, causal, attn_mask or None)``:
        lengths + causal when the mask is exactly right padding (keys
        ``>= length`` dropped for every query) with or without fastattn's
        causal pattern; otherwise ``attn_mask`` is the mask (bool, or the float
        bias) and ``key_lengths`` None.
    """
    if mask is None:
        return None, bool(is_causal), None
    if mask.dim() == 2:
        mask = mask[None, None]
    elif mask.dim() == 3:
        mask = mask[:, None]
    if mask.dim() != 4:
        raise ValueError("fastattn: attention mask must have 2 to 4 dims, got shape %s"
                         % (tuple(mask.shape),))
    if mask.shape[-1] > S:  # a mask over a longer (static) cache than the keys
        mask = mask[..., :S]
    keep, bias = _as_keep(mask)
    if keep is None:
        return None, False, bias
    if keep.shape[1] != 1:  # per-head masks: one pattern only if all heads agree
        if not bool((keep == keep[:, :1]).all()):
            return None, False, keep
        keep = keep[:, :1]
    rows = keep[:, 0]  # (B, L or 1, S)
    counts = rows.sum(-1)  # (B, L or 1): kept keys per query
    j = torch.arange(S, device=rows.device)
    if not bool((rows == (j < counts[..., None])).all()):  # every row a prefix?
        return None, False, keep
    lengths = counts[:, -1]  # the last query sees every valid key (causal too)
    flat = bool((counts == lengths[:, None]).all())
    i = torch.arange(L, device=rows.device)
    seen = torch.minimum(lengths[:, None], i + 1 + (S - L)).clamp_min(0)  # (B, L)
    causal = rows.shape[1] == L and bool((counts == seen).all())
    if not (flat or causal):
        return None, False, keep
    if flat and causal:  # both readings hold (L = 1, or no key beyond the diagonal)
        causal = bool(is_causal)
    if bool((lengths == S).all()):
        lengths = None
    return lengths, causal, None


# The decomposition of the last mask seen: a model passes one mask tensor to
# every layer of a forward, so decoding decomposes it once per token, not once
# per layer (per layer it was a large share of a decoding call: git show
# 5f604de:docs/benchmarks.md, "Greedy decoding through Hugging Face (issue
# 64)"). Keyed by the tensor itself (a weak reference), its version counter
# and storage, and the shapes: a new or modified mask is decomposed again.
_mask_memo = [None]


def _masks_from_hf_memo(mask, L, S, is_causal):
    compiling = getattr(getattr(torch, "compiler", None), "is_compiling", lambda: False)()
    if mask is None or compiling:
        return masks_from_hf(mask, L, S, is_causal)
    key = (L, S, bool(is_causal), mask._version, mask.data_ptr(), tuple(mask.shape))
    memo = _mask_memo[0]
    if memo is not None and memo[0]() is mask and memo[1] == key:
        return memo[2]
    out = masks_from_hf(mask, L, S, is_causal)
    _mask_memo[0] = (weakref.ref(mask), key, out)
    return out


def mask_function(*args, **kwargs):
    """The mask builder registered with ``AttentionMaskInterface``: Hugging
    Face's ``sdpa_mask`` (a bool ``(B, 1, L, S)`` keep mask, or None where
    the causal / bidirectional pattern alone describes it)."""
    return sdpa_mask(*args, **kwargs)


# ---------------------------------------------------------------------------
# The attention function


def _error(kind, text):
    return ValueError("%s%s: %s" % (PREFIX, kind, text))


def _decoding_hint(kind):
    return ("Generate with use_cache=False (every step recomputes the whole sequence), or use "
            "attn_implementation='fastattn-full' (exact; 'fastattn-local', "
            "'fastattn-hard-retrieval' and 'fastattn-sparse-*' with a stride in fastattn_params "
            "also decode with the cache).")


def _types_with_dropout():
    # (Not the learned types: they cannot train from Python.)
    types, _ = _registry()
    return sorted(t for t, names in types.items()
                  if "attention_dropout" in names and t not in _LEARNED_TYPES)


def _check(kind, caps, params, L, S, causal, attn_mask, mask, training, dropout):
    base = _base(kind)
    if dropout and dropout > 0 and "attention_dropout" not in _param_names(kind):
        raise _error(kind, (
            "the model asks for attention dropout p=%g, and '%s' has none (types with "
            "attention dropout: %s). Build the model with its attention dropout at 0 (BERT: "
            "attention_probs_dropout_prob=0.0; Llama: attention_dropout=0.0), or use one of "
            "those types." % (dropout, base, ", ".join(_types_with_dropout()))))
    if training and base in _LEARNED_TYPES:
        raise _error(kind, (
            "this type has learned parameters, which fastattn's Python operator re-initialises "
            "at every call; it cannot be trained from Python. Use it in eval() mode."))
    if caps is None:
        return
    if causal and not caps["causal"]:
        twin = _CAUSAL_TWIN.get(base)
        raise _error(kind, (
            "the model asks for causal attention (a decoder, or a causal mask) and '%s' has no "
            "causal form%s." % (base, "; use attn_implementation='%s%s'" % (PREFIX, twin)
                                if twin else "")))
    if not causal and not caps["bidirectional"]:
        twin = _BIDIRECTIONAL_TWIN.get(base)
        raise _error(kind, (
            "the model asks for attention without a causal mask (an encoder, cross-attention, "
            "or a mask that is not causal) and '%s' computes causal attention only%s."
            % (base, "; use attn_implementation='%s%s'" % (PREFIX, twin) if twin else "")))
    if causal and L != S:
        inc = caps["incremental"]
        if inc is False or (inc == "stride" and params.get("stride") is None):
            why = ("it needs the stride fixed: give 'stride' in config.fastattn_params (its "
                   "default, round(sqrt(L)), depends on the number of queries)"
                   if inc == "stride" else "it has no incremental form")
            raise _error(kind, (
                "causal attention of %d new queries over %d keys (KV-cache decoding: earlier "
                "keys come from the cache) is not available for '%s': %s. %s"
                % (L, S, base, why, _decoding_hint(kind))))
    if attn_mask is not None:
        takes = caps["attn_mask"]
        if takes is None or (takes == "bool" and attn_mask.dtype != torch.bool):
            if attn_mask.dtype == torch.bool:
                what = "%s with %s" % (_describe(mask), _what_pattern(attn_mask[:, 0]
                                                                       if attn_mask.dim() == 4
                                                                       else attn_mask))
            else:
                what = "an additive float mask that is a bias (%s; values other than 0 and -inf)" \
                    % _describe(attn_mask)
            raise _error(kind, (
                "cannot express the attention mask: '%s' takes only right padding (key lengths)"
                " and causal%s, and the model gave %s. Pad on the right, or use "
                "attn_implementation='fastattn-full', which takes any mask."
                % (base, ", and bool masks" if takes == "bool" else "", what)))


# full's parameters (what fastattn.full_attention takes directly).
_FULL_PARAMS = frozenset(("softmax_temp", "attention_dropout"))


def _check_dropout(kind, dropout):
    if dropout is not None and not 0 <= dropout < 1:
        raise _error(kind, "attention dropout must be in [0, 1), got %r" % (dropout,))


def attention_forward(kind):
    """The attention function of type ``kind`` with Hugging Face's signature
    ``(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
    **kwargs) -> (out (B, L, H, M), None)``, query ``(B, H, L, E)``, key and
    value ``(B, H_kv, S, E|M)`` (H_kv dividing H: grouped-query attention)."""
    caps = CAPABILITIES.get(_base(kind))
    accepts_temp = "softmax_temp" in _param_names(kind)

    def forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        if kwargs.get("softcap") is not None:
            raise _error(kind, "logit soft-capping (softcap) is not supported")
        if kwargs.get("s_aux") is not None:
            raise _error(kind, "attention sinks (s_aux) are not supported")
        H, Hkv = query.shape[1], key.shape[1]
        if Hkv != H:
            if H % Hkv:
                raise _error(kind, "%d query heads and %d key/value heads: not a multiple"
                             % (H, Hkv))
            key = key.repeat_interleave(H // Hkv, dim=1)
            value = value.repeat_interleave(H // Hkv, dim=1)
        L, S = query.shape[2], key.shape[2]
        is_causal = kwargs.get("is_causal")
        if is_causal is None:
            is_causal = getattr(module, "is_causal", True)
        key_lengths, causal, attn_mask = _masks_from_hf_memo(attention_mask, L, S, is_causal)
        if attention_mask is None and causal and 1 < L < S:
            # HF builds no mask for the prefill of an empty static cache and
            # means the causal pattern aligned at the first key (the keys past
            # L are empty cache slots), as sdpa's is_causal: keep the first L.
            key, value, S = key[:, :, :L], value[:, :, :L], L
        bias = kwargs.get("position_bias")
        if bias is not None:  # T5-style relative position bias, added to the scores
            if caps is not None and caps["attn_mask"] != "any":
                raise _error(kind, (
                    "this model adds a position bias to the attention scores (position_bias, "
                    "T5-style), which '%s' cannot take; use attn_implementation='fastattn-full'"
                    % _base(kind)))
            bias = bias[..., :S].to(query.dtype)
            if attn_mask is not None:
                bias = (bias.masked_fill(~attn_mask, float("-inf"))
                        if attn_mask.dtype == torch.bool else bias + attn_mask)
            attn_mask = bias.expand(query.shape[0], H, L, S)
        elif attn_mask is not None:
            attn_mask = attn_mask.expand(query.shape[0], *attn_mask.shape[1:])
        params = type_params(getattr(module, "config", None), kind)
        _check(kind, caps, params, L, S, causal, attn_mask, attention_mask,
               module.training, dropout)
        if scaling is not None and accepts_temp:
            params.setdefault("softmax_temp", float(scaling))
        _check_dropout(kind, dropout)
        # The type's training form while the model trains (attention dropout,
        # hard-retrieval's sampling). Hugging Face's models pass their
        # attention dropout in training only (0 in evaluation): fused in the
        # type, its mask never stored.
        if dropout and dropout > 0:
            params["attention_dropout"] = float(dropout)
        if kind == "full" and query.device.type == "cpu" and set(params) <= _FULL_PARAMS:
            # The type is the fused operator on the CPU: called directly, without
            # the registry operator's per-call construction of the type (a large
            # share of a decoding call). Other parameters go to the registry,
            # which names what it refuses.
            out = _full_attention(query, key, value, attn_mask=attn_mask, key_lengths=key_lengths,
                                  causal=causal, softmax_temp=params.get("softmax_temp"),
                                  dropout_p=params.get("attention_dropout", 0.0)
                                  if module.training else 0.0)
        else:
            out = _attention(kind, query, key, value, causal=causal, key_lengths=key_lengths,
                             attn_mask=attn_mask, training=bool(module.training), **params)
        return out.transpose(1, 2).contiguous(), None

    forward.__name__ = "fastattn_%s_attention" % kind.replace("-", "_").replace(":", "__")
    forward.__qualname__ = forward.__name__
    forward.fastattn_type = kind
    return forward


# ---------------------------------------------------------------------------
# Registration

_registered = {}


def register(types=None):
    """Registers fastattn types with ``transformers.AttentionInterface`` and
    ``AttentionMaskInterface`` as ``"fastattn-<type>"``.

    Args:
        types: type names to register (e.g. a decorated
            ``"conditional-full:improved-clustered"``); default every
            registered type (``fastattn.attention_types()``).

    Returns:
        The ``attn_implementation`` names registered by this and earlier calls.
        Idempotent: a name already registered is left as it is.
    """
    if types is None:
        types = sorted(_registry()[0])
    elif isinstance(types, str):
        types = [types]
    known, decorators = _registry()
    for kind in types:
        parts = kind.split(":") if isinstance(kind, str) else [None]
        if parts[-1] not in known or any(p not in decorators for p in parts[:-1]):
            raise ValueError(
                "fastattn.hf.register: unknown attention type %r; types: %s; decorators: %s"
                % (kind, ", ".join(sorted(known)),
                   ", ".join("%s:<type>" % d for d in sorted(decorators)) or "none"))
        name = implementation_name(kind)
        if _registered.get(name) is not None and name in AttentionInterface._global_mapping:
            continue
        fn = attention_forward(kind)
        AttentionInterface.register(name, fn)
        AttentionMaskInterface.register(name, mask_function)
        _registered[name] = fn
    return sorted(_registered)


def registered():
    """The ``attn_implementation`` names registered so far."""
    return sorted(_registered)


register()
