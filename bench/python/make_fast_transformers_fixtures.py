#!/usr/bin/env python3
"""Runs tests/python/fast_transformers_programs.py's programs on the
reference, fast-transformers 0.4.0 (built as bench/python/bench_fast_transformers.py
says, in /tmp/ft), and stores each program's inputs, weights and outputs in
tests/python/fixtures/fast_transformers/<program>.pt; the drop-in is then
tested against them in CI (tests/python/test_compat_fast_transformers_fixtures.py)
without the reference. Not run by the tests: it needs the reference built.

  PYTHONPATH=/tmp/ft .venv/bin/python bench/python/make_fast_transformers_fixtures.py \
      [--only NAME ...]

Also prints, per program, the largest difference between the reference's
outputs and the drop-in's on the same fixture (the check CI repeats).
"""

import argparse
import importlib
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))

import fast_transformers_programs as programs  # noqa: E402

OUT = os.path.join(ROOT, "tests", "python", "fixtures", "fast_transformers")


def package(root):
    return lambda name: importlib.import_module(root + "." + name)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", nargs="*")
    args = p.parse_args()
    import fast_transformers

    assert "fastattn" not in fast_transformers.__file__, fast_transformers.__file__
    reference = package("fast_transformers")
    dropin = package("fastattn.compat.fast_transformers")
    os.makedirs(OUT, exist_ok=True)
    print("# reference: %s, torch %s" % (fast_transformers.__file__, torch.__version__))
    for name, run in programs.PROGRAMS.items():
        if args.only and name not in args.only:
            continue
        torch.manual_seed(0)
        fixture = {}
        outputs = run(reference, fixture)
        fixture = {"inputs": fixture, "outputs": outputs}
        torch.save(fixture, os.path.join(OUT, name + ".pt"))
        ours = run(dropin, dict(fixture["inputs"]))
        diff = max(float((ours[k].double() - v.double()).abs().max()) for k, v in outputs.items())
        print("%-36s max |drop-in - reference| = %.2e" % (name, diff))


if __name__ == "__main__":
    main()
