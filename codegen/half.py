"""q for 16-bit outputs: what the torch, Triton and numba views print for y stored in bf16 or fp16.

coeffs/defaults_16bit.json names, per activation, the family its 16-bit q is printed from (the 'half'
family: the 'floor' forms at lower degree, fitting/families/floor.py); an activation it does not name
evaluates its default family's q in every dtype. The torch and Triton views print that family's
branches as q16_left and q16_right, or alias them to q_left and q_right; the numba view prints
q16_left_scalar and q16_right_scalar and a backward16_kernel from them (one plain loop: no near tables
or far-piece blocks), or nothing, where invact.activation._numba keeps the fp32 kernel.

The 16-bit functions print log as `_log16`, a log without libdevice's special cases, in fewer
instructions (an sm_90 Triton kernel: about 13 per element against tl.log's 25). For a positive normal
fp32 v (the far pieces' arguments are floored at the smallest normal), v = 2^e m with m in
[sqrt(1/2), sqrt(2)), and log v = e log 2 + log1p(f), f = m - 1, with log1p(f) = f + f^2 R(f), R of
degree 5: the minimax fit on [sqrt(1/2) - 1, sqrt(2) - 1] (linear programming, error 2.9e-7), rounded
to fp32. Measured in fp32 over 4096 mantissas in each binade of the normal range: max |_log16(v) -
log v| = 8.1e-6, from rounding e log 2 at large |e| (3.4e-7 for v in [1/2, 2]); tests/invact/test_half.py
bounds it. In the 'half' forms log only feeds w = sqrt(-log u) of a far piece q = u P(w): an error d in
log moves q by u P'(w) d / (2 w), largest where u is largest and w smallest (laplace's split, u / U =
1/2: measured 4e-7), under a tenth of the fits' own errors.
"""

from __future__ import annotations

from codegen.coeffs_json import CoeffFile
from codegen.common import q_functions
from codegen.printers import ScalarPrinter, TorchPrinter, TritonPrinter

# log1p(f) ~ f + f^2 (C2 + f (C3 + f (C4 + f (C5 + f (C6 + f C7))))), f in [sqrt(1/2) - 1, sqrt(2) - 1)
# (module docstring)
C2, C3, C4, C5, C6, C7 = (-0.5000145435333252, 0.3331547975540161, -0.24898391962051392, 0.20493900775909424,
                          -0.1875879317522049, 0.11980091780424118)  # fmt: skip
SQRT_HALF_BITS = 0x3F3504F3  # fp32 sqrt(1/2): e = (bits - this) >> 23 puts m in [sqrt(1/2), sqrt(2))
LN2 = 0.6931471805599453
_POLY = f"(f + f * f * ({C2!r} + f * ({C3!r} + f * ({C4!r} + f * ({C5!r} + f * ({C6!r} + f * {C7!r}))))))"

LOG16_TORCH = f'''

def _log16(v: torch.Tensor) -> torch.Tensor:
    """log v for positive normal v to 8.1e-6, in fp32 (codegen.half): exponent and mantissa from the
    bits, a degree-7 polynomial for the mantissa's log, as the Triton view's _log16 computes it."""
    b = v.float().view(torch.int32)
    e = (b - {SQRT_HALF_BITS:#x}) >> 23
    f = (b - (e << 23)).view(torch.float32) - 1.0
    return e.float() * {LN2!r} + {_POLY}
'''

LOG16_TRITON = f'''

@triton.jit
def _log16(v):
    """log v for positive normal fp32 v to 8.1e-6 (codegen.half): exponent and mantissa from the bits,
    a degree-7 polynomial for the mantissa's log, without tl.log's special cases (fewer instructions)."""
    b = v.to(tl.int32, bitcast=True)
    e = (b - {SQRT_HALF_BITS:#x}) >> 23
    f = (b - (e << 23)).to(tl.float32, bitcast=True) - 1.0
    return e.to(tl.float32) * {LN2!r} + {_POLY}
'''


LOG16_NUMBA = f'''

@numba.njit(inline="always", cache=True)
def _log16_32(v):
    """log v for positive normal fp32 v to 8.1e-6 (codegen.half), as the Triton view's _log16."""
    b = _f32_as_i32(F(v))
    e = (b - np.int32({SQRT_HALF_BITS:#x})) >> np.int32(23)
    f = _i32_as_f32(b - (e << np.int32(23))) - F(1.0)
    return F(e) * F({LN2!r}) + (f + f * f * (F({C2!r}) + f * (F({C3!r}) + f * (F({C4!r}) + f * (F({C5!r})
        + f * (F({C6!r}) + f * F({C7!r})))))))
'''

# The numba view's 16-bit backward kernel: the q16 functions above, jitted like q's, one loop.
NUMBA16_TWO_BRANCHES = '''

_q16_left = numba.njit(inline="always", fastmath=_FASTMATH, cache=True)(q16_left_scalar)
_q16_right = numba.njit(inline="always", fastmath=_FASTMATH, cache=True)(q16_right_scalar)


@numba.njit(fastmath=_FASTMATH, cache=True)
def _backward16_span(y, flags, dy, dx):  # pragma: no cover - runs compiled
    """dx = dy * q16(y, bit) on one thread's span: both branches for every element, then the bit's
    (branch-free, so the loop vectorizes); NaN where y is +-inf or NaN."""
    prefer_512_bit_vectors()
    for i in range(y.size):
        v = y[i]
        left, right = _q16_left(v), _q16_right(v)
        q = left if flags[i] & 1 else right
        dx[i] = dy[i] * (q if abs(v) < _INF else _NAN)


@numba.njit(parallel=True, cache=True)
def backward16_kernel(y, flags, dy, dx):  # pragma: no cover - runs compiled
    """dx = dy * q16(y, bit) for y that was stored in bf16 or fp16 (given in fp32): q16_left where
    flags[i] & 1, else q16_right, span by span of _SPAN elements across the threads."""
    for p in numba.prange((y.size + _SPAN - 1) // _SPAN):
        lo, hi = p * _SPAN, min(y.size, (p + 1) * _SPAN)
        _backward16_span(y[lo:hi], flags[lo:hi], dy[lo:hi], dx[lo:hi])
'''
NUMBA16_MONOTONE = '''

_q16_right = numba.njit(inline="always", fastmath=_FASTMATH, cache=True)(q16_right_scalar)


@numba.njit(fastmath=_FASTMATH, cache=True)
def _backward16_span(y, dy, dx):  # pragma: no cover - runs compiled
    """dx = dy * q16(y) on one thread's span (monotone: no bit). q16 itself at y = +-inf; NaN stays
    NaN."""
    prefer_512_bit_vectors()
    for i in range(y.size):
        v = y[i]
        dx[i] = dy[i] * (_q16_right(v) if v == v else _NAN)


@numba.njit(parallel=True, cache=True)
def backward16_kernel(y, dy, dx):  # pragma: no cover - runs compiled
    """dx = dy * q16(y) for y that was stored in bf16 or fp16 (given in fp32), span by span of _SPAN
    elements across the threads."""
    for p in numba.prange((y.size + _SPAN - 1) // _SPAN):
        lo, hi = p * _SPAN, min(y.size, (p + 1) * _SPAN)
        _backward16_span(y[lo:hi], dy[lo:hi], dx[lo:hi])
'''


class Scalar16Printer(ScalarPrinter):
    LOG = "_log16_32"


class Torch16Printer(TorchPrinter):
    LOG = "_log16"


class Triton16Printer(TritonPrinter):
    LOG = "_log16"


def numba16_view(c16: CoeffFile) -> str:
    """The numba view's 16-bit part: q16 per branch as fp32 scalar functions, _log16_32, and
    backward16_kernel, which invact.activation._numba calls for bf16 and fp16 y."""
    note = f"16-bit y (family {c16.family!r}): "
    functions = q_functions(c16, Scalar16Printer(), "_scalar", stem="q16", note=note)
    kernel = NUMBA16_MONOTONE if c16.monotone else NUMBA16_TWO_BRANCHES
    return f"\n\n{functions}{LOG16_NUMBA}{kernel}"


def q16_functions(c: CoeffFile, c16: CoeffFile | None, printer, **kwargs) -> str:
    """q16_left/q16_right printed from `c16` with `printer` (a 16-bit printer), or aliases of q_left
    and q_right (printed from `c`) where no 16-bit family is named; `kwargs` as common.q_functions."""
    if c16 is None:
        aliases = "".join(f"q16_{b} = q_{b}\n" for b in c.branches)
        return f"# 16-bit y: the same q (coeffs/defaults_16bit.json names no other family)\n{aliases}"
    if set(c16.branches) != set(c.branches):
        raise ValueError(f"{c16.activation}: family {c16.family!r} has branches {sorted(c16.branches)}, "
                         f"family {c.family!r} {sorted(c.branches)}")  # fmt: skip
    note = f"16-bit y (family {c16.family!r}): "
    return q_functions(c16, printer, "", stem="q16", note=note, **kwargs)
