"""The functions an activation's formula may use (coeffs/activations.json), as sympy functions.
How each is computed is the printers' business: codegen.printers (torch, Triton) and
fitting.activations (float64 numpy).

Beyond the coefficient files' sqrt, exp, expm1, log, Abs, Max, Min and Piecewise: erf, erfc, tanh,
log1p, and three that sympy lacks, kept as functions so that sympy never rewrites them into forms that
cancel (it turns erfc(-z) into 2 - erfc(z)), with derivatives that never cancel or overflow:

- Phi(z), the standard normal CDF (1 + erf(z / sqrt 2)) / 2, derivative exp(-z^2 / 2) / sqrt(2 pi);
- sigmoid(z) = 1 / (1 + exp(-z)), derivative sigmoid(z) sigmoid(-z) (no 1 - sigmoid cancellation);
- softplus(z) = log(1 + exp(z)), derivative sigmoid(z).
"""

from __future__ import annotations

import sympy
from sympy.codegen.cfunctions import log1p

from codegen.safe_expr import FUNCTIONS


class Phi(sympy.Function):
    """The standard normal distribution function."""

    @classmethod
    def eval(cls, z):
        if z.is_zero:
            return sympy.S.Half

    def fdiff(self, argindex=1):
        z = self.args[0]
        return sympy.exp(-(z**2) / 2) / sympy.sqrt(2 * sympy.pi)

    def _eval_rewrite_as_erf(self, z, **kwargs):
        return (1 + sympy.erf(z / sympy.sqrt(2))) / 2


class sigmoid(sympy.Function):  # noqa: N801 - named as written in formulas
    """The logistic function 1 / (1 + exp(-z))."""

    @classmethod
    def eval(cls, z):
        if z.is_zero:
            return sympy.S.Half

    def fdiff(self, argindex=1):
        z = self.args[0]
        return sigmoid(z) * sigmoid(-z)

    def _eval_rewrite_as_exp(self, z, **kwargs):
        return 1 / (1 + sympy.exp(-z))


class softplus(sympy.Function):  # noqa: N801 - named as written in formulas
    """log(1 + exp(z)), the unscaled softplus."""

    @classmethod
    def eval(cls, z):
        if z.is_zero:
            return sympy.log(2)

    def fdiff(self, argindex=1):
        return sigmoid(self.args[0])

    def _eval_rewrite_as_exp(self, z, **kwargs):
        return sympy.log(1 + sympy.exp(z))


# name in a formula -> sympy function
ACTIVATION_FUNCTIONS = dict(FUNCTIONS) | {
    "erf": sympy.erf,
    "erfc": sympy.erfc,
    "tanh": sympy.tanh,
    "log1p": log1p,
    "Phi": Phi,
    "sigmoid": sigmoid,
    "softplus": softplus,
}
# What names other than x a formula may use.
CONSTANTS = {"pi": sympy.pi}


def fold_constants(expr: sympy.Basic) -> sympy.Basic:
    """expr with the constant factors of each product (terms of each sum) folded into one float64
    constant, exponents kept exact and sums kept undistributed: 2*sqrt(2)*(x + d x^3)/sqrt(pi) becomes
    1.5957691216057308*(x + d x^3), one rounding for the constant instead of four, as torch writes it
    (tests/fitting/test_activations.py holds gelu_tanh's float64 f' to 1.2e-13 relative in its left
    tail, where the error of the sigmoid's argument is multiplied by the argument, ~700). sympy's evalf does
    not reach into the arguments of functions it cannot evaluate, like sigmoid."""
    if expr.is_Number or not expr.args:
        return expr
    if expr.is_number:
        return sympy.Float(float(expr), 17)
    if expr.is_Pow:
        return sympy.Pow(fold_constants(expr.base), expr.exp)
    if expr.is_Add or expr.is_Mul:
        constants = [a for a in expr.args if a.is_number]
        rest = [fold_constants(a) for a in expr.args if not a.is_number]
        if constants:
            rest.insert(0, sympy.Float(float(expr.func(*constants)), 17))  # 17 digits: prints as the float64
        return expr.func(*rest, evaluate=False)  # c*(x + d x^3) stays so (sympy would distribute c)
    return expr.func(*[fold_constants(a) for a in expr.args])
