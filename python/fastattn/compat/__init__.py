"""Compatibility layers for programs written against other libraries.

- :mod:`fastattn.compat.fast_transformers`: the public API of the papers'
  reference implementation, fast-transformers 0.4 (docs/python.md, "compat").
"""
