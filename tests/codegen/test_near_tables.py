"""The near tables' exact arithmetic (codegen.near_tables): basis changes that lose nothing."""

from fractions import Fraction

import numpy as np
import pytest

from codegen.near_tables import _affine, _chebyshev_of_affine, _round_up, _to_power

# A polynomial with dyadic coefficients (as a coefficient file's floats are) and affine maps whose
# coefficients are not dyadic (1/k for an fp32 k is not), like an entry's.
POLYNOMIAL = tuple(Fraction(c) for c in (0.75, -1.5, 0.3125, 2.0**-30, -3.0, 1.25))
MAPS = [(Fraction(1, 3), Fraction(-2, 7)), (Fraction(5, 11), Fraction(0)), (Fraction(-1), Fraction(1, 2))]
# float64 conversions of degree-5 polynomials with terms below 10: a few ulp of 10 each, with room.
FLOAT64_ROUNDING = 1e-13


@pytest.mark.parametrize(("a", "b"), MAPS)
def test_chebyshev_of_an_affine_map_converts_back_exactly(a, b):
    numerators, denominator = _chebyshev_of_affine(POLYNOMIAL, a, b)
    chebyshev = tuple(Fraction(v, denominator) for v in numerators)
    assert _to_power(chebyshev) == _affine(POLYNOMIAL, a, b)


@pytest.mark.parametrize(("a", "b"), MAPS)
def test_chebyshev_of_an_affine_map_agrees_with_numpy(a, b):
    numerators, denominator = _chebyshev_of_affine(POLYNOMIAL, a, b)
    power = [float(c) for c in POLYNOMIAL]
    w = np.linspace(-1, 1, 41)
    p = np.polynomial.Polynomial(power)(float(a) * w + float(b))
    assert np.abs(np.polynomial.chebyshev.chebval(w, [v / denominator for v in numerators]) - p).max() < (
        FLOAT64_ROUNDING
    )


def test_affine_of_the_identity_is_the_polynomial():
    assert _affine(POLYNOMIAL, Fraction(1), Fraction(0)) == POLYNOMIAL


@pytest.mark.parametrize(
    ("bound", "printed"),
    [
        (Fraction(1, 1000), "0.001"),  # a power of ten stays itself
        (Fraction(1001, 10**6), "0.00101"),  # rounded up, never down
        (Fraction(999_999, 10**9), "0.001"),  # just under a decade: 1.00e-3, not 9.99e-4
        (Fraction(2**-22), "2.39e-07"),  # 2.384...e-7
    ],
)
def test_round_up_keeps_three_digits_and_never_shrinks(bound, printed):
    assert _round_up(bound) == printed
    assert Fraction(printed) >= bound
