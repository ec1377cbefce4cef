"""fastattn: efficient transformer attention, from Python.

A thin, compilation-free layer over the fastattn operators: importing the
package loads the C++ shared library (libfastattn.so) with
``torch.ops.load_library``, which registers every operator as
``torch.ops.fastattn.<op>`` (also available as ``fastattn.ops``).

Library search order (the first that exists is loaded):

1. the environment variable ``FASTATTN_LIBRARY`` (a path to the .so; if it is
   set but names no file, import fails rather than trying the others);
2. the package directory itself: ``pip install .`` puts ``libfastattn.so``
   beside this file;
3. the build tree: ``<repo>/build/libfastattn.so``, i.e. ``../../build``
   relative to this package's directory ``<repo>/python/fastattn``;
4. the installed layout: ``make install`` puts this package in
   ``<prefix>/lib/fastattn/python/fastattn`` and the library in
   ``<prefix>/lib``, i.e. ``../../..`` relative to this package
   (``libfastattn.so``, then ``libfastattn.so.0``).

The library is built against one torch release; ``fastattn_build.json``
beside it records which. Importing it into another torch release raises
ImportError naming both versions (a C++ extension's ABI changes between
torch releases).

Layout: queries ``(N, H, L, E)``, keys ``(N, H, S, E)``, values ``(N, H, S, M)``,
outputs ``(N, H, L, M)``. Masks follow "true means keep".
"""

import functools
import json
import math
import os

import torch

__all__ = [
    "attention",
    "attention_step",
    "attention_step_",
    "attention_step_state",
    "full_attention",
    "aft_attention",
    "attention_types",
    "capabilities",
    "cpu_capability",
    "supported_cpu_capabilities",
    "set_cpu_capability",
    "empty_cpu_cache",
    "cpu_cache_bytes",
    "ops",
    "library_path",
    "build_info",
]


def _candidates():
    """The library paths to try, in search order (see the module docstring)."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = os.environ.get("FASTATTN_LIBRARY")
    if env:
        return [("FASTATTN_LIBRARY", env)]
    build = os.path.normpath(os.path.join(here, "..", "..", "build", "libfastattn.so"))
    libdir = os.path.normpath(os.path.join(here, "..", "..", ".."))
    return [
        ("package directory", os.path.join(here, "libfastattn.so")),
        ("build tree", build),
        ("installed lib dir", os.path.join(libdir, "libfastattn.so")),
        ("installed lib dir", os.path.join(libdir, "libfastattn.so.0")),
    ]


def _release(version):
    """'2.15.0+cu132' -> (2, 15): the part of a torch version its C++ ABI follows."""
    parts = version.split("+")[0].split(".")
    try:
        return tuple(int(p) for p in parts[:2])
    except ValueError:
        return tuple(parts[:2])


def _check_build(path):
    """Compares the library's build record with the running torch."""
    record = os.path.join(os.path.dirname(path), "fastattn_build.json")
    if not os.path.isfile(record):
        return {}
    with open(record) as f:
        info = json.load(f)
    built = info.get("torch") or ""
    rebuild = (
        "Rebuild fastattn against this torch: from the fastattn source tree, "
        "`pip install --no-build-isolation --force-reinstall --no-deps .` "
        "(or `make build` with the matching LibTorch for a build tree)."
    )
    if built and _release(built) != _release(torch.__version__):
        raise ImportError(
            "fastattn: %s was built against torch %s, but this Python has torch %s; "
            "a C++ extension works only with the torch release it was built against. %s"
            % (path, built, torch.__version__, rebuild)
        )
    if info.get("cuda") and torch.version.cuda is None:
        raise ImportError(
            "fastattn: %s was built with CUDA operators against torch %s, but this Python's "
            "torch %s has no CUDA. %s (FASTATTN_CUDA=0 builds the CPU operators only)"
            % (path, built, torch.__version__, rebuild)
        )
    return info


def _load():
    tried = []
    for where, path in _candidates():
        if os.path.isfile(path):
            info = _check_build(path)
            torch.ops.load_library(path)
            return path, info
        tried.append("%s: %s" % (where, path))
    raise ImportError(
        "fastattn: cannot find the shared library libfastattn.so; tried\n  "
        + "\n  ".join(tried)
        + "\nInstall the package (pip install --no-build-isolation .), build it "
        "(make build) or set FASTATTN_LIBRARY to its path."
    )


#: The path of the shared library that was loaded, and its build record
#: (``{"fastattn": version, "torch": the torch version it was built against,
#: "cuda": whether it has the CUDA operators}``; empty for a build without one).
library_path, build_info = _load()
__version__ = build_info.get("fastattn", "unknown")

# Shapes of every operator's outputs for torch.compile / torch.export (torch >= 2.4).
from . import _fake  # noqa: E402  (also describes step states; registers where torch can)

if hasattr(torch.library, "register_fake"):
    _fake.register()

#: Every fastattn operator: ``ops.full_attention``, ``ops.attention``,
#: ``ops.attention_types``, ... (the same object as ``torch.ops.fastattn``).
ops = torch.ops.fastattn


def _constant(fn):
    """fn, a pure function of Python values, evaluated while torch.compile
    traces (the JSON string becomes a constant of the graph, no graph break)."""
    compiler = getattr(torch, "compiler", None)
    mark = getattr(compiler, "assume_constant_result", None)
    return mark(fn) if mark is not None else fn


@_constant
def _params_json(params):
    """Keyword parameters as the JSON object the registry validates.

    bool, int, float and str keep their kinds (an int given for a float
    parameter is accepted by the registry; a float for an int one is not).
    None leaves a parameter at its default.
    """
    if not params:  # the common call: no JSON encoder on the per-call path
        return "{}"
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


def attention(type, q, k, v, *, causal=False, key_lengths=None, attn_mask=None, training=False,
              **params):
    """Any registered attention type by name.

    Builds the type from the C++ registry with ``params`` (validated there:
    an unknown type or parameter, a wrong kind or an out-of-range value raises
    RuntimeError naming it and listing what is valid) and the dims of the
    tensors, then runs its forward. One operator (``torch.ops.fastattn.attention``)
    whatever the type: ``torch.compile`` and ``torch.export`` see a single
    node. Eagerly, the backward differentiates the type's own autograd graph
    kept from the forward; compiled, it recomputes the type's forward with
    autograd and differentiates that (as activation checkpointing does: one
    more forward, only q, k and v kept between the passes).

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
        training: run the type in its training form: attention dropout
            (the ``attention_dropout`` parameter of the types that have it)
            applies, and training-only behaviour such as hard-retrieval's
            sampling. False by default, so inference code never drops.
        **params: the type's parameters, e.g. ``softmax_temp=0.125`` or
            ``attention_dropout=0.1``.

    Returns:
        ``(N, H, L, M)``. A query that sees no key outputs zeros.

    Each call builds a fresh instance, in evaluation mode unless
    ``training``. Attention dropout keeps each weight with probability
    ``1 - attention_dropout`` and scales it by ``1 / (1 - attention_dropout)``;
    its mask's seed is drawn from torch's default CPU generator (on CUDA,
    where a type composes torch's dropout, from the device's). Random draws: types with a ``seed``
    parameter (clustered types, reformer, clusterformer, hard-retrieval) use
    their own generator when it is given; otherwise they, and the random
    feature maps of ``linear``/``causal-linear`` (whose ``seed`` defaults to
    0, so the same features every call), draw from torch's default CPU
    generator -- ``torch.manual_seed`` makes a call reproducible, and each
    call advances it. The backward replays the forward's draws from the
    generator state the forward started with, so gradients belong to the
    output that was returned.
    """
    return _attention_op(type, q, k, v, causal, key_lengths, attn_mask, _params_json(params),
                         bool(training))


# The overload itself: a call skips the packet's overload lookup (issue 65's
# tiny call, where the call's path is the time).
_attention_op = ops.attention.default


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
        ``(out (N, H, M), state)``; the given state is not modified, so two
        steps from one state give two independent continuations. A cache
        state (``full``, ``hard-retrieval``) is the keys (N, H, t + 1, E) and
        values (N, H, t + 1, M): eagerly, views of buffers that grow by
        doubling (amortised O(1) a step); under ``torch.compile``, new tensors
        (the operator copies the t rows a step), and also where gradients are
        recorded (the step is differentiable). Compiled decoding loops
        should use the fixed-size :func:`attention_step_state` and
        :func:`attention_step_` (no copies, the same shapes every step).

    Example::

        state = None
        for t in range(T):
            out, state = fastattn.attention_step("causal-linear", q[:, :, t], k[:, :, t],
                                                 v[:, :, t], state)
    """
    params_json = _params_json(params)
    if not _compiling() and not _needs_grad(q, k, v, state) and _grows(type, q, v, params_json):
        return _cache_step(type, q, k, v, state, params_json)
    return ops.attention_step(type, q, k, v, list(state or []), params_json)


def _compiling():
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and getattr(compiler, "is_compiling", lambda: False)())


def _needs_grad(*tensors):
    """Whether autograd records a step of these (then the functional operator,
    which is differentiable, takes it)."""
    leaves = [t for x in tensors for t in (x if isinstance(x, (list, tuple)) else [x])
              if isinstance(t, torch.Tensor)]
    return torch.is_grad_enabled() and any(t.requires_grad for t in leaves)


def _grows(type, q, v, params_json):
    """Whether the type's step state is a cache that grows with the positions
    (full, hard-retrieval), from the C++ description of its state."""
    if q.dim() != 3 or v.dim() != 3:
        return False  # the operator names the problem
    spec = _fake._state_spec(type, q.shape[-1], v.shape[-1], params_json)
    return any(-1 in e["shape"] for e in spec)


class _CacheState(list):
    """The eager state of a cache type: the compact ``[K (N, H, t, E), V
    (N, H, t, M)]`` as views of buffers with room to grow, which the next
    step appends to in place (amortised O(1), not a copy of the t rows)."""

    __slots__ = ("buffers",)


def _is_cache(state, q, k, v):
    """Whether state is a cache [K (N, H, t, E), V (N, H, t, M)] for q, k, v."""
    if len(state) != 2 or q.dim() != 3 or k.shape != q.shape or v.dim() != 3:
        return False
    K, V = state
    N, H, E = q.shape
    return (K.dim() == 4 and V.dim() == 4 and K.shape[:2] == (N, H) and K.shape[3] == E
            and V.shape[:3] == K.shape[:3] and V.shape[3] == v.shape[2]
            and all(t.dtype == q.dtype and t.device == q.device for t in (K, V, k, v)))


def _cache_step(type, q, k, v, state, params_json):
    # The buffers ([K, V, filled], capacity on dimension 2) take row t in
    # place when they have room and no other state stepped from this one
    # (filled == t): every state returned stays valid and unmodified.
    if state and not _is_cache(state, q, k, v):
        return ops.attention_step(type, q, k, v, list(state), params_json)  # names the problem
    t = state[0].shape[2] if state else 0
    buffers = getattr(state, "buffers", None)
    if buffers is None or t >= buffers[0].shape[2] or int(buffers[2]) != t:
        buffers = ops.attention_step_state(type, q, v, max(16, 2 * (t + 1)), params_json)
        if t:
            buffers[0][:, :, :t].copy_(state[0])
            buffers[1][:, :, :t].copy_(state[1])
            buffers[2].fill_(t)
    out = ops.attention_step_(type, q, k, v, buffers, params_json)
    new = _CacheState([buffers[0][:, :, : t + 1], buffers[1][:, :, : t + 1]])
    new.buffers = buffers
    return out, new


def attention_step_state(type, q, v, capacity, **params):
    """A zero state for :func:`attention_step_`, sized like ``q (N, H, E)``
    and ``v (N, H, M)`` with room for ``capacity`` positions.

    ``causal-linear``: ``[S (N, H, F, M), Z (N, H, F)]`` (constant size;
    ``capacity`` is not used), and for the exponential feature maps (``favor``,
    ``generalized`` with ``kernel_fn='exp'``) a third tensor, the running key
    offset ``(N, H)`` (``-inf`` before the first key). ``full``, ``hard-retrieval``: ``[K (N, H,
    capacity, E), V (N, H, capacity, M), filled]`` where ``filled`` is an
    int64 scalar on the CPU counting the positions written (set it to 0 to
    reuse the state). Allocate it outside a compiled function, like Hugging
    Face's static cache.
    """
    return ops.attention_step_state(type, q, v, int(capacity), _params_json(params))


def attention_step_(type, q, k, v, state, **params):
    """One step that updates ``state`` (from :func:`attention_step_state`) in
    place; returns ``out (N, H, M)``, equal to :func:`attention_step`'s.

    Nothing is copied or reallocated, so every step has the same shapes: a
    decoding loop compiles once (``torch.compile(fullgraph=True)``). A full
    cache raises an error naming its capacity.

    Example::

        state = fastattn.attention_step_state("full", q[:, :, 0], v[:, :, 0], capacity=T)
        step = torch.compile(fastattn.attention_step_, fullgraph=True)
        for t in range(T):
            out = step("full", q[:, :, t], k[:, :, t], v[:, :, t], state)
    """
    return ops.attention_step_(type, q, k, v, state, _params_json(params))


def full_attention(q, k, v, attn_mask=None, key_lengths=None, causal=False, softmax_temp=None,
                   dropout_p=0.0, dropout_seed=None):
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
        dropout_p: attention dropout in ``[0, 1)``, fused (CPU): each weight
            is kept with probability ``1 - dropout_p`` and scaled by
            ``1 / (1 - dropout_p)``; the keep mask comes from a counter-based
            generator keyed by ``dropout_seed`` (default: drawn from torch's
            generator, so ``torch.manual_seed`` reproduces a run), and the
            backward regenerates it: nothing L x S is stored. Pass it only in
            training.

    Returns:
        ``softmax(q k^T * softmax_temp + masks) v``, shape ``(N, H, L, M)``;
        a query that sees no key outputs zeros. Differentiable in q, k and v.
    """
    return ops.full_attention(q, k, v, attn_mask, key_lengths, causal, softmax_temp, dropout_p,
                              dropout_seed)


def aft_attention(q, k, v, position_bias=None, key_lengths=None, causal=False):
    """AFT (Zhai et al. 2021, "An Attention Free Transformer"), channel by channel.

    Args:
        q, k, v: ``(N, H, L, E)``, ``(N, H, S, E)``, ``(N, H, S, E)`` (values
            as wide as the keys).
        position_bias: ``w``, ``(L, S)`` shared by the heads or ``(H, L, S)``;
            None for AFT-simple. Learned by the caller (AFT-full's ``u v^T``).
        key_lengths: ``(N,)`` integer tensor in ``[0, S]``.
        causal: query t sees key s iff ``s <= t + (S - L)``.

    Returns:
        ``sigmoid(q_t) * sum_s exp(k_s + w_ts) v_s / sum_s exp(k_s + w_ts)``
        per channel, ``(N, H, L, E)``; zeros for a query that sees no key.
        Differentiable in q, k, v and position_bias. AFT-simple on the CPU is
        one scan over the keys (O(S E)); with a bias, two matrix products.
    """
    return ops.aft_attention(q, k, v, position_bias, key_lengths, causal)


def attention_types():
    """The registry's description of every type, as parsed JSON.

    ``{"types": [{"name", "description", "params": [{"name", "type",
    "default", "help", and where they apply "min", "max", "min_exclusive",
    "max_exclusive", "choices"}]}], "decorators": [...]}`` -- the same JSON as
    ``fastattn list --json``.
    """
    return json.loads(ops.attention_types())


def cpu_capability():
    """The instruction set the CPU kernels use: ``"default"`` (portable),
    ``"avx2"``, ``"avx512"``, ``"avx512_bf16"`` (avx512 with bfloat16 full
    attention on AVX512-BF16 dot products) or ``"amx"`` (the same on AMX
    tiles). The best for this CPU (avx512_bf16 only on AMD's, whose dot
    products run at twice the float32 FMA's FLOP rate) unless the environment
    variable ``FASTATTN_CPU_CAPABILITY`` (read at the first kernel call) or
    :func:`set_cpu_capability` chose a lower one."""
    return ops.cpu_capability()


def supported_cpu_capabilities():
    """The instruction sets this CPU and build support, lowest first."""
    return list(ops.supported_cpu_capabilities())


def set_cpu_capability(level):
    """Runs the CPU kernels at ``level`` (one of
    :func:`supported_cpu_capabilities`) from now on, process-wide: for
    reproducing figures and testing the lower levels. Any other value raises
    ``RuntimeError`` naming the supported ones."""
    if not isinstance(level, str):
        raise TypeError(f"set_cpu_capability: level must be a str, got {type(level).__name__}")
    ops.set_cpu_capability(level)


def empty_cpu_cache():
    """Gives the free buffers of fastattn's CPU output cache back to the
    system. Outputs of 4 MiB and more that fastattn's CPU operators allocate
    are reused from buffers freed earlier (no fresh pages to fault in and
    clear on every call); the cache holds at most ``FASTATTN_CPU_CACHE_MB``
    MiB of free buffers (default 1024; 0 turns it off). Buffers still in use
    are not affected."""
    ops.empty_cpu_cache()


def cpu_cache_bytes():
    """Bytes of free buffers fastattn's CPU output cache holds now."""
    return int(ops.cpu_cache_bytes())


def capabilities():
    """What each registered type can do, from its registry entry:
    ``{type: {"causal", "bidirectional", "attn_mask" ("any" | "bool" |
    "none"), "incremental" ("yes" | "no" | "stride"), "recurrent",
    "learned", "causal_form", "bidirectional_form", "oracle", "selects",
    "channelwise"}}`` (see ``fastattn list``; "selects": picks keys, clusters
    or buckets, so float16 / bfloat16 results follow their own picks;
    "channelwise": values as wide as the keys, AFT)."""
    return {name: dict(caps) for name, caps in _capabilities().items()}


@functools.lru_cache(maxsize=None)
def _capabilities():
    return {t["name"]: t["capabilities"] for t in attention_types()["types"]}


@functools.lru_cache(maxsize=None)
def _registry_params():
    """{type: its parameter names}, and {decorator prefix: its parameter names}."""
    info = attention_types()
    types = {t["name"]: frozenset(p["name"] for p in t["params"]) for t in info["types"]}
    decorators = {d["name"].split(":", 1)[0]: frozenset(p["name"] for p in d["params"])
                  for d in info.get("decorators", [])}
    return types, decorators


def _param_names(kind):
    """The parameter names of a (possibly decorated) type, e.g.
    ``"conditional-full:local"``."""
    types, decorators = _registry_params()
    parts = kind.split(":")
    names = set(types.get(parts[-1], ()))
    for prefix in parts[:-1]:
        names |= decorators.get(prefix, set())
    return names
