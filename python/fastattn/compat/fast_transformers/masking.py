"""fast_transformers.masking: FullMask, LengthMask, TriangularCausalMask.

The masks of fast-transformers 0.4: boolean matrices (True keeps) with
``bool_matrix``, ``float_matrix``, ``additive_matrix``, ``lengths``,
``all_ones`` and ``lower_triangular`` views. The layers of this package turn
them into fastattn's ``attn_mask`` / ``key_lengths`` / ``causal`` arguments.
"""

import torch

from ...nn.masking import FullMask as _NnFullMask

__all__ = ["BaseMask", "FullMask", "LengthMask", "TriangularCausalMask"]


class BaseMask:
    """A boolean (N, M) matrix and the views fast-transformers programs read."""

    @property
    def bool_matrix(self):
        raise NotImplementedError()

    @property
    def shape(self):
        return self.bool_matrix.shape

    @property
    def float_matrix(self):
        """1.0 where kept, 0.0 where masked."""
        return self.bool_matrix.float()

    @property
    def lengths(self):
        """The number of kept positions per row, for a length mask (each row
        kept positions first, then masked ones); ValueError otherwise, as in
        fast-transformers."""
        m = self.bool_matrix
        lengths = m.long().sum(dim=-1)
        prefix = torch.arange(m.shape[-1], device=m.device) < lengths.unsqueeze(-1)
        if not torch.equal(prefix, m):
            raise ValueError("The mask is not a length mask: a row keeps a position after a "
                             "masked one")
        return lengths

    @property
    def additive_matrix(self):
        """0 where kept, -inf where masked."""
        return torch.log(self.float_matrix)

    @property
    def additive_matrix_finite(self):
        """0 where kept, -1e24 where masked."""
        return (~self.bool_matrix).float() * (-1e24)

    @property
    def all_ones(self):
        return bool(self.bool_matrix.all())

    @property
    def lower_triangular(self):
        """True for a length mask whose lengths are 1, 2, ..., N (the causal
        mask), as in fast-transformers; False for any other mask."""
        try:
            lengths = self.lengths
        except ValueError:
            return False
        return lengths.dim() == 1 and torch.equal(
            lengths, torch.arange(1, lengths.numel() + 1, device=lengths.device))


class FullMask(_NnFullMask, BaseMask):
    """A boolean (N, M) attention matrix; all True when only sizes are given
    (made only if ``bool_matrix`` is read).

    ``FullMask(mask=None, N=None, M=None, device="cpu")``; as in
    fast-transformers, an int as the first argument is N (``FullMask(L)``).
    """

    def __init__(self, mask=None, N=None, M=None, device="cpu"):
        if isinstance(mask, int):  # FullMask(N), FullMask(N, M)
            mask, N, M = None, mask, (N if M is None else M)
        if mask is None and N is None:
            raise ValueError("FullMask: give either mask or N (and optionally M)")
        if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dim() != 2):
            raise ValueError("FullMask: mask must be a 2-D bool tensor (True keeps), got %s"
                             % (tuple(mask.shape) if isinstance(mask, torch.Tensor) else mask))
        super().__init__(mask, N, M, device)

    @property
    def shape(self):
        return torch.Size(self._shape) if self._mask is None else self._mask.shape


class LengthMask(BaseMask):
    """Sequence n holds ``lengths[n]`` real positions, padded to ``max_len``.

    ``LengthMask(lengths, max_len=None, device=None)``.
    """

    def __init__(self, lengths, max_len=None, device=None):
        if not isinstance(lengths, torch.Tensor):
            lengths = torch.as_tensor(lengths, dtype=torch.long, device=device)
        elif device is not None:
            lengths = lengths.to(device)
        if lengths.dim() != 1 or lengths.is_floating_point():
            raise ValueError("LengthMask: lengths must be an integer tensor (N,), got %s of shape %s"
                             % (lengths.dtype, tuple(lengths.shape)))
        self._lengths = lengths.long()
        longest = int(self._lengths.max()) if self._lengths.numel() else 0
        self.max_len = int(max_len) if max_len is not None else longest
        if longest > self.max_len or (self._lengths.numel() and int(self._lengths.min()) < 0):
            raise ValueError("LengthMask: lengths must lie in [0, max_len=%d], got %s"
                             % (self.max_len, self._lengths.tolist()))

    @property
    def lengths(self):
        return self._lengths

    @property
    def bool_matrix(self):
        positions = torch.arange(self.max_len, device=self._lengths.device)
        return positions[None, :] < self._lengths[:, None]

    @property
    def all_ones(self):
        return bool((self._lengths == self.max_len).all())


class TriangularCausalMask(BaseMask):
    """Position i sees positions j <= i: ``TriangularCausalMask(N, device="cpu")``."""

    def __init__(self, N, device="cpu"):
        self.N = int(N)
        self.device = device

    @property
    def bool_matrix(self):
        return torch.ones(self.N, self.N, dtype=torch.bool, device=self.device).tril()

    @property
    def lengths(self):
        return torch.arange(1, self.N + 1, device=self.device)

    @property
    def all_ones(self):
        return self.N <= 1

    @property
    def lower_triangular(self):
        return True
