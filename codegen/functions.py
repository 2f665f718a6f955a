"""The functions an activation's formula may use (coeffs/activations.json, `invact-fit --expr`), as
sympy functions, and how each is computed in float64 numpy.

Beyond the coefficient files' sqrt, exp, log, Abs, Max, Min and Piecewise: erf, erfc, tanh, log1p,
and two that sympy lacks, written so that their float64 values and derivatives never cancel or
overflow:

- sigmoid(z) = 1 / (1 + exp(-z)), derivative sigmoid(z) sigmoid(-z) (no 1 - sigmoid cancellation);
- softplus(z) = log(1 + exp(z)) (numpy's logaddexp(0, z): z itself past exp's range), derivative
  sigmoid(z).
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
