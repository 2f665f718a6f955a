"""The numba backend for CPU tensors: the backward, one kernel per activation compiled from its
numba view (fp32 scalar functions, invact/_generated/<act>_cpu.py), and the forward's bit packing
fused into one pass for float32. Same signature as the other backends (invact/_portable.py).
Optional: without numba, CPU tensors take the portable backend (correct, ~15x slower than torch's own
backward).

The backward reads y, one branch flag per element (none for a monotone activation) and dy, and
writes dx in fp32: one vectorized pass, then a fix-up of the rare left-tail elements (see _kernel).
Half-precision tensors are converted to fp32 around it (numba has no bf16). The first call per
activation compiles it (4 to 5 s on a 2-core machine; benchmarks/speed.py reports the first call);
later calls in the process are free.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from invact import _bits, _portable
from invact._layout import flat, like
from invact.activations import Activation


@functools.cache
def available() -> bool:
    """numba is installed (imported only when the first CPU backward runs: it loads scipy if present)."""
    return importlib.util.find_spec("numba") is not None


# Fast-math flags that keep IEEE semantics for NaN and inf (which the kernel relies on): FMA
# contraction, reassociation, reciprocal and approximate-function rewrites (results within 6e-7 of
# the strict build, tests/invact/test_functional.py compares them with the torch-op backward).
_FASTMATH = {"contract", "reassoc", "arcp", "afn"}
_BLOCK = 2**20  # elements per kernel call in bits mode: the unpacked flags (1 MB) are reused per block
# The left branch's later pieces (its tail, x << T: under 0.1% of N(0, 1) pre-activations) cost a
# log, a sqrt and a polynomial per element. The kernel evaluates the first piece everywhere, then
# redoes only the left elements outside it, checking blocks of this many elements.
_SKIP_BLOCK = 256


@functools.cache
def _kernel(act: Activation):
    """kernel(y, flags, dy, dx) for a two-branch activation; kernel(y, dy, dx) for a monotone one."""
    import numba
    import numpy as np

    gen = act.cpu
    q_right = numba.njit(inline="always", fastmath=_FASTMATH)(gen.q_right_scalar)
    inf, nan = np.float32(np.inf), np.float32(np.nan)

    if not hasattr(gen, "q_left_scalar"):  # monotone: one branch, no flags

        @numba.njit(parallel=True, fastmath=_FASTMATH)
        def monotone_kernel(y, dy, dx):  # pragma: no cover - runs compiled
            for i in numba.prange(y.size):  # q itself at y = +-inf (x = +-inf); NaN stays NaN
                dx[i] = dy[i] * (q_right(y[i]) if y[i] == y[i] else nan)

        return monotone_kernel

    q_left = numba.njit(inline="always", fastmath=_FASTMATH)(gen.q_left_scalar)
    has_first = hasattr(gen, "q_left_first_scalar")  # codegen emits it when the left branch is piecewise
    q_first = (
        numba.njit(inline="always", fastmath=_FASTMATH)(gen.q_left_first_scalar) if has_first else q_left
    )
    holds = numba.njit(inline="always")(gen.left_first_holds if has_first else lambda y: True)
    one = np.uint8(1)

    @numba.njit(parallel=True, fastmath=_FASTMATH)
    def kernel(y, flags, dy, dx):  # pragma: no cover - runs compiled
        for i in numba.prange(y.size):  # both branches, then a select: branch-free, so it vectorizes
            a, b = q_first(y[i]), q_right(y[i])  # the left branch's first piece stands in for it...
            q = a if flags[i] & 1 else b
            dx[i] = dy[i] * (q if abs(y[i]) < inf else nan)  # y = +-inf or NaN: NaN, as torch
        if has_first:  # ...and the rare left elements outside it are redone, block by block
            for block in numba.prange((y.size + _SKIP_BLOCK - 1) // _SKIP_BLOCK):
                lo, hi = block * _SKIP_BLOCK, min((block + 1) * _SKIP_BLOCK, y.size)
                rest = np.uint8(0)
                for i in range(lo, hi):  # branch-free test first: it vectorizes
                    rest |= (flags[i] & one) & (one ^ np.uint8(holds(y[i])))
                if rest:
                    for i in range(lo, hi):
                        if flags[i] & 1 and not holds(y[i]):
                            q = q_left(y[i])
                            dx[i] = dy[i] * (q if abs(y[i]) < inf else nan)

    return kernel


@functools.cache
def _unpack_kernel():
    import numba

    @numba.njit(parallel=True)
    def unpack(bits, n, out):  # pragma: no cover - runs compiled
        full = n // 8
        for b in numba.prange(full):  # eight explicit stores: a loop over k would not vectorize
            v, s = bits[b], 8 * b
            out[s], out[s + 1], out[s + 2], out[s + 3] = v & 1, (v >> 1) & 1, (v >> 2) & 1, (v >> 3) & 1
            out[s + 4], out[s + 5], out[s + 6], out[s + 7] = (v >> 4) & 1, (v >> 5) & 1, (v >> 6) & 1, v >> 7
        for i in range(8 * full, n):
            out[i] = (bits[full] >> (i - 8 * full)) & 1

    return unpack


@functools.cache
def _pack_kernel():
    import numba

    @numba.njit(parallel=True)
    def pack_less(x, threshold, out):  # pragma: no cover - runs compiled
        full = x.size // 8
        for b in numba.prange(full):  # one byte from eight explicit compares (vectorizes)
            s = 8 * b
            t = threshold
            lo = (x[s] < t) | ((x[s + 1] < t) << 1) | ((x[s + 2] < t) << 2) | ((x[s + 3] < t) << 3)
            hi = ((x[s + 4] < t) << 4) | ((x[s + 5] < t) << 5) | ((x[s + 6] < t) << 6) | ((x[s + 7] < t) << 7)
            out[b] = lo | hi
        if x.size > 8 * full:
            v = 0
            for i in range(8 * full, x.size):
                v |= (x[i] < threshold) << (i - 8 * full)
            out[full] = v

    return pack_less


@functools.cache
def _lsb_kernel():
    import numba
    import numpy as np

    clear = np.int32(-2)  # all but the lowest bit; an int literal would be int64 (no vectorizing)

    @numba.njit(parallel=True)
    def set_lsb_less(x, y_int, threshold):  # pragma: no cover - runs compiled
        for i in numba.prange(x.size):
            y_int[i] = (y_int[i] & clear) | np.int32(x[i] < threshold)

    return set_lsb_less


def set_lsb_less_(y: torch.Tensor, x: torch.Tensor, threshold: float) -> torch.Tensor:
    """Precision-bit mode in one pass: y's lowest mantissa bit := x < threshold, in place, for flat
    contiguous float32 CPU tensors (the bool mask then two bitwise passes: three passes)."""
    import numpy as np

    _lsb_kernel()(x.numpy(), y.view(torch.int32).numpy(), np.float32(threshold))
    return y


def pack_less(x: torch.Tensor, threshold: float) -> torch.Tensor:
    """The packed bits of x < threshold (LSB first) for a flat contiguous float32 CPU tensor, in one
    pass (the bool mask then _bits.pack: three passes, measured 3.4 -> 1.0 ms on 2^22 elements).
    The threshold is rounded to float32 first, as torch does when it compares with a Python float."""
    import numpy as np

    out = torch.empty((x.numel() + 7) // 8, dtype=torch.uint8)
    _pack_kernel()(x.numpy(), np.float32(threshold), out.numpy())
    return out


def forward(act: Activation, x: torch.Tensor, precision_bit: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's forward, then the bits in one fused pass for float32 (other dtypes: the portable
    forward's)."""
    if x.dtype != torch.float32 or act.monotone:
        return _portable.forward(act, x, precision_bit)
    y = act.torch_forward(x)  # on x as given: torch's strided and contiguous paths round differently
    x_flat = flat(like(x, y))
    if precision_bit:  # y is ours: its lowest mantissa bit becomes the branch bit
        set_lsb_less_(flat(y), x_flat, act.threshold)
        return y, x.new_empty(0, dtype=torch.uint8)
    return y, pack_less(x_flat, act.threshold)


def backward(act: Activation, y: torch.Tensor, bits: torch.Tensor, dy: torch.Tensor, precision_bit: bool
             ) -> torch.Tensor:  # fmt: skip
    """dx = dy * q(y, bit) for flat CPU tensors. The bits come packed (`bits`, uint8, LSB first) or, in
    precision-bit mode, as y's own integer view, whose lowest bit is the branch bit; neither for a
    monotone activation. Packed bits are unpacked block by block into a small reused buffer: reading
    them inside the loop blocks vectorization (measured 8x slower), and one n-byte buffer per call
    costs ~1 ms of page faults."""
    flags = _bits.int_view(y) if precision_bit and not act.monotone else None
    bits = None if act.monotone or precision_bit else bits
    kernel = _kernel(act)
    y32, dy32 = y.float().contiguous(), dy.float().contiguous()
    dx32 = torch.empty_like(y32)
    n = y32.numel()
    arrays = y32.numpy(), dy32.numpy(), dx32.numpy()
    if bits is None and flags is None:
        kernel(*arrays)
        return dx32.to(dy.dtype)
    if flags is not None:
        kernel(arrays[0], flags.contiguous().numpy(), arrays[1], arrays[2])
        return dx32.to(dy.dtype)
    unpack = _unpack_kernel()
    scratch = torch.empty(min(n, _BLOCK), dtype=torch.uint8).numpy()
    bits_np = bits.numpy()
    for start in range(0, n, _BLOCK):
        stop = min(start + _BLOCK, n)
        unpack(bits_np[start // 8 : (stop + 7) // 8], stop - start, scratch)
        kernel(arrays[0][start:stop], scratch[: stop - start], arrays[1][start:stop], arrays[2][start:stop])
    return dx32.to(dy.dtype)
