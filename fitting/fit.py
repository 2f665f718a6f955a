"""Fit a branch form's coefficients: weighted least squares, then minimax (L-inf) refinement.

Both stages are deterministic (fixed samples, no random numbers). The minimax stage is sequential
linear programming: linearize the residuals r(c) = q(y_i; c) - target_i on the sample, solve
min t s.t. |r + J dc| <= t inside a trust region (scipy's HiGHS), accept the step when the true max
error falls by at least a tenth of the predicted fall. Then an exchange step adds the dense metric
grid's worst points to the sample and repeats, so the L-inf error holds between sample points too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import sympy
from scipy import optimize

from fitting.activations import Activation
from fitting.evaluate import branch_x_range, branch_y_range, full_precision, metric_x_grid
from fitting.families import BranchForm, Y
from fitting.targets import Branch, target

Progress = Callable[[str], None]


@dataclass(frozen=True)
class FitSettings:
    """Sample sizes per branch and iteration limits. The defaults are what `invact-fit` uses."""

    uniform_x: int = 1200  # uniform in x over the branch's part of [-20, 20]
    cusp_x: int = 1200  # geometric in |x - T|, from 1e-10 (none for a monotone activation)
    uniform_y: int = 1200  # uniform in y over the branch's range
    lstsq_max_nfev: int = 2000
    minimax_iterations: int = 150  # per exchange round
    exchange_rounds: int = 4
    exchange_points: int = 64  # worst dense-grid points added per round


@dataclass(frozen=True)
class Sample:
    y: np.ndarray
    target: np.ndarray
    weight: np.ndarray  # least-squares weights: each part of the sample has total weight 1


def fit_sample(act: Activation, branch: Branch, s: FitSettings) -> Sample:
    """y uniform in x, geometric toward T (not for a monotone activation: no cusp) and uniform in y."""
    lo, hi = branch_x_range(act, branch)
    sign = -1.0 if branch == "left" else 1.0
    x_parts = [np.linspace(lo, hi, s.uniform_x)]
    if not act.monotone:
        x_parts.append(act.threshold + sign * np.geomspace(1e-10, hi - lo, s.cusp_x))
    parts = [act.f(x) for x in x_parts] + [np.linspace(*branch_y_range(act, branch), s.uniform_y)]
    y = np.concatenate(parts)
    weight = np.concatenate([np.full(p.size, 1.0 / p.size) for p in parts])
    return Sample(y=y, target=target(act, y, branch), weight=weight)


class Residuals:
    """r(c) = q(y; c) - target on fixed y, with non-finite values mapped to a large penalty."""

    PENALTY = 1e6

    def __init__(self, form: BranchForm, y: np.ndarray, t: np.ndarray):
        self.names = list(form.start)
        symbols = [sympy.Symbol(n, real=True) for n in self.names]
        self._fn = sympy.lambdify([Y, *symbols], full_precision(form.expression), "numpy")
        self.y, self.t = y, t

    def __call__(self, c: np.ndarray) -> np.ndarray:
        with np.errstate(all="ignore"):
            r = np.broadcast_to(self._fn(self.y, *c), self.y.shape) - self.t
        return np.where(np.isfinite(r), r, self.PENALTY)

    def jacobian(self, c: np.ndarray) -> np.ndarray:
        """Central differences, step 1e-7 relative (truncation and rounding both ~1e-8 relative)."""
        h = 1e-7 * np.maximum(np.abs(c), 1e-3)
        cols = []
        for j in range(c.size):
            e = np.zeros_like(c)
            e[j] = h[j]
            cols.append((self(c + e) - self(c - e)) / (2 * h[j]))
        return np.stack(cols, axis=1)


def least_squares(form: BranchForm, sample: Sample, start: np.ndarray, s: FitSettings) -> np.ndarray:
    r = Residuals(form, sample.y, sample.target)
    sw = np.sqrt(sample.weight)
    result = optimize.least_squares(
        lambda c: sw * r(c), start, jac=lambda c: sw[:, None] * r.jacobian(c), method="trf",
        x_scale="jac", max_nfev=s.lstsq_max_nfev, xtol=1e-15, ftol=1e-15, gtol=1e-15,
    )  # fmt: skip
    return result.x


def _minimax_on(r: Residuals, c: np.ndarray, iterations: int) -> tuple[np.ndarray, float]:
    """SLP trust-region minimax of max|r(c)| over r's fixed sample; the best c found and its error."""
    res = r(c)
    err = np.max(np.abs(res))
    scale = np.maximum(np.abs(c), 1e-3)
    radius = 0.05  # trust region, relative to `scale`
    n = c.size
    objective = np.r_[np.zeros(n), 1.0]
    for _ in range(iterations):
        js = r.jacobian(c) * scale
        ones = np.ones((res.size, 1))
        a_ub = np.block([[js, -ones], [-js, -ones]])
        b_ub = np.r_[-res, res]
        bounds = [(-radius, radius)] * n + [(0, None)]
        lp = optimize.linprog(objective, A_ub=a_ub, b_ub=b_ub, bounds=bounds, method="highs")
        if lp.status != 0:
            break
        predicted = err - lp.x[n]
        if predicted <= 1e-13 * err:
            break
        trial = c + lp.x[:n] * scale
        trial_res = r(trial)
        trial_err = np.max(np.abs(trial_res))
        if err - trial_err >= 0.1 * predicted:
            c, res, err = trial, trial_res, trial_err
            if err - trial_err >= 0.75 * predicted:
                radius = min(2 * radius, 1.0)
            scale = np.maximum(np.abs(c), 1e-3)
        else:
            radius *= 0.25
            if radius < 1e-12:
                break
    return c, err


def _worst_points(q_err: np.ndarray, y: np.ndarray, k: int) -> np.ndarray:
    """The y of the k largest local maxima of |error| along the sorted grid."""
    a = np.abs(q_err)
    peak = np.r_[a[0] >= a[1], (a[1:-1] >= a[:-2]) & (a[1:-1] >= a[2:]), a[-1] >= a[-2]]
    idx = np.flatnonzero(peak)
    return y[idx[np.argsort(a[idx])[::-1][:k]]]


def minimax(
    act: Activation, branch: Branch, form: BranchForm, sample: Sample, start: np.ndarray, s: FitSettings,
    progress: Progress | None = None,
) -> np.ndarray:  # fmt: skip
    """Minimax refinement with exchange against the dense metric grid (y = f(x) in float64)."""
    y_dense = act.f(metric_x_grid(act, branch))
    order = np.argsort(y_dense)
    y_dense = y_dense[order]
    t_dense = target(act, y_dense, branch)
    dense = Residuals(form, y_dense, t_dense)
    y, t, c = sample.y, sample.target, start
    for k in range(s.exchange_rounds):
        if progress:
            progress(f"minimax, exchange round {k + 1}/{s.exchange_rounds}")
        c, sample_err = _minimax_on(Residuals(form, y, t), c, s.minimax_iterations)
        dense_res = dense(c)
        if np.max(np.abs(dense_res)) <= sample_err * (1 + 1e-3):
            break
        extra = _worst_points(dense_res, y_dense, s.exchange_points)
        y = np.r_[y, extra]
        t = np.r_[t, target(act, extra, branch)]
    return c


@dataclass(frozen=True)
class BranchFit:
    lstsq: dict[str, float]
    minimax: dict[str, float]


def fit_branch(
    act: Activation, branch: Branch, form: BranchForm, start: dict[str, float] | None = None,
    settings: FitSettings = FitSettings(), progress: Progress | None = None,
) -> BranchFit:  # fmt: skip
    """Least squares from `start` (default: the form's own), then minimax from the least-squares fit."""
    names = list(form.start)
    c0 = np.array([(start or form.start)[n] for n in names], dtype=np.float64)
    if progress:
        progress("exact targets")
    sample = fit_sample(act, branch, settings)
    if progress:
        progress("least squares")
    c_ls = least_squares(form, sample, c0, settings)
    c_mm = minimax(act, branch, form, sample, c_ls, settings, progress)
    as_dict = lambda c: {n: float(v) for n, v in zip(names, c, strict=True)}  # noqa: E731
    return BranchFit(lstsq=as_dict(c_ls), minimax=as_dict(c_mm))
