"""The CPU backward of an inverted norm (invact.norm) in one numba pass per row: reads y and dy, writes
dx, and sums dy h and dy into per-thread rows for dweight and dbias. Where torch ops take five or six
passes over the tensor (recover h, scale, the native backward, rescale), this takes the two reads and
the write a fused norm backward needs (the row is read twice, from cache).

Per row, with h = y scale - shift (scale = 1 / w_eff, shift = b / w_eff) and g = dy w_eff:
    dx = rstd (g - [mean g] - h mean(g h))      ([mean g] only where the norm centers: LayerNorm)
in fp32, the row sums in fp32 (reassociated for vector lanes: the sum over d elements is within d
roundings of the exact one, as a sequential sum is). Compiled with cache=True (numba's disk cache),
on first use; imported by invact.norm only when a CPU backward runs and numba is installed. Up to
SERIAL elements the serial kernel runs on the calling thread (no parallel region: see invact._numba).
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from invact._numba import SERIAL

_FAST = {"reassoc", "contract"}  # vectorized row sums and FMAs; no approximate division or functions


@numba.njit(inline="always", fastmath=_FAST)
def _rows(y, dy, scale, shift, w_eff, rstd, center, dx, acc, start, stop):  # pragma: no cover - compiled
    d = y.shape[1]
    inv_d = np.float32(1.0) / np.float32(d)
    for r in range(start, stop):
        s_g = np.float32(0.0)
        s_gh = np.float32(0.0)
        for j in range(d):
            h = y[r, j] * scale[j] - shift[j]
            g = dy[r, j] * w_eff[j]
            s_g += g
            s_gh += g * h
        m_g = s_g * inv_d if center else np.float32(0.0)
        m_gh = s_gh * inv_d
        a = rstd[r]
        for j in range(d):
            h = y[r, j] * scale[j] - shift[j]
            dx[r, j] = a * (dy[r, j] * w_eff[j] - m_g - h * m_gh)
            acc[0, j] += dy[r, j] * h
            acc[1, j] += dy[r, j]


@numba.njit(parallel=True, cache=True, fastmath=_FAST)
def _parallel(y, dy, scale, shift, w_eff, rstd, center, dx, partial):  # pragma: no cover - compiled
    rows = y.shape[0]
    threads = partial.shape[0]
    per = (rows + threads - 1) // threads
    for t in numba.prange(threads):
        _rows(y, dy, scale, shift, w_eff, rstd, center, dx, partial[t], t * per, min(rows, (t + 1) * per))


@numba.njit(cache=True, fastmath=_FAST)
def _serial(y, dy, scale, shift, w_eff, rstd, center, dx, partial):  # pragma: no cover - compiled
    _rows(y, dy, scale, shift, w_eff, rstd, center, dx, partial[0], 0, y.shape[0])


def backward(y: torch.Tensor, dy: torch.Tensor, w_eff, bias, rstd: torch.Tensor, center: bool):
    """(dx, sum over rows of dy h, sum over rows of dy), fp32, for y and dy of shape (rows, d) (fp32,
    or 16-bit: converted first), w_eff and bias (d,) or None, rstd (rows, 1)."""
    rows, d = y.shape
    y32 = y.float().contiguous()
    dy32 = dy.float().contiguous()
    if w_eff is None:
        w = torch.ones(d)
        scale = w
    else:
        w = w_eff.float().contiguous()
        scale = 1.0 / w
    shift = (bias.float() * scale).contiguous() if bias is not None else torch.zeros(d)
    dx = torch.empty_like(y32)
    threads = 1 if y.numel() <= SERIAL else numba.get_num_threads()
    partial = np.zeros((threads, 2, d), dtype=np.float32)
    kernel = _serial if threads == 1 else _parallel
    kernel(y32.numpy(), dy32.numpy(), scale.contiguous().numpy(), shift.numpy(), w.numpy(),
           rstd.float().reshape(rows).contiguous().numpy(), center, dx.numpy(), partial)  # fmt: skip
    sums = partial.sum(axis=0)
    return dx, torch.from_numpy(sums[0].copy()), torch.from_numpy(sums[1].copy())  # not views of one array
