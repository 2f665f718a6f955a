"""The numba kernels every activation shares: bit packing for the forward, unpacking for the backward,
and precision-bit mode's one-pass bit setting. Module-level functions with cache=True: numba compiles
each once per machine and stores the machine code on disk (next to this file, or in its user-wide
cache directory where that is not writable; NUMBA_CACHE_DIR overrides), and later processes load it
instead of compiling. Imported by invact._numba on the first CPU call only (it imports numba).
"""

from __future__ import annotations

import numba
import numpy as np

_CLEAR_LSB = np.int32(-2)  # all but the lowest bit; an int literal would be int64 (no vectorizing)


@numba.njit(parallel=True, cache=True)
def unpack(bits, n, out):  # pragma: no cover - runs compiled
    """out[i] = bit i of `bits` (LSB first) for i < n."""
    full = n // 8
    for b in numba.prange(full):  # eight explicit stores: a loop over k would not vectorize
        v, s = bits[b], 8 * b
        out[s], out[s + 1], out[s + 2], out[s + 3] = v & 1, (v >> 1) & 1, (v >> 2) & 1, (v >> 3) & 1
        out[s + 4], out[s + 5], out[s + 6], out[s + 7] = (v >> 4) & 1, (v >> 5) & 1, (v >> 6) & 1, v >> 7
    for i in range(8 * full, n):
        out[i] = (bits[full] >> (i - 8 * full)) & 1


@numba.njit(parallel=True, cache=True)
def pack_less(x, threshold, out):  # pragma: no cover - runs compiled
    """out = the bits of x < threshold, packed LSB first."""
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


@numba.njit(parallel=True, cache=True)
def set_lsb_less(x, y_int, threshold):  # pragma: no cover - runs compiled
    """The lowest bit of each y (as int32) := x < threshold, in place."""
    for i in numba.prange(x.size):
        y_int[i] = (y_int[i] & _CLEAR_LSB) | np.int32(x[i] < threshold)
