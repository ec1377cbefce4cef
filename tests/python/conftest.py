"""Shared fixtures of the Python suite."""

import pytest
import torch


@pytest.fixture
def float64_and_seeded():
    """Modules and tensors made in float64 (the references' precision), seed 0."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    yield
    torch.set_default_dtype(before)
