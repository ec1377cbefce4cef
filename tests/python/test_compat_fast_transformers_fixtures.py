"""The drop-in against fast-transformers' own outputs (issue 63): the
programs of fast_transformers_programs.py, written against the reference's
documented API, run on fastattn.compat.fast_transformers with the inputs and
weights the reference run stored (bench/python/make_fast_transformers_fixtures.py,
fast-transformers 0.4.0) and must give its outputs to float32 tolerance.
"""

import importlib
import os

import pytest
import torch

import fast_transformers_programs as programs

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "fast_transformers")


def test_every_program_has_a_fixture():
    stored = {f[:-3] for f in os.listdir(FIXTURES) if f.endswith(".pt")}
    assert stored == set(programs.PROGRAMS)


@pytest.mark.parametrize("name", sorted(programs.PROGRAMS))
def test_program_gives_the_reference_outputs(name):
    fixture = torch.load(os.path.join(FIXTURES, name + ".pt"))
    def dropin(sub):
        return importlib.import_module("fastattn.compat.fast_transformers." + sub)

    inputs = dict(fixture["inputs"])
    outputs = programs.PROGRAMS[name](dropin, inputs)
    assert inputs.keys() == fixture["inputs"].keys()  # nothing made afresh
    assert outputs.keys() == fixture["outputs"].keys()
    for key, want in fixture["outputs"].items():
        torch.testing.assert_close(outputs[key], want, rtol=1e-4, atol=2e-5,
                                   msg=lambda m: "%s[%s]: %s" % (name, key, m))
