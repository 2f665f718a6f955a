"""fp32 scalar math for the numba CPU kernels: exp and log that LLVM can vectorize; and the bit
unpacking each backward kernel runs on its span (unpack_bits).

numba lowers math.exp to a libm call per element, which blocks SIMD; without Intel's SVML (a second
dependency) the backward kernel then runs ~3x slower. These versions use range reduction, a
polynomial and an integer <-> float bitcast, all of which vectorize. Accuracy over the normal fp32
range: exp32 within 1 ulp, log32 within 2 ulp (tests/invact/test_cpu_math.py). Arguments beyond the
fp32 range saturate: exp32 is exactly 0 below -87.34 (where expf turns subnormal) and 3.4e38 above 88.72.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import carray, njit, types
from numba.core.extending import intrinsic

F = np.float32


@intrinsic
def _i32_as_f32(typingctx, value):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.int32), codegen


@intrinsic
def _f32_as_i32(typingctx, value):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.int32(types.float32), codegen


@intrinsic
def _f32_pointer(typingctx, address):
    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(types.CPointer(types.float32)))

    return types.CPointer(types.float32)(types.intp), codegen


@intrinsic
def _u8_pointer(typingctx, address):
    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(types.CPointer(types.uint8)))

    return types.CPointer(types.uint8)(types.intp), codegen


@njit(inline="always")
def f32_at(address, n):
    """The n float32 at `address` (a contiguous tensor's data_ptr()) as a 1-D array, for a kernel
    called with addresses instead of numpy arrays: x.numpy() is an object built per argument (0.6 us,
    and several times that inside a training step), data_ptr() an integer."""
    return carray(_f32_pointer(address), (n,))


@njit(inline="always")
def u8_at(address, n):
    """f32_at for n uint8."""
    return carray(_u8_pointer(address), (n,))


@intrinsic
def prefer_512_bit_vectors(typingctx):
    """Marks the calling function "prefer-vector-width"="512": LLVM then vectorizes its loops with
    512-bit vectors where the CPU has AVX-512, and as before elsewhere (the attribute is x86's only).
    LLVM's tuning for Intel cores from Skylake-SP to Rocket Lake and others prefers 256-bit vectors,
    to spare the clock drop 512-bit instructions once cost. The backward kernels are compute-bound
    and gain: on a 2-core Intel Xeon with AVX-512 (LLVM host name rocketlake), the fitted two-branch
    backward span measured 0.88 -> 0.75 ns per element in cache, one core. A no-op at run time."""

    def codegen(context, builder, signature, args):
        # llvmlite's FunctionAttributes.add takes only LLVM's keyword attributes; a key="value"
        # attribute goes in as the set item it prints, which llvmlite writes out as it is.
        set.add(builder.function.attributes, '"prefer-vector-width"="512"')
        return context.get_dummy_value()

    return types.none(), codegen


# Cody-Waite split of ln 2 and the Cephes expf/logf minimax polynomials (public-domain coefficients).
_LOG2E, _LN2_HI, _LN2_LO = F(1.4426950408889634), F(0.693359375), F(-2.12194440e-4)
_EXP_P = (F(1.9875691500e-4), F(1.3981999507e-3), F(8.3334519073e-3), F(4.1665795894e-2),
          F(1.6666665459e-1), F(5.0000001201e-1))  # fmt: skip
_LOG_P = (F(7.0376836292e-2), F(-1.1514610310e-1), F(1.1676998740e-1), F(-1.2420140846e-1),
          F(1.4249322787e-1), F(-1.6668057665e-1), F(2.0000714765e-1), F(-2.4999993993e-1),
          F(3.3333331174e-1))  # fmt: skip
_SQRTHF = F(0.707106781186547524)
# int32 constants: a plain int literal is int64 in numba and would widen the arithmetic (scalar code).
_I23, _I126, _I127 = np.int32(23), np.int32(126), np.int32(127)
_MANTISSA, _HALF_EXPONENT = np.int32(0x007FFFFF), np.int32(0x3F000000)


@njit(inline="always")
def exp32(x):
    x = F(x)
    underflow = x < F(-87.33654)
    x = min(max(x, F(-87.33654)), F(88.72283))
    k = np.floor(x * _LOG2E + F(0.5))  # np.floor keeps float32 (math.floor gives an int64: scalar code)
    r = x - k * _LN2_HI - k * _LN2_LO
    p = _EXP_P[0]
    for c in _EXP_P[1:]:
        p = p * r + c
    p = p * r * r + r + F(1.0)
    # 2^k with k <= 128: k = 128 (x > 88.03) would overflow the exponent field, so it is 2^127 * 2.
    k_low = np.int32(min(k, F(127.0)))
    p = p * _i32_as_f32((k_low + _I127) << _I23) * (F(2.0) if k > F(127.0) else F(1.0))
    return F(0.0) if underflow else p


@njit(inline="always")
def log32(x):
    """log for x > 0 (normal range); 0 gives -88.7 (saturated), negative or NaN gives NaN."""
    x = F(x)
    bad = not (x >= F(0.0))
    x = max(x, F(1.17549435e-38))
    bits = _f32_as_i32(x)
    e = F((bits >> _I23) - _I126)
    m = _i32_as_f32((bits & _MANTISSA) | _HALF_EXPONENT)  # mantissa in [0.5, 1)
    small = m < _SQRTHF
    e = e - F(1.0) if small else e
    m = m + m - F(1.0) if small else m - F(1.0)
    z = m * m
    p = _LOG_P[0]
    for c in _LOG_P[1:]:
        p = p * m + c
    y = m * z * p + e * _LN2_LO - F(0.5) * z
    y = m + y + e * _LN2_HI
    return F(np.nan) if bad else y


# expm1 by one reduction for every x: x = k ln 2 + r with |r| <= ln(2)/2, so e^x - 1 = 2^k (e^r - 1) +
# (2^k - 1), where 2^k - 1 is exact (k >= -24; below, e^x - 1 rounds to -1 anyway) and e^r - 1 = r (1 + r
# P(r)) has no cancellation: one polynomial, no select between a Taylor series near 0 and exp beyond.
# P: the degree-5 Chebyshev interpolant of (e^r - 1 - r) / r^2 on [-ln(2)/2, ln(2)/2] (interpolation
# error under 2e-9 of P, which enters e^r - 1 damped by r^2 / |r|; the test measures 1.8 ulps in all).
# The split of ln 2 is fdlibm's expm1f one: k * hi is exact for |k| < 128 and lo is positive, so r = -0
# when x = -0 (k = 0: -0 - 0 * hi - 0 * lo stays -0), and r (1 + r P) keeps that sign.
_EXPM1_HALF_RANGE = float(np.log(2.0) / 2.0)
_EXPM1_P = tuple(
    F(c)
    for c in np.polynomial.Chebyshev.interpolate(
        lambda r: (np.expm1(r) - r) / r**2, 5, domain=[-_EXPM1_HALF_RANGE, _EXPM1_HALF_RANGE]
    )
    .convert(kind=np.polynomial.Polynomial)
    .coef[::-1]
)
_EXPM1_LN2_HI, _EXPM1_LN2_LO = F(6.9313812256e-01), F(9.0580006145e-06)
# 1.5 * 2^23: fp32 values from 2^23 to 2^24 are the integers, so x + ROUNDING (|x| < 2^22) rounds x to
# the nearest integer, whose value sits in the sum's low mantissa bits (expm1_32's k; the near tables'
# entry, invact.activation._lookup, where a lookup reads its index from those bits).
ROUNDING = F(12582912.0)
_HALF_BITS = np.int32(126 << 23)  # the bits of 2^-1: 2^(k-1) is these plus k << 23


@njit(inline="always")
def expm1_32(x):
    """e^x - 1, within 2 ulps over the normal fp32 range (tests/invact/test_cpu_math.py), -0 at -0.
    Saturates like exp32: -1 below -30 (e^-30 is under half an ulp of 1), 3.4e38 above 88.72.
    Branch-free, so it vectorizes."""
    x = min(max(F(x), F(-30.0)), F(88.72283))
    rounded = x * _LOG2E + ROUNDING
    k = rounded - ROUNDING  # exact: both lie in [2^23, 2^24)
    r = x - k * _EXPM1_LN2_HI
    r = r - k * _EXPM1_LN2_LO
    p = _EXPM1_P[0]
    for c in _EXPM1_P[1:]:
        p = p * r + c
    em1 = r * (p * r + F(1.0))
    # 2^(k-1) rather than 2^k, and the sum doubled: k reaches 128 at the top of the range, past the
    # exponent field. The rounded sum's low 9 bits hold k (two's complement), so << 23 leaves k's own
    # bits in the exponent field. -(0.5 - s) is -0 at s = 1/2 (k = 0), so that em1 = -0 survives the add.
    half = _i32_as_f32((_f32_as_i32(rounded) << _I23) + _HALF_BITS)
    return F(2.0) * (half * em1 + -(F(0.5) - half))


# Byte b times this repeats it in all eight bytes of a uint64; & _BIT_K keeps bit k in byte k; adding
# 0x7F to each byte (no byte exceeds 0x80, so none carries) sets its top bit where it was not 0; >> 7
# and & _REPEAT leave byte k = bit k of b. The eight flags of one byte in one uint64 store.
_REPEAT = np.uint64(0x0101010101010101)
_BIT_K = np.uint64(0x8040201008040201)
_SEVEN_F = np.uint64(0x7F7F7F7F7F7F7F7F)
_SEVEN = np.uint64(7)


@njit(inline="always")
def unpack_bits(bits, flags, words):
    """flags[i] = bit i of `bits` (uint8, LSB first) for i < flags.size, one byte (0 or 1) each.
    Whole bytes go eight flags at a time, as one uint64 (eight strided byte stores per bit byte ran
    several times slower): `words` is flags' first 8 (flags.size // 8) bytes viewed as uint64, a
    view of a whole array (writes through numba's view of a slice were lost: numba 0.68)."""
    full = words.size
    for b in range(full):
        v = (np.uint64(bits[b]) * _REPEAT) & _BIT_K
        words[b] = ((v + _SEVEN_F) >> _SEVEN) & _REPEAT
    for i in range(8 * full, flags.size):
        flags[i] = (bits[full] >> (i - 8 * full)) & 1
