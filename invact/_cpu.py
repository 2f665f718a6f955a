"""The fused CPU backward: one numba kernel per activation, compiled from the generated fp32 scalar
functions (invact/_generated/<act>_cpu.py). Optional: without numba the torch backend falls back
to the generated torch functions (correct, ~15x slower than torch's own backward).

Kernels read y, the branch bits and dy, and write dx in one parallel pass, in fp32. Half-precision
tensors are converted to fp32 around the kernel (numba has no bf16). First call per activation and
kernel: ~1-2 s of compilation (reported by benchmarks/speed.py); later calls in the process are free.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util

import torch


@functools.cache
def available() -> bool:
    """numba is installed (imported only when the first CPU backward runs: it loads scipy if present)."""
    return importlib.util.find_spec("numba") is not None


@functools.cache
def _kernels(activation: str):
    import numba
    import numpy as np

    _INF, _NAN = np.float32(np.inf), np.float32(np.nan)  # non-finite y (x = +-inf or NaN): NaN, as torch

    gen = importlib.import_module(f"invact._generated.{activation}_cpu")
    q_left = numba.njit(inline="always")(gen.q_left_scalar)
    q_right = numba.njit(inline="always")(gen.q_right_scalar)

    @numba.njit(parallel=True)
    def packed(y, bits, dy, dx):  # pragma: no cover - runs compiled
        for i in numba.prange(y.size):
            bit = (bits[i >> 3] >> (i & 7)) & 1
            left, right = q_left(y[i]), q_right(y[i])  # both, then select: branch-free, vectorizes
            q = left if bit else right
            dx[i] = dy[i] * (q if abs(y[i]) < _INF else _NAN)

    @numba.njit(parallel=True)
    def per_element(y, mask, dy, dx):  # pragma: no cover - runs compiled
        for i in numba.prange(y.size):
            left, right = q_left(y[i]), q_right(y[i])
            q = left if mask[i] else right
            dx[i] = dy[i] * (q if abs(y[i]) < _INF else _NAN)

    return packed, per_element


def backward(activation: str, y: torch.Tensor, dy: torch.Tensor, bits=None, mask=None) -> torch.Tensor:
    """dx = dy * q(y, bit) for flat CPU tensors; `bits` packed uint8 or `mask` bool (one per element)."""
    packed, per_element = _kernels(activation)
    y32, dy32 = y.float().contiguous(), dy.float().contiguous()
    dx32 = torch.empty_like(y32)
    if bits is not None:
        packed(y32.numpy(), bits.numpy(), dy32.numpy(), dx32.numpy())
    else:
        per_element(y32.numpy(), mask.contiguous().view(torch.uint8).numpy(), dy32.numpy(), dx32.numpy())
    return dx32.to(dy.dtype)
