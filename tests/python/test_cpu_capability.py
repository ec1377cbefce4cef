"""The CPU kernels' instruction set from Python: the level in use, the
supported ones, choosing a lower one, and the same outputs at every level
(full attention here; every type is compared in C++, test_cpu_isa.cpp)."""
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
    assert set(levels) <= {"default", "avx2", "avx512"}
    assert fastattn.cpu_capability() in levels
    for level in levels:
        fastattn.set_cpu_capability(level)
        assert fastattn.cpu_capability() == level


def test_bad_levels_are_named(restore_level):
    with pytest.raises(RuntimeError, match="expected one of default, avx2, avx512; got 'avx9'"):
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
    assert "FASTATTN_CPU_CAPABILITY: expected one of default, avx2, avx512; got 'bogus'" in out.stderr
