"""fast_transformers.utils: helpers for fast_transformers modules."""

__all__ = ["make_mirror"]


def make_mirror(src_module, dst_module):
    """Makes dst_module use src_module's parameters (the same tensors, so that
    training one trains both), e.g. a recurrent twin of a batch transformer
    for decoding. Parameters are matched by name; dst_module changes in place.
    A name src_module has and dst_module lacks raises AttributeError."""
    for name, param in src_module.named_parameters():
        *path, leaf = name.split(".")
        owner = dst_module
        for part in path:
            owner = getattr(owner, part)
        setattr(owner, leaf, param)
