"""Activation registry: f, f' in float64, the branch split T = argmin f and y_min = f(T).

Every function here is vectorized over numpy arrays and evaluated in float64. T is never typed in:
it is the root of f' found by Brent's method to an absolute tolerance of 1e-15. The left branch is
x < T (bit = 1), the right branch x >= T (bit = 0); f is strictly monotone on each.

A monotone (increasing) f is the degenerate case T = -inf: every x is on the one branch "right", the
bit is always 0 and is not stored, and y_min is f's infimum, f(-inf) (the limit x -> -inf).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from scipy import optimize, special

Array = np.ndarray
_SQRT_2_OVER_PI = np.sqrt(2.0 / np.pi)
_TANH_GELU_CUBIC = 0.044715  # torch's tanh-GELU constant
_QUICK_GELU_SCALE = 1.702  # Hugging Face's QuickGELUActivation: x * sigmoid(1.702 x)
_MONOTONE_CHECK = np.linspace(-20.0, 20.0, 4001)  # where a monotone entry's f' >= 0 is checked


@dataclass(frozen=True)
class Derivation:
    """f(x) = base(a*x) / a, so f'(x) = base'(a*x), f^-1(y) = base^-1(a*y) / a and q(y) = q_base(a*y)."""

    base: str
    scale: float


@dataclass(frozen=True)
class Activation:
    """One registry entry. `f` and `df` map float64 arrays to float64 arrays of the same shape."""

    name: str
    f: Callable[[Array], Array]
    df: Callable[[Array], Array]
    torch_op: str  # the exact torch expression the runtime must reproduce
    # k(y) as a sympy string, with f'(x) - 1 ~ exp(-k(x)) as x -> +inf: the 'floor' family's right branch
    right_decay: str | None = None
    monotone: bool = False  # an increasing f: one branch ("right"), no bit
    # f'(f^-1(y)) as a sympy string in y, where a closed form exists (monotone f): the 'exact' family
    exact_q: str | None = None
    derivation: Derivation | None = None
    threshold: float = field(init=False)  # T = argmin f; -inf when monotone
    y_min: float = field(init=False)  # f(T); inf f = f(-inf) when monotone

    def __post_init__(self) -> None:
        if self.exact_q is not None and not self.monotone:
            raise ValueError(f"{self.name}: exact_q is one expression, for a monotone activation only")
        t = -np.inf if self.monotone else _root_of_derivative(self.df)
        with np.errstate(invalid="ignore"):  # f(-inf) may be NaN (then the entry is rejected below)
            y_min = float(self.f(np.float64(t)))
        if self.monotone and not (np.isfinite(y_min) and np.all(self.df(_MONOTONE_CHECK) >= 0)):
            raise ValueError(f"{self.name}: monotone=True needs f' >= 0 and a finite f(-inf)")
        object.__setattr__(self, "threshold", t)
        object.__setattr__(self, "y_min", y_min)

    @property
    def branches(self) -> tuple[str, ...]:
        """The branches q is fitted and stored on: ("right",) for a monotone f, else ("left", "right")."""
        return ("right",) if self.monotone else ("left", "right")

    def d2f_at_threshold(self, h: float = 1e-5) -> float:
        """f''(T) by a central difference (relative error ~1e-10); used to start inversions at the cusp."""
        t = self.threshold
        return float((self.df(np.float64(t + h)) - self.df(np.float64(t - h))) / (2 * h))


def _root_of_derivative(df: Callable[[Array], Array]) -> float:
    """The sign change of f' from negative to positive on [-10, 0], refined by brentq to 1e-15."""
    grid = np.linspace(-10.0, 0.0, 10001)
    vals = df(grid)
    idx = np.flatnonzero((vals[:-1] < 0) & (vals[1:] >= 0))
    if idx.size != 1:
        raise ValueError(f"expected one minimum of f on [-10, 0], found {idx.size}")
    lo, hi = grid[idx[0]], grid[idx[0] + 1]
    return float(optimize.brentq(df, lo, hi, xtol=1e-15, rtol=4 * np.finfo(float).eps, maxiter=200))


# --- GELU (erf form): f = x * Phi(x), f' = Phi(x) + x * phi(x) ---------------------------------------
def _gelu(x: Array) -> Array:
    return x * special.ndtr(x)


def _gelu_df(x: Array) -> Array:
    return special.ndtr(x) + x * np.exp(-0.5 * x * x) / np.sqrt(2 * np.pi)


# --- tanh GELU: f = 0.5 x (1 + tanh u) = x * sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3) -------------
# Written with sigmoid so that 1 + tanh(u) does not cancel for large negative x.
def _gelu_tanh(x: Array) -> Array:
    u = _SQRT_2_OVER_PI * (x + _TANH_GELU_CUBIC * x**3)
    return x * special.expit(2 * u)


def _gelu_tanh_df(x: Array) -> Array:
    u = _SQRT_2_OVER_PI * (x + _TANH_GELU_CUBIC * x**3)
    du = _SQRT_2_OVER_PI * (1 + 3 * _TANH_GELU_CUBIC * x * x)
    s = special.expit(2 * u)
    return s + x * s * special.expit(-2 * u) * 2 * du


# --- SiLU: f = x * sigmoid(x), f' = sigmoid(x) * (1 + x * sigmoid(-x)) ----------------------------------
def _silu(x: Array) -> Array:
    return x * special.expit(x)


def _silu_df(x: Array) -> Array:
    return special.expit(x) * (1 + x * special.expit(-x))


# --- Mish: f = x tanh(softplus(x)), f' = tanh(sp) + x sech^2(sp) sigmoid(x) ---------------------------
def _mish(x: Array) -> Array:
    return x * np.tanh(np.logaddexp(0.0, x))


def _mish_df(x: Array) -> Array:
    sp = np.logaddexp(0.0, x)
    sech2 = 4 * special.expit(-2 * sp) * special.expit(2 * sp)  # 1 - tanh^2 without cancellation
    return np.tanh(sp) + x * sech2 * special.expit(x)


# --- softplus: f = log(1 + e^x), f' = sigmoid(x); monotone, f'(f^-1(y)) = 1 - exp(-y) --------------------
def _softplus(x: Array) -> Array:
    return np.logaddexp(0.0, x)


def _scaled(base: Callable[[Array], Array], a: float, *, derivative: bool) -> Callable[[Array], Array]:
    if derivative:
        return lambda x: base(a * x)
    return lambda x: base(a * x) / a


ACTIVATIONS: dict[str, Activation] = {
    a.name: a
    for a in (
        Activation("gelu", _gelu, _gelu_df, 'torch.nn.functional.gelu(x, approximate="none")', "y**2/2"),
        Activation(
            "gelu_tanh",
            _gelu_tanh,
            _gelu_tanh_df,
            'torch.nn.functional.gelu(x, approximate="tanh")',
            f"{float(2 * _SQRT_2_OVER_PI)!r}*(y + {_TANH_GELU_CUBIC}*y**3)",
        ),
        Activation("silu", _silu, _silu_df, "torch.nn.functional.silu(x)", "y"),
        # 1 - tanh(softplus(x)) ~ 2 exp(-2x), so f' - 1 ~ (4x - 2) exp(-2x)
        Activation("mish", _mish, _mish_df, "torch.nn.functional.mish(x)", "2*y"),
        Activation(
            "softplus",
            _softplus,
            special.expit,
            "torch.nn.functional.softplus(x)",
            monotone=True,
            exact_q="1 - exp(-y)",  # e^x = e^y - 1, so sigmoid(x) = (e^y - 1)/e^y
        ),
        Activation(
            "quick_gelu",
            _scaled(_silu, _QUICK_GELU_SCALE, derivative=False),
            _scaled(_silu_df, _QUICK_GELU_SCALE, derivative=True),
            f"x * torch.sigmoid({_QUICK_GELU_SCALE} * x)",
            f"{_QUICK_GELU_SCALE}*y",  # silu's k(y) = y at a*y
            derivation=Derivation("silu", _QUICK_GELU_SCALE),
        ),
    )
}


class UnknownActivation(KeyError):
    def __str__(self) -> str:
        return f"unknown activation {self.args[0]!r} (choose from {', '.join(sorted(ACTIVATIONS))})"


def get_activation(name: str) -> Activation:
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise UnknownActivation(name) from None
