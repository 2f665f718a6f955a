"""Element order: the kernels see a dense tensor as one flat run of storage, in whatever dimension
order it is laid out (contiguous, channels_last, any permutation)."""

from __future__ import annotations

import torch


def is_dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: its elements fill one block of storage, in some dimension order."""
    expected = 1
    for stride, size in sorted((s, n) for s, n in zip(t.stride(), t.shape, strict=True) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def flat(t: torch.Tensor) -> torch.Tensor:
    """A 1-D view of a dense tensor in storage order."""
    return t.view(-1) if t.is_contiguous() else t.as_strided((t.numel(),), (1,), t.storage_offset())


def shaped_like(flat_t: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Inverse of flat for a fresh buffer: `flat_t` seen with ref's shape and strides."""
    return flat_t.as_strided(ref.shape, ref.stride())


def like(t: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """t laid out with ref's strides, so both flatten to the same element order."""
    return t if t.stride() == ref.stride() else torch.empty_like(ref, dtype=t.dtype).copy_(t)
