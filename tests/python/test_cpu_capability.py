"""The CPU kernels' instruction set from Python: the level in use, the
supported ones, choosing a lower one, and the same outputs at every level
(full attention here; every type is compared in C++, test_cpu_isa.cpp).
Then the CPU output cache: reuse, emptying, FASTATTN_CPU_CACHE_MB."""
import os
import subprocess
import sys

import pytest
import torch

import fastattn


@pytest.fixture
def restore_level():
    saved = fastattn.cpu_capability()
    yield
    fastattn.set_cpu_capability(saved)


def test_levels_listed_and_settable(restore_level):
    levels = fastattn.supported_cpu_capabilities()
    assert levels[0] == "default"
    assert set(levels) <= {"default", "avx2", "avx512", "avx512_bf16", "amx"}
    assert fastattn.cpu_capability() in levels
    for level in levels:
        fastattn.set_cpu_capability(level)
        assert fastattn.cpu_capability() == level


def test_bad_levels_are_named(restore_level):
    with pytest.raises(RuntimeError, match="expected one of default, avx2, avx512, avx512_bf16, amx; got 'avx9'"):
        fastattn.set_cpu_capability("avx9")
    with pytest.raises(TypeError, match="level must be a str, got int"):
        fastattn.set_cpu_capability(2)


def test_full_attention_equal_at_every_level(restore_level):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 37, 40, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    ref = torch.softmax(q @ k.transpose(-1, -2) / 40 ** 0.5, -1) @ v
    for level in fastattn.supported_cpu_capabilities():
        fastattn.set_cpu_capability(level)
        out = fastattn.full_attention(q, k, v)
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10, msg=level)


def test_environment_variable_chooses_the_level():
    env = dict(os.environ, FASTATTN_CPU_CAPABILITY="default")
    code = "import fastattn; print(fastattn.cpu_capability())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "default"
    env["FASTATTN_CPU_CAPABILITY"] = "bogus"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode != 0
    assert "FASTATTN_CPU_CAPABILITY: expected one of default, avx2, avx512, avx512_bf16, amx; got 'bogus'" in out.stderr


def test_output_cache_keeps_freed_outputs_until_emptied():
    fastattn.empty_cpu_cache()
    assert fastattn.cpu_cache_bytes() == 0
    x = torch.randn(1, 8, 4096, 64)  # 8 MiB outputs
    out = torch.ops.fastattn.elu_feature_map(x)
    first = out.data_ptr()
    del out
    assert fastattn.cpu_cache_bytes() == 8 << 20
    out = torch.ops.fastattn.elu_feature_map(-x)
    assert out.data_ptr() == first
    torch.testing.assert_close(out, torch.nn.functional.elu(-x) + 1)
    del out
    fastattn.empty_cpu_cache()
    assert fastattn.cpu_cache_bytes() == 0


def _cache_bytes_after_one_output(mib):
    env = dict(os.environ, FASTATTN_CPU_CACHE_MB=mib)
    code = (
        "import torch, fastattn\n"
        "out = torch.ops.fastattn.elu_feature_map(torch.randn(1, 8, 4096, 64))\n"
        "del out\n"
        "print(fastattn.cpu_cache_bytes())"
    )
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)


@pytest.mark.parametrize("mib, held", [("0", 0), ("4", 0), ("8", 8 << 20), ("1024", 8 << 20)])
def test_output_cache_size_from_the_environment(mib, held):
    out = _cache_bytes_after_one_output(mib)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.strip()) == held


@pytest.mark.parametrize("mib", ["lots", "-1", "1.5", ""])
def test_output_cache_size_must_be_whole_mib(mib):
    out = _cache_bytes_after_one_output(mib)
    assert out.returncode != 0
    assert (
        f"FASTATTN_CPU_CACHE_MB must be a whole number of MiB >= 0 (0: no cache), got '{mib}'"
        in out.stderr
    )

