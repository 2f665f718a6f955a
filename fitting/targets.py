"""Exact targets: x = f_b^-1(y) and f'(x) on one monotone branch b, in float64.

Method: a table of (x, f(x)) per branch, geometric in |x - T| (dense at the cusp), gives every y a
bracket [x_lo, x_hi]; the start inside it is interpolated linearly in s = sqrt(y - y_min), in which
x is analytic at the cusp. A safeguarded Newton iteration (bisection whenever a step leaves the
bracket) then converges quadratically. On the left branch it solves log(-f(x)) = log(-y), which
stays well scaled as y -> 0- and x -> -inf. Result: |f(x) - y| within a few ulp of y (tested), and
10^6 points in well under 2 s on one core (benchmarks/targets.py).

A monotone activation has the one branch "right" over the whole line (T = -inf): its table is
geometric in |x| both ways from x = 0, over x in [-700, 1e3]. Where f > 0 it solves log f(x) = log y
for y < 1, so y -> 0+ (x -> -inf) stays well scaled like the left branch's tail, and f(x) = y above.

Conventions: y below y_min (a rounded cusp value) is treated as y_min, so x = T and the target is 0
(f'(T) = 0; for a monotone f, x = -inf and f'(-inf) = 0). On the left branch y >= 0 means x = -inf,
where f' -> 0. Non-finite y gives NaN.
"""

from __future__ import annotations

import functools
from typing import Literal

import numpy as np

from fitting.activations import Activation

Branch = Literal["left", "right"]
_TABLE_POINTS = 4096
_MAX_ITER = 200  # bisection alone needs at most ~1100 halvings across float64; Newton needs < 10
_POLISH_STEPS = 2  # Newton steps on f - y after the log-residual solve of a positive monotone f
_EDGE_STEPS = 64  # ulps target() steps off a flat piece at most (see there)
_MONOTONE_LEFT_END = 700.0  # a monotone table starts at x = -700, where f is still a normal float64


def _positive(act: Activation) -> bool:
    """A monotone f > 0 (y_min >= 0): solved in log f toward y -> 0+."""
    return act.monotone and act.y_min >= 0


@functools.lru_cache(maxsize=32)
def _table(act: Activation, branch: Branch) -> tuple[np.ndarray, np.ndarray]:
    """(x, f(x)) on the branch, ordered by increasing f, from x = T out to where f leaves float64 range."""
    d = np.concatenate([[0.0], np.geomspace(1e-9, 1e3, _TABLE_POINTS)])
    if act.monotone:  # increasing in x over the whole line, around x = 0
        left = d[(d > 0) & (d <= _MONOTONE_LEFT_END)]
        x = np.concatenate([-left[::-1], d])
    else:
        x = act.threshold + (-d if branch == "left" else d)
    with np.errstate(over="ignore", under="ignore"):
        fx = act.f(x)
    # Keep the strictly increasing, finite part (the left tail underflows to 0 near x ~ -38 for GELU),
    # where the residual's log |f| exists.
    keep = np.isfinite(fx)
    if branch == "left":
        keep &= fx < 0
    elif _positive(act):
        keep &= fx > 0
    x, fx = x[keep], fx[keep]
    strictly = np.concatenate([[True], np.diff(fx) > 0])
    return x[strictly], fx[strictly]


def _residual(act: Activation, branch: Branch, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """g(x) increasing in x with g = 0 at the root, and g'(x)."""
    fx, dfx = act.f(x), act.df(x)
    if branch == "left":
        # f < 0 and decreasing in x, so log(-f) is increasing; g' = f'/f > 0.
        return np.log(-fx) - np.log(-y), dfx / fx
    if not _positive(act):
        return fx - y, dfx
    # log f below y = 1; above, f itself: log y's rounding, eps |log y|, would move x by that relative.
    tail = y < 1
    return np.where(tail, np.log(fx) - np.log(y), fx - y), np.where(tail, dfx / fx, dfx)


def invert(act: Activation, y: np.ndarray, branch: Branch) -> np.ndarray:
    """x = f_b^-1(y) for an array of float64 y (any shape). See the module docstring for conventions."""
    y = np.asarray(y, dtype=np.float64)
    out = np.full(y.shape, np.nan)
    flat_y = y.ravel()
    flat = out.reshape(-1)
    finite = np.isfinite(flat_y)
    yc = np.maximum(flat_y, act.y_min)

    at_cusp = finite & (yc == act.y_min)
    flat[at_cusp] = act.threshold
    todo = finite & ~at_cusp
    if branch == "left":
        flat[todo & (yc >= 0)] = -np.inf
        todo &= yc < 0
    idx = np.flatnonzero(todo)
    flat[idx] = _solve(act, branch, yc[idx])
    return out


def _solve(act: Activation, branch: Branch, y: np.ndarray) -> np.ndarray:
    """Safeguarded Newton for y strictly inside the branch's range (y_min < y, and y < 0 on the left)."""
    xt, ft = _table(act, branch)
    k = np.searchsorted(ft, y)  # ft[k-1] < y <= ft[k]
    above, below = k == len(ft), y < ft[0]  # below: only a monotone f's table ends above y_min
    inside = ~above & ~below
    lo_i = np.clip(k - 1, 0, len(ft) - 1)
    hi_i = np.clip(k, 0, len(ft) - 1)
    # Bracket in x; on the left branch x decreases as f increases, so the table's order flips.
    a, b = xt[lo_i], xt[hi_i]
    lo, hi = np.minimum(a, b), np.maximum(a, b)
    if above.any():
        outward = -1.0 if branch == "left" else 1.0
        lo[above], hi[above] = _expand_beyond_table(act, branch, y[above], xt[-1], outward, rising=True)
    if below.any():
        lo[below], hi[below] = _expand_beyond_table(act, branch, y[below], xt[0], -1.0, rising=False)

    # Start: linear in s = sqrt(f - y_min) between the table's points (exact at the cusp to first order).
    s_y, s_a, s_b = (np.sqrt(np.maximum(v - act.y_min, 0.0)) for v in (y, ft[lo_i], ft[hi_i]))
    with np.errstate(invalid="ignore", divide="ignore"):
        w = np.where(inside & (s_b > s_a), (s_y - s_a) / (s_b - s_a), 0.5)
    x = xt[lo_i] + np.clip(w, 0.0, 1.0) * (xt[hi_i] - xt[lo_i])
    x = np.where(inside, x, 0.5 * (lo + hi))
    # y is a table value: its x is the root. Needed where the root is the bracket's end and no
    # relative tolerance is reached (y = 0 at x = 0: leaky_relu's 0.01 x, bisected toward 0 forever).
    hit = inside & (ft[hi_i] == y)
    x[hit] = xt[hi_i][hit]

    active = np.flatnonzero(~hit)
    for _ in range(_MAX_ITER):
        if active.size == 0:
            break
        xa, ya, la, ha = x[active], y[active], lo[active], hi[active]
        with np.errstate(all="ignore"):
            g, dg = _residual(act, branch, xa, ya)
            la = np.where(g < 0, xa, la)
            ha = np.where(g > 0, xa, ha)
            xn = xa - g / dg
        bad = ~((xn > la) & (xn < ha))  # also catches NaN steps
        xn = np.where(bad, 0.5 * (la + ha), xn)
        tol = 2 * np.finfo(float).eps * np.abs(xn)
        done = (g == 0) | (np.abs(xn - xa) <= tol) | (ha - la <= tol)
        xn = np.where(g == 0, xa, xn)
        x[active], lo[active], hi[active] = xn, la, ha
        active = active[~done]
    if active.size:
        raise RuntimeError(f"{act.name}/{branch}: inversion did not converge for {active.size} points")
    if _positive(act):
        # Solved in log f below y = 1, which leaves eps |log y| of relative error in y: harmless where
        # x ~ log y (softplus's tail), 60 ulp where f is a power of x (relu2 at y = 1e-26). Newton
        # steps on f - y remove it; each is kept only where it brings f(x) closer to y.
        for _ in range(_POLISH_STEPS):
            with np.errstate(all="ignore"):
                fx = act.f(x)
                xn = x - (fx - y) / act.df(x)
                better = np.isfinite(xn) & (np.abs(act.f(xn) - y) < np.abs(fx - y))
            x = np.where(better, xn, x)
    return x


def _expand_beyond_table(
    act: Activation, branch: Branch, y: np.ndarray, x_edge: float, outward: float, rising: bool
) -> tuple[np.ndarray, np.ndarray]:
    """(lo, hi) brackets of roots past the table's end x_edge, found by doubling the distance from T
    (from 0 for a monotone f) in the direction `outward` (+-1 in x), along which f is `rising` or not."""
    center = 0.0 if act.monotone else act.threshold
    near = np.full(y.shape, x_edge)  # the bracket's end on the table's side
    far = near.copy()
    pending = np.ones(y.shape, bool)
    d = abs(x_edge - center)
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        while pending.any():
            d *= 2
            if not np.isfinite(d):
                raise RuntimeError(f"{act.name}/{branch}: cannot bracket y = {y[pending][0]!r}")
            x_far = center + outward * d
            f_far = act.f(np.float64(x_far))
            reached = pending & ((f_far >= y) if rising else (f_far <= y))
            near[pending & ~reached] = x_far
            far[reached] = x_far
            pending &= ~reached
    return (near, far) if outward > 0 else (far, near)


def target(act: Activation, y: np.ndarray, branch: Branch) -> np.ndarray:
    """f'(f_b^-1(y)): what q must approximate. 0 at the cusp, (left branch) as y -> 0- and (monotone
    f) at y <= y_min."""
    x = invert(act, y, branch)
    with np.errstate(invalid="ignore", over="ignore"):
        t = act.df(x)
        if not act.monotone:
            # Next to a flat piece (hardswish: f = 0 for x < -3) a y between f's last two float64
            # values there may invert to the flat side, whose f' = 0 is not f' at y: step toward T.
            # Stepped ulp by ulp: the inversion ends within a few ulps of the root.
            for _ in range(_EDGE_STEPS):
                stuck = np.isfinite(x) & (t == 0) & (act.f(x) != np.asarray(y)) & (x != act.threshold)
                if not stuck.any():
                    break
                x = np.where(stuck, np.nextafter(x, act.threshold), x)
                t = np.where(stuck, act.df(x), t)
    return np.where(np.isneginf(x), 0.0, t)


def branch_of(act: Activation, x: np.ndarray) -> np.ndarray:
    """The stored bit: True (left) where x < T."""
    return np.asarray(x) < act.threshold
