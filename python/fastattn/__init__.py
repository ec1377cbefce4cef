"""fastattn: efficient transformer attention, from Python.

A thin, compilation-free layer over the fastattn operators: importing the
package loads the C++ shared library (libfastattn.so) with
``torch.ops.load_library``, which registers every operator as
``torch.ops.fastattn.<op>`` (also available as ``fastattn.ops``).

Library search order (the first that exists is loaded):

1. the environment variable ``FASTATTN_LIBRARY`` (a path to the .so; if it is
   set but names no file, import fails rather than trying the others);
2. the build tree: ``<repo>/build/libfastattn.so``, i.e. ``../../build``
   relative to this package's directory ``<repo>/python/fastattn``;
3. the installed layout: ``make install`` puts this package in
   ``<prefix>/lib/fastattn/python/fastattn`` and the library in
   ``<prefix>/lib``, i.e. ``../../..`` relative to this package
   (``libfastattn.so``, then ``libfastattn.so.0``).

Layout: queries ``(N, H, L, E)``, keys ``(N, H, S, E)``, values ``(N, H, S, M)``,
outputs ``(N, H, L, M)``. Masks follow "true means keep".

Use the interpreter whose torch matches the LibTorch the library was built
against (on Debian: ``/usr/bin/python3`` with ``python3-torch``).
"""

import json
import math
import os

import torch

__all__ = ["attention", "attention_step", "full_attention", "attention_types", "ops", "library_path"]


def _candidates():
    """The library paths to try, in search order (see the module docstring)."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = os.environ.get("FASTATTN_LIBRARY")
    if env:
        return [("FASTATTN_LIBRARY", env)]
    build = os.path.normpath(os.path.join(here, "..", "..", "build", "libfastattn.so"))
    libdir = os.path.normpath(os.path.join(here, "..", "..", ".."))
    return [
        ("build tree", build),
        ("installed lib dir", os.path.join(libdir, "libfastattn.so")),
        ("installed lib dir", os.path.join(libdir, "libfastattn.so.0")),
    ]


def _load():
    tried = []
    for where, path in _candidates():
        if os.path.isfile(path):
            torch.ops.load_library(path)
            return path
        tried.append("%s: %s" % (where, path))
    raise ImportError(
        "fastattn: cannot find the shared library libfastattn.so; tried\n  "
        + "\n  ".join(tried)
        + "\nBuild it (make build) or set FASTATTN_LIBRARY to its path."
    )


#: The path of the shared library that was loaded.
library_path = _load()

#: Every fastattn operator: ``ops.full_attention``, ``ops.attention``,
#: ``ops.attention_types``, ... (the same object as ``torch.ops.fastattn``).
ops = torch.ops.fastattn


def _params_json(params):
    """Keyword parameters as the JSON object the registry validates.

    bool, int, float and str keep their kinds (an int given for a float
    parameter is accepted by the registry; a float for an int one is not).
    None leaves a parameter at its default.
    """
    out = {}
    for name, value in params.items():
        if value is None:
            continue
        if isinstance(value, bool):
            out[name] = value
        elif isinstance(value, int):
            out[name] = int(value)
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise ValueError(
                    "fastattn: parameter '%s' must be a finite number, got %r" % (name, value)
                )
            out[name] = value
        elif isinstance(value, str):
            out[name] = value
        else:
            raise TypeError(
                "fastattn: parameter '%s' must be a bool, int, float or str, got %s"
                % (name, type(value).__name__)
            )
    return json.dumps(out)


def attention(type, q, k, v, *, causal=False, key_lengths=None, attn_mask=None, **params):
    """Any registered attention type by name.

    Builds the type from the C++ registry with ``params`` (validated there:
    an unknown type or parameter, a wrong kind or an out-of-range value raises
    RuntimeError naming it and listing what is valid) and the dims of the
    tensors, then runs its forward. Gradients flow to q, k and v through the
    type's operators.

    Args:
        type: the type's name, e.g. ``"full"`` or ``"conditional-full:full"``
            (``attention_types()`` lists them).
        q: queries ``(N, H, L, E)``.
        k: keys ``(N, H, S, E)``.
        v: values ``(N, H, S, M)``.
        causal: query i sees key j iff ``j <= i + (S - L)``.
        key_lengths: ``(N,)`` integer tensor in ``[0, S]``; keys at positions
            ``>= length`` are padding.
        attn_mask: ``(L, S)``, ``(N, L, S)`` or ``(N, H, L, S)``; bool (True
            keeps) or floating (added to the scores).
        **params: the type's parameters, e.g. ``softmax_temp=0.125``.

    Returns:
        ``(N, H, L, M)``. A query that sees no key outputs zeros.

    Each call builds a fresh instance in evaluation mode (no dropout;
    training-only behaviour is off); types with random parameters draw them
    from torch's default generator (seed with ``torch.manual_seed``).
    """
    return ops.attention(type, q, k, v, causal, key_lengths, attn_mask, _params_json(params))


def attention_step(type, q, k, v, state=None, **params):
    """One token-by-token step of a type's recurrent form (inference).

    Types with a step form: ``"causal-linear"`` (a constant (S, Z) state per
    head), ``"full"`` (a key/value cache) and ``"hard-retrieval"`` (a key
    cache, one value row per head). Step i over positions 0..i gives row i of
    the causal batch type with the same parameters.

    Args:
        type: the type's name.
        q, k: the new position's query and key ``(N, H, E)``.
        v: its value ``(N, H, M)``.
        state: the state returned by the previous step; ``None`` (or ``[]``)
            at the first position. Opaque: pass it back unchanged.
        **params: the type's parameters, as for :func:`attention`.

    Returns:
        ``(out (N, H, M), state)``.

    Example::

        state = None
        for t in range(T):
            out, state = fastattn.attention_step("causal-linear", q[:, :, t], k[:, :, t],
                                                 v[:, :, t], state)
    """
    return ops.attention_step(type, q, k, v, list(state or []), _params_json(params))


def full_attention(q, k, v, attn_mask=None, key_lengths=None, causal=False, softmax_temp=None):
    """Exact softmax attention, fused (no L x S matrix is kept).

    Args:
        q: queries ``(N, H, L, E)``.
        k: keys ``(N, H, S, E)``.
        v: values ``(N, H, S, M)``.
        attn_mask: ``(L, S)``, ``(N, L, S)`` or ``(N, H, L, S)``; bool (True
            keeps) or floating (added to the scores; -inf drops).
        key_lengths: ``(N,)`` integer tensor in ``[0, S]``.
        causal: query i sees key j iff ``j <= i + (S - L)`` (the last query is
            aligned with the last key).
        softmax_temp: scale of the scores; default ``1 / sqrt(E)``.

    Returns:
        ``softmax(q k^T * softmax_temp + masks) v``, shape ``(N, H, L, M)``;
        a query that sees no key outputs zeros. Differentiable in q, k and v.
    """
    return ops.full_attention(q, k, v, attn_mask, key_lengths, causal, softmax_temp)


def attention_types():
    """The registry's description of every type, as parsed JSON.

    ``{"types": [{"name", "description", "params": [{"name", "type",
    "default", "help", and where they apply "min", "max", "min_exclusive",
    "max_exclusive", "choices"}]}], "decorators": [...]}`` -- the same JSON as
    ``fastattn list --json``.
    """
    return json.loads(ops.attention_types())
