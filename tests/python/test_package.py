"""The installed package: what it was built against, and refusing another torch.

- ``fastattn.build_info`` records the torch the library was built against;
  it is the running torch's release.
- A library whose record names another torch release, or CUDA operators
  under a torch without CUDA, is refused at import with both versions and the
  command that rebuilds (run in a subprocess, with FASTATTN_LIBRARY pointing
  at a copy of the library beside an altered record).
- The library links only the running torch's libraries (no second LibTorch,
  e.g. Debian's 1.13 beside a pip torch 2.x).
- Every registered type runs forward and backward through fastattn.attention.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import fastattn


def test_build_info_names_the_running_torch_release():
    built = fastattn.build_info.get("torch")
    assert built, fastattn.build_info
    assert built.split("+")[0].split(".")[:2] == torch.__version__.split("+")[0].split(".")[:2]
    assert fastattn.__version__ == fastattn.build_info["fastattn"]


def import_with_record(tmp_path, record):
    """`import fastattn` in a fresh interpreter, loading a copy of the library
    beside the given build record; returns (returncode, stderr)."""
    lib = tmp_path / "libfastattn.so"
    shutil.copy(fastattn.library_path, lib)
    (tmp_path / "fastattn_build.json").write_text(json.dumps(record))
    pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(fastattn.__file__)))
    env = dict(os.environ, FASTATTN_LIBRARY=str(lib),
               PYTHONPATH=pkg_parent + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", "import fastattn"], env=env, capture_output=True,
                       text=True, timeout=300)
    return r.returncode, r.stderr


def test_import_into_another_torch_release_is_refused(tmp_path):
    other = "1.2.3+cu999"
    rc, err = import_with_record(tmp_path, dict(fastattn="0.0.0", torch=other, cuda=False))
    assert rc != 0
    assert "ImportError" in err
    assert other in err and torch.__version__ in err, err
    assert "pip install --no-build-isolation" in err, err


def test_cuda_build_under_a_torch_without_cuda_is_refused(tmp_path):
    if torch.version.cuda is not None:
        pytest.skip("this torch has CUDA")
    rc, err = import_with_record(tmp_path, dict(fastattn="0.0.0", torch=torch.__version__,
                                                cuda=True))
    assert rc != 0 and "has no CUDA" in err, err


def test_matching_record_imports(tmp_path):
    rc, err = import_with_record(tmp_path, dict(fastattn="0.0.0", torch=torch.__version__,
                                                cuda=bool(fastattn.build_info.get("cuda"))))
    assert rc == 0, err


def test_links_only_the_running_torch():
    if shutil.which("ldd") is None:
        pytest.skip("no ldd")
    torch_lib = os.path.realpath(os.path.join(os.path.dirname(torch.__file__), "lib"))
    # pip's torch carries its libraries; Debian's torch/lib links to /usr/lib.
    bundled = os.path.realpath(os.path.join(torch_lib, "libc10.so")).startswith(torch_lib + os.sep)
    release = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    out = subprocess.run(["ldd", fastattn.library_path], capture_output=True, text=True).stdout
    torch_libs = [l for l in out.splitlines() if "libtorch" in l or "libc10" in l]
    assert torch_libs, out
    for line in torch_libs:
        path = os.path.realpath(line.split("=>")[-1].split("(")[0].strip())
        if bundled:
            assert path.startswith(torch_lib + os.sep), (line, torch_lib)
        else:  # Debian's torch: the system libraries of its release (libc10.so.1.13)
            assert ".so." + release in path, (line, release)


def small_inputs(type_name):
    g = torch.Generator().manual_seed(0)
    L = 16
    q, k, v = (torch.randn(2, 2, L, 8, generator=g, dtype=torch.float64) for _ in range(3))
    return [t.requires_grad_() for t in (q, k, v)]


@pytest.mark.parametrize("name", [t["name"] for t in fastattn.attention_types()["types"]])
def test_every_type_runs_forward_and_backward(name):
    params = {"clusters": 3} if "cluster" in name else {}
    if name in ("improved-clustered", "causal-improved-clustered"):
        params["topk"] = 4
    q, k, v = small_inputs(name)
    out = fastattn.attention(name, q, k, v, causal=name.startswith("causal"), **params)
    assert out.shape == (2, 2, 16, 8) and torch.isfinite(out).all()
    out.square().sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
    assert v.grad is not None and v.grad.abs().sum() > 0


def test_the_package_holds_every_module_of_the_source_tree():
    # A pip-installed package must hold every .py file of python/fastattn (an
    # exclude pattern once dropped nn/builders.py from the wheel). Where the
    # tests import the source tree itself, the comparison is trivially true.
    source = os.path.join(os.path.dirname(__file__), "..", "..", "python", "fastattn")
    package = os.path.dirname(os.path.abspath(fastattn.__file__))

    def modules(root):
        return {os.path.relpath(os.path.join(d, f), root)
                for d, _, files in os.walk(root) for f in files if f.endswith(".py")}

    assert modules(source), source
    missing = sorted(modules(source) - modules(package))
    assert not missing, "installed package %s lacks %s" % (package, missing)
