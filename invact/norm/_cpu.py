"""The CPU backward of an inverted norm (invact.norm) in one numba pass per row: reads y and dy, writes
dx, and sums dy h and dy into per-thread rows for dweight and dbias. Where torch ops take five or six
passes over the tensor (recover h, scale, the native backward, rescale), this takes the two reads and
the write a fused norm backward needs (the row is read twice, from cache).

Per row, with h = y scale - shift (scale = 1 / w_eff, shift = b / w_eff) and g = dy w_eff:
    dx = rstd (g - [mean g] - h mean(g h))      ([mean g] only where the norm centers: LayerNorm)
in fp32, the row sums in fp32 (reassociated for vector lanes: the sum over d elements is within d
roundings of the exact one, as a sequential sum is), the sums over rows for dweight and dbias in fp64
(of fp32 sums over blocks of BLOCK rows).
Compiled with cache=True (numba's disk cache), on first use; imported by invact.norm only when a CPU
backward runs and numba is installed. Up to SERIAL elements the serial kernel runs on the calling
thread (no parallel region: see invact.activation._numba).
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from numba import types
from numba.extending import overload

from invact.activation._cpu_math import _f32_as_i32, _i32_as_f32, f32_at
from invact.activation._numba import SERIAL, keeps_torch_threads

_FAST = {"reassoc", "contract"}  # vectorized row sums and FMAs; no approximate division or functions
BLOCK = 16  # rows whose dweight and dbias terms are summed in fp32 before the fp64 sums (_rows)


def _load(v):  # pragma: no cover - replaced by the overload below in compiled code
    """An element as fp32: itself, or for a bf16 tensor's bits (uint16) the fp32 they are the top of."""


@overload(_load, inline="always")
def _load_impl(v):
    if isinstance(v, types.Integer):  # bf16 bits: exactly the fp32 with these 16 bits on top
        return lambda v: _i32_as_f32(np.int32(v) << np.int32(16))
    return lambda v: np.float32(v)


def _store(out, r, j, value):  # pragma: no cover - replaced by the overload below in compiled code
    """out[r, j] = value, rounded to bf16 (to nearest, ties to even) where out holds bf16 bits."""


@overload(_store, inline="always")
def _store_impl(out, r, j, value):
    if isinstance(out.dtype, types.Integer):

        def store_bf16(out, r, j, value):
            bits = _f32_as_i32(value)
            rounded = (bits + np.int32(0x7FFF) + ((bits >> np.int32(16)) & np.int32(1))) >> np.int32(16)
            out[r, j] = np.uint16(rounded & np.int32(0xFFFF))

        return store_bf16

    def store(out, r, j, value):
        out[r, j] = value

    return store


@numba.njit(inline="always")
def _pre(bits, packed, e):  # pragma: no cover - compiled
    """invact.norm.decode_residual of one element: bf16 bits (uint16) and element e's nibble of
    `packed` (element 2i in the low nibble of byte i) give the fp32 y was rounded from, within the
    middle of its 2^12-unit step."""
    code = (np.int32(packed[e >> 1]) >> ((e & 1) * 4)) & np.int32(15)
    # in int32 with wraparound, as the torch ops compute it (numba widens int32 arithmetic to int64)
    return _i32_as_f32(np.int32((np.int32(bits) << np.int32(16)) + (code << np.int32(12)) - np.int32(0x7800)))


def _value(y, packed, r, j, d):  # pragma: no cover - replaced by the overload below in compiled code
    """Element (r, j) of y as fp32: with `packed` (a bf16 y's residual nibbles) the fp32 y was rounded
    from, else y's own value."""


@overload(_value, inline="always")
def _value_impl(y, packed, r, j, d):
    # specialized when compiled: a kernel without residuals has no branch in its loops (with a run-time
    # test there the fp32 LayerNorm backward took 9.5 ms against 6.8 ms, 4096 x 1024, 1 thread, Zen 4)
    if isinstance(packed, types.NoneType):
        return lambda y, packed, r, j, d: _load(y[r, j])
    return lambda y, packed, r, j, d: _pre(y[r, j], packed, r * d + j)


@numba.njit(inline="always", fastmath=_FAST)
def _rows(
    y, dy, scale, shift, w_eff, rstd, center, dx, acc, start, stop, packed
):  # pragma: no cover - compiled
    # packed: y's residual nibbles (bf16 y only), or None: y's values as they are. The sums over rows
    # (dweight, dbias) gather BLOCK rows in fp32, then go into the fp64 `acc`: an fp64 add per element
    # took a third of the kernel's time (4096 x 1024 fp32, 1 thread, AMD EPYC Zen 4: 4.4 ms against
    # 3.9 ms in blocks of 16, 2.8 ms without the sums), and BLOCK fp32 terms add at most BLOCK - 1
    # roundings, where one fp32 sum over every row drifted (see backward).
    d = y.shape[1]
    inv_d = np.float32(1.0) / np.float32(d)
    block = np.zeros((2, d), dtype=np.float32)
    for r in range(start, stop):
        s_g = np.float32(0.0)
        s_gh = np.float32(0.0)
        for j in range(d):
            v = _value(y, packed, r, j, d)
            h = v * scale[j] - shift[j]
            g = _load(dy[r, j]) * w_eff[j]
            s_g += g
            s_gh += g * h
        m_g = s_g * inv_d if center else np.float32(0.0)
        m_gh = s_gh * inv_d
        a = rstd[r]
        for j in range(d):
            v = _value(y, packed, r, j, d)
            h = v * scale[j] - shift[j]
            g_out = _load(dy[r, j])
            _store(dx, r, j, a * (g_out * w_eff[j] - m_g - h * m_gh))
            block[0, j] += g_out * h
            block[1, j] += g_out
        if (r - start) % BLOCK == BLOCK - 1 or r == stop - 1:
            for j in range(d):
                acc[0, j] += block[0, j]
                acc[1, j] += block[1, j]
                block[0, j] = np.float32(0.0)
                block[1, j] = np.float32(0.0)


@numba.njit(parallel=True, cache=True, fastmath=_FAST)
def _parallel(y, dy, scale, shift, w_eff, rstd, center, dx, partial, packed):  # pragma: no cover - compiled
    rows = y.shape[0]
    threads = partial.shape[0]
    per = (rows + threads - 1) // threads
    for t in numba.prange(threads):
        _rows(y, dy, scale, shift, w_eff, rstd, center, dx, partial[t], t * per, min(rows, (t + 1) * per),
              packed)  # fmt: skip


@numba.njit(cache=True, fastmath=_FAST)
def _serial(y, dy, scale, shift, w_eff, rstd, center, dx, partial, packed):  # pragma: no cover - compiled
    _rows(y, dy, scale, shift, w_eff, rstd, center, dx, partial[0], 0, y.shape[0], packed)


@numba.njit(inline="always")
def _encode_span(pre, bits, out, start, stop):  # pragma: no cover - compiled
    """Bytes start..stop of invact.norm.encode_residual for bf16: element e's nibble is
    clamp((pre's pattern - y's pattern + 2^15) >> 12, max 15), low nibble first."""
    n = pre.size
    for i in range(start, stop):
        byte = np.int32(0)
        for k in range(2):
            e = 2 * i + k
            if e < n:
                # both patterns signed int32 (y's wraps there), their difference exact
                d = _f32_as_i32(pre[e]) - np.int32(np.int32(bits[e]) << np.int32(16))
                code = min((d + np.int32(0x8000)) >> np.int32(12), np.int32(15))
                byte |= (code & np.int32(15)) << (4 * k)
        out[i] = np.uint8(byte)


@numba.njit(parallel=True, cache=True)
def _encode_parallel(pre, bits, out, threads):  # pragma: no cover - compiled
    per = (out.size + threads - 1) // threads
    for t in numba.prange(threads):
        _encode_span(pre, bits, out, t * per, min(out.size, (t + 1) * per))


@numba.njit(cache=True)
def _encode_serial(pre, bits, out):  # pragma: no cover - compiled
    _encode_span(pre, bits, out, 0, out.size)


@numba.njit(cache=True, fastmath=_FAST)
def _serial_at(
    y_at, dy_at, w_at, b_at, rstd_at, dx_at, dw_at, db_at, rows, d, offset, center
):  # pragma: no cover - compiled; fmt: skip
    """backward's serial pass for a norm's fp32 y and dy of `rows` rows of d, given by addresses
    (data_ptr()s of contiguous tensors: no numpy array per argument): w_at the fp32 weight (0: none;
    its effective weight + offset formed here, as invact.norm.op._w_eff forms it), b_at the fp32 bias
    (0: none), rstd_at `rows` fp32; writes dx (rows x d) at dx_at and, where dw_at and db_at are not
    0, the d sums over rows of dy h and of dy there. The same pass as backward's (_rows), its scale
    and shift formed as backward forms them in torch."""
    y = f32_at(y_at, rows * d).reshape((rows, d))
    dy = f32_at(dy_at, rows * d).reshape((rows, d))
    dx = f32_at(dx_at, rows * d).reshape((rows, d))
    w_eff = np.ones(d, dtype=np.float32) if w_at == 0 else f32_at(w_at, d) + np.float32(offset)
    scale = np.float32(1.0) / w_eff if w_at != 0 else w_eff
    shift = np.zeros(d, dtype=np.float32) if b_at == 0 else f32_at(b_at, d) * scale
    acc = np.zeros((2, d), dtype=np.float64)
    _rows(y, dy, scale, shift, w_eff, f32_at(rstd_at, rows), center, dx, acc, 0, rows, None)
    for at, k in ((dw_at, 0), (db_at, 1)):
        if at != 0:
            out = f32_at(at, d)
            for j in range(d):
                out[j] = np.float32(acc[k, j])


def backward_small(dy: torch.Tensor, y: torch.Tensor, rstd: torch.Tensor, weight, bias, offset: float,
                   center: bool, want_w: bool, want_b: bool):  # fmt: skip
    """(dx in y's shape, dweight where `want_w` else None, dbias where `want_b` else None) of a norm
    from its fp32 output y, for contiguous fp32 y, dy and rstd (one per row) and an fp32 weight and bias
    or None, of fewer than invact.norm.op.NUMBA_MIN_ELEMENTS elements: backward's pass on the calling
    thread (nothing parallel runs: no keeps_torch_threads), its arguments by address. A small norm's
    cost is its host time: the torch formulas take seven ops or more (invact.norm.op._rms_backward,
    _lean_backward)."""
    d = y.shape[-1]
    dx = torch.empty_like(y)
    dw = torch.empty(d) if want_w else None
    db = torch.empty(d) if want_b else None
    address = lambda t: 0 if t is None else t.data_ptr()  # noqa: E731
    _serial_at(y.data_ptr(), dy.data_ptr(), address(weight), address(bias), rstd.data_ptr(), dx.data_ptr(),
               address(dw), address(db), y.numel() // d, d, offset, center)  # fmt: skip
    return dx, dw, db


def _threads(elements: int) -> int:
    """As many spans as torch has threads (torch.set_num_threads holds for these ops too), at most
    numba's (its configured count: numba.get_num_threads() would start its threading layer,
    keeps_torch_threads); one, on the calling thread, up to SERIAL elements."""
    return 1 if elements <= SERIAL else max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))


@keeps_torch_threads
def encode_bf16(pre: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """invact.norm.encode_residual for a bf16 y rounded from the fp32 `pre` (both contiguous, of one
    shape), in one pass: ceil(n / 2) bytes, bitwise the torch ops' result."""
    out = torch.empty((pre.numel() + 1) // 2, dtype=torch.uint8)
    flat_pre, bits = pre.reshape(-1).numpy(), y.reshape(-1).view(torch.uint16).numpy()
    threads = _threads(pre.numel())
    if threads == 1:
        _encode_serial(flat_pre, bits, out.numpy())
    else:
        _encode_parallel(flat_pre, bits, out.numpy(), threads)
    return out


def _array(t: torch.Tensor) -> np.ndarray:
    """A contiguous fp32 or bf16 tensor as numpy (bf16 as its uint16 bits); other dtypes as fp32."""
    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.uint16).numpy()
    return t.float().contiguous().numpy()


@keeps_torch_threads
def backward(y: torch.Tensor, dy: torch.Tensor, w_eff, bias, rstd: torch.Tensor, center: bool,
             packed: torch.Tensor | None = None):  # fmt: skip
    """(dx in dy's dtype where that is fp32 or bf16, else fp32; sum over rows of dy h; sum over rows
    of dy) for y and dy of shape (rows, d) (fp32 or bf16 read as they are, others converted), w_eff
    and bias (d,) or None, rstd (rows, 1); `packed`: a bf16 y's residuals (invact.norm.encode_residual),
    decoded in the pass. Row sums in fp32, the sums over rows in fp64 (of fp32 sums over BLOCK rows)."""
    rows, d = y.shape
    if w_eff is None:
        w = torch.ones(d)
        scale = w
    else:  # a copy: .numpy() would mark the parameter's storage non-resizable, which FSDP2 resizes
        w = w_eff.float().contiguous().clone()
        scale = 1.0 / w
    shift = (bias.float() * scale).contiguous() if bias is not None else torch.zeros(d)
    dx = torch.empty(rows, d, dtype=dy.dtype if dy.dtype == torch.bfloat16 else torch.float32)
    threads = _threads(y.numel())
    # the sums over rows (dweight, dbias) in fp64: in fp32 each thread's running sum over its rows drifted
    # to 9.5x the RMS error of torch's own dweight at 16384 rows (benchmarks/rope_inversion.py, fp32)
    partial = np.zeros((threads, 2, d), dtype=np.float64)
    kernel = _serial if threads == 1 else _parallel
    residual = None if packed is None else packed.contiguous().numpy()
    rstd = rstd.float().reshape(rows).contiguous().numpy()
    kernel(_array(y), _array(dy), scale.contiguous().numpy(), shift.numpy(), w.numpy(), rstd, center,
           _array(dx), partial, residual)  # fmt: skip
    sums = partial.sum(axis=0)
    return dx, torch.from_numpy(sums[0].copy()), torch.from_numpy(sums[1].copy())  # not views of one array
