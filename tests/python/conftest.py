"""Shared fixtures of the Python suite."""

import os
import tempfile

# Inductor caches compiled graphs on disk (/tmp/torchinductor_<user>) keyed
# without the custom operators' fake implementations: a graph compiled by an
# earlier build asserts the output strides that build's fakes promised. Each
# run compiles afresh in its own directory.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="fastattn-inductor-"))

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture
def float64_and_seeded():
    """Modules and tensors made in float64 (the references' precision), seed 0."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    yield
    torch.set_default_dtype(before)
