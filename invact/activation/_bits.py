"""Branch bits: pack/unpack (LSB first: element i is bit i % 8 of byte i // 8) and the precision-bit
variant, where the bit replaces the lowest mantissa bit of y itself. Plain torch ops, any device."""

from __future__ import annotations

import torch

# Multiplying 8 bytes that are each 0 or 1 (one int64, byte k = element k) by this constant puts
# element k at bit 56 + k; the other partial products land below bit 56 or past bit 63, at distinct
# positions, so nothing carries into the top byte. Written as the int64 with the same bits.
_GATHER = 0x0102040810204080
_INT_OF = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def packed_size(n: int) -> int:
    return (n + 7) // 8


def pack(mask: torch.Tensor) -> torch.Tensor:
    """1-D bool (n,) -> uint8 (ceil(n/8),)."""
    n = mask.numel()
    if not isinstance(n, int):  # a symbolic size (torch.compile's dynamic shapes)
        return pack_indexed(mask)
    pad = (-n) % 8
    if pad:
        mask = torch.cat([mask, mask.new_zeros(pad)])
    return ((mask.view(torch.uint8).view(torch.int64) * _GATHER) >> 56).to(torch.uint8)


def pack_indexed(mask: torch.Tensor) -> torch.Tensor:
    """pack in ops a compiled graph takes: no view of bool as bytes (torch 2.11's inductor cannot lower
    one) and, for a symbolic n, no guard on it: the last byte's missing elements are read as 0 by an
    index past the end, not appended as a tensor of (-n) % 8 elements (whose size, 0 or not, a traced
    graph would guard on: one graph per residue of n mod 8)."""
    n = mask.numel()
    index = torch.arange(packed_size(n) * 8, device=mask.device)
    inside = index < n
    flags = (mask[index.clamp(max=n - 1)] & inside).view(-1, 8).to(torch.uint8)
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=mask.device)
    return (flags * weights).sum(dim=1, dtype=torch.uint8)


def unpack(bits: torch.Tensor, n: int) -> torch.Tensor:
    """uint8 (ceil(n/8),) -> bool (n,)."""
    shifts = torch.arange(8, device=bits.device, dtype=torch.uint8)
    return ((bits.unsqueeze(-1) >> shifts) & 1).view(-1)[:n].bool()


def int_view(y: torch.Tensor) -> torch.Tensor:
    """y's bits as a signed integer tensor of the same width (no copy)."""
    return y.view(_INT_OF[y.dtype])


def with_lsb(y: torch.Tensor, bit: torch.Tensor) -> torch.Tensor:
    """y with its lowest mantissa bit replaced by `bit` (bool, same shape), as a new tensor: y itself
    may be held elsewhere (selective checkpointing caches the activation's output and checks that
    nobody modified it). Moves each value by at most 1 ulp."""
    return ((int_view(y) & -2) | bit).view(y.dtype)


def lsb(y: torch.Tensor) -> torch.Tensor:
    """The bit stored by with_lsb, as bool."""
    return (int_view(y) & 1).bool()


def supports_precision_bit(dtype: torch.dtype) -> bool:
    return dtype in _INT_OF


def is_left(x: torch.Tensor, threshold: float) -> torch.Tensor:
    """The branch bit, x < T, compared in fp32 for half types (as the Triton kernels do), else in x's
    dtype."""
    xs = x if x.dtype in (torch.float32, torch.float64) else x.float()
    return xs < threshold
