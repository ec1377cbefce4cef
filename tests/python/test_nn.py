"""Tests of fastattn.nn: layers against a float64 multi-head reference written
with torch ops, masks, batch modules against their recurrent twins (sharing a
state_dict), builders and their configs, errors naming the argument,
torch.compile (torch 2.x) and DistributedDataParallel (gloo, CPU).

Run: ctest -R python_tests, or
  PYTHONPATH=python FASTATTN_LIBRARY=build/libfastattn.so /usr/bin/python3 -m pytest tests/python/test_nn.py
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import fastattn
import fastattn.nn as fnn
from test_ops import reference

F64_TOL = 1e-10


def reference_layer(layer, queries, keys, values, **masks):
    """The AttentionLayer's computation with torch ops and the float64 reference."""
    H = layer.n_heads

    def heads(proj, x):
        return proj(x).view(x.shape[0], x.shape[1], H, -1).transpose(1, 2)

    out = reference(heads(layer.query_projection, queries), heads(layer.key_projection, keys),
                    heads(layer.value_projection, values), **masks)
    return layer.out_projection(out.transpose(1, 2).reshape(queries.shape[0], queries.shape[1], -1))


# Modules and tensors in float64, seed 0 (tests/python/conftest.py).
pytestmark = pytest.mark.usefixtures("float64_and_seeded")


def test_attention_layer_matches_the_reference_with_every_mask():
    layer = fnn.AttentionLayer("full", d_model=12, n_heads=3, d_keys=5, d_values=6)
    x = torch.randn(2, 7, 12)
    mem = torch.randn(2, 9, 12)
    lengths = torch.tensor([9, 4])
    bool_mask = torch.rand(7, 9) > 0.3
    cases = [
        (dict(), dict()),
        (dict(key_lengths=fnn.LengthMask(lengths, max_len=9)), dict(key_lengths=lengths)),
        (dict(key_lengths=lengths), dict(key_lengths=lengths)),
        (dict(attn_mask=fnn.FullMask(bool_mask)), dict(attn_mask=bool_mask)),
        (dict(attn_mask=fnn.FullMask(N=7, M=9)), dict()),
    ]
    for kwargs, ref_kwargs in cases:
        got = layer(x, mem, mem, **kwargs)
        want = reference_layer(layer, x, mem, mem, **ref_kwargs)
        assert got.shape == (2, 7, 12)
        assert (got - want).abs().max() < F64_TOL, kwargs
    got = layer(x, attn_mask=fnn.TriangularCausalMask(7))
    want = reference_layer(layer, x, x, x, causal=True)
    assert (got - want).abs().max() < F64_TOL
    assert (layer(x, causal=True) - want).abs().max() < F64_TOL


def test_attention_layer_gradients_match_the_reference():
    layer = fnn.AttentionLayer("full", d_model=8, n_heads=2)
    x = torch.randn(2, 5, 8, requires_grad=True)
    layer(x, causal=True).pow(2).sum().backward()
    got = [p.grad.clone() for p in layer.parameters()] + [x.grad.clone()]
    layer.zero_grad()
    x.grad = None
    reference_layer(layer, x, x, x, causal=True).pow(2).sum().backward()
    want = [p.grad for p in layer.parameters()] + [x.grad]
    for g, w in zip(got, want):
        assert (g - w).abs().max() < 1e-9


def test_attention_dropout_in_training_mode_only():
    """Attention(type, attention_dropout=p) drops weights in train() (what
    fastattn.attention(training=True) computes under the same seed) and
    never in eval(); an encoder built with it trains reproducibly."""
    q, k, v = (torch.randn(2, 2, 16, 8, dtype=torch.float64) for _ in range(3))
    attn = fnn.Attention("full", attention_dropout=0.25)
    plain = fastattn.attention("full", q, k, v)
    assert torch.equal(attn.eval()(q, k, v), plain)
    torch.manual_seed(1)
    got = attn.train()(q, k, v)
    torch.manual_seed(1)
    assert torch.equal(got, fastattn.attention("full", q, k, v, training=True,
                                               attention_dropout=0.25))
    assert (got - plain).abs().max() > 0.1
    enc = fnn.build_encoder(n_layers=1, n_heads=2, query_dimensions=4, dropout=0.0,
                            attention_params={"attention_dropout": 0.25}).double()
    x = torch.randn(2, 16, 8, dtype=torch.float64)
    runs = []
    for _ in range(2):
        torch.manual_seed(2)
        runs.append(enc.train()(x))
    assert torch.equal(runs[0], runs[1])
    assert (runs[0] - enc.eval()(x)).abs().max() > 1e-3


def test_all_true_full_mask_works_with_types_without_attn_mask():
    layer = fnn.AttentionLayer("linear", d_model=8, n_heads=2)
    x = torch.randn(1, 6, 8)
    assert torch.equal(layer(x, attn_mask=fnn.FullMask(N=6)), layer(x))
    with pytest.raises(RuntimeError, match="linear: attn_mask: got a boolean attn_mask"):
        layer(x, attn_mask=fnn.FullMask(torch.rand(6, 6) > 0.5))


def test_every_type_runs_in_a_layer():
    x = torch.randn(2, 16, 8)
    lengths = torch.tensor([16, 11])
    for spec in fastattn.attention_types()["types"]:
        name = spec["name"]
        causal = name.startswith("causal")
        layer = fnn.AttentionLayer(name, d_model=8, n_heads=2).eval()
        out = layer(x, key_lengths=lengths, causal=causal)
        assert out.shape == x.shape and torch.isfinite(out).all(), name


def test_feature_map_objects_are_the_type_parameters():
    x = torch.randn(1, 2, 6, 4)
    a = fnn.Attention("linear", feature_map=fnn.Favor(n_features=16, seed=3))
    b = fnn.Attention("linear", feature_map="favor", n_features=16, seed=3)
    assert torch.equal(a(x, x, x), b(x, x, x))
    assert a.params == dict(feature_map="favor", n_features=16, orthogonal=True, seed=3, redraw=1)
    maps = [fnn.EluFeatureMap(), fnn.ReluFeatureMap(), fnn.Favor(), fnn.RandomFourierFeatures(),
            fnn.SmoothedRandomFourierFeatures(smoothing=2.0),
            fnn.GeneralizedRandomFeatures(kernel_fn="exp")]
    for fm in maps:
        out = fnn.Attention("causal-linear", feature_map=fm)(x, x, x, causal=True)
        assert torch.isfinite(out).all(), fm


@pytest.mark.parametrize("kind", fnn.STEP_TYPES)
def test_recurrent_encoder_twin_gives_the_causal_batch_rows(kind):
    config = dict(n_layers=2, n_heads=2, query_dimensions=4, attention_type=kind)
    batch = fnn.build_encoder(config).eval()
    twin = fnn.build_encoder(json.dumps(config), recurrent=True).eval()
    assert list(batch.state_dict()) == list(twin.state_dict())
    twin.load_state_dict(batch.state_dict())
    x = torch.randn(2, 9, 8)
    want = batch(x, causal=True)
    state = None
    for t in range(9):
        y, state = twin(x[:, t], state=state)
        assert (y - want[:, t]).abs().max() < 1e-9, (kind, t)


def test_recurrent_decoder_twin_gives_the_batch_rows():
    config = dict(n_layers=2, n_heads=2, query_dimensions=3, memory_dimensions=5,
                  self_attention_type="causal-linear", cross_attention_type="full",
                  feed_forward_dimensions=10, activation="gelu", norm_first=True)
    batch = fnn.build_decoder(config).eval()
    twin = fnn.build_decoder(config, recurrent=True).eval()
    batch.load_state_dict(twin.state_dict())  # either direction
    x, memory = torch.randn(2, 6, 6), torch.randn(2, 8, 5)
    lengths = torch.tensor([8, 5])
    want = batch(x, memory, memory_lengths=fnn.LengthMask(lengths))
    state = None
    for t in range(6):
        y, state = twin(x[:, t], memory, memory_lengths=lengths, state=state)
        assert (y - want[:, t]).abs().max() < 1e-9, t


def test_builders_take_json_files_and_keywords(tmp_path):
    path = tmp_path / "enc.json"
    path.write_text(json.dumps(dict(n_layers=3, n_heads=2, query_dimensions=8,
                                    attention_type="improved-clustered",
                                    attention_params=dict(clusters=4, topk=3))))
    enc = fnn.build_encoder(str(path), dropout=0.0, final_norm=False)
    assert len(enc.layers) == 3 and enc.norm is None
    assert enc.layers[0].dropout.p == 0.0
    inner = enc.layers[0].attention.inner_attention
    assert inner.type == "improved-clustered" and inner.params == dict(clusters=4, topk=3)
    assert enc(torch.randn(2, 10, 16)).shape == (2, 10, 16)
    with pytest.raises(ValueError, match="unknown config key 'n_layer'.*n_layers"):
        fnn.build_encoder(n_layer=2)
    with pytest.raises(ValueError, match="not valid JSON"):
        fnn.build_encoder("{n_layers: 2}")


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="unknown attention type 'fulll'"):
        fnn.Attention("fulll")
    with pytest.raises(ValueError, match="has no parameter 'clusterz'.*clusters"):
        fnn.Attention("clustered", clusterz=3)
    with pytest.raises(ValueError, match="not divisible by n_heads=3"):
        fnn.AttentionLayer("full", d_model=8, n_heads=3)
    layer = fnn.AttentionLayer("full", d_model=8, n_heads=2)
    with pytest.raises(ValueError, match=r"queries must be \(N, L, 8\), got \(2, 5, 7\)"):
        layer(torch.randn(2, 5, 7))
    with pytest.raises(ValueError, match=r"keys must be \(N, L, 8\), got \(5, 8\)"):
        layer(torch.randn(2, 5, 8), torch.randn(5, 8))
    with pytest.raises(TypeError, match="key_lengths must be None, an integer tensor"):
        layer(torch.randn(1, 5, 8), key_lengths=[3])
    with pytest.raises(ValueError, match="has no recurrent form.*causal-linear, full"):
        fnn.RecurrentAttentionLayer("linear", d_model=8, n_heads=2)
    with pytest.raises(ValueError, match=r"lengths must lie in \[0, max_len=4\]"):
        fnn.LengthMask([5, 2], max_len=4)
    with pytest.raises(ValueError, match="activation must be one of"):
        fnn.build_encoder(activation="tanh")
    with pytest.raises(TypeError, match="attention must be a AttentionLayer, got RecurrentAtt"):
        fnn.TransformerEncoderLayer(fnn.RecurrentAttentionLayer("full", 8, 2), 8)
    twin = fnn.build_encoder(n_layers=2, n_heads=2, query_dimensions=4, recurrent=True)
    with pytest.raises(ValueError, match=r"state must hold one entry per layer \(2\), got 1"):
        twin(torch.randn(1, 8), state=[None])


def test_learned_types_refuse_training_mode():
    layer = fnn.AttentionLayer("clusterformer", d_model=8, n_heads=2)
    x = torch.randn(1, 6, 8)
    with pytest.raises(RuntimeError, match="learned parameters"):
        layer(x)
    assert layer.eval()(x).shape == x.shape


def test_training_mode_applies_dropout_and_eval_is_deterministic():
    enc = fnn.build_encoder(n_layers=1, n_heads=2, query_dimensions=4, dropout=0.5)
    x = torch.randn(2, 5, 8)
    assert not torch.equal(enc(x), enc(x))
    enc.eval()
    assert torch.equal(enc(x), enc(x))


@pytest.mark.skipif(not hasattr(torch, "compile"), reason="torch.compile needs torch 2.x")
def test_encoder_under_torch_compile():
    enc = fnn.build_encoder(n_layers=2, n_heads=2, query_dimensions=4,
                            attention_type="causal-linear").eval()
    x = torch.randn(2, 7, 8)
    compiled = torch.compile(enc, backend="eager", fullgraph=True)
    assert (compiled(x, causal=True) - enc(x, causal=True)).abs().max() < 1e-12


DDP_WORKER = textwrap.dedent(
    """
    import os, sys, torch, torch.distributed as dist
    import fastattn.nn as fnn
    rank, world, port, out = int(sys.argv[1]), 2, sys.argv[2], sys.argv[3]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    enc = fnn.build_encoder(n_layers=1, n_heads=2, query_dimensions=4, dropout=0.0,
                            attention_type="linear")
    model = torch.nn.parallel.DistributedDataParallel(enc)
    x = torch.randn(4, 6, 8)
    model(x[2 * rank:2 * rank + 2]).pow(2).mean().backward()
    if rank == 0:
        torch.save([p.grad for p in enc.parameters()], out)
    # Both ranks done, then out without running static destructors: about
    # one run in ten, a rank's exit after destroy_process_group aborted with
    # "terminate called without an active exception" (a thread of torch's
    # gloo process group still joinable), after the gradients were saved.
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
    """
)


def test_distributed_data_parallel_averages_the_gradients(tmp_path):
    worker = tmp_path / "worker.py"
    worker.write_text(DDP_WORKER)
    out = tmp_path / "grads.pt"
    port = str(29500 + os.getpid() % 1000)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(worker), str(r), port, str(out)], env=env,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    errors = [p.communicate(timeout=120)[1] for p in procs]
    assert all(p.returncode == 0 for p in procs), errors
    torch.manual_seed(0)
    enc = fnn.build_encoder(n_layers=1, n_heads=2, query_dimensions=4, dropout=0.0,
                            attention_type="linear")
    x = torch.randn(4, 6, 8)
    # The mean over ranks of each half's mean loss is the whole batch's mean loss.
    enc(x).pow(2).mean().backward()
    for got, p in zip(torch.load(out), enc.parameters()):
        assert (got - p.grad).abs().max() < 1e-10


HAVE_CUDA = bool(fastattn.build_info.get("cuda")) and torch.cuda.is_available()


@pytest.mark.skipif(not HAVE_CUDA, reason="no CUDA operators built, or no GPU")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 0.1)])
def test_modules_on_cuda_match_the_cpu_in_float64(dtype, tol):
    config = dict(n_layers=2, n_heads=2, query_dimensions=16, dropout=0.0,
                  self_attention_type="causal-linear", cross_attention_type="full")
    cpu = fnn.build_decoder(config).eval()
    gpu = fnn.build_decoder(config).eval()
    gpu.load_state_dict(cpu.state_dict())
    gpu.to("cuda", dtype)
    x, memory = torch.randn(2, 40, 32), torch.randn(2, 50, 32)
    lengths = torch.tensor([50, 31])
    want = cpu(x, memory, memory_lengths=lengths)
    xg = x.to("cuda", dtype).requires_grad_(True)
    got = gpu(xg, memory.to("cuda", dtype), memory_lengths=lengths.cuda())
    assert (got.double().cpu() - want).abs().max() < tol
    got.float().pow(2).sum().backward()
    assert torch.isfinite(xg.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in gpu.parameters())
    twin = fnn.build_decoder(config, recurrent=True).eval()
    twin.load_state_dict(cpu.state_dict())
    twin.to("cuda", dtype)
    state = None
    with torch.no_grad():
        for t in range(5):
            y, state = twin(xg[:, t].detach(), memory.to("cuda", dtype), lengths.cuda(), state)
            assert (y.double().cpu() - want[:, t]).abs().max() < tol, t


@pytest.mark.skipif(not HAVE_CUDA, reason="no CUDA operators built, or no GPU")
def test_every_type_runs_in_a_layer_on_cuda():
    x = torch.randn(2, 128, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    lengths = torch.tensor([128, 77], device="cuda")
    for spec in fastattn.attention_types()["types"]:
        name = spec["name"]
        layer = fnn.AttentionLayer(name, d_model=64, n_heads=4).eval().to("cuda", torch.bfloat16)
        out = layer(x, key_lengths=lengths, causal=name.startswith("causal"))
        out.float().sum().backward()
        assert out.shape == x.shape and torch.isfinite(out).all(), name
        assert torch.isfinite(x.grad).all(), name
        x.grad = None
