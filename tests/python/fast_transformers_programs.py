"""Programs written against fast-transformers' documented API, run on the
reference (its 0.4.0 release, built as bench/python/bench_fast_transformers.py
says) by bench/python/make_fast_transformers_fixtures.py, which stores each
program's inputs, weights and outputs in tests/python/fixtures/fast_transformers/,
and on the drop-in by tests/python/test_compat_fast_transformers_fixtures.py
against those files.

A program is ``program(ft, fixture)``: ``ft(name)`` imports a submodule of
the package under test (``ft("builders")``); ``fixture`` holds the tensors
and state dicts the reference run stored (``take`` makes or reuses one), and
the program returns its outputs. Every program here is deterministic in
both packages (clustering with top-k over every key, no random features),
so the outputs are compared to float32 tolerance.
"""

import torch

PROGRAMS = {}


def program(fn):
    PROGRAMS[fn.__name__] = fn
    return fn


def take(fixture, name, make):
    """The fixture's ``name``, made by ``make()`` the first time."""
    if name not in fixture:
        fixture[name] = make()
    return fixture[name]


def weights(fixture, name, model):
    """Loads the stored state of ``model`` (or stores the reference's)."""
    if name in fixture:
        model.load_state_dict(fixture[name])
    else:
        fixture[name] = {k: v.clone() for k, v in model.state_dict().items()}
    return model


def rand(fixture, name, *shape):
    return take(fixture, name, lambda: torch.rand(*shape) * 2 - 1)


SIZES = dict(n_layers=2, n_heads=2, query_dimensions=8, value_dimensions=8,
             feed_forward_dimensions=32)
N, L = 2, 12


def valid_rows(y, lengths):
    """y with its padded positions zeroed: what a padded query outputs is not
    compared (fast-transformers' local attention gives a query that sees no
    key a uniform average of nothing, fastattn zeros)."""
    keep = torch.arange(y.shape[1])[None, :] < lengths[:, None]
    return y * keep[..., None]


def encoder_program(kind, causal=False, padded=True, **params):
    def run(ft, fixture):
        builder = ft("builders").TransformerEncoderBuilder.from_kwargs(
            attention_type=kind, **SIZES, **params)
        model = weights(fixture, "model", builder.get().eval())
        masking = ft("masking")
        x = rand(fixture, "x", N, L, 16)
        lengths = take(fixture, "lengths", lambda: torch.tensor([L, 9 if padded else L]))
        attn = masking.TriangularCausalMask(L) if causal else None
        with torch.no_grad():
            y = model(x, attn_mask=attn, length_mask=masking.LengthMask(lengths))
        return {"y": valid_rows(y, lengths)}
    return run


for _name, _args in {
        "full": (("full",), {}),
        "linear": (("linear",), {}),
        "causal_linear": (("causal-linear", True), {}),
        "local": (("local",), dict(local_context=4)),
        "exact_topk": (("exact-topk",), dict(topk=5)),
        # top-k over every key: exact softmax in both packages. Unpadded:
        # fast-transformers 0.4 masks padded keys in the top-k softmax by
        # the slots of head 0's first cluster, which the unsorted top-k
        # does not keep in the same place for the others.
        "improved_clustered_all_keys": (("improved-clustered", False, False),
                                        dict(clusters=3, topk=L)),
        "conditional_full_short": (("conditional-full:linear",), dict(length_limit=64)),
        "conditional_full_long": (("conditional-full:linear",), dict(length_limit=8)),
}.items():
    PROGRAMS["encoder_" + _name] = encoder_program(*_args[0], **_args[1])


@program
def encoder_from_dictionary(ft, fixture):
    builder = ft("builders").TransformerEncoderBuilder.from_dictionary(dict(
        SIZES, attention_type="full", activation="gelu", final_normalization=False,
        softmax_temp=0.2, dropout=0.3))
    model = weights(fixture, "model", builder.get().eval())
    x = rand(fixture, "x", N, L, 16)
    with torch.no_grad():
        return {"y": model(x)}


@program
def decoder(ft, fixture):
    builder = ft("builders").TransformerDecoderBuilder.from_kwargs(
        self_attention_type="full", cross_attention_type="linear", **SIZES)
    model = weights(fixture, "model", builder.get().eval())
    masking = ft("masking")
    x, memory = rand(fixture, "x", N, L, 16), rand(fixture, "memory", N, 7, 16)
    memory_lengths = take(fixture, "memory_lengths", lambda: torch.tensor([7, 4]))
    with torch.no_grad():
        return {"y": model(x, memory, x_mask=masking.TriangularCausalMask(L),
                           memory_length_mask=masking.LengthMask(memory_lengths))}


def recurrent_encoder_program(kind):
    def run(ft, fixture):
        builders = ft("builders")
        batch = builders.TransformerEncoderBuilder.from_kwargs(attention_type=kind, **SIZES)
        model = weights(fixture, "model", batch.get().eval())
        recurrent = builders.RecurrentEncoderBuilder.from_kwargs(attention_type=kind, **SIZES)
        step_model = recurrent.get().eval()
        step_model.load_state_dict(model.state_dict())
        x = rand(fixture, "x", N, L, 16)
        outs, state = [], None
        with torch.no_grad():
            batch_y = model(x, attn_mask=ft("masking").TriangularCausalMask(L))
            for i in range(L):
                y, state = step_model(x[:, i], state)
                outs.append(y)
        return {"batch": batch_y, "steps": torch.stack(outs, 1)}
    return run


PROGRAMS["recurrent_encoder_causal_linear"] = recurrent_encoder_program("causal-linear")
PROGRAMS["recurrent_encoder_full"] = recurrent_encoder_program("full")


@program
def recurrent_decoder(ft, fixture):
    builders = ft("builders")
    kw = dict(SIZES, self_attention_type="causal-linear", cross_attention_type="full")
    model = weights(fixture, "model", builders.RecurrentDecoderBuilder.from_kwargs(**kw).get()
                    .eval())
    x, memory = rand(fixture, "x", N, 6, 16), rand(fixture, "memory", N, 5, 16)
    lengths = take(fixture, "memory_lengths", lambda: torch.tensor([5, 3]))
    outs, state = [], None
    with torch.no_grad():
        for i in range(6):
            y, state = model(x[:, i], memory, ft("masking").LengthMask(lengths), state=state)
            outs.append(y)
    return {"steps": torch.stack(outs, 1)}


@program
def custom_attention(ft, fixture):
    registry = ft("attention_registry")

    class GatedFull(torch.nn.Module):
        """A user's attention: softmax attention times a gate."""

        def __init__(self, gate, softmax_temp=None, event_dispatcher=""):
            super().__init__()
            self.gate = gate
            self.full = ft("attention").FullAttention(softmax_temp, 0.0)

        def forward(self, queries, keys, values, attn_mask, query_lengths, key_lengths):
            out = self.full(queries, keys, values, attn_mask, query_lengths, key_lengths)
            return self.gate * out

    if "fixture-gated-full" not in registry.AttentionRegistry:
        registry.AttentionRegistry.register("fixture-gated-full", GatedFull, [
            ("gate", registry.Optional(registry.Float, 0.5)),
            ("softmax_temp", registry.Optional(registry.Float)),
            ("event_dispatcher", registry.Optional(registry.EventDispatcherInstance, ""))])
    builder = ft("builders").TransformerEncoderBuilder.from_kwargs(
        attention_type="fixture-gated-full", gate="3", **SIZES)
    model = weights(fixture, "model", builder.get().eval())
    x = rand(fixture, "x", N, L, 16)
    with torch.no_grad():
        return {"y": model(x)}


@program
def events(ft, fixture):
    # (IntermediateOutput is later than fast-transformers 0.4.0: not here.)
    ev = ft("events")
    dispatcher = ev.EventDispatcher()
    builder = ft("builders").TransformerEncoderBuilder.from_kwargs(
        attention_type="full", event_dispatcher=dispatcher, **SIZES)
    model = weights(fixture, "model", builder.get().eval())
    matrices, qkv = [], []
    filters = ft("events.filters")
    dispatcher.listen(ev.AttentionEvent, lambda e: matrices.append(e.attention_matrix))
    dispatcher.listen(filters.layer_name_contains(model, "layers.1") & ev.QKVEvent,
                      lambda e: qkv.append(e.queries))
    x = rand(fixture, "x", N, L, 16)
    lengths = take(fixture, "lengths", lambda: torch.tensor([L, 9]))
    with torch.no_grad():
        model(x, length_mask=ft("masking").LengthMask(lengths))
    return {"attention": torch.stack(matrices), "queries": torch.stack(qkv)}


@program
def pytorch_mapper(ft, fixture):
    source = take(fixture, "source", lambda: torch.nn.TransformerEncoder(
        torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, batch_first=True),
        num_layers=2, norm=torch.nn.LayerNorm(16), enable_nested_tensor=False).state_dict())
    model = ft("builders").TransformerEncoderBuilder.from_kwargs(
        attention_type="full", **SIZES).get().eval()
    model.load_state_dict(ft("weight_mapper").PytorchMapper().map(source))
    x = rand(fixture, "x", N, L, 16)
    with torch.no_grad():
        return {"y": model(x)}


@program
def bert_mapper(ft, fixture):
    def bert():
        import transformers
        config = transformers.BertConfig(hidden_size=16, num_hidden_layers=2,
                                         num_attention_heads=2, intermediate_size=32)
        return transformers.BertModel(config).encoder.state_dict()

    source = take(fixture, "source", bert)
    model = ft("builders").TransformerEncoderBuilder.from_kwargs(
        attention_type="full", activation="gelu", final_normalization=False, **SIZES).get()
    model.load_state_dict(ft("weight_mapper").HugginfaceBertEncoderMapper().map(source))
    x = rand(fixture, "x", N, L, 16)
    with torch.no_grad():
        return {"y": model.eval()(x)}
