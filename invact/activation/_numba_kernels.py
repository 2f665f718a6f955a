"""The numba kernels every activation shares: bit packing for the forward and precision-bit mode's
one-pass bit setting (each activation's backward kernel unpacks its bits itself, span by span:
invact.activation._cpu_math.unpack_bits). Module-level functions with cache=True: numba compiles
each once per machine and stores the machine code on disk (next to this file, or in its user-wide
cache directory where that is not writable; NUMBA_CACHE_DIR overrides), and later processes load it
instead of compiling. Imported by invact.activation._numba on the first CPU call only (it imports numba).
"""

from __future__ import annotations

import numba
import numpy as np

from invact.activation._cpu_math import f32_at, u8_at

_CLEAR_LSB = np.int32(-2)  # all but the lowest bit; an int literal would be int64 (no vectorizing)


# Eight bytes b_k (0 or 1) of a little-endian uint64 v = sum b_k 2^(8k), times this, put b_k at bit
# 56 + k: the term b_k 2^(8k) * 2^(56 - 7j) lands at 56 + k + 7(k - j), in the top byte only for
# j = k, and no two terms share a position (so nothing carries into it). >> 56 leaves the byte
# sum b_k 2^k: the eight flags packed LSB first.
_GATHER_BITS = np.uint64(0x0102040810204080)
_TOP_BYTE = np.uint64(56)


_SPAN = 2**16  # elements per thread's turn: whole bytes of bits (and a 64 KB flag buffer in cache)


@numba.njit(inline="always")
def _pack(flags, words, out):  # pragma: no cover - runs compiled
    """out = `flags` (one 0/1 byte per element) packed LSB first, eight flags (one uint64 of `words`:
    flags' whole 8-byte words, a view of a whole array as for invact.activation._cpu_math.unpack_bits) into
    each byte by one multiply (loading eight strided elements per byte ran 8x slower)."""
    full = words.size
    for b in range(full):
        out[b] = np.uint8((words[b] * _GATHER_BITS) >> _TOP_BYTE)
    if flags.size > 8 * full:
        v = 0
        for i in range(8 * full, flags.size):
            v |= flags[i] << (i - 8 * full)
        out[full] = v


@numba.njit(parallel=True, cache=True)
def pack_flags(flags, words, out):  # pragma: no cover - runs compiled
    """out = `flags` (one 0/1 byte per element) packed LSB first, span by span across the threads;
    `words`: flags' first 8 (size // 8) bytes viewed as uint64 by numpy."""
    for p in numba.prange((flags.size + _SPAN - 1) // _SPAN):
        lo, hi = p * _SPAN, min(flags.size, (p + 1) * _SPAN)
        _pack(flags[lo:hi], words[lo // 8 : hi // 8], out[lo // 8 :])


@numba.njit(inline="always")
def _pack_less(x, threshold, flags, words, out):  # pragma: no cover - runs compiled
    """out = the packed bits (LSB first) of x < threshold, compared into `flags` (a buffer of at least
    x.size bytes, in cache) and packed from `words`, a uint64 view of the whole buffer (see _pack)."""
    for i in range(x.size):
        flags[i] = x[i] < threshold
    _pack(flags[: x.size], words[: x.size // 8], out)


@numba.njit(parallel=True, cache=True)
def pack_less(x, threshold, out):  # pragma: no cover - runs compiled
    """out = the packed bits (LSB first) of x < threshold. Each thread compares its span into a flag
    buffer that stays in cache, then packs it: one pass over x (measured on a 2-core Zen 4, 2^22
    fp32: 0.41 ms against 0.59 for a compare pass and a packing pass through a scratch buffer, and
    0.33 for torch's x.sum())."""
    for p in numba.prange((x.size + _SPAN - 1) // _SPAN):
        lo, hi = p * _SPAN, min(x.size, (p + 1) * _SPAN)
        flags = np.empty(_SPAN, dtype=np.uint8)
        _pack_less(x[lo:hi], threshold, flags, flags.view(np.uint64), out[lo // 8 :])


@numba.njit(parallel=True, cache=True)
def pack_less_rows(x, rows, row_stride, cols, threshold, out):  # pragma: no cover - runs compiled
    """out = the packed bits (LSB first, row after row) of x[r * row_stride + c] < threshold for
    r < rows, c < cols, with cols a multiple of 8 (each row's bits are whole bytes of out): a chunk of
    a fused projection, compared where it lies, without the byte-per-element mask a torch compare
    writes first (measured on a 2-core Zen 4, 4096 x 2048 of a 4096 x 4096 output: the compare alone
    took 5.3 ms, and its 8 MB of fresh pages fault on first touch). Threads take whole rows, about a
    span's worth at a turn."""
    per = max(1, _SPAN // cols)
    for p in numba.prange((rows + per - 1) // per):
        flags = np.empty(cols, dtype=np.uint8)
        words = flags.view(np.uint64)
        for r in range(p * per, min(rows, (p + 1) * per)):
            _pack_less(
                x[r * row_stride : r * row_stride + cols], threshold, flags, words, out[r * (cols // 8) :]
            )


@numba.njit(parallel=True, cache=True)
def set_lsb_less_rows(x, rows, row_stride, cols, y_int, threshold):  # pragma: no cover - runs compiled
    """The lowest bit of y_int[r * cols + c] (int32, contiguous) := x[r * row_stride + c] < threshold,
    in place, for r < rows, c < cols: precision-bit mode for a chunk of a fused projection."""
    for r in numba.prange(rows):
        row = x[r * row_stride : r * row_stride + cols]
        out = y_int[r * cols : (r + 1) * cols]
        for i in range(cols):
            out[i] = (out[i] & _CLEAR_LSB) | np.int32(row[i] < threshold)


@numba.njit(parallel=True, cache=True)
def set_lsb_less(x, y_int, threshold):  # pragma: no cover - runs compiled
    """The lowest bit of each y (as int32) := x < threshold, in place."""
    for i in numba.prange(x.size):
        y_int[i] = (y_int[i] & _CLEAR_LSB) | np.int32(x[i] < threshold)


@numba.njit(cache=True)
def pack_less_serial_at(x, n, threshold, out):  # pragma: no cover - runs compiled
    """pack_less on the calling thread for a small x (up to invact.activation._numba.SERIAL
    elements), given by addresses: x the n float32 at address x, out the (n + 7) // 8 bytes at address
    out (data_ptr()s of contiguous tensors; invact.activation._numba checks their dtype, layout and
    size). The flags of the last byte's missing elements stay 0, eight flags (one uint64) go into each
    byte by one multiply."""
    padded = (n + 7) // 8
    xs, dest = f32_at(x, n), u8_at(out, padded)
    flags = np.zeros(8 * padded, dtype=np.uint8)
    for i in range(n):
        flags[i] = xs[i] < threshold
    words = flags.view(np.uint64)
    for b in range(padded):
        dest[b] = np.uint8((words[b] * _GATHER_BITS) >> _TOP_BYTE)


@numba.njit(cache=True)
def set_lsb_less_serial(x, y_int, threshold):  # pragma: no cover - runs compiled
    """set_lsb_less on the calling thread, for up to invact.activation._numba.SERIAL elements."""
    for i in range(x.size):
        y_int[i] = (y_int[i] & _CLEAR_LSB) | np.int32(x[i] < threshold)
