"""fast_transformers.attention: the attention layer and the inner attentions.

Inner attentions take and return fast-transformers' layout ``(N, L, H, E)``
and its masks (``attn_mask``: FullMask / TriangularCausalMask;
``query_lengths``, ``key_lengths``: LengthMask) and run fastattn's registered
types. Differences (docs/python.md, "Programs written for fast-transformers"):
attention dropout is applied (fused) by fastattn's types (a type without it
would say so once in training mode), padded queries are clustered with the
real ones, and Reformer hashes with fastattn's angular LSH.
"""

import contextlib
import warnings

import torch
from torch import nn

from .... import _param_names
from .... import aft_attention as _aft_attention
from .... import attention as _attention
from ....nn.attention import aft_position_bias
from ..events import AttentionEvent, EventDispatcher, QKVEvent
from ..masking import FullMask, LengthMask, TriangularCausalMask

__all__ = ["AttentionLayer", "FullAttention", "LinearAttention", "CausalLinearAttention",
           "ClusteredAttention", "ImprovedClusteredAttention",
           "ImprovedClusteredCausalAttention", "ReformerAttention", "ExactTopKAttention",
           "LocalAttention", "ConditionalFullAttention", "AFTFullAttention", "AFTSimpleAttention"]


def fastattn_masks(attn_mask, key_lengths, S, where, L=None):
    """(attn_mask tensor or None, key_lengths tensor or None, causal) for fastattn.

    ``key_lengths`` may be any fast_transformers mask of shape (N, S), as in
    fast-transformers: a length mask gives fastattn's key lengths, any other
    (keys kept out of order) joins ``attn_mask`` as an (N, L, S) keep mask
    (L: the number of queries).
    """
    causal, mask = False, None
    if isinstance(attn_mask, TriangularCausalMask):
        causal = True
    elif attn_mask is not None:
        if not isinstance(attn_mask, FullMask) and not hasattr(attn_mask, "bool_matrix"):
            raise TypeError("%s: attn_mask must be a fast_transformers mask, got %s"
                            % (where, type(attn_mask).__name__))
        if not attn_mask.all_ones:
            if attn_mask.lower_triangular and attn_mask.shape[-1] == S:
                causal = True
            else:
                mask = attn_mask.bool_matrix
    lengths = None
    if key_lengths is None:
        return mask, lengths, causal
    if not hasattr(key_lengths, "bool_matrix"):
        raise TypeError("%s: key_lengths must be a fast_transformers mask (LengthMask, FullMask, "
                        "...), got %s" % (where, type(key_lengths).__name__))
    if isinstance(key_lengths, LengthMask):  # its lengths (max_len may be shorter than S)
        if not (key_lengths.all_ones and key_lengths.max_len == S):
            lengths = key_lengths.lengths
        return mask, lengths, causal
    keep = key_lengths.bool_matrix
    if keep.dim() != 2 or keep.shape[-1] != S:
        raise ValueError("%s: key_lengths must be an (N, S = %d) mask, got shape %s"
                         % (where, S, tuple(keep.shape)))
    try:
        lengths = key_lengths.lengths
    except ValueError:  # keys kept out of order: part of the attention mask
        if L is None:
            raise ValueError("%s: key_lengths must be a length mask here (kept keys first), got "
                             "one that keeps a key after a masked one" % where)
        rows = mask if mask is not None else torch.ones(L, S, dtype=torch.bool,
                                                         device=keep.device)
        return rows.unsqueeze(0) & keep.unsqueeze(1), None, causal
    if bool((lengths == S).all()):
        lengths = None
    return mask, lengths, causal


def rng_state(x):
    """The generator state(s) an operator on ``x`` draws from."""
    return (torch.get_rng_state(),
            torch.cuda.get_rng_state(x.device) if x.is_cuda else None)


@contextlib.contextmanager
def _rng_restored(state, x):
    now = rng_state(x)
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], x.device)
    try:
        yield
    finally:
        torch.set_rng_state(now[0])
        if now[1] is not None:
            torch.cuda.set_rng_state(now[1], x.device)


def attention_weights(kind, q, k, rng=None, **kwargs):
    """The weights (N, H, L, S) fastattn's ``kind`` gives the rows of
    ``q`` (N, H, L, E) over the keys ``k`` (N, H, S, E): the attention of
    the identity values, run from generator state ``rng`` (the one the
    forward started from, so with the same dropout) when given. For the
    events: the kernels never materialise the matrix."""
    N, H, S = k.shape[0], k.shape[1], k.shape[2]
    eye = torch.eye(S, dtype=q.dtype, device=q.device).expand(N, H, S, S).contiguous()
    if rng is None:
        return _attention(kind, q, k, eye, **kwargs)
    with _rng_restored(rng, q):
        return _attention(kind, q, k, eye, **kwargs)


class _Inner(nn.Module):
    """An inner attention running fastattn type ``kind`` with ``params``."""

    kind = None
    # Whether forward dispatches an AttentionEvent (full attention, as in
    # fast-transformers).
    reports_attention = False

    def __init__(self, attention_dropout=0.0, event_dispatcher="", **params):
        super().__init__()
        self.params = {k: v for k, v in params.items() if v is not None}
        self.attention_dropout = float(attention_dropout)
        self.event_dispatcher = EventDispatcher.get(event_dispatcher)
        self._warned = False

    def _type(self):
        return self.kind

    def forward(self, queries, keys, values, attn_mask=None, query_lengths=None,
                key_lengths=None):
        where = type(self).__name__
        params = self.params
        if self.training and self.attention_dropout > 0:
            if "attention_dropout" in _param_names(self._type()):
                params = dict(params, attention_dropout=self.attention_dropout)
            elif not self._warned:
                warnings.warn("%s: attention_dropout=%g is not applied: fastattn's '%s' has no "
                              "attention dropout yet" % (where, self.attention_dropout,
                                                         self._type()))
                self._warned = True
        mask, lengths, causal = fastattn_masks(attn_mask, key_lengths, keys.shape[1], where,
                                               L=queries.shape[1])
        q, k = queries.transpose(1, 2), keys.transpose(1, 2)
        kwargs = dict(causal=causal, key_lengths=lengths, attn_mask=mask, training=self.training,
                      **params)
        report = self.reports_attention and self.event_dispatcher.listening
        rng = rng_state(q) if report else None
        out = _attention(self._type(), q, k, values.transpose(1, 2), **kwargs)
        if report:
            kind = self._type()
            self.event_dispatcher.dispatch(AttentionEvent(
                self, lambda: attention_weights(kind, q, k, rng, **kwargs)))
        return out.transpose(1, 2).contiguous()


class FullAttention(_Inner):
    """Dispatches an AttentionEvent with its weights (N, H, L, S), computed
    only when a handler reads them."""

    kind = "full"
    reports_attention = True

    def __init__(self, softmax_temp=None, attention_dropout=0.1, event_dispatcher=""):
        super().__init__(attention_dropout, event_dispatcher, softmax_temp=softmax_temp)


class _Linear(_Inner):
    def __init__(self, query_dimensions, feature_map=None, eps=1e-6, event_dispatcher=""):
        from ..feature_maps import elu_feature_map

        fmap = (feature_map or elu_feature_map)(query_dimensions)
        super().__init__(0.0, event_dispatcher, eps=eps, **fmap.fastattn_params())
        self.feature_map = fmap


class LinearAttention(_Linear):
    kind = "linear"


class CausalLinearAttention(_Linear):
    """Needs a TriangularCausalMask (as in fast-transformers)."""

    kind = "causal-linear"


class ClusteredAttention(_Inner):
    kind = "clustered"

    def __init__(self, clusters, iterations=10, bits=32, hash_bias=True, softmax_temp=None,
                 attention_dropout=0.1, event_dispatcher=""):
        super().__init__(attention_dropout, event_dispatcher, clusters=clusters,
                         iterations=iterations, bits=bits,
                         hash_bias=hash_bias, softmax_temp=softmax_temp)


class ImprovedClusteredAttention(_Inner):
    kind = "improved-clustered"

    def __init__(self, clusters, iterations=10, bits=32, hash_bias=True, topk=32,
                 softmax_temp=None, attention_dropout=0.1, event_dispatcher=""):
        super().__init__(attention_dropout, event_dispatcher, clusters=clusters,
                         iterations=iterations, bits=bits,
                         hash_bias=hash_bias, topk=topk, softmax_temp=softmax_temp)


class ImprovedClusteredCausalAttention(ImprovedClusteredAttention):
    """Needs a TriangularCausalMask."""

    kind = "causal-improved-clustered"


class ReformerAttention(_Inner):
    """``bits`` random directions per round give 2·bits buckets, as in
    fast-transformers (the argmax over [xP; -xP] of the keys' projections on
    ``bits`` Gaussian directions; fastattn's angular LSH draws them per
    module and clamps the bucket count to the sequence length)."""

    kind = "reformer"

    def __init__(self, chunk_size=32, bits=8, rounds=4, masked=False, softmax_temp=None,
                 attention_dropout=0.1, event_dispatcher=""):
        if isinstance(bits, bool) or not isinstance(bits, int) or bits < 1:
            raise ValueError("ReformerAttention: bits must be an int >= 1, got %r" % (bits,))
        super().__init__(attention_dropout, event_dispatcher, chunk_size=chunk_size,
                         n_buckets=2 * bits,
                         rounds=rounds, masked=masked, softmax_temp=softmax_temp)


class ExactTopKAttention(_Inner):
    kind = "exact-topk"

    def __init__(self, topk=32, softmax_temp=None, attention_dropout=0.1, event_dispatcher=""):
        super().__init__(attention_dropout, event_dispatcher, topk=topk, softmax_temp=softmax_temp)


class LocalAttention(_Inner):
    """``local_context`` keys around each query (fastattn's ``local`` window)."""

    kind = "local"

    def __init__(self, local_context, softmax_temp=None, attention_dropout=0.1,
                 event_dispatcher=""):
        super().__init__(attention_dropout, event_dispatcher, window=local_context,
                         softmax_temp=softmax_temp)


def _aft(module, queries, keys, values, attn_mask, key_lengths, bias_of):
    """AFT on fast-transformers' layout: (N, L, H, E) in and out; ``bias_of(L,
    S, causal, keep)`` gives the position bias (or None) for the keep mask
    ``keep`` (L, S) or None."""
    where = type(module).__name__
    N, L, H, E = queries.shape
    S, D = values.shape[1], values.shape[3]
    if E != D:
        raise ValueError("%s: AFT requires that queries, keys and values have the same "
                         "dimensionality, got E = %d and D = %d" % (where, E, D))
    keep, lengths, causal = fastattn_masks(attn_mask, key_lengths, S, where, L=L)
    if keep is not None and keep.dim() != 2:
        raise ValueError("%s: key_lengths must keep the first keys of each sequence (a length "
                         "mask); AFT takes no per-sequence attention mask" % where)
    w = bias_of(L, S, causal, keep)
    if w is not None:
        w = w.to(queries.dtype)
    out = _aft_attention(queries.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                         w, lengths, causal)
    return out.transpose(1, 2).contiguous()


class AFTFullAttention(nn.Module):
    """AFT-full (Zhai et al. 2021): ``sigmoid(q_t) * sum_s softmax_s(k_s + w_ts) v_s``
    per channel, with the learned position bias ``w = u v^T`` (``u``, ``v``:
    ``max_sequence_length x aft_parameterization``, shared by the heads).

    As the paper and fast-transformers' docstring define it: the bias is
    added to the keys (fast-transformers' later sources multiply them,
    ``K * w``). A causal mask is fastattn's causal (the queries are the last
    L positions; their bias rows ``u[S-L:S]``); any other FullMask joins the
    bias as -inf where it drops a key."""

    def __init__(self, max_sequence_length=1024, aft_parameterization=64, event_dispatcher=""):
        super().__init__()
        self.u = nn.Parameter(torch.randn(max_sequence_length, aft_parameterization) * 0.01)
        self.v = nn.Parameter(torch.randn(max_sequence_length, aft_parameterization) * 0.01)
        self.event_dispatcher = EventDispatcher.get(event_dispatcher)

    def _bias(self, L, S, causal, keep):
        w = aft_position_bias(self.u, self.v, L, S, causal, "AFTFullAttention")
        return w if keep is None else w.masked_fill(~keep.to(w.device), float("-inf"))

    def forward(self, queries, keys, values, attn_mask=None, query_lengths=None,
                key_lengths=None):
        return _aft(self, queries, keys, values, attn_mask, key_lengths, self._bias)


class AFTSimpleAttention(nn.Module):
    """AFT-simple (Zhai et al. 2021): ``sigmoid(q_t) * sum_s softmax_s(k_s) v_s``
    per channel, over all keys or, under a causal mask, the prefix (the
    paper's causal softmax: fast-transformers' later sources normalise each
    position by its own prefix sum before the cumulative sum). One pass over
    the keys on the CPU. No attention mask besides causal and key lengths."""

    def __init__(self, event_dispatcher=""):
        super().__init__()
        self.event_dispatcher = EventDispatcher.get(event_dispatcher)

    @staticmethod
    def _bias(L, S, causal, keep):
        if keep is not None:
            raise ValueError("You cannot use general attention masks with AFTSimpleAttention "
                             "because it would be quadratic in time. Use AFTFullAttention "
                             "instead.")
        return None

    def forward(self, queries, keys, values, attn_mask=None, query_lengths=None,
                key_lengths=None):
        return _aft(self, queries, keys, values, attn_mask, key_lengths, self._bias)


class ConditionalFullAttention(_Inner):
    """Full attention up to ``length_limit`` queries and keys,
    ``other_attention`` beyond: fused in one fastattn type
    (``conditional-full:<type>``) when the other is one of this module's
    attentions; any other module (a registered one of the user's) is called
    as it is."""

    def __init__(self, other_attention, length_limit=512, softmax_temp=None,
                 attention_dropout=0.1, event_dispatcher=""):
        if not isinstance(other_attention, nn.Module):
            raise TypeError("ConditionalFullAttention: other_attention must be an attention "
                            "module, got %s" % type(other_attention).__name__)
        fused = isinstance(other_attention, _Inner) and other_attention.kind is not None
        if fused:
            params = dict(other_attention.params, length_limit=length_limit)
        else:
            params = dict(softmax_temp=softmax_temp)
        super().__init__(attention_dropout, event_dispatcher, **params)
        self.other = other_attention.kind if fused else None
        self.length_limit = int(length_limit)
        self.other_attention = None if fused else other_attention

    def _type(self):
        return "full" if self.other is None else "conditional-full:" + self.other

    def forward(self, queries, keys, values, attn_mask=None, query_lengths=None,
                key_lengths=None):
        if self.other_attention is not None and \
                max(queries.shape[1], keys.shape[1]) > self.length_limit:
            return self.other_attention(queries, keys, values, attn_mask, query_lengths,
                                        key_lengths)
        return super().forward(queries, keys, values, attn_mask, query_lengths, key_lengths)


class AttentionLayer(nn.Module):
    """Projections around an inner attention: fast-transformers'
    ``AttentionLayer(attention, d_model, n_heads, d_keys=None, d_values=None,
    d_model_keys=None, event_dispatcher="")``, with its weight names
    (``query_projection``, ``key_projection``, ``value_projection``,
    ``out_projection``, ``inner_attention``); keys and values come in with
    ``d_model_keys`` features (default ``d_model``). Dispatches a QKVEvent
    with the projections (N, L, H, E), (N, S, H, E), (N, S, H, D)."""

    def __init__(self, attention, d_model, n_heads, d_keys=None, d_values=None,
                 d_model_keys=None, event_dispatcher=""):
        super().__init__()
        d_keys = d_keys or (d_model // n_heads)
        d_values = d_values or (d_model // n_heads)
        d_model_keys = d_model_keys or d_model
        self.inner_attention = attention
        self.query_projection = nn.Linear(d_model, d_keys * n_heads)
        self.key_projection = nn.Linear(d_model_keys, d_keys * n_heads)
        self.value_projection = nn.Linear(d_model_keys, d_values * n_heads)
        self.out_projection = nn.Linear(d_values * n_heads, d_model)
        self.n_heads = n_heads
        self.event_dispatcher = EventDispatcher.get(event_dispatcher)

    def forward(self, queries, keys, values, attn_mask, query_lengths, key_lengths):
        N, L, _ = queries.shape
        S = keys.shape[1]
        H = self.n_heads
        q = self.query_projection(queries).view(N, L, H, -1)
        k = self.key_projection(keys).view(N, S, H, -1)
        v = self.value_projection(values).view(N, S, H, -1)
        if self.event_dispatcher.listening:
            self.event_dispatcher.dispatch(QKVEvent(self, q, k, v))
        out = self.inner_attention(q, k, v, attn_mask, query_lengths, key_lengths)
        return self.out_projection(out.reshape(N, L, -1))


def _register():
    """fastattn's attentions in fast-transformers' registry, under its keys
    and with its parameter specs (so its builders' defaults: 63 bits, ...)."""
    from ..attention_registry import (AttentionRegistry, Bool, Callable,
                                      EventDispatcherInstance, Float, Int, Optional)

    temp = ("softmax_temp", Optional(Float))
    dropout = ("attention_dropout", Optional(Float, 0.1))
    dispatcher = ("event_dispatcher", Optional(EventDispatcherInstance, ""))
    softmax = [temp, dropout, dispatcher]
    # eps: fastattn's addition (the constructors take it; fast-transformers'
    # builders do not).
    linear = [("query_dimensions", Int), ("feature_map", Optional(Callable)),
              ("eps", Optional(Float, 1e-6)), dispatcher]
    hashing = [("clusters", Int), ("iterations", Optional(Int, 10)), ("bits", Optional(Int, 63)),
               ("hash_bias", Optional(Bool, True))]
    topk = ("topk", Optional(Int, 32))
    for key, cls, params in [
            ("full", FullAttention, softmax),
            ("linear", LinearAttention, linear),
            ("causal-linear", CausalLinearAttention, linear),
            ("clustered", ClusteredAttention, hashing + softmax),
            ("improved-clustered", ImprovedClusteredAttention, hashing + [topk] + softmax),
            ("causal-improved-clustered", ImprovedClusteredCausalAttention,
             hashing + [topk] + softmax),
            # the key fast-transformers' documentation gives it
            ("improved-causal", ImprovedClusteredCausalAttention, hashing + [topk] + softmax),
            ("reformer", ReformerAttention,
             [("chunk_size", Optional(Int, 32)), ("bits", Optional(Int, 63)),
              ("rounds", Optional(Int, 4)), ("masked", Optional(Bool, False))] + softmax),
            ("exact-topk", ExactTopKAttention, [topk] + softmax),
            ("conditional-full", ConditionalFullAttention,
             [("length_limit", Optional(Int, 512))] + softmax),
            ("local", LocalAttention, [("local_context", Int)] + softmax),
            ("aft-full", AFTFullAttention,
             [("max_sequence_length", Optional(Int, 1024)),
              ("aft_parameterization", Optional(Int, 64)), dispatcher]),
            ("aft-simple", AFTSimpleAttention, [dispatcher])]:
        AttentionRegistry.register(key, cls, params)


_register()
