"""Error metrics of an approximation q of f'(f_b^-1(y)) (docs/fitting.md, "Error metrics"), and flop counts.

- linf: max |q(y) - target(y)| with y = f(x) in float64, x on the branch within [-20, 20]: a uniform
  grid of 2^17 points plus 4096 points geometric in |x - T| from 1e-12 (the cusp).
- linf_<dtype>: the same with y rounded to the dtype and the target recomputed at the rounded y. For
  fp16 and bf16 every representable y of the branch's range is checked (exhaustive); for fp32 the
  rounded grid plus the first 2^16 fp32 values above y_min, where the error peaks.
- l2: RMS of q(f(x)) - f'(x) with x ~ N(0, 1) on the branch (quadrature on 2^16 points).
- storage floor in a dtype: max |f'(f_b^-1(round(f(x)))) - f'(x)| over the linf grid: what even the
  exact estimator loses once y is stored in that dtype.

A monotone activation's one branch ("right") is all of [-20, 20] (and l2 the whole line): there is no
cusp, so no geometric refinement, and its range of y starts at f(-20), not at y_min = f(-inf). So its
fp32 lattice part is the first 2^16 fp32 values above f(-20) (x within ~1e-2 of -20), and its 16-bit
lattices cover [f(-20), f(20)].
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import sympy
from sympy.codegen.cfunctions import expm1

from codegen.coeffs_json import Y
from fitting.activations import Activation
from fitting.targets import Branch, target

X_RANGE = (-20.0, 20.0)
_UNIFORM_POINTS = 2**17
_CUSP_POINTS = 4096
_L2_POINTS = 2**16
_FP32_CUSP_LATTICE = 2**16

QFunction = Callable[[np.ndarray], np.ndarray]


@dataclass(frozen=True)
class FloatFormat:
    """A binary float format: `bits` significand bits (with the implicit one), smallest normal
    2^(min_exp - 1), largest finite `max`."""

    name: str
    bits: int
    min_exp: int
    max: float


FORMATS = {
    "fp32": FloatFormat("fp32", 24, -125, float(np.finfo(np.float32).max)),
    "fp16": FloatFormat("fp16", 11, -13, float(np.finfo(np.float16).max)),
    "bf16": FloatFormat("bf16", 8, -125, 3.3895313892515355e38),
}


def round_to(y: np.ndarray, fmt: FloatFormat) -> np.ndarray:
    """Round float64 values to the nearest value of `fmt` (ties to even, subnormals, overflow to inf),
    returned as float64. Matches numpy's float32/float16 casts and torch's float32 -> bfloat16 cast
    (torch's float64 -> bfloat16 cast goes through float32 and so rounds twice)."""
    y = np.asarray(y, dtype=np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        _, e = np.frexp(y)
        e = np.maximum(e, fmt.min_exp)  # below the normal range the quantum stays fixed
        out = np.ldexp(np.rint(np.ldexp(y, fmt.bits - e)), e - fmt.bits)
        return np.where(np.abs(out) > fmt.max, np.copysign(np.inf, y), out)


@functools.lru_cache(maxsize=4)
def _all_16bit_values(name: str) -> np.ndarray:
    codes = np.arange(2**16, dtype=np.uint32)
    if name == "fp16":
        v = codes.astype(np.uint16).view(np.float16).astype(np.float64)
    else:
        with np.errstate(invalid="ignore"):  # NaN patterns, dropped below
            v = (codes << 16).view(np.float32).astype(np.float64)
    return np.unique(v[np.isfinite(v)])


def lattice(fmt: FloatFormat, lo: float, hi: float) -> np.ndarray:
    """Every value of a 16-bit format in [round(lo), round(hi)], or for fp32 the first 2^16 values
    from round(lo) upward (capped at round(hi)), as float64."""
    a, b = (float(round_to(np.float64(v), fmt)) for v in (lo, hi))
    if fmt.name != "fp32":
        v = _all_16bit_values(fmt.name)
        return v[(v >= a) & (v <= b)]
    # Ordinals: consecutive integers are consecutive fp32 values (-x maps to -ordinal(x)).
    start = np.float32(a)
    magnitude = np.int64(np.abs(start).view(np.int32))
    ordinals = (-magnitude if start < 0 else magnitude) + np.arange(_FP32_CUSP_LATTICE, dtype=np.int64)
    mags = np.abs(ordinals).astype(np.int32).view(np.float32).astype(np.float64)
    v = np.where(ordinals < 0, -mags, mags)
    return v[v <= b]


def branch_x_range(act: Activation, branch: Branch) -> tuple[float, float]:
    """The branch's part of X_RANGE (all of it for a monotone activation)."""
    if act.monotone:
        return X_RANGE
    return (X_RANGE[0], act.threshold) if branch == "left" else (act.threshold, X_RANGE[1])


def branch_y_range(act: Activation, branch: Branch) -> tuple[float, float]:
    """The y of the branch's part of X_RANGE: from y_min (from f(-20) for a monotone activation, whose
    y_min is at x = -inf) to f at the end of X_RANGE."""
    lo, hi = branch_x_range(act, branch)
    y_far = float(act.f(np.float64(lo if branch == "left" else hi)))
    return (float(act.f(np.float64(lo))) if act.monotone else act.y_min), y_far


def metric_x_grid(act: Activation, branch: Branch) -> np.ndarray:
    """Sorted x on the branch within X_RANGE: uniform plus geometric refinement toward T (none for a
    monotone activation)."""
    lo, hi = branch_x_range(act, branch)
    uniform = np.linspace(lo, hi, _UNIFORM_POINTS)
    if act.monotone:
        return uniform
    span = hi - lo
    near = np.geomspace(1e-12, span, _CUSP_POINTS)
    cusp = act.threshold - near if branch == "left" else act.threshold + near
    x = np.concatenate([uniform, cusp])
    x = x[(x < act.threshold) if branch == "left" else (x >= act.threshold)]
    return np.unique(x)


def full_precision(expression: sympy.Expr) -> sympy.Expr:
    """Every Float at 17 significant digits: lambdify prints a 53-bit Float with only 15, which moves
    constants by up to 1e-15 relative and q by ~1e-10 relative."""
    return expression.xreplace({f: sympy.Float(float(f), 17) for f in expression.atoms(sympy.Float)})


def compile_q(expression: sympy.Expr) -> QFunction:
    """A float64 numpy function of y from an expression whose only free symbol is y."""
    free = expression.free_symbols - {Y}
    if free:
        raise ValueError(f"expression has free symbols besides y: {sorted(map(str, free))}")
    fn = sympy.lambdify(Y, full_precision(expression), "numpy")

    def q(y: np.ndarray) -> np.ndarray:
        y = np.asarray(y, dtype=np.float64)
        with np.errstate(all="ignore"):
            return np.broadcast_to(fn(y), y.shape).astype(np.float64)

    return q


def _max_abs(err: np.ndarray) -> float:
    """max |err|, with NaN counted as an infinite error."""
    return float(np.max(np.where(np.isnan(err), np.inf, np.abs(err)), initial=0.0))


def linf(act: Activation, branch: Branch, q: QFunction) -> float:
    y = act.f(metric_x_grid(act, branch))
    return _max_abs(q(y) - target(act, y, branch))


def dtype_eval_points(act: Activation, branch: Branch, fmt: FloatFormat) -> np.ndarray:
    """The stored y values a kernel sees in `fmt` for x on the branch (see the module docstring)."""
    y = act.f(metric_x_grid(act, branch))
    return np.unique(np.concatenate([round_to(y, fmt), lattice(fmt, *branch_y_range(act, branch))]))


def linf_dtype(act: Activation, branch: Branch, q: QFunction, fmt: FloatFormat) -> float:
    y = dtype_eval_points(act, branch, fmt)
    return _max_abs(q(y) - target(act, y, branch))


def l2(act: Activation, branch: Branch, q: QFunction) -> float:
    """RMS of q(f(x)) - f'(x), x ~ N(0, 1) on the branch (the whole line for a monotone activation)."""
    x = np.linspace(-10.0, 10.0, _L2_POINTS)
    x = x[(x < act.threshold) if branch == "left" else (x >= act.threshold)]
    w = np.exp(-0.5 * x * x)
    err = q(act.f(x)) - act.df(x)
    return float(np.sqrt(np.sum(w * err * err) / np.sum(w)))


def storage_floor(act: Activation, branch: Branch, fmt: FloatFormat) -> float:
    x = metric_x_grid(act, branch)
    return _max_abs(target(act, round_to(act.f(x), fmt), branch) - act.df(x))


def errors(act: Activation, branch: Branch, q: QFunction) -> dict[str, float]:
    """All error metrics for one branch: l2, linf, linf_fp32, linf_fp16, linf_bf16."""
    out = {"linf": linf(act, branch, q), "l2": l2(act, branch, q)}
    for name, fmt in FORMATS.items():
        out[f"linf_{name}"] = linf_dtype(act, branch, q, fmt)
    return out


def storage_floors(act: Activation, branch: Branch) -> dict[str, float]:
    return {name: storage_floor(act, branch, fmt) for name, fmt in FORMATS.items()}


def count_flops(expression: sympy.Expr) -> int:
    """Operations per element after common-subexpression elimination (as generated code computes it):
    one per +, -, *, /, sqrt, exp, log, abs, max, min; x^k costs k-1 multiplications (plus a division
    when k < 0); other powers cost 2 (exp and log)."""
    replacements, (reduced,) = sympy.cse(expression)
    return sum(_flops_of_tree(e) for _, e in replacements) + _flops_of_tree(reduced)


def _flops_of_tree(expression: sympy.Expr) -> int:
    total = 0
    for node in sympy.preorder_traversal(expression):
        if isinstance(node, (sympy.Add, sympy.Mul, sympy.Max, sympy.Min)):
            total += len(node.args) - 1
        elif isinstance(node, sympy.Pow):
            k = node.exp
            negative = bool(k.is_negative)
            if abs(k) == sympy.S.Half:
                total += 1 + negative
            elif k.is_Integer:
                total += abs(int(k)) - 1 + negative
            else:
                total += 2
        elif isinstance(node, (sympy.exp, sympy.log, sympy.Abs, sympy.Piecewise)):
            total += 1
        elif isinstance(node, expm1):  # as computed in fp32: exp, then - 1
            total += 2
    return total
