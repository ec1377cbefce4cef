"""Fake (meta) implementations of the fastattn operators, for torch.compile.

torch's compiler traces a program with "fake" tensors that carry shapes,
dtypes and devices but no data; an operator library tells it what each
operator returns through ``torch.library.register_fake``. Every operator
with tensor outputs has one here: the shapes of its outputs in terms of its
inputs, nothing more (the C++ kernels do the checking when they run).
Shapes are written with ``new_empty`` so they stay symbolic under dynamic
shapes. Registered on import of ``fastattn`` where torch has
``register_fake`` (torch >= 2.4).

``tests/python/test_compile.py`` runs ``torch.library.opcheck`` on every
operator: it compares these with the real kernels' outputs.
"""

import functools
import json

import torch

_LONG = torch.int64
# The generators' states attention_forward returns: the default CPU
# generator's, then on CUDA the device's.
_CPU_RNG_STATE_SIZE = torch.get_rng_state().numel()


def _rng_state_shape(device):
    if device.type != "cuda":
        return (_CPU_RNG_STATE_SIZE,)
    return (_CPU_RNG_STATE_SIZE + torch.cuda.get_rng_state(device).numel(),)


def _like(t):
    return t.new_empty(t.shape)


def _out(q, v):
    """(N, H, L, M): q's batch, heads and length, v's value width."""
    return q.new_empty(q.shape[:-1] + v.shape[-1:])


def _rows_like(like, cols, rows=None):
    """(N, H, rows, cols) laid out as ``ops::empty_rows_like`` (src/ops/op_util.cpp)
    lays it out: (N, rows, H, cols) viewed as (N, H, rows, cols) when like's
    heads lie within its rows (the layers' (N, L, H, E) projections viewed as
    (N, H, L, E)), contiguous otherwise. The linear attention kernels write
    their outputs and gradients so, and the registry operator returns them so."""
    N, H, R = like.shape[:3]
    rows = R if rows is None else rows
    if H > 1 and R > 1 and like.stride(1) < like.stride(2):
        # Not a transposed view of an (N, rows, H, cols) tensor: inductor
        # takes a fake output that is a view for a contiguous one.
        return like.new_empty_strided((N, H, rows, cols), (rows * H * cols, cols, H * cols, 1))
    return like.new_empty((N, H, rows, cols))


def _row_grads(q, k, v):
    """Gradients of q, k, v in their row layouts (_rows_like)."""
    return tuple(_rows_like(t, t.shape[-1]) for t in (q, k, v))


def _stats_dtype(q):
    """Saved softmax statistics (lse, normalisers): float32 for float16 and
    bfloat16 inputs (the CUDA kernels accumulate and save them in float32),
    q's dtype otherwise (float32, and float64 on the CPU)."""
    return torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype


def _stats(q, shape=None):
    """(N, H, L) statistics, one per query row (or of ``shape``)."""
    return q.new_empty(q.shape[:-1] if shape is None else shape, dtype=_stats_dtype(q))


@functools.lru_cache(maxsize=None)
def _state_spec(type, E, M, params_json):
    """What ``attention_step_state`` returns for head widths E, M (a list of
    {shape after (N, H) with -1 for the capacity, batched, dtype, device}),
    from the C++ side: only it knows a type's state (feature counts)."""
    return tuple(json.loads(torch.ops.fastattn.attention_step_state_spec(type, E, M, params_json)))


def _step_state(type, q, v, capacity, params_json, batched_only=False):
    """Fake tensors of a type's fixed-size step state (``capacity`` may be
    symbolic); ``batched_only`` keeps the (N, H, ...) tensors, the
    functional step's compact state."""
    N, H, E = q.shape
    state = []
    for entry in _state_spec(type, int(E), int(v.shape[-1]), params_json):
        dtype = q.dtype if entry["dtype"] == "query" else _LONG
        shape = tuple(capacity if d == -1 else d for d in entry["shape"])
        if entry["batched"]:
            state.append(q.new_empty((N, H) + shape, dtype=dtype))
        elif not batched_only:
            state.append(torch.empty(shape, dtype=dtype, device=entry["device"]))
    return state


def register():
    """Registers every fake implementation (idempotent per process)."""
    fake = torch.library.register_fake

    # ---- full attention ----------------------------------------------------
    @fake("fastattn::full_attention")
    def _(q, k, v, attn_mask=None, key_lengths=None, causal=False, softmax_temp=None,
          dropout_p=0.0, dropout_seed=None):
        return _rows_like(q, v.shape[-1])

    @fake("fastattn::full_attention_forward")
    def _(q, k, v, attn_mask, key_lengths, causal, softmax_temp, dropout_p=0.0, dropout_seed=0):
        return _rows_like(q, v.shape[-1]), _stats(q)

    @fake("fastattn::full_attention_backward")
    def _(grad_out, q, k, v, out, lse, attn_mask, key_lengths, causal, softmax_temp,
          grad_lse=None, dropout_p=0.0, dropout_seed=0):
        return _row_grads(q, k, v)

    def lse_topk(q, k, v, key_lengths=None, softmax_temp=None, topk=0):
        return _out(q, v), _stats(q), q.new_empty(q.shape[:-1] + (topk,), dtype=_LONG)

    fake("fastattn::full_attention_lse_topk")(lse_topk)
    fake("fastattn::full_attention_lse_topk_forward")(lse_topk)

    # ---- linear attention --------------------------------------------------
    def causal_product(q, k, v):
        return _out(q, v)

    fake("fastattn::causal_linear_product")(causal_product)
    fake("fastattn::causal_linear_product_forward")(causal_product)

    @fake("fastattn::causal_linear_product_backward")
    def _(grad_out, q, k, v):
        return _like(q), _like(k), _like(v)

    @fake("fastattn::elu_linear_attention")
    def _(q, k, v, key_lengths=None, causal=False, eps=1e-6):
        return _rows_like(q, v.shape[-1])

    @fake("fastattn::elu_linear_attention_forward")
    def _(q, k, v, key_lengths, causal, eps):
        # The key state [S | z]: the non-causal CPU kernel's, else 0 elements.
        with_state = q.device.type == "cpu" and not causal
        state = q.shape[:2] + (q.shape[-1], v.shape[-1] + 1) if with_state else (0,)
        return _rows_like(q, v.shape[-1]), _stats(q), _stats(q, state)

    @fake("fastattn::elu_linear_attention_backward")
    def _(grad_out, q, k, v, out, den, key_lengths, causal, eps, state=None):
        return _row_grads(q, k, v)

    @fake("fastattn::elu_feature_map")
    def _(x):
        return _like(x)

    @fake("fastattn::elu_feature_map_backward")
    def _(grad_out, x):
        return _like(x)

    # ---- clustering and clustered attention --------------------------------
    @fake("fastattn::hash_queries")
    def _(x, planes):
        return x.new_empty(x.shape[:-1], dtype=_LONG)

    @fake("fastattn::cluster_codes")
    def _(codes, lengths, clusters, iterations, seed):
        # C = min(clusters, max(L, 1)), as the operator clamps it.
        L = codes.shape[-1]
        C = torch.sym_min(clusters, torch.sym_max(L, 1))
        return _like(codes), codes.new_empty(codes.shape[:-1] + (C,))

    @fake("fastattn::clustered_topk_attention")
    def _(q, k, v, topk, mass, assignments, key_lengths, softmax_temp, dropout_p=0.0,
          dropout_seed=None):
        return _rows_like(q, v.shape[-1])

    @fake("fastattn::clustered_topk_attention_backward")
    def _(grad_out, q, k, v, topk, mass, assignments, key_lengths, softmax_temp, dropout_p=0.0,
          dropout_seed=0):
        return _row_grads(q, k, v) + (_like(mass),)

    @fake("fastattn::improved_clustered_attention")
    def _(q, k, v, assignments, counts, topk, key_lengths=None, softmax_temp=None, dropout_p=0.0,
          dropout_seed=None):
        return _rows_like(q, v.shape[-1])

    @fake("fastattn::improved_clustered_attention_forward")
    def _(q, k, v, assignments, counts, topk, key_lengths, softmax_temp, dropout_p=0.0,
          dropout_seed=0):
        clusters = counts.shape[-1]
        centroids = q.new_empty(q.shape[:2] + (clusters, q.shape[-1]))
        return (
            _rows_like(q, v.shape[-1]),
            centroids,
            _stats(q, q.shape[:2] + (clusters,)),
            q.new_empty(q.shape[:2] + (clusters, v.shape[-1])),
            q.new_empty(q.shape[:2] + (clusters, topk), dtype=_LONG),
        )

    @fake("fastattn::improved_clustered_attention_backward")
    def _(grad_out, q, k, v, assignments, counts, centroids, lse, out_c, top_idx, key_lengths,
          softmax_temp, dropout_p=0.0, dropout_seed=0):
        return _row_grads(q, k, v)

    # ---- hard retrieval ----------------------------------------------------
    @fake("fastattn::hard_retrieval_attention")
    def _(q, k, v, attn_mask=None, key_lengths=None, causal=False, sample=False,
          softmax_temp=None, seed=0):
        return _rows_like(q, v.shape[-1]), q.new_empty(q.shape[:-1], dtype=_LONG)

    @fake("fastattn::hard_retrieval_attention_forward")
    def _(q, k, v, attn_mask, key_lengths, causal, sample, softmax_temp, seed, need_lse):
        lse = _stats(q) if (sample or need_lse) else _stats(q, (0,))
        # The softmax output P V for the backward: computed by the CPU kernel only.
        with_soft = need_lse and q.device.type == "cpu"
        soft_out = _stats(q, q.shape[:-1] + v.shape[-1:] if with_soft else (0,))
        return _rows_like(q, v.shape[-1]), q.new_empty(q.shape[:-1], dtype=_LONG), lse, soft_out

    @fake("fastattn::hard_retrieval_attention_backward")
    def _(grad_out, q, k, v, index, lse, soft_out, attn_mask, key_lengths, causal, softmax_temp):
        return _row_grads(q, k, v)

    # ---- AFT ---------------------------------------------------------------
    @fake("fastattn::aft_attention")
    def _(q, k, v, position_bias=None, key_lengths=None, causal=False):
        return q.new_empty(q.shape)

    @fake("fastattn::aft_attention_forward")
    def _(q, k, v, position_bias, key_lengths, causal, need_stats):
        stats = q.shape if need_stats else (0,)
        return q.new_empty(q.shape), _stats(q, stats), _stats(q, stats)

    @fake("fastattn::aft_attention_backward")
    def _(grad_out, q, k, v, position_bias, a, lse, key_lengths, causal):
        gw = q.new_empty((0,)) if position_bias is None else position_bias.new_empty(
            position_bias.shape)
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), gw

    # ---- block-sparse attention --------------------------------------------
    @fake("fastattn::block_sparse_attention")
    def _(q, k, v, pattern, params, key_lengths=None, causal=False, softmax_temp=None,
          dropout_p=0.0, dropout_seed=None):
        return _rows_like(q, v.shape[-1])

    @fake("fastattn::block_sparse_attention_forward")
    def _(q, k, v, pattern, params, key_lengths, causal, softmax_temp, dropout_p=0.0,
          dropout_seed=0):
        return _rows_like(q, v.shape[-1]), _stats(q)

    @fake("fastattn::block_sparse_attention_backward")
    def _(grad_out, q, k, v, out, lse, pattern, params, key_lengths, causal, softmax_temp,
          dropout_p=0.0, dropout_seed=0):
        return _row_grads(q, k, v)

    # ---- Reformer ----------------------------------------------------------
    @fake("fastattn::lsh_hash")
    def _(x, rotations):
        return x.new_empty(x.shape[:2] + rotations.shape[:1] + x.shape[2:3], dtype=_LONG)

    @fake("fastattn::reformer_attention")
    def _(q, v, buckets, key_lengths=None, chunk_size=32, causal=False, mask_self=True,
          softmax_temp=None, dropout_p=0.0, dropout_seed=None):
        return _rows_like(q, v.shape[-1])

    @fake("fastattn::reformer_attention_forward")
    def _(q, v, buckets, key_lengths, chunk_size, causal, mask_self, softmax_temp, dropout_p,
          dropout_seed):
        return _rows_like(q, v.shape[-1]), q.new_empty(q.shape[:-1] + (2,), dtype=torch.float64)

    @fake("fastattn::reformer_attention_backward")
    def _(grad_out, q, v, buckets, out, stats, key_lengths, chunk_size, causal, mask_self,
          softmax_temp, dropout_p, dropout_seed):
        return _rows_like(q, q.shape[-1]), _rows_like(v, v.shape[-1])

    # ---- ClusterFormer token gather ----------------------------------------
    @fake("fastattn::gather_tokens")
    def _(x, index):
        return x.new_empty(x.shape[:2] + index.shape[1:2] + x.shape[3:])

    @fake("fastattn::gather_tokens_backward")
    def _(grad_out, index, length):
        return grad_out.new_empty(grad_out.shape[:2] + (length,) + grad_out.shape[3:])

    # ---- any registered type (fastattn.attention) --------------------------
    @fake("fastattn::attention")
    def _(type, q, k, v, causal=False, key_lengths=None, attn_mask=None, params_json="{}",
          training=False):
        return _rows_like(q, v.shape[-1])

    @fake("fastattn::attention_forward")
    def _(type, q, k, v, causal, key_lengths, attn_mask, params_json, training=False):
        return (_rows_like(q, v.shape[-1]),
                q.new_empty(_rng_state_shape(q.device), dtype=torch.uint8, device="cpu"))

    @fake("fastattn::attention_backward")
    def _(type, grad_out, q, k, v, causal, key_lengths, attn_mask, params_json, rng_state,
          training=False):
        return _row_grads(q, k, v)

    # ---- recurrent steps -----------------------------------------------------
    @fake("fastattn::attention_step")
    def _(type, q, k, v, state, params_json="{}"):
        # The compact state of t + 1 positions: a cache's rows grow by one
        # (dimension 2 of the spec's capacity), constant states keep theirs.
        spec = _state_spec(type, int(q.shape[-1]), int(v.shape[-1]), params_json)
        grows = [e for e in spec if e["batched"] and -1 in e["shape"]]
        t = state[0].shape[2 + grows[0]["shape"].index(-1)] if state and grows else 0
        return q.new_empty(q.shape[:2] + v.shape[-1:]), _step_state(
            type, q, v, t + 1, params_json, batched_only=True)

    @fake("fastattn::attention_step_state")
    def _(type, q, v, capacity, params_json="{}"):
        return _step_state(type, q, v, capacity, params_json)

    @fake("fastattn::attention_step_")
    def _(type, q, k, v, state, params_json="{}"):
        return q.new_empty(q.shape[:2] + v.shape[-1:])
