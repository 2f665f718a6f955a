"""The paper's family (Method section, eqs. for q^left / q^right; coefficients from its appendix).

Guards added to the written formulas, none of which changes a value on the branch's own range:
- y is clamped at y_min, so a y rounded below it (bf16 SiLU: f(T) rounds to -0.279296875 < y_min)
  gives the cusp value instead of NaN or an extrapolation; other sqrt arguments are clamped at 0;
- y~ = y - y_min is capped at Y_TILDE_CAP in the exp(c3*(c4 - y~)^3) forms: past it the exp factor is
  0 in float64 for any c3 > 1e-9, and the cap keeps the cube and the prefactor finite (no 0 * inf);
  SiLU's (1 - y) factor there is capped the same way (fp32 y near 3e38 times the prefactor overflows);
- SiLU's f' = p*(1 - y) + y is written as 1 + (1 - y)*(p - 1) on the right branch, where p -> 1 and
  the printed form cancels catastrophically for large y.

The appendix prints SiLU's two coefficient tables with their labels swapped: the 4-coefficient table
belongs to the left polynomial, the 5-coefficient one to the right exponential form
(tests/fitting/test_evaluate.py pins the errors).
GELU's forms serve gelu_tanh too, refitted from GELU's coefficients (no published set exists).
"""

from __future__ import annotations

import sympy
from sympy import Abs, Max, Min, exp, sqrt

from fitting.activations import Activation
from fitting.families import BranchForm, Family, UnknownFamily, Y, coefficient_symbols, register

Y_TILDE_CAP = 1e4

# Appendix "Approximation Coefficients" of the paper.
GELU_LEFT = (1.6311011311381, 0.16997246666667, -0.06261728, 1.2947087, 1.98055565, 0.22730362,
             -0.038978495, 1.3295193)  # fmt: skip
GELU_RIGHT = (-1.383717971214795, 1.558420184350027, 0.044045748018110, 0.032146736769376, -2.119885089843949)
SILU_LEFT = (0.217177007595768, -0.507684370508263, 0.079631397669175, 0.357494204859375)
SILU_RIGHT = (
    -1.310856402130980,
    0.848589647031652,
    -0.162990512595109,
    0.002696163985044,
    -5.770613302664509,
)


def _start(values: tuple[float, ...]) -> dict[str, float]:
    return {f"c{i}": float(v) for i, v in enumerate(values)}


def _y_clamped(act: Activation) -> sympy.Expr:
    """max(y, y_min): the value every formula of this family reads instead of y."""
    return Max(Y, sympy.Float(act.y_min, 17))


def _y_tilde(act: Activation, cap: float | None = None) -> sympy.Expr:
    """y~ = max(y, y_min) - y_min >= 0, optionally capped."""
    shifted = _y_clamped(act) - sympy.Float(act.y_min, 17)
    return shifted if cap is None else Min(shifted, sympy.Float(cap, 17))


def _saturating_exp_term(act: Activation) -> sympy.Expr:
    """(c0 + c1 sqrt(y~) + c2 y~) * exp(c3 (c4 - y~)^3): the paper's right-branch correction to 1."""
    c = coefficient_symbols(5)
    yt = _y_tilde(act, Y_TILDE_CAP)
    return (c[0] + c[1] * sqrt(yt) + c[2] * yt) * exp(c[3] * (c[4] - yt) ** 3)


def gelu_forms(act: Activation) -> dict[str, BranchForm]:
    c = coefficient_symbols(8)
    y = _y_clamped(act)
    left = (
        c[0] * sqrt(Max(y + c[1], 0)) * (2 * y + c[2] * sqrt(Max(-y, 0)))
        * (Abs(c[3] * y**2 + Abs(c[4] * y + c[5]) + c[6]) + c[7])
    )  # fmt: skip
    right = 1 + _saturating_exp_term(act)
    return {"left": BranchForm(left, _start(GELU_LEFT)), "right": BranchForm(right, _start(GELU_RIGHT))}


def silu_forms(act: Activation) -> dict[str, BranchForm]:
    c = coefficient_symbols(4)
    y, yt = _y_clamped(act), _y_tilde(act)
    p_left = c[0] + c[1] * sqrt(yt) + c[2] * yt + c[3] * yt**2
    left = p_left * (1 - y) + y
    y_capped = Min(y, sympy.Float(Y_TILDE_CAP, 17))  # past the cap the exp term is 0: nothing changes
    right = 1 + (1 - y_capped) * _saturating_exp_term(act)  # = p*(1 - y) + y with p = 1 + term
    return {"left": BranchForm(left, _start(SILU_LEFT)), "right": BranchForm(right, _start(SILU_RIGHT))}


@register("paper")
def paper(act: Activation) -> Family:
    source = "Inverted Activations (paper), Method section and appendix 'Approximation Coefficients'"
    if act.name == "gelu":
        return Family("paper", act.name, gelu_forms(act), published=True, source=source)
    if act.name == "gelu_tanh":
        return Family("paper", act.name, gelu_forms(act), published=False, source=source + "; GELU's forms")
    if act.name == "silu":
        return Family("paper", act.name, silu_forms(act), published=True, source=source)
    raise UnknownFamily(
        f"family 'paper' has no form for {act.name!r} (it covers gelu, gelu_tanh, silu, quick_gelu)"
    )
