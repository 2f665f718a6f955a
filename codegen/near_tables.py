"""The near tables printed into `<act>_cpu.py` (and `--emit` modules), which invact.activation._lookup reads.

Where both branches' near pieces are polynomials in affine maps of one g = sqrt(max(e1, y + a) + e2)
(the floor family's), each branch's g from 0 to its split is cut into n + 1 entries, and entry j
holds the near piece on k g in [j - 1/2, j + 1/2] as a polynomial in u = k g - j: its Chebyshev series
in u, cut to the lowest degree whose cut terms stay within NEAR_TABLE_BOUND.

Every number here is computed in exact rational arithmetic (`fractions.Fraction`) from the floats the
coefficient file holds, and rounded once, correctly, when it is printed (`float(Fraction)` rounds to
nearest). No BLAS or LAPACK call, no SIMD-dispatched NumPy loop and no libm function reaches a
printed digit, so the tables are the same bytes on every CPU. (They were once fitted by NumPy's
Chebyshev.fit at cosine nodes: its lstsq and np.cos moved the last digits by up to 5.7e-10 between an
AVX2 and an AVX-512 machine.) Exactness also makes the cut bound the true sum of the cut terms: a
polynomial of degree d has no Chebyshev terms past d, where a fit left rounding noise there.
"""

from __future__ import annotations

import functools
import math
import struct
from fractions import Fraction

import sympy

from codegen import spec

# Per instruction set, the entries one lookup instruction reads (the two branches' entries together;
# invact.activation._lookup.LOOKUPS, checked equal by tests/codegen) and the highest degree worth a table. The
# entries are split between the branches where the degree that meets NEAR_TABLE_BOUND on both is lowest.
NEAR_TABLE_LOOKUPS = {"avx512": 32, "avx2": 8}
# A lookup and a multiply-add per coefficient, where the polynomial in g (degree 14 for the floor fits)
# costs a blend and a multiply-add: an 8-entry AVX2 table pays beyond degree 12, a 32-entry one
# (cheap at degree 5, and its two-register lookup the dearer instruction) beyond 8.
NEAR_TABLE_MAX_DEGREE = {"avx512": 8, "avx2": 12}
# |table - near piece| allowed. The kernels' fp32 evaluation of a near piece stays
# within 1e-6 of its float64 value (tests/codegen/test_generated_precision.py; measured worst 1.7e-7),
# and the table's error adds to that: 2^-22 = 2.4e-7 keeps the sum (4.1e-7) under half of the 1e-6.
# Each degree less saves a lookup and a multiply-add per block. At 2^-26 (a quarter of fp32's half ulp
# at 1) AVX-512's 32 entries needed degree 5 (gelu) where 2^-22 needs 4: the AVX-512 near blocks
# measured 0.33 -> 0.29 ns per element on Zen 4 in cache; AVX2's 8 entries need degree 9 at 2^-26 and
# 7 at 2^-22, and each degree cost its kernel 0.045 ns per element of about 0.7.
NEAR_TABLE_BOUND = Fraction(1, 2**22)
# How far past the split the last entry's polynomial holds, in u: fp32 rounding of g moves k g by
# about 1e-7 of n there (n <= 31), so 2^-16 = 1.5e-5 leaves room.
_PAST_THE_SPLIT = 2.0**-16

Polynomial = tuple[Fraction, ...]  # coefficients, lowest degree first


def _float32(x: float) -> float:
    """x rounded to the nearest fp32 (ties to even: the C conversion struct performs, IEEE on every CPU)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def _entry_scale(g_max: float, entries: int) -> float:
    """k, the fp32 factor the kernel multiplies g by: k g = n (= entries - 1) at the split, so entry j
    holds k g in [j - 1/2, j + 1/2]. One IEEE division and one rounding to fp32: the same on every CPU."""
    return _float32((entries - 1) / g_max)


def _affine(p: Polynomial, a: Fraction, b: Fraction) -> Polynomial:
    """The coefficients of p(a w + b) in w, exactly (Horner's scheme on coefficient lists)."""
    out: list[Fraction] = [Fraction(0)]
    for c in reversed(p):
        nxt = [Fraction(0)] * (len(out) + 1)
        for i, v in enumerate(out):
            nxt[i] += v * b
            nxt[i + 1] += v * a
        nxt[0] += c
        out = nxt
    return tuple(out[: len(p)])  # degree len(p) - 1: the top entry Horner adds is always 0


def _chebyshev_of_affine(p: Polynomial, a: Fraction, b: Fraction) -> tuple[list[int], int]:
    """The Chebyshev coefficients on [-1, 1] of p(a w + b) in w, exactly, as (numerators, their common
    denominator). Horner's scheme in the Chebyshev basis (w T_0 = T_1, w T_k = (T_(k+1) + T_(k-1)) / 2),
    on integers: with p's coefficients P_i / D, a = alpha / Q and b = beta / Q, the state after t steps
    is S_t / (D (2 Q)^t) and S_(t+1) = alpha (2 w S_t) + 2 beta S_t + P (2 Q)^(t+1), where 2 w S_t stays
    whole. (Fraction arithmetic reduces by a gcd at every step; it took most of a regeneration.)"""
    d = math.lcm(*(c.denominator for c in p))
    numerators = [c.numerator * (d // c.denominator) for c in p]
    q = math.lcm(a.denominator, b.denominator)
    alpha, beta = a.numerator * (q // a.denominator), b.numerator * (q // b.denominator)
    state, scale = [0] * len(p), 1
    for c in reversed(numerators):
        scale *= 2 * q
        twice_w = [0] * len(p)  # after t < len(p) steps the state has degree t - 1: no index overflows
        for k, v in enumerate(state):
            if v and k == 0:
                twice_w[1] += 2 * v
            elif v:
                twice_w[k - 1] += v
                twice_w[k + 1] += v
        state = [2 * beta * v + alpha * w for v, w in zip(state, twice_w, strict=True)]
        state[0] += c * scale
    return state, d * scale


def _to_power(c: Polynomial) -> Polynomial:
    """The power series in w of the Chebyshev series c on [-1, 1], exactly (T_(k+1) = 2 w T_k - T_(k-1))."""
    zero = [Fraction(0)] * len(c)
    out, previous, current = list(zero), zero, [Fraction(1), *zero[1:]]  # T_0 = 1
    for k, coefficient in enumerate(c):
        for i, v in enumerate(current[: k + 1]):
            out[i] += coefficient * v
        if k + 1 < len(c):  # T_1 = w T_0; T_(k+1) = 2 w T_k - T_(k-1) beyond
            times_w = [Fraction(0), *current[:-1]]
            following = times_w if k == 0 else [2 * t - p for t, p in zip(times_w, previous, strict=True)]
            previous, current = current, following
    return tuple(out)


def _fraction(x) -> Fraction:
    """A coefficient's exact value as the float64 it prints as (the value the kernels are fitted to)."""
    return Fraction(float(x))


@functools.cache
def _entry_series(piece: tuple[float, float, Polynomial], g_max: float, entries: int) -> tuple:
    """Per entry j of g = (j + u) / k (k = _entry_scale), on the part [lo, hi] of [-1/2, 1/2] that g
    from 0 to the split covers (and _PAST_THE_SPLIT beyond it): (lo, hi, the numerators of the near
    piece's Chebyshev series in w, their denominator), u = m + r w with m, r the middle and half-width
    of [lo, hi]. `piece`: (scale, shift, coefficients in t), the piece being sum_k c_k t^k with
    t = scale g + shift. Exact."""
    scale, shift, coefficients = piece
    k = Fraction(_entry_scale(g_max, entries))
    series = []
    for j in range(entries):
        # lo, hi in float64 as the kernel's entry ranges are defined; from here on exact.
        lo, hi = max(-0.5, -j), min(0.5, g_max * float(k) - j + _PAST_THE_SPLIT)
        m, r = (Fraction(lo) + Fraction(hi)) / 2, (Fraction(hi) - Fraction(lo)) / 2
        a, b = scale * r / k, scale * (j + m) / k + shift  # t = scale (j + m + r w) / k + shift = a w + b
        series.append((lo, hi, *_chebyshev_of_affine(coefficients, a, b)))
    return tuple(series)


def _cut_bound(series: tuple, degree: int) -> Fraction:
    """The largest sum of the magnitudes of the terms past `degree` over the entries' series, which
    bounds |cut series - piece| since |T_k| <= 1 on [-1, 1]. Exact."""
    return max(Fraction(sum(abs(v) for v in numerators[degree + 1 :]), denominator)
               for _, _, numerators, denominator in series)  # fmt: skip


def _lowest_degree(series: tuple, most: int, bound: Fraction) -> int | None:
    """The lowest degree up to `most` whose cut meets `bound` on every entry, else None."""
    return next((d for d in range(1, most + 1) if _cut_bound(series, d) <= bound), None)


def _entry_polynomials(series: tuple, degree: int) -> list[list[float]]:
    """coefficients[j][k] of u^k in entry j: each entry's series cut to `degree` (economization), back in
    the power basis of u (w = (u - m) / r), each rounded once to float64."""
    rows = []
    for lo, hi, numerators, denominator in series:
        m, r = (Fraction(lo) + Fraction(hi)) / 2, (Fraction(hi) - Fraction(lo)) / 2
        chebyshev = tuple(Fraction(v, denominator) for v in numerators[: degree + 1])
        in_u = _affine(_to_power(chebyshev), 1 / r, -m / r)
        rows.append([float(v) for v in in_u] + [0.0] * (degree + 1 - len(in_u)))  # a piece of lower degree
    return rows


def _round_up(bound: Fraction) -> str:
    """bound to three significant digits, rounded up: a printed bound the tests check must not shrink.
    The decade is found by exact comparison, not log10 (libm), so the digits are the same on every CPU."""
    exponent = math.floor(math.log10(bound))  # a first guess, corrected exactly below
    while Fraction(10) ** exponent > bound:
        exponent -= 1
    while Fraction(10) ** (exponent + 1) <= bound:
        exponent += 1
    step = Fraction(10) ** (exponent - 2)
    return f"{float(math.ceil(bound / step) * step):.3g}"


def sqrt_of_clamped_shift(g: sympy.Expr) -> tuple[float, float, float] | None:
    """(e1, a, e2) with g = sqrt(max(e1, y + a) + e2) (the floor family's g), else None."""
    if not (isinstance(g, sympy.Pow) and g.exp == sympy.Rational(1, 2) and g.base.is_Add):
        return None
    numbers = [t for t in g.base.args if t.is_Number]
    clamps = [t for t in g.base.args if isinstance(t, sympy.Max)]
    if len(numbers) != 1 or len(clamps) != 1 or len(g.base.args) != 2 or len(clamps[0].args) != 2:
        return None
    e1 = [t for t in clamps[0].args if t.is_Number]
    shifted = [t for t in clamps[0].args if not t.is_Number]
    if len(e1) != 1 or len(shifted) != 1 or not (shifted[0] - spec.Y).is_Number:
        return None
    return float(e1[0]), float(shifted[0] - spec.Y), float(numbers[0])


def near_table(forms: dict[str, tuple], splits: dict[str, sympy.Expr]) -> tuple[str, list[str]] | None:
    """The constants invact.activation._lookup.near_table takes, printed, with the instruction sets that have
    a table; None without any. `forms[branch]`: (g, scale, shift, coefficients in t, lowest degree
    first), the near piece being sum_k c_k t^k with t = scale g + shift, the same g for both branches;
    `splits[branch]`: the y where the branch's far piece takes over. A table only where g has the
    floor family's shape and a degree up to NEAR_TABLE_MAX_DEGREE meets NEAR_TABLE_BOUND (elsewhere
    the kernel evaluates the polynomial in g)."""
    g = forms["left"][0]
    shape = sqrt_of_clamped_shift(g)
    if shape is None:
        return None
    g_max, pieces = {}, {}
    for name, (_, scale, shift, coefficients) in forms.items():
        g_max[name] = float(g.subs(spec.Y, splits[name]))
        pieces[name] = (_fraction(scale), _fraction(shift), tuple(_fraction(c) for c in coefficients))
    tables = {isa: _isa_table(isa, pieces, g_max) for isa in NEAR_TABLE_LOOKUPS}
    tables = {isa: text for isa, text in tables.items() if text}
    if not tables:
        return None
    e1, a, e2 = shape
    return (
        f"""# The near pieces again, as tables for CPUs with AVX-512 or AVX2 (invact.activation._lookup says
# how the kernel reads them): each branch's g from 0 to its split in n + 1 entries; entry j holds the
# near piece on k g in [j - 1/2, j + 1/2] (k g = n at the split) as a polynomial in u = k g - j (its
# Chebyshev series, cut).
NEAR_TABLE_G = ({e1!r}, {a!r}, {e2!r})  # g = sqrt(max(e1, y + a) + e2)
{"".join(tables.values())}""",
        list(tables),
    )


def _isa_table(isa: str, pieces: dict, g_max: dict[str, float]) -> str | None:
    """One instruction set's table, printed (NEAR_TABLE_<ISA>, its entries, scales and bound): the split
    of its lookup's entries between the branches with the lowest degree (the smaller bound among
    equals)."""
    entries, most = NEAR_TABLE_LOOKUPS[isa], NEAR_TABLE_MAX_DEGREE[isa]
    best = None
    for n_left in range(2, entries - 1):
        split = {"left": n_left, "right": entries - n_left}
        series = {name: _entry_series(pieces[name], g_max[name], split[name]) for name in pieces}
        degrees = [_lowest_degree(series[name], most, NEAR_TABLE_BOUND) for name in pieces]
        if None in degrees:
            continue
        key = (max(degrees), max(_cut_bound(series[name], max(degrees)) for name in pieces))
        if best is None or key < best[0]:
            best = (key, split, series)
    if best is None:
        return None
    (degree, cut), split, series = best
    fitted = {name: _entry_polynomials(series[name], degree) for name in pieces}
    columns = fitted["right"] + fitted["left"]  # the right branch's entries first
    rows = "\n".join(f"    ({', '.join(repr(col[k]) for col in columns)}),"
                     for k in range(degree + 1))  # fmt: skip
    scales = tuple(_entry_scale(g_max[name], split[name]) for name in ("left", "right"))
    name = f"NEAR_TABLE_{isa.upper()}"
    return f"""# {isa}: one {entries}-entry lookup per coefficient; degree {degree}.
{name}_ENTRIES = ({split["left"]}, {split["right"]})  # the left branch's, the right's
{name}_SCALE = ({scales[0]!r}, {scales[1]!r})  # k, fp32: k g = entries - 1 at the split
{name}_BOUND = {_round_up(cut)}  # |table - near piece|, at most (float64; the cut terms' sum)
# {name}[k][e]: the coefficient of u^k in entry e, the right branch's for e < {split["right"]}.
{name} = (
{rows}
)
"""
