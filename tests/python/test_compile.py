"""fastattn under torch's compiler (torch >= 2.4): opcheck and torch.compile.

- ``torch.library.opcheck`` on every operator with tensor outputs (schema,
  autograd registration, fake implementation against the real kernel, and
  AOT dispatch with dynamic shapes, gradients included), with sample inputs
  covering masks, key lengths, causal, every registered type with its
  parameters, float32 and float64.
- A two-layer encoder whose attention is a fastattn type compiles with
  ``fullgraph=True`` (no graph break: ``torch._dynamo.explain``), and gives
  the eager outputs and gradients.

Skipped under torch < 2.4 (Debian's 1.13 has no torch.library.opcheck).
"""

import json

import pytest
import torch

import fastattn

pytestmark = pytest.mark.skipif(
    not hasattr(torch.library, "opcheck"), reason="torch.library.opcheck needs torch >= 2.4"
)

N, H, L, S, E, M = 2, 2, 7, 9, 4, 3
DTYPES = [torch.float64, torch.float32]


def qkv(dtype, l=L, s=S, grad=True, positive=False, type=None):
    """q, k, v; v of width M, or E for a type that works channel by channel (AFT)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(N, H, l, E, generator=g, dtype=dtype)
    k = torch.randn(N, H, s, E, generator=g, dtype=dtype)
    width = E if fastattn.capabilities().get(type, {}).get("channelwise") else M
    v = torch.randn(N, H, s, width, generator=g, dtype=dtype)
    if positive:
        q, k = q.exp(), k.exp()
    return [t.requires_grad_(grad) for t in (q, k, v)]


def lengths(s=S):
    return torch.tensor([s, s - 3])


def bool_mask(l=L, s=S):
    m = torch.rand(l, s, generator=torch.Generator().manual_seed(1)) > 0.3
    m[:, 0] = True
    return m


def clusters(q, n_clusters=3):
    """Valid assignments and counts for q, from fastattn's own clustering ops."""
    planes = torch.randn(6, E + 1, generator=torch.Generator().manual_seed(2), dtype=q.dtype)
    codes = torch.ops.fastattn.hash_queries(q.detach(), planes)
    return torch.ops.fastattn.cluster_codes(codes, torch.tensor([q.shape[2], q.shape[2] - 2]),
                                            n_clusters, 3, 7)


def op_cases():
    """(id, op, args, kwargs) for every operator with tensor outputs."""
    ops = torch.ops.fastattn
    cases = []
    for dt in DTYPES:
        d = str(dt).split(".")[1]
        q, k, v = qkv(dt)
        cases += [
            (f"full-{d}", ops.full_attention, (q, k, v), {}),
            (f"full-mask-lengths-{d}", ops.full_attention, (q, k, v),
             dict(attn_mask=bool_mask(), key_lengths=lengths(), softmax_temp=0.3)),
            (f"full-additive-causal-{d}", ops.full_attention, (q, k, v),
             dict(attn_mask=torch.zeros(L, S, dtype=dt), causal=True)),
            # Attention dropout with a seed: the same mask in every run and
            # in the backward.
            (f"full-dropout-{d}", ops.full_attention, (q, k, v),
             dict(key_lengths=lengths(), causal=True, dropout_p=0.25, dropout_seed=17)),
            (f"full-lse-topk-{d}", ops.full_attention_lse_topk, (q, k, v),
             dict(key_lengths=lengths(), topk=3)),
        ]
        fq, fk, fv = qkv(dt, l=S, positive=True)
        cases += [
            (f"causal-product-{d}", ops.causal_linear_product, (fq, fk, fv), {}),
            (f"elu-linear-{d}", ops.elu_linear_attention, (q, k, v),
             dict(key_lengths=lengths(), eps=1e-5)),
            (f"elu-linear-causal-{d}", ops.elu_linear_attention, qkv(dt, l=S), dict(causal=True)),
            (f"elu-feature-map-{d}", ops.elu_feature_map, (q,), {}),
        ]
        assignments, counts = clusters(q)
        cases += [
            (f"improved-clustered-{d}", ops.improved_clustered_attention,
             (q, k, v, assignments, counts, 3), dict(key_lengths=lengths(), softmax_temp=0.5)),
            (f"improved-clustered-dropout-{d}", ops.improved_clustered_attention,
             (q, k, v, assignments, counts, 3),
             dict(key_lengths=lengths(), softmax_temp=0.5, dropout_p=0.25, dropout_seed=17)),
        ]
        C = counts.shape[-1]
        topk = torch.stack([torch.randperm(S, generator=torch.Generator().manual_seed(i))[:4]
                            for i in range(N * H * C)]).view(N, H, C, 4)
        mass = torch.rand(N, H, C, dtype=dt, generator=torch.Generator().manual_seed(3))
        cases += [
            (f"clustered-topk-{d}", ops.clustered_topk_attention,
             (q, k, v, topk, mass.requires_grad_(), assignments, None, 0.5), {}),
            (f"clustered-topk-dropout-{d}", ops.clustered_topk_attention,
             (q, k, v, topk, mass, assignments, None, 0.5),
             dict(dropout_p=0.25, dropout_seed=17)),
        ]
        for sample in (False, True):
            cases.append((f"hard-retrieval-sample{int(sample)}-{d}", ops.hard_retrieval_attention,
                          (q, k, v), dict(attn_mask=bool_mask(), key_lengths=lengths(),
                                          sample=sample, seed=5)))
        cases.append((f"hard-retrieval-causal-{d}", ops.hard_retrieval_attention, (q, k, v),
                      dict(causal=True)))
        aq, ak, _ = qkv(dt, l=S)
        av = torch.randn(N, H, S, E, dtype=dt, generator=torch.Generator().manual_seed(6))
        bias = torch.randn(S, S, dtype=dt, generator=torch.Generator().manual_seed(7))
        cases += [
            (f"aft-simple-{d}", ops.aft_attention, (aq, ak, av.requires_grad_()),
             dict(key_lengths=lengths())),
            (f"aft-simple-causal-{d}", ops.aft_attention, (aq, ak, av), dict(causal=True)),
            (f"aft-full-{d}", ops.aft_attention, (aq, ak, av, bias.requires_grad_()),
             dict(key_lengths=lengths(), causal=True)),
            (f"aft-full-per-head-{d}", ops.aft_attention,
             (aq, ak, av, bias.expand(H, S, S).detach().clone().requires_grad_()), {}),
        ]
        sq, sk, sv = qkv(dt, l=S)
        for pattern, params in (("local", [2]), ("strided", [3, 0]), ("fixed", [3, 1, 0, 0]),
                                ("window", [2, 1])):
            cases.append((f"block-sparse-{pattern}-{d}", ops.block_sparse_attention,
                          (sq, sk, sv, pattern, params),
                          dict(key_lengths=lengths(), causal=pattern != "local")))
        cases.append((f"block-sparse-strided-dropout-{d}", ops.block_sparse_attention,
                      (sq, sk, sv, "strided", [3, 0]),
                      dict(key_lengths=lengths(), causal=True, dropout_p=0.25, dropout_seed=17)))
        # The dense-attention engine's internal operators (no autograd: inputs
        # without grad).
        dq_, dk_, dv_ = (t.detach() for t in qkv(dt, l=S))
        dout, dlse = ops._dense_attention_forward(dq_, dk_, dv_, 0.5, True, 2, 1)
        cases += [
            (f"dense-forward-{d}", ops._dense_attention_forward, (dq_, dk_, dv_, 0.5),
             dict(causal=True, window_left=2, window_right=1)),
            (f"dense-backward-{d}", ops._dense_attention_backward,
             (torch.randn_like(dout), dq_, dk_, dv_, dout, dlse, 0.5),
             dict(causal=True, window_left=2, window_right=1)),
        ]
        rot = torch.randn(2, E, 2, dtype=dt, generator=torch.Generator().manual_seed(4))
        buckets = ops.lsh_hash(sq.detach(), rot)
        cases += [
            (f"lsh-hash-{d}", ops.lsh_hash, (sq.detach(), rot), {}),
            (f"reformer-{d}", ops.reformer_attention, (sq, sv, buckets),
             dict(key_lengths=lengths(), chunk_size=4)),
            (f"reformer-causal-{d}", ops.reformer_attention, (sq, sv, buckets),
             dict(chunk_size=3, causal=True, mask_self=False)),
            (f"reformer-dropout-{d}", ops.reformer_attention, (sq, sv, buckets),
             dict(key_lengths=lengths(), chunk_size=4, dropout_p=0.25, dropout_seed=17)),
            (f"gather-tokens-{d}", ops.gather_tokens,
             (q, torch.tensor([[0, 3, -1, 6], [2, 2, 1, -1]])), {}),
            (f"hash-queries-{d}", ops.hash_queries,
             (q.detach(), torch.randn(5, E + 1, dtype=dt)), {}),
        ]
    codes = ops.hash_queries(qkv(torch.float64)[0].detach(), torch.randn(5, E + 1, dtype=torch.float64))
    cases.append(("cluster-codes", ops.cluster_codes, (codes, lengths(L), 3, 2, 1), {}))
    return cases


STEP_TYPES = [
    ("causal-linear", {}),
    ("causal-linear", dict(feature_map="favor", n_features=6)),
    ("full", dict(softmax_temp=0.5)),
    ("hard-retrieval", {}),
    ("aft-simple", {}),
]
STEP_IDS = ["causal-linear", "causal-linear-favor", "full", "hard-retrieval", "aft-simple"]


def step_cases():
    """The recurrent step operators: the functional step from an empty and
    from a two-position state, the fixed-size state and its in-place step."""
    ops = torch.ops.fastattn
    cases = []
    for dt in DTYPES:
        d = str(dt).split(".")[-1]
        for (type, params), name in zip(STEP_TYPES, STEP_IDS):
            q, k, v = (t[:, :, 0].detach() for t in qkv(dt, grad=False, type=type))  # (N, H, E|M)
            pj = fastattn._params_json(params)
            _, one = ops.attention_step(type, q, k, v, [], pj)
            _, two = ops.attention_step(type, q, k, v, one, pj)
            # Room for every run opcheck makes of the in-place step.
            fixed = ops.attention_step_state(type, q, v, 64, pj)
            cases += [
                (f"step-{name}-empty-{d}", ops.attention_step, (type, q, k, v, [], pj), {}),
                (f"step-{name}-{d}", ops.attention_step, (type, q, k, v, two, pj), {}),
                (f"step-state-{name}-{d}", ops.attention_step_state, (type, q, v, 5, pj), {}),
                (f"step-in-place-{name}-{d}", ops.attention_step_, (type, q, k, v, fixed, pj),
                 {}),
            ]
    return cases


CASES = op_cases() + step_cases() if hasattr(torch.library, "opcheck") else []

HAVE_CUDA = bool(fastattn.build_info.get("cuda")) and torch.cuda.is_available()


def on_cuda(value, dtype):
    """A CPU case's argument on the GPU, floating tensors in dtype."""
    if isinstance(value, torch.Tensor):
        t = value.detach().to("cuda", dtype if value.is_floating_point() else None)
        return t.requires_grad_(value.requires_grad)
    if isinstance(value, (list, tuple)):
        return type(value)(on_cuda(x, dtype) for x in value)
    if isinstance(value, dict):
        return {k: on_cuda(x, dtype) for k, x in value.items()}
    return value


def cuda_cases():
    """The float32 CPU cases on the GPU in float32, float16 and bfloat16."""
    out = []
    for name, op, args, kwargs in CASES:
        if not name.endswith("-float32"):
            continue
        for dt in (torch.float32, torch.float16, torch.bfloat16):
            d = str(dt).split(".")[1]
            out.append((name.replace("-float32", f"-cuda-{d}"), op, on_cuda(args, dt),
                        on_cuda(kwargs, dt)))
    return out


CUDA_CASES = cuda_cases() if HAVE_CUDA else []


@pytest.mark.parametrize("name,op,args,kwargs", CASES, ids=[c[0] for c in CASES])
def test_opcheck_kernel_ops(name, op, args, kwargs):
    torch.library.opcheck(op, args, kwargs)


def inner_calls(op, args, kwargs):
    """The fastattn operators a differentiable operator calls in an eager
    forward and backward (its _forward and _backward operators), with the
    arguments they were given: tensors detached, those that required grad
    still requiring it (the saved inputs a backward is given do), so that
    opcheck's autograd-registration test runs on them."""
    from torch.utils._python_dispatch import TorchDispatchMode

    calls = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, a=(), kw=None):
            if func.namespace == "fastattn" and func._overloadpacket is not op:
                detach = (lambda x: x.detach().requires_grad_(x.requires_grad)
                          if isinstance(x, torch.Tensor) else x)
                calls.append((func, torch.utils._pytree.tree_map(detach, (a, kw or {}))))
            return func(*a, **(kw or {}))

    with Record():
        out = op(*args, **kwargs)
        outs = [o for o in (out if isinstance(out, (tuple, list)) else [out])
                if isinstance(o, torch.Tensor) and o.requires_grad]
        if outs:
            torch.autograd.backward(outs, [torch.randn_like(o) for o in outs])
    return calls


@pytest.mark.parametrize("name,op,args,kwargs", CASES, ids=[c[0] for c in CASES])
def test_opcheck_forward_and_backward_ops(name, op, args, kwargs):
    # Every differentiable operator's own _forward and _backward operators,
    # opchecked with the arguments the autograd function gives them.
    calls = inner_calls(op, args, kwargs)
    if not any(isinstance(a, torch.Tensor) and a.requires_grad
               for a in torch.utils._pytree.tree_leaves((args, kwargs))):
        assert not calls
        return
    for func, (a, kw) in calls:
        torch.library.opcheck(func, a, kw)


def test_internal_halves_are_not_differentiable():
    """A direct call of an X_forward / X_backward operator with inputs that
    require grad runs below autograd: its outputs have no gradient history
    (no silent, warning autograd fallback), and gradients come from X."""
    import warnings

    ops = torch.ops.fastattn
    halves = [n for n in torch._C._dispatch_get_all_op_names()
              if n.startswith("fastattn::") and n.endswith(("_forward", "_backward"))]
    assert len(halves) >= 20
    unregistered = [n for n in halves
                    if not torch._C._dispatch_has_kernel_for_dispatch_key(n, "Autograd")]
    assert not unregistered, "halves without an Autograd kernel (schemas.cpp): %s" % unregistered
    q, k, v = qkv(torch.float64, grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = ops.full_attention_forward(q, k, v, None, None, False, 0.25, 0.0, 0)
        grads = ops.full_attention_backward(torch.ones_like(out), q, k, v, out, lse, None,
                                            None, False, 0.25, None, 0.0, 0)
    assert not out.requires_grad and out.grad_fn is None
    assert not any(g.requires_grad for g in grads)
    ref = ops.full_attention(q, k, v, softmax_temp=0.25)
    torch.testing.assert_close(out, ref.detach())
    torch.autograd.backward(ref, torch.ones_like(ref))
    for g, t in zip(grads, (q, k, v)):
        torch.testing.assert_close(g, t.grad)


def test_every_operator_has_a_fake_and_an_opcheck_case():
    """Each fastattn operator with tensor outputs has a fake implementation
    (or is composite: the compiler traces its parts) and is opchecked in this
    file: directly (CASES), as a case's own _forward / _backward, or (the
    registry operator and its halves) by test_opcheck_attention_every_type.
    A new schema without either fails here, naming it."""
    from torch._library.simple_registry import singleton

    def tensor_outputs(name):
        packet = getattr(torch.ops.fastattn, name.split("::")[1])
        return any("Tensor" in str(r.type) for o in packet.overloads()
                   for r in getattr(packet, o)._schema.returns)

    def composite(name):
        return any(torch._C._dispatch_has_kernel_for_dispatch_key(name, key)
                   for key in ("CompositeImplicitAutograd", "CompositeExplicitAutograd"))

    names = sorted(n for n in torch._C._dispatch_get_all_op_names()
                   if n.startswith("fastattn::") and tensor_outputs(n))
    assert len(names) >= 30
    no_fake = [n for n in names if singleton.find(n).fake_impl.kernel is None and not composite(n)]
    assert not no_fake, "operators without a fake implementation: %s" % no_fake
    checked = {c[1]._qualified_op_name for c in CASES}
    for _, op, args, kwargs in CASES:
        checked |= {"fastattn::" + f._overloadpacket.__name__
                    for f, _ in inner_calls(op, args, kwargs)}
    checked |= {"fastattn::attention", "fastattn::attention_forward",
                "fastattn::attention_backward"}
    # Composite operators of the GPU engine's routes: traced through their
    # parts, which are opchecked (or need a GPU: tests/cuda).
    unchecked = [n for n in names if n not in checked
                 and not torch._C._dispatch_has_kernel_for_dispatch_key(
                     n, "CompositeImplicitAutograd")]
    assert not unchecked, "operators without an opcheck case: %s" % unchecked


@pytest.mark.skipif(not HAVE_CUDA, reason="no CUDA operators built, or no GPU")
@pytest.mark.parametrize("name,op,args,kwargs", CUDA_CASES or [("none", None, (), {})],
                         ids=[c[0] for c in CUDA_CASES] or ["none"])
def test_opcheck_kernel_ops_cuda(name, op, args, kwargs):
    torch.library.opcheck(op, args, kwargs)


def type_cases():
    """(id, type, params, causal, lengths, mask) for every registered type."""
    seeded = {"seed": 3}
    extra = {
        "clustered": dict(clusters=3, **seeded),
        "improved-clustered": dict(clusters=3, topk=3, **seeded),
        "causal-improved-clustered": dict(clusters=3, topk=3, **seeded),
        "exact-topk": dict(topk=3),
        "reformer": dict(chunk_size=4, **seeded),
        "local": dict(window=3),
        "clusterformer": dict(clusters=2, **seeded),
        "hard-retrieval": seeded,
    }
    out = []
    for t in fastattn.attention_types()["types"]:
        name = t["name"]
        names = {p["name"] for p in t["params"]}
        params = {k: v for k, v in extra.get(name, {}).items() if k in names}
        out.append((name, name, params))
    out.append(("linear-favor", "linear", dict(feature_map="favor", n_features=8)))
    out.append(("conditional-full-linear", "conditional-full:linear", dict(length_limit=4)))
    return out


TYPES = type_cases() if hasattr(torch.library, "opcheck") else []


def supported(type, q, k, v, **kw):
    """Whether a type takes this combination (causal, lengths, mask, S != L)."""
    try:
        fastattn.attention(type, q.detach(), k.detach(), v.detach(), **kw)
        return True
    except RuntimeError:
        return False


@pytest.mark.parametrize("name,type,params", TYPES, ids=[c[0] for c in TYPES])
@pytest.mark.parametrize("dtype", DTYPES, ids=["float64", "float32"])
def test_opcheck_attention_every_type(name, type, params, dtype):
    q, k, v = qkv(dtype, l=S, type=type)
    variants = [dict(), dict(causal=True), dict(key_lengths=lengths())]
    ran = 0
    for kw in variants:
        if not supported(type, q, k, v, **kw, **params):
            continue
        args = (type, q, k, v)
        kwargs = dict(causal=kw.get("causal", False), key_lengths=kw.get("key_lengths"),
                      params_json=json.dumps(params))
        torch.library.opcheck(torch.ops.fastattn.attention, args, kwargs)
        if not ran:  # its attention_forward and attention_backward
            calls = inner_calls(torch.ops.fastattn.attention, args, kwargs)
            assert len(calls) >= 2
            for func, (a, kw_) in calls:
                torch.library.opcheck(func, a, kw_)
        ran += 1
    assert ran > 0, f"{type} ran in none of {variants}"


@pytest.mark.parametrize("name,type,params", TYPES, ids=[c[0] for c in TYPES])
def test_attention_backward_replays_random_draws(name, type, params):
    """Forward and backward of the registry op see the same random draws: the
    backward replays the forward's generator state, so drawing other numbers
    from the default generator between the two passes changes nothing."""
    q, k, v = qkv(torch.float64, l=S, type=type)
    params = {k_: v_ for k_, v_ in params.items() if k_ != "seed"}  # default generator draws
    causal = type.startswith("causal")
    assert supported(type, q, k, v, causal=causal, **params)
    grads = []
    for draws_between in (0, 1000):
        torch.manual_seed(11)
        out = fastattn.attention(type, q, k, v, causal=causal, **params)
        torch.rand(draws_between)
        grads.append(torch.autograd.grad(out.sum(), (q, k, v), allow_unused=True))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_training_dropout_compiles_and_replays_its_mask(backend):
    """fastattn.attention(training=True, attention_dropout=p) compiled: one
    node whose backward recomputes the forward with the same dropout mask, so
    under one seed the compiled output and gradients equal the eager ones."""
    q, k, v = qkv(torch.float64, l=S)

    def f(q, k, v):
        return fastattn.attention("full", q, k, v, causal=True, training=True,
                                  attention_dropout=0.25)

    compiled = torch.compile(f, fullgraph=True, backend=backend)
    runs = []
    for fn in (f, compiled):
        torch.manual_seed(5)
        out = fn(q, k, v)
        runs.append((out,) + torch.autograd.grad(out.square().sum(), (q, k, v)))
    torch.manual_seed(6)
    assert not torch.equal(f(q, k, v), runs[0][0])  # another seed, another mask
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("type,params", [
    ("full", {}), ("improved-clustered", dict(clusters=3, topk=3, seed=1))])
def test_opcheck_attention_training_with_dropout(type, params):
    q, k, v = qkv(torch.float64, l=S)
    kwargs = dict(causal=False, params_json=json.dumps(dict(params, attention_dropout=0.25)),
                  training=True)
    torch.library.opcheck(torch.ops.fastattn.attention, (type, q, k, v), kwargs)
    calls = inner_calls(torch.ops.fastattn.attention, (type, q, k, v), kwargs)
    assert len(calls) >= 2
    for func, (a, kw_) in calls:
        torch.library.opcheck(func, a, kw_)


class Encoder(torch.nn.Module):
    """Two post-norm transformer layers around a fastattn type."""

    def __init__(self, type, params, d_model=16, heads=2, layers=2):
        super().__init__()
        self.type, self.params, self.heads = type, params, heads
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(d_model, 3 * d_model) for _ in range(layers))
        self.out = torch.nn.ModuleList(torch.nn.Linear(d_model, d_model) for _ in range(layers))
        self.ff = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(d_model, 32), torch.nn.GELU(),
                                torch.nn.Linear(32, d_model)) for _ in range(layers))
        self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(d_model) for _ in range(2 * layers))

    def forward(self, x, key_lengths):
        n, l, d = x.shape
        for i in range(len(self.qkv)):
            q, k, v = self.qkv[i](x).view(n, l, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
            a = fastattn.attention(self.type, q, k, v, key_lengths=key_lengths, **self.params)
            x = self.norms[2 * i](x + self.out[i](a.transpose(1, 2).reshape(n, l, d)))
            x = self.norms[2 * i + 1](x + self.ff[i](x))
        return x


COMPILE_TYPES = [
    ("full", {}),
    ("linear", {}),
    ("improved-clustered", dict(clusters=4, topk=4, seed=1)),
    ("reformer", dict(chunk_size=8, seed=1)),
    ("local", dict(window=4)),
    ("sparse-strided", {}),
]


@pytest.mark.parametrize("type,params", COMPILE_TYPES, ids=[t for t, _ in COMPILE_TYPES])
def test_two_layer_encoder_compiles_fullgraph(type, params):
    torch.manual_seed(0)
    model = Encoder(type, params).double()
    x = torch.randn(2, 24, 16, dtype=torch.float64, requires_grad=True)
    klen = torch.tensor([24, 17])

    explained = torch._dynamo.explain(model)(x, klen)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1

    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    eager_out = model(x, klen)
    (eager_gx,) = torch.autograd.grad(eager_out.square().sum(), x)
    out = compiled(x, klen)
    (gx,) = torch.autograd.grad(out.square().sum(), x)
    torch.testing.assert_close(out, eager_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(gx, eager_gx, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("type", ["full", "linear"])
def test_encoder_compiles_with_inductor_and_dynamic_lengths(type):
    # Forward and backward: q, k, v are permuted views, so the registry
    # operator must return its output and gradients in the row layouts its
    # fake implementation promises (inductor asserts the strides): linear
    # attention's kernels write them, full's output is copied into them.
    torch.manual_seed(0)
    model = Encoder(type, {})
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    for l in (12, 20):
        x = torch.randn(2, l, 16, requires_grad=True)
        klen = torch.tensor([l, l - 5])
        out, eager_out = compiled(x, klen), model(x, klen)
        torch.testing.assert_close(out, eager_out, rtol=1e-4, atol=1e-5)
        (gx,) = torch.autograd.grad(out.square().sum(), x)
        (eager_gx,) = torch.autograd.grad(eager_out.square().sum(), x)
        torch.testing.assert_close(gx, eager_gx, rtol=1e-4, atol=1e-4)


def test_export_of_encoder():
    model = Encoder("improved-clustered", dict(clusters=4, topk=4, seed=1)).eval()
    x, klen = torch.randn(2, 24, 16), torch.tensor([24, 17])
    exported = torch.export.export(model, (x, klen))
    assert any("fastattn" in str(n.target) for n in exported.graph.nodes)
    torch.testing.assert_close(exported.module()(x, klen), model(x, klen))


def decode(step, type, params, q, k, v, state):
    """Positions 0..S-1 through ``step``: (N, H, S, M)."""
    outs = [step(type, q[:, :, t], k[:, :, t], v[:, :, t], state, **params)
            for t in range(q.shape[2])]
    return torch.stack(outs, 2)


@pytest.mark.parametrize("type,params", STEP_TYPES, ids=STEP_IDS)
def test_decoding_loop_in_place_compiles_once(type, params):
    # The fixed-size state keeps every step's shapes: one graph, no break,
    # no recompilation over the whole loop, and eager's outputs.
    q, k, v = qkv(torch.float64, l=S, grad=False, type=type)
    state = fastattn.attention_step_state(type, q[:, :, 0], v[:, :, 0], S, **params)
    explained = torch._dynamo.explain(fastattn.attention_step_)(
        type, q[:, :, 0], k[:, :, 0], v[:, :, 0], state, **params)
    assert explained.graph_break_count == 0, explained.break_reasons

    state = fastattn.attention_step_state(type, q[:, :, 0], v[:, :, 0], S, **params)
    eager = decode(fastattn.attention_step_, type, params, q, k, v, state)
    functional = []
    state = None
    for t in range(S):
        out, state = fastattn.attention_step(type, q[:, :, t], k[:, :, t], v[:, :, t], state,
                                             **params)
        functional.append(out)
    torch.testing.assert_close(eager, torch.stack(functional, 2), rtol=0, atol=1e-12)

    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()  # compilations of the other cases count towards the recompile limit
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(fastattn.attention_step_, fullgraph=True, backend=counter)
    state = fastattn.attention_step_state(type, q[:, :, 0], v[:, :, 0], S, **params)
    torch.testing.assert_close(decode(compiled, type, params, q, k, v, state), eager,
                               rtol=0, atol=1e-12)
    assert counter.frame_count == 1


def test_decoding_loop_with_inductor():
    # Inductor functionalises the in-place step (a mutated list of tensors).
    q, k, v = qkv(torch.float32, l=S, grad=False)
    state = fastattn.attention_step_state("full", q[:, :, 0], v[:, :, 0], S)
    eager = decode(fastattn.attention_step_, "full", {}, q, k, v, state)
    state = fastattn.attention_step_state("full", q[:, :, 0], v[:, :, 0], S)
    compiled = torch.compile(fastattn.attention_step_, fullgraph=True)
    torch.testing.assert_close(decode(compiled, "full", {}, q, k, v, state), eager)
    assert state[2].item() == S


@pytest.mark.parametrize("type,params", STEP_TYPES, ids=STEP_IDS)
def test_functional_step_compiles_fullgraph(type, params):
    # The functional step's cache grows by a row a step: dynamic shapes after
    # the first recompilation, eager's outputs.
    q, k, v = qkv(torch.float64, l=S, grad=False, type=type)

    def steps(compiled_step):
        state, outs = None, []
        for t in range(S):
            out, state = compiled_step(type, q[:, :, t], k[:, :, t], v[:, :, t], state, **params)
            outs.append(out)
        return torch.stack(outs, 2)

    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()  # compilations of the other cases count towards the recompile limit
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(fastattn.attention_step, fullgraph=True, backend=counter)
    torch.testing.assert_close(steps(compiled), steps(fastattn.attention_step), rtol=0,
                               atol=1e-12)
    assert counter.frame_count <= 3
