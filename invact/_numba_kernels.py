"""The numba kernels every activation shares: bit packing for the forward and precision-bit mode's
one-pass bit setting (each activation's backward kernel unpacks its bits itself, span by span:
invact._cpu_math.unpack_bits). Module-level functions with cache=True: numba compiles
each once per machine and stores the machine code on disk (next to this file, or in its user-wide
cache directory where that is not writable; NUMBA_CACHE_DIR overrides), and later processes load it
instead of compiling. Imported by invact._numba on the first CPU call only (it imports numba).
"""

from __future__ import annotations

import numba
import numpy as np

_CLEAR_LSB = np.int32(-2)  # all but the lowest bit; an int literal would be int64 (no vectorizing)


# Eight bytes b_k (0 or 1) of a little-endian uint64 v = sum b_k 2^(8k), times this, put b_k at bit
# 56 + k: the term b_k 2^(8k) * 2^(56 - 7j) lands at 56 + k + 7(k - j), in the top byte only for
# j = k, and no two terms share a position (so nothing carries into it). >> 56 leaves the byte
# sum b_k 2^k: the eight flags packed LSB first.
_GATHER_BITS = np.uint64(0x0102040810204080)
_TOP_BYTE = np.uint64(56)


@numba.njit(parallel=True, cache=True)
def less(x, threshold, flags):  # pragma: no cover - runs compiled
    """flags[i] = x[i] < threshold (one byte each), the first of pack_less's two passes."""
    for i in numba.prange(x.size):
        flags[i] = x[i] < threshold


@numba.njit(parallel=True, cache=True)
def pack_flags(flags, words, out):  # pragma: no cover - runs compiled
    """out = `flags` (one 0/1 byte per element) packed LSB first, eight flags (one uint64 of `words`,
    flags' first 8 (size // 8) bytes viewed by numpy, as for unpack) into each byte by one multiply.
    With `less` before it: two passes over contiguous memory, both vectorized (one pass that loaded
    eight strided elements per byte ran 8x slower)."""
    full = flags.size // 8
    for b in numba.prange(full):
        out[b] = np.uint8((words[b] * _GATHER_BITS) >> _TOP_BYTE)
    if flags.size > 8 * full:
        v = 0
        for i in range(8 * full, flags.size):
            v |= flags[i] << (i - 8 * full)
        out[full] = v


@numba.njit(parallel=True, cache=True)
def set_lsb_less(x, y_int, threshold):  # pragma: no cover - runs compiled
    """The lowest bit of each y (as int32) := x < threshold, in place."""
    for i in numba.prange(x.size):
        y_int[i] = (y_int[i] & _CLEAR_LSB) | np.int32(x[i] < threshold)
