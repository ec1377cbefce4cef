"""Mask objects for the modules of :mod:`fastattn.nn`.

fastattn's operators take three independent masks: a boolean or additive
``attn_mask`` over (query, key) pairs, ``key_lengths`` (padding at the end of
each sequence) and ``causal``. The classes here carry one each, so that a
program can build its masks once and hand them to a layer; every layer also
takes the plain tensors and flags.

- :class:`FullMask`: a boolean (L, S) or (N, L, S) matrix, True keeps; with no
  matrix every key is kept (``all_ones``), which the layers pass on as no mask.
- :class:`LengthMask`: ``lengths`` (N,) of the key sequences; keys at
  positions ``>= lengths[n]`` are padding.
- :class:`TriangularCausalMask`: query i sees keys ``j <= i`` (``causal=True``).
"""

import torch

__all__ = ["FullMask", "LengthMask", "TriangularCausalMask", "resolve_masks"]


class FullMask:
    """A boolean attention matrix (True keeps), or none at all.

    Args:
        mask: a bool tensor ``(L, S)`` or ``(N, L, S)``; ``None`` keeps every key.
        N, M: with no ``mask``, the matrix ``(N, M)`` of all True that
            :attr:`bool_matrix` returns (``M`` defaults to ``N``).
        device: where that matrix is made.
    """

    def __init__(self, mask=None, N=None, M=None, device="cpu"):
        if mask is not None:
            if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
                raise TypeError(
                    "FullMask: mask must be a bool tensor (True keeps), got %s"
                    % (mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__)
                )
            if mask.dim() not in (2, 3):
                raise ValueError(
                    "FullMask: mask must be (L, S) or (N, L, S), got shape %s" % tuple(mask.shape)
                )
        self._mask = mask
        # Sizes alone: every key kept; the (N, M) matrix is made only when
        # bool_matrix is read, never to decide all_ones (an L x L bool tensor
        # per forward at long L).
        self._shape = (N, M if M is not None else N) if mask is None and N is not None else None
        self._device = device

    @property
    def bool_matrix(self):
        """The boolean matrix (None for a mask made with no arguments)."""
        if self._mask is None and self._shape is not None:
            return torch.ones(self._shape, dtype=torch.bool, device=self._device)
        return self._mask

    @property
    def all_ones(self):
        """True when no key is masked."""
        return self._mask is None or bool(self._mask.all())

    def __repr__(self):
        return "FullMask(%s)" % ("all" if self._mask is None else tuple(self._mask.shape))


class LengthMask:
    """Key padding: sequence n has ``lengths[n]`` real keys, then padding.

    Args:
        lengths: an integer tensor ``(N,)`` (or a list of ints) in ``[0, max_len]``.
        max_len: the padded length S; default ``max(lengths)``.
        device: where a list of lengths is put.
    """

    def __init__(self, lengths, max_len=None, device=None):
        if not isinstance(lengths, torch.Tensor):
            lengths = torch.as_tensor(lengths, dtype=torch.long, device=device)
        if lengths.dim() != 1 or lengths.is_floating_point() or lengths.dtype == torch.bool:
            raise ValueError(
                "LengthMask: lengths must be an integer tensor (N,), got %s of shape %s"
                % (lengths.dtype, tuple(lengths.shape))
            )
        lengths = lengths.long()
        longest = int(lengths.max()) if lengths.numel() else 0
        if max_len is None:
            max_len = longest
        if lengths.numel() and (int(lengths.min()) < 0 or longest > max_len):
            raise ValueError(
                "LengthMask: lengths must lie in [0, max_len=%d], got min %d, max %d"
                % (max_len, int(lengths.min()), longest)
            )
        self.lengths = lengths
        self.max_len = int(max_len)

    @property
    def bool_matrix(self):
        """``(N, max_len)``, True at the real positions."""
        positions = torch.arange(self.max_len, device=self.lengths.device)
        return positions[None, :] < self.lengths[:, None]

    @property
    def all_ones(self):
        return bool((self.lengths == self.max_len).all())

    def __repr__(self):
        return "LengthMask(lengths=%s, max_len=%d)" % (self.lengths.tolist(), self.max_len)


class TriangularCausalMask:
    """Causal attention: query i sees key j iff ``j <= i`` (aligned at the end
    when there are more keys than queries, as fastattn's ``causal``).

    Args:
        length: L, only used by :attr:`bool_matrix`.
        device: where :attr:`bool_matrix` is made.
    """

    causal = True

    def __init__(self, length=None, device="cpu"):
        self.length = length
        self.device = device

    @property
    def bool_matrix(self):
        if self.length is None:
            raise ValueError("TriangularCausalMask: bool_matrix needs the length it was made with")
        return torch.ones(self.length, self.length, dtype=torch.bool, device=self.device).tril()

    all_ones = False

    def __repr__(self):
        return "TriangularCausalMask(%s)" % ("" if self.length is None else self.length)


def resolve_masks(attn_mask=None, key_lengths=None, causal=False, where="attention"):
    """The operator's ``(attn_mask, key_lengths, causal)`` from tensors or mask objects.

    ``attn_mask`` may be None, a tensor (bool: True keeps; floating: added to
    the scores), a :class:`FullMask` or a :class:`TriangularCausalMask`;
    ``key_lengths`` None, an integer tensor ``(N,)`` or a :class:`LengthMask`.
    A FullMask that keeps everything becomes None, so that types without
    ``attn_mask`` support (linear, ...) accept it.
    """
    if isinstance(attn_mask, TriangularCausalMask):
        attn_mask, causal = None, True
    elif isinstance(attn_mask, FullMask):
        attn_mask = None if attn_mask.all_ones else attn_mask.bool_matrix
    elif attn_mask is not None and not isinstance(attn_mask, torch.Tensor):
        raise TypeError(
            "%s: attn_mask must be None, a tensor, FullMask or TriangularCausalMask, got %s"
            % (where, type(attn_mask).__name__)
        )
    if isinstance(key_lengths, LengthMask):
        key_lengths = key_lengths.lengths
    elif key_lengths is not None and not isinstance(key_lengths, torch.Tensor):
        raise TypeError(
            "%s: key_lengths must be None, an integer tensor (N,) or LengthMask, got %s"
            % (where, type(key_lengths).__name__)
        )
    return attn_mask, key_lengths, bool(causal)
