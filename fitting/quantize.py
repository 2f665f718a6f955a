"""The FewBit baseline: optimal k-bit piecewise-constant approximations of f'(x), and the x-space metrics
that compare them with InvAct on equal terms.

A k-bit quantizer Q has n = 2^k levels: n contiguous intervals of x covering the domain, borders free,
one constant per interval (FewBit stores the interval's index, k bits per element). Q and f' are
gradients (dimensionless); x is the pre-activation. Metrics of an approximation g(x) of f'(x):

- `l2`: sqrt of the integrated squared error, sqrt(int_{-100}^{100} (g - f')^2 dx), unweighted (units:
  gradient * sqrt(x)); the definition of a published FewBit table (a gradient-descent re-implementation).
- `linf`: max |g - f'| over x in [-100, 100] (gradient units).
- `l2_normal`: RMS of g - f' with x ~ N(0, 1), on the quadrature of `fitting.evaluate.l2` but over both
  branches at once (gradient units): the project's `l2` (docs/fitting.md, "Error metrics") for a
  function of x.

Optima (each is exact for its discretization; see the functions for the resolution):
- `l2_optimal`: minimizes int w (Q - f')^2 dx (w = 1 on [-100, 100], or the N(0, 1) density on
  [-10, 10]) by dynamic programming over borders on a grid of cells; one DP gives every n <= 2^max_bits.
- `linf_optimal`: minimizes max |Q - f'| over a dense sample of x by greedy interval growth (optimal
  for a given error bound) and bisection on the bound.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from fitting.activations import Activation

X_DOMAIN = (-100.0, 100.0)  # the published FewBit table's domain: x in [-100, 100]
NORMAL_DOMAIN = (-10.0, 10.0)  # the N(0, 1)-weighted L2 ignores the rest (weight < 2e-22)
_NORMAL_POINTS = 2**16  # same quadrature as fitting.evaluate.l2
_GAUSS_NODES = 8  # Gauss-Legendre nodes per cell for the integrals
_MONITOR_POINTS = 200_001  # auxiliary grid on which f'' is differenced to place cells and samples
_MONITOR_FLOOR = 1e-3  # relative floor of the cell density, so that the flat tails keep some cells
_BISECTION_RTOL = 1e-12

# FewBit (Novikov et al., ICML 2023) as a baseline: a re-implementation of its gradient-descent fit of GELU's
# f' (unweighted L2 over x in [-100, 100]); k -> (L2, L-inf). An optimal quantizer is no worse in L2.
FACTS_FEWBIT_GELU = {
    1: (0.376, 0.500),
    2: (0.212, 0.175),
    3: (0.110, 0.128),
    4: (0.0641, 0.0670),
    5: (0.0296, 0.0334),
    6: (0.0150, 0.0172),
    7: (0.00875, 0.0111),
}

XFunction = Callable[[np.ndarray], np.ndarray]
_NO_BREAKS = np.empty(0)


@dataclass(frozen=True)
class Quantizer:
    """Q(x) = levels[i] on the i-th interval; `borders` (n - 1, increasing, in x) separate them, and
    the outer intervals extend to +-inf. `objective` names the metric it is optimal for."""

    borders: np.ndarray
    levels: np.ndarray
    objective: str

    @property
    def bits(self) -> int:
        return int(np.log2(len(self.levels)))

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return self.levels[np.searchsorted(self.borders, np.asarray(x, dtype=np.float64), side="right")]


# --- grids ---------------------------------------------------------------------------------------------
def _density_grid(act: Activation, lo: float, hi: float, n: int, power: float, weighted: bool) -> np.ndarray:
    """n + 1 points from lo to hi, equidistributed in the density (w |f''|^2)^(power/2) floored at
    _MONITOR_FLOOR of its maximum (w: N(0, 1) density when `weighted`, else 1)."""
    xa = np.linspace(lo, hi, _MONITOR_POINTS)
    d2 = np.abs(np.gradient(act.df(xa), xa))
    w = np.exp(-0.5 * xa * xa) if weighted else 1.0
    rho = (w * d2 * d2) ** (power / 2)
    rho = np.maximum(rho, _MONITOR_FLOOR * rho.max())
    cum = np.concatenate([[0.0], np.cumsum(0.5 * (rho[1:] + rho[:-1]) * np.diff(xa))])
    x = np.interp(np.linspace(0.0, cum[-1], n + 1), cum, xa)
    x[0], x[-1] = lo, hi
    return x


def _gauss(edges: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Nodes (cells x _GAUSS_NODES) and weights of composite Gauss-Legendre quadrature on the cells."""
    t, wt = np.polynomial.legendre.leggauss(_GAUSS_NODES)
    mid, half = 0.5 * (edges[1:] + edges[:-1]), 0.5 * np.diff(edges)
    return mid[:, None] + half[:, None] * t, half[:, None] * wt


# --- L2: dynamic programming over borders ----------------------------------------------------------------
def segment_l2(w: np.ndarray, s1: np.ndarray, s2: np.ndarray, n_max: int) -> tuple[np.ndarray, np.ndarray]:
    """Optimal partition of M cells into n contiguous segments, each approximated by one constant.

    Cell m carries w[m] = int w, s1[m] = int w g, s2[m] = int w g^2 (weight w > 0, target g). A segment's
    best constant is S1/W and its cost S2 - S1^2/W (prefix sums make every cost O(1), and each DP layer
    one vectorized min over an (M+1) x (M+1) matrix). Returns cost[n] for n = 0..n_max (cost[0] = inf)
    and parent[n, j]: the last border before edge j in the best n-segment partition of cells [0, j).
    """
    m = len(w)
    c = 0.5 * (s1.sum() / w.sum())  # shift g by a constant (costs unchanged) to cut cancellation
    s2 = s2 - 2 * c * s1 + c * c * w
    s1 = s1 - c * w
    W, S1, S2 = (np.concatenate([[0.0], np.cumsum(a)]) for a in (w, s1, s2))
    cost_t = np.full((m + 1, m + 1), np.inf)  # cost_t[j, i]: cells i..j-1, transposed for row reductions
    for j0 in range(0, m + 1, 512):
        j = np.arange(j0, min(j0 + 512, m + 1))[:, None]
        dw, d1, d2 = W[j] - W[None, :], S1[j] - S1[None, :], S2[j] - S2[None, :]
        with np.errstate(divide="ignore", invalid="ignore"):
            block = np.maximum(d2 - np.where(dw > 0, d1 * d1 / dw, 0.0), 0.0)
        cost_t[j0 : j0 + len(j)] = np.where(np.arange(m + 1)[None, :] < j, block, np.inf)
    cost = np.full(n_max + 1, np.inf)
    parent = np.zeros((n_max + 1, m + 1), dtype=np.int64)
    best = cost_t[:, 0].copy()  # one segment
    cost[1] = best[m]
    rows = np.arange(m + 1)
    buf = np.empty_like(cost_t)
    for n in range(2, n_max + 1):
        np.add(cost_t, best[None, :], out=buf)
        parent[n] = buf.argmin(axis=1)
        best = buf[rows, parent[n]]
        cost[n] = best[m]
    return cost, parent


def _borders(parent: np.ndarray, n: int, m: int) -> np.ndarray:
    """The n + 1 edge indices (0 and m included) of the best n-segment partition."""
    edges = [m]
    for layer in range(n, 1, -1):
        edges.append(int(parent[layer, edges[-1]]))
    return np.array([0, *edges[::-1]])


def l2_optimal(act: Activation, max_bits: int = 8, cells: int = 4000, weight: str = "uniform") -> dict:
    """{k: Quantizer} for k = 1..max_bits, each minimizing int w (Q - f')^2 dx over borders on a grid.

    weight "uniform": w = 1 on X_DOMAIN (the published L2); "normal": the N(0, 1) density on NORMAL_DOMAIN
    (the project's l2). The grid has `cells` cells equidistributed in (w f''^2)^(1/3), the asymptotic
    density of optimal borders, with Gauss-Legendre integrals per cell: the DP is exactly optimal over
    borders on the grid, and the continuous optimum is below it by the border rounding. GELU's k = 8 L2
    with 1000 / 2000 / 4000 / 8000 cells: 0.0037962 / 0.0037221 / 0.0037088 / 0.0037032, so 4000 cells
    are within ~0.3% of the continuous optimum (k = 7: 0.01% from 8000 cells). O(cells^2 * 2^max_bits)
    time, 2 * 8 * cells^2 bytes of memory (4000 cells: 256 MB and ~5 s for k = 8 on one core).
    """
    if weight not in ("uniform", "normal"):
        raise ValueError(f"weight must be 'uniform' or 'normal', got {weight!r}")
    lo, hi = X_DOMAIN if weight == "uniform" else NORMAL_DOMAIN
    edges = _density_grid(act, lo, hi, cells, power=2 / 3, weighted=weight == "normal")
    nodes, qw = _gauss(edges)
    if weight == "normal":
        qw = qw * np.exp(-0.5 * nodes * nodes) / np.sqrt(2 * np.pi)
    g = act.df(nodes)
    cost, parent = segment_l2(qw.sum(1), (qw * g).sum(1), (qw * g * g).sum(1), 2**max_bits)
    out = {}
    for k in range(1, max_bits + 1):
        idx = _borders(parent, 2**k, cells)
        W = np.add.reduceat(qw.sum(1), idx[:-1])
        S1 = np.add.reduceat((qw * g).sum(1), idx[:-1])
        out[k] = Quantizer(edges[idx[1:-1]], S1 / W, "l2" if weight == "uniform" else "l2_normal")
    return out


# --- L-inf: greedy interval growth + bisection ----------------------------------------------------------
def greedy_segments(v: np.ndarray, eps: float, n_limit: int) -> list[int]:
    """Start indices of the greedy partition of the sequence v into segments of range <= 2 eps (each
    segment as long as possible). Stops once it has n_limit + 1 segments. Greedy needs the fewest
    segments for a given eps: any partition's i-th border is at or before greedy's."""
    starts: list[int] = []
    s, size = 0, 64
    while s < len(v) and len(starts) <= n_limit:
        starts.append(s)
        hi = lo = v[s]
        e = s + 1
        while e < len(v):
            block = v[e : e + size]
            mx = np.maximum(np.maximum.accumulate(block), hi)
            mn = np.minimum(np.minimum.accumulate(block), lo)
            bad = mx - mn > 2 * eps
            if bad.any():
                e += int(np.argmax(bad))
                break
            hi, lo, e = mx[-1], mn[-1], e + len(block)
            size *= 2
        size = max(64, e - s)
        s = e
    return starts


def segment_linf(v: np.ndarray, n: int) -> tuple[float, list[int]]:
    """The least max |Q - v| of an n-segment piecewise-constant Q on the sequence v, and the greedy
    segment starts achieving it. Bisection on eps, relative tolerance _BISECTION_RTOL; the returned
    error is the one the returned partition achieves."""
    lo, hi = 0.0, 0.5 * float(v.max() - v.min())
    if len(greedy_segments(v, lo, n)) <= n:
        return 0.0, greedy_segments(v, lo, n)
    while hi - lo > _BISECTION_RTOL * hi:
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if len(greedy_segments(v, mid, n)) <= n else (mid, hi)
    starts = greedy_segments(v, hi, n)
    bounds = [*starts, len(v)]
    err = max(0.5 * float(v[a:b].max() - v[a:b].min()) for a, b in zip(bounds[:-1], bounds[1:], strict=True))
    return err, starts


@functools.lru_cache(maxsize=8)
def linf_samples(act: Activation, samples: int) -> np.ndarray:
    """`samples` + 1 points of X_DOMAIN equidistributed in |f''| (so f' moves about equally between
    neighbours), floored so the tails keep some points."""
    return _density_grid(act, *X_DOMAIN, samples, power=1.0, weighted=False)


def linf_optimal(act: Activation, max_bits: int = 8, samples: int = 2**20) -> dict:
    """{k: Quantizer} for k = 1..max_bits minimizing max |Q - f'| on `samples` points of X_DOMAIN.

    Exactly optimal on the samples (up to the bisection tolerance), and any quantizer's continuous
    error is at least that; the returned Q's continuous error exceeds it by at most the largest change
    of f' between neighbouring samples (`linf_resolution`, 1.6e-6 for GELU at 2^20 samples). Borders
    lie midway between samples; levels are the midranges of f' on their segments.
    """
    x = linf_samples(act, samples)
    v = act.df(x)
    out = {}
    for k in range(1, max_bits + 1):
        _, starts = segment_linf(v, 2**k)
        bounds = [*starts, len(v)]
        levels = [0.5 * (v[a:b].max() + v[a:b].min()) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        borders = 0.5 * (x[np.array(starts[1:], dtype=int) - 1] + x[starts[1:]])
        levels += [levels[-1]] * (2**k - len(levels))  # fewer segments sufficed: repeat the last level
        borders = np.concatenate([borders, np.full(2**k - 1 - len(borders), X_DOMAIN[1])])
        out[k] = Quantizer(borders, np.array(levels), "linf")
    return out


def linf_resolution(act: Activation, samples: int = 2**20) -> float:
    """Largest |f'| change between neighbouring L-inf samples: a bound on how far the continuous error
    of `linf_optimal`'s quantizer can exceed its error on the samples."""
    return float(np.max(np.abs(np.diff(act.df(linf_samples(act, samples))))))


# --- metrics in x ------------------------------------------------------------------------------------------
def x_errors(
    act: Activation, g: XFunction, breaks: np.ndarray = _NO_BREAKS, cells: int = 2**14, samples: int = 2**20
) -> dict:
    """{"l2", "linf", "l2_normal"} of g(x) against f'(x) (see the module docstring for the definitions).

    l2: composite Gauss-Legendre on `cells` cells equidistributed in |f''|^(2/3) plus `breaks` (g's
    discontinuities, e.g. a quantizer's borders) and T, so the integrand is smooth on every cell.
    linf: max over linf_samples(act, samples) plus 4096 points geometric toward T on either side.
    """
    edges = np.union1d(_density_grid(act, *X_DOMAIN, cells, 2 / 3, False), [*breaks, act.threshold])
    edges = edges[(edges >= X_DOMAIN[0]) & (edges <= X_DOMAIN[1])]
    nodes, qw = _gauss(edges)
    l2 = float(np.sqrt(np.sum(qw * (g(nodes) - act.df(nodes)) ** 2)))
    near = np.geomspace(1e-12, 1.0, 4096)
    x = np.concatenate([linf_samples(act, samples), act.threshold - near, act.threshold + near])
    linf = float(np.max(np.abs(g(x) - act.df(x))))
    return {"l2": l2, "linf": linf, "l2_normal": l2_normal(act, g)}


def l2_normal(act: Activation, g: XFunction, branch: str | None = None) -> float:
    """RMS of g(x) - f'(x) with x ~ N(0, 1), by fitting.evaluate.l2's quadrature (2^16 points on
    [-10, 10]); `branch` "left"/"right" restricts to x < T / x >= T as that function does."""
    x = np.linspace(*NORMAL_DOMAIN, _NORMAL_POINTS)
    if branch is not None:
        x = x[(x < act.threshold) if branch == "left" else (x >= act.threshold)]
    w = np.exp(-0.5 * x * x)
    err = g(x) - act.df(x)
    return float(np.sqrt(np.sum(w * err * err) / np.sum(w)))


def invact_of_x(act: Activation, q_left: XFunction, q_right: XFunction) -> XFunction:
    """g(x) = q_b(f(x)) with the branch b chosen by x (left where x < T): InvAct's gradient in x."""

    def g(x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float64)
        y = act.f(x)
        return np.where(x < act.threshold, q_left(y), q_right(y))

    return g


def fewbit_table(
    act: Activation, max_bits: int = 8, cells: int = 4000, samples: int = 2**20, metric_cells: int = 2**14
) -> list[dict]:
    """Per k = 1..max_bits, the x-space metrics (`x_errors`) of the three optimal quantizers, one
    optimal for each metric: rows {"k", "objective", "l2", "linf", "l2_normal"}."""
    quantizers = {
        "l2": l2_optimal(act, max_bits, cells, "uniform"),
        "l2_normal": l2_optimal(act, max_bits, cells, "normal"),
        "linf": linf_optimal(act, max_bits, samples),
    }
    return [
        {"k": k, "objective": obj, **x_errors(act, qs[k], qs[k].borders, metric_cells, samples)}
        for k in range(1, max_bits + 1)
        for obj, qs in quantizers.items()
    ]
