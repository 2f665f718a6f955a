"""Activation registry: f, f' in float64, the branch split T = argmin f and y_min = f(T), for every
entry of the activation spec (coeffs/activations.json, read by codegen.spec).

Every function here is vectorized over numpy arrays and evaluated in float64. T is never typed in:
it is the root of f' found by Brent's method to an absolute tolerance of 1e-15. The left branch is
x < T (bit = 1), the right branch x >= T (bit = 0); f is strictly monotone on each.

A monotone (increasing) f is the degenerate case T = -inf: every x is on the one branch "right", the
bit is always 0 and is not stored, and y_min is f's infimum, f(-inf) (the limit x -> -inf).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import sympy
from scipy import optimize, special

from codegen import spec
from codegen.functions import fold_constants

Array = np.ndarray
_MONOTONE_CHECK = np.linspace(-20.0, 20.0, 4001)  # where a monotone entry's f' >= 0 is checked


@dataclass(frozen=True)
class Derivation:
    """f(x) = base(a*x) / a, so f'(x) = base'(a*x), f^-1(y) = base^-1(a*y) / a and q(y) = q_base(a*y);
    with `clip` = (lo, hi) f is clipped to [lo, hi] and f' = 0 at and past the bounds (_clipped)."""

    base: str
    scale: float
    clip: tuple[float, float] | None = None


@dataclass(frozen=True)
class Activation:
    """One registry entry. `f` and `df` map float64 arrays to float64 arrays of the same shape."""

    name: str
    f: Callable[[Array], Array]
    df: Callable[[Array], Array]
    # k(y) as a sympy string, with f'(x) - 1 ~ exp(-k(x)) as x -> +inf: the 'floor' family's right branch
    right_decay: str | None = None
    monotone: bool = False  # an increasing f: one branch ("right"), no bit
    # (branch, f'(f^-1(y)) as a sympy string in y) for each branch, where closed forms exist: the
    # 'exact' family (a monotone f: the one branch "right")
    exact_q: tuple[tuple[str, str], ...] | None = None
    derivation: Derivation | None = None
    # (lo, hi) around T where f' goes from < 0 to >= 0: given by from_expression; else found on [-10, 0]
    bracket: tuple[float, float] | None = None
    threshold: float = field(init=False)  # T = argmin f; -inf when monotone
    y_min: float = field(init=False)  # f(T); inf f = f(-inf) when monotone

    def __post_init__(self) -> None:
        t = -np.inf if self.monotone else _root_of_derivative(self.df, self.bracket)
        with np.errstate(invalid="ignore"):  # f(-inf) may be NaN (then the entry is rejected below)
            y_min = float(self.f(np.float64(t)))
        # A monotone f's infimum may be -inf (leaky_relu); it may not be NaN or +inf.
        if self.monotone and not (y_min < np.inf and np.all(self.df(_MONOTONE_CHECK) >= 0)):
            raise ValueError(f"{self.name}: monotone=True needs f' >= 0 and f(-inf) < inf")
        object.__setattr__(self, "threshold", t)
        object.__setattr__(self, "y_min", y_min)
        if self.exact_q is not None and tuple(b for b, _ in self.exact_q) != self.branches:
            raise ValueError(f"{self.name}: exact_q needs one formula per branch {self.branches}")

    @property
    def branches(self) -> tuple[str, ...]:
        """The branches q is fitted and stored on: ("right",) for a monotone f, else ("left", "right")."""
        return ("right",) if self.monotone else ("left", "right")

    def d2f_at_threshold(self, h: float = 1e-5) -> float:
        """f''(T) by a central difference (relative error ~1e-10); used to start inversions at the cusp."""
        t = self.threshold
        return float((self.df(np.float64(t + h)) - self.df(np.float64(t - h))) / (2 * h))


def _root_of_derivative(df: Callable[[Array], Array], bracket: tuple[float, float] | None = None) -> float:
    """The sign change of f' from negative to positive in `bracket`, else on [-10, 0], refined by
    brentq to 1e-15."""
    if bracket is None:
        grid = np.linspace(-10.0, 0.0, 10001)
        vals = df(grid)
        idx = np.flatnonzero((vals[:-1] < 0) & (vals[1:] >= 0))
        if idx.size != 1:
            raise ValueError(f"expected one minimum of f on [-10, 0], found {idx.size}")
        bracket = grid[idx[0]], grid[idx[0] + 1]
    lo, hi = bracket
    return float(optimize.brentq(df, lo, hi, xtol=1e-15, rtol=4 * np.finfo(float).eps, maxiter=200))


# Each formula function -> its float64 numpy implementation (sympy.lambdify prints the rest: exp, log,
# sqrt, tanh, Abs, Max, Min, Piecewise). logaddexp(0, z) is softplus without overflow past z = 709.
_NUMPY = {
    "Phi": special.ndtr,
    "erf": special.erf,
    "erfc": special.erfc,
    "log1p": np.log1p,
    "expm1": np.expm1,
    "sigmoid": special.expit,
    "softplus": lambda z: np.logaddexp(0.0, z),
}


def numpy_function(expr, symbol=spec.X) -> Callable[[Array], Array]:
    """A sympy expression in one symbol as a float64 numpy function (sympy.lambdify prints the code from
    the parsed expression, which holds only allow-listed functions: no text is evaluated)."""
    fn = sympy.lambdify(symbol, fold_constants(expr), modules=[_NUMPY, "numpy"])

    def evaluate(x):
        x = np.asarray(x, dtype=np.float64)
        out = np.asarray(fn(x), dtype=np.float64)
        return out if out.shape == x.shape else np.broadcast_to(out, x.shape).copy()  # a constant f'

    return evaluate


def _clipped(f, df, lo: float, hi: float):
    """clip(f, lo, hi) and its derivative, 0 where f is at or past a bound. torch's clamp passes the
    gradient on the bounds themselves, but y there cannot tell a bound from beyond it, where the
    gradient is 0 (gelu_10: x = 10 exactly against every x > 10): InvAct's q and this agree on 0."""

    def clipped_df(x):
        fx = f(x)
        return np.where((fx > lo) & (fx < hi), df(x), 0.0)

    return (lambda x: np.clip(f(x), lo, hi)), clipped_df


def _registry(entries: dict[str, spec.Entry]) -> dict[str, Activation]:
    """name -> Activation: f and f' printed from the spec's formulas (f' from its df, or sympy's
    derivative of f). A derived entry computes them from its base, f(x) = base(a x) / a and
    f'(x) = base'(a x), the form its fits are derived in (fitting.families.derive)."""
    out = {}
    for name, e in entries.items():
        f, df, derivation = numpy_function(e.f), numpy_function(e.df), None
        if e.derivation:
            derivation = Derivation(*e.derivation)
            base, a = entries[derivation.base], derivation.scale
            base_f, base_df = numpy_function(base.f), numpy_function(base.df)
            f, df = (lambda x, g=base_f, a=a: g(a * x) / a), (lambda x, g=base_df, a=a: g(a * x))
            if derivation.clip:
                f, df = _clipped(f, df, *derivation.clip)
        out[name] = Activation(name, f, df, e.right_decay, e.monotone, e.exact_q, derivation)
    return out


# Every activation of coeffs/activations.json.
ACTIVATIONS: dict[str, Activation] = _registry(spec.load())


class UnknownActivation(KeyError):
    def __str__(self) -> str:
        return f"unknown activation {self.args[0]!r} (choose from {', '.join(sorted(ACTIVATIONS))})"


def get_activation(name: str) -> Activation:
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise UnknownActivation(name) from None


# Where a user-defined activation's shape is read: the metric range (fitting.evaluate.X_RANGE), every
# 0.001. A sign change of f' narrower than that goes unseen.
SHAPE_GRID = np.linspace(-20.0, 20.0, 40001)


class ShapeError(ValueError):
    """f is not one InvAct can invert: one line saying why."""


def _shape(name: str, f, df) -> tuple[bool, tuple[float, float] | None]:
    """(monotone, bracket of T) from the signs of f' on SHAPE_GRID; ShapeError unless f is increasing
    or decreasing then increasing (flat pieces, f' = 0, allowed anywhere)."""
    with np.errstate(all="ignore"):
        fx, d = f(SHAPE_GRID), df(SHAPE_GRID)
    bad = ~(np.isfinite(fx) & np.isfinite(d))
    if bad.any():
        raise ShapeError(f"{name}: f or f' is not finite at x = {SHAPE_GRID[bad][0]:.4g}")
    nonzero = np.flatnonzero(d != 0)
    if nonzero.size == 0:
        raise ShapeError(f"{name}: f is constant on [-20, 20]")
    signs = np.sign(d[nonzero])
    turns = np.flatnonzero(signs[1:] != signs[:-1])
    expected = "InvAct needs f increasing, or decreasing then increasing (one interior minimum)"
    if turns.size == 0 and signs[0] > 0:
        return True, None
    if turns.size == 1 and signs[0] < 0:
        return False, (float(SHAPE_GRID[nonzero[turns[0]]]), float(SHAPE_GRID[nonzero[turns[0] + 1]]))
    if turns.size == 0:
        raise ShapeError(f"{name}: f is decreasing on [-20, 20]; {expected}")
    where = ", ".join(f"{SHAPE_GRID[nonzero[i]]:.3g}" for i in turns[:4])
    minima = int(np.sum(signs[turns] < 0))  # a turn from - to + is a minimum
    raise ShapeError(f"{name}: f' changes sign {turns.size} times on [-20, 20] (near x = {where}: "
                     f"{minima} minima, {turns.size - minima} maxima); {expected}")  # fmt: skip


def from_expression(name: str, text: str) -> tuple[spec.Entry, Activation]:
    """A user-defined activation f(x) = `text` (parsed by codegen.safe_expr, never evaluated): its spec
    entry and registry entry, added to ACTIVATIONS for this process. Its shape (monotone, or one
    minimum T) is read from f'; SpecError or ShapeError (both ValueError) say what is wrong."""
    if name in ACTIVATIONS:
        raise spec.SpecError(f"{name!r} is a built-in activation: give yours another name")
    entry = spec.expression_entry(name, text)
    f, df = numpy_function(entry.f), numpy_function(entry.df)
    monotone, bracket = _shape(name, f, df)
    entry = dataclasses.replace(entry, monotone=monotone)
    act = Activation(name, f, df, monotone=monotone, bracket=bracket)
    ACTIVATIONS[name] = act
    return entry, act
