"""The 'floor' family: piecewise polynomials in variables where q is smooth, at the fp32 storage floor.

Goal: error <= GOAL = 1e-5 on the fp32 lattice (docs/fitting.md, "Error metrics") on both branches,
with kernels that keep it when they compute in fp32. Each branch is two pieces, selected by y; each piece is
q = A(y) + B(y) * P(z), P a Horner polynomial in z in [-1, 1] with monomial coefficients c_k:

- left, y < split:  P(s), s = sqrt(y - y_min): f'(f^-1(y)) is analytic in s at the cusp.
- left, y >= split: y * P(w), w = sqrt(-log(-y)): q/y = f'/f (~ -x for a Gaussian tail, 1 + 1/x for
  SiLU's) is smooth out to y -> 0-. w is capped where |q| < CUT; -y is floored at the smallest normal
  fp32, so y = 0 gives q = 0.
- right, y < split: P(s).
- right, y >= split: 1 + D(y) * P(s) with D = exp(-k(y)) the activation's own decay of f' - 1
  (`Activation.right_decay`): (q - 1)/D grows at most linearly in y. s is capped where |q - 1| < CUT,
  and D reads max(y, y_min) like s does. Without a right_decay (a user-defined activation), k is
  estimated: k(y) = a y + b y^2, least squares on -log|q - 1| over the tail where CUT < |q - 1| <
  1e-3 (estimate_decay). Measured on the built-ins with their decay withheld (right branch, linf_fp32):
  silu 1.95e-6 (1.27e-6 with k = y), gelu 8.99e-7, mish 1.38e-6; with D = 1 instead, 2e-5 to 6e-5.

fp32 details: y - y_min is computed as max(y - y_hi, y_lo) - y_lo with y_hi = fp32(y_min) and
y_lo = y_min - y_hi. Near the cusp y - y_hi is exact (Sterbenz), so s is right to fp32 rounding at the
lattice points next to y_min, where one fp32 y_min would cost up to ~1e-4 in q. Each piece's variable
is mapped to [-1, 1], so its monomial coefficients stay small (at most 22 for the built-ins, at
degrees up to 14) and Horner loses little in fp32 (tested against the generated torch code evaluated
in fp32).

A monotone activation bounded on both sides has one branch of two pieces, one per end (monotone_form).

Splits and degrees are chosen per activation: each piece gets the smallest degree whose Chebyshev
least-squares start is within GOAL/2 on the metric grid, and of the splits whose pieces all reach
that, the one with the lowest block cost wins (block_cost: what the CPU kernel, which runs a far
piece only in blocks of 16 elements that need it, spends per element for N(0, 1) inputs). The
pipeline then refines all coefficients to minimax. The forms use f and f' only, so derived
activations (quick_gelu) get their own fit (`native=True`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import sympy
from numpy.polynomial import chebyshev
from scipy import special
from sympy import Max, Min, Piecewise, exp, log, sqrt

from codegen.safe_expr import parse
from fitting.activations import SHAPE_GRID, Activation
from fitting.evaluate import metric_x_grid
from fitting.families import BranchForm, Family, UnknownFamily, Y, coefficient_symbols, register
from fitting.targets import Branch, invert, target

GOAL = 1e-5
MAX_DEGREE = 16
CUT = 1e-7  # past the caps, q is within CUT of its limit (0 or 1)
LEFT_SPLITS = (0.05, 0.1, 0.25, 0.5)  # candidate splits, as fractions of y_min
RIGHT_SPLITS = (0.5, 1.0, 2.0, 3.0, 4.0)  # candidate splits, in y
FP32_TINY = float(np.finfo(np.float32).tiny)

Numeric = np.ndarray


def _f(value: float) -> sympy.Float:
    return sympy.Float(float(value), 17)


def _rounded(value: float) -> float:
    """A data-driven choice (split, cap, range) to 6 digits: the expression, compared with the committed
    one by tests, then does not depend on the last bits of a machine's libm."""
    return float(f"{value:.6g}")


def horner(coefficients: list[sympy.Symbol], z: sympy.Expr) -> sympy.Expr:
    """c0 + z (c1 + z (c2 + ...)): 2 flops per degree, the order the kernels evaluate it in."""
    expr = coefficients[-1]
    for c in reversed(coefficients[:-1]):
        expr = c + z * expr
    return expr


@dataclass(frozen=True)
class Piece:
    """q = a + b * P(z) on y in [lo, hi), with z = v(y) mapped from [v_lo, v_hi] to [-1, 1].

    Symbolic parts (sympy, in Y) print into the kernels; numeric parts (float64 arrays of y) fit the
    start."""

    a: sympy.Expr
    b: sympy.Expr
    v: sympy.Expr
    v_lo: float
    v_hi: float

    def numeric(self, part: sympy.Expr, y: Numeric) -> Numeric:
        with np.errstate(all="ignore"):
            return np.broadcast_to(sympy.lambdify(Y, part, "numpy")(y), y.shape).astype(np.float64)

    def z(self, y: Numeric) -> Numeric:
        return (2.0 * self.numeric(self.v, y) - (self.v_lo + self.v_hi)) / (self.v_hi - self.v_lo)

    def start(self, y: Numeric, t: Numeric, goal: float = GOAL) -> tuple[list[float], float]:
        """The smallest degree whose least-squares fit is within goal/2 (else MAX_DEGREE): monomial
        coefficients in z and the fit's max error on y."""
        z, a, b = self.z(y), self.numeric(self.a, y), self.numeric(self.b, y)
        for degree in range(2, MAX_DEGREE + 1):
            basis = chebyshev.chebvander(z, degree) * b[:, None]
            coef, *_ = np.linalg.lstsq(basis, t - a, rcond=None)
            err = float(np.max(np.abs(basis @ coef + a - t)))
            if err <= goal / 2:
                break
        return [float(c) for c in chebyshev.cheb2poly(coef)], err

    def expression(self, coefficients: list[sympy.Symbol]) -> sympy.Expr:
        scale = 2.0 / (self.v_hi - self.v_lo)
        z = _f(scale) * self.v - _f(scale * self.v_lo + 1.0)
        return self.a + self.b * horner(coefficients, z)


def _fp32_pair(value: float) -> tuple[sympy.Float, sympy.Float]:
    """(hi, lo): hi = fp32(value), lo = value - hi, so y - value = (y - hi) - lo is exact to fp32 rounding
    near value (Sterbenz)."""
    hi = float(np.float32(value))
    return _f(hi), _f(value - hi)


def _s(act: Activation) -> sympy.Expr:
    """sqrt(y - y_min) >= 0, exact to fp32 rounding near the cusp (module docstring)."""
    hi, lo = _fp32_pair(act.y_min)
    return sqrt(Max(Y - hi, lo) - lo)


@functools.lru_cache(maxsize=16)
def _samples(act: Activation, branch: Branch) -> tuple[Numeric, Numeric]:
    """y on the branch (float64, sorted) and the exact target there: the metric grid."""
    y = np.sort(act.f(metric_x_grid(act, branch)))
    return y, target(act, y, branch)


def _cut(goal: float) -> float:
    """How close q must be to its limit past a cap: CUT for GOAL, in proportion for another goal."""
    return CUT * goal / GOAL


def _last_y_beyond(y: Numeric, excess: Numeric, goal: float = GOAL) -> float:
    """The largest y where `excess` (|q - limit|) is still above the cut."""
    return _rounded(y[np.flatnonzero(excess > _cut(goal)).max()])


# The CPU kernel's cost model (invact/_generated/<act>_cpu.py, _backward_span): every element pays
# its branch's near piece; a block of BLOCK elements pays a far piece when one of them lies beyond the
# split. Costs are in Horner steps (one fused multiply-add over a vector). The far piece's own
# transform, exp or log (~25 steps each in invact/activation/_cpu_math.py) plus a sqrt and its pass over the
# block, counts FAR_STEPS more: measured on a 2-core AMD EPYC (AVX-512), in-cache per element, a log
# cost 3.6x and an exp 2.8x a degree-8 Horner polynomial. The kernel now evaluates both branches'
# near pieces as one polynomial of the larger degree with per-element coefficients, so an element
# pays the larger near degree; each branch's split is still chosen alone, which for gelu leaves its
# left split at 0.1 y_min, where 0.05 y_min (degree 16) would halve the blocks needing that far piece.
BLOCK = 16
FAR_STEPS = 30


@dataclass(frozen=True)
class Split:
    """A branch's two fitted pieces: the form, each start's degree and max error, and the share of
    N(0, 1) inputs x that land on the far piece."""

    form: BranchForm
    degrees: tuple[int, int]
    errors: tuple[float, float]
    far_share: float
    goal: float = GOAL

    @property
    def cost(self) -> float:
        """Horner steps per element (see BLOCK): the near piece, and the far one in its blocks."""
        far_blocks = 1.0 - (1.0 - self.far_share) ** BLOCK
        return self.degrees[0] + far_blocks * (self.degrees[1] + FAR_STEPS)

    @property
    def lane_cost(self) -> int:
        """Horner steps per element where every element computes both pieces and selects one (a GPU
        kernel: the lanes of a warp run in step); the far piece's transform costs the same at any split."""
        return sum(self.degrees)

    @property
    def reaches_goal(self) -> bool:
        return max(self.errors) <= self.goal / 2


def best_split(splits: list[Split], lanes: bool = False) -> Split:
    """The cheapest split of those whose starts reach goal/2 (of all if none does): by block cost, or
    by lane cost with `lanes`."""
    cost = (lambda s: (s.lane_cost, s.cost)) if lanes else (lambda s: s.cost)
    return min([s for s in splits if s.reaches_goal] or splits, key=cost)


def _far_share(act: Activation, branch: Branch, split: float) -> float:
    """P(x lands on the branch's far piece, y >= split) for x ~ N(0, 1): x below f_b^-1(split) on the
    left branch, above it on the right."""
    x = float(invert(act, np.array([split]), branch)[0])
    return float(special.ndtr(x) if branch == "left" else special.ndtr(-x))


def _two_pieces(act: Activation, branch: Branch, y: Numeric, t: Numeric, split: float, near: Piece,
                far: Piece, goal: float = GOAL) -> Split:  # fmt: skip
    """Piecewise((near, y < split), (far, True)) with fitted starts."""
    inside = y < split
    c_near, e_near = near.start(y[inside], t[inside], goal)
    c_far, e_far = far.start(y[~inside], t[~inside], goal)
    c = coefficient_symbols(len(c_near) + len(c_far))
    expression = Piecewise(
        (near.expression(c[: len(c_near)]), Y < _f(split)), (far.expression(c[len(c_near) :]), True)
    )
    start = {f"c{i}": v for i, v in enumerate(c_near + c_far)}
    share = _far_share(act, branch, split) if branch in ("left", "right") else 0.0
    degrees = (len(c_near) - 1, len(c_far) - 1)
    return Split(BranchForm(expression, start), degrees, (e_near, e_far), share, goal)


def left_form(act: Activation, split_fraction: float, goal: float = GOAL) -> Split:
    y, t = _samples(act, "left")
    if not (act.y_min < 0 and y[-1] < 0 and abs(t[-1]) < _DECAY_TAIL):  # the far piece is y P(w)
        shape = f"{act.name} has f = {y[-1]:.4g}, f' = {t[-1]:.4g} at x = -20"
        raise UnknownFamily(f"family 'floor' fits activations with f < 0 left of the minimum and f, f' -> 0 "
                            f"as x -> -inf; {shape}")  # fmt: skip
    y, t = y[y < 0], t[y < 0]
    split = _rounded(split_fraction * act.y_min)
    w_cap = _rounded(np.sqrt(-np.log(-_last_y_beyond(y, np.abs(t), goal))))
    w = sqrt(-log(Max(-Y, _f(FP32_TINY))))
    near = Piece(sympy.S.Zero, sympy.S.One, _s(act), 0.0, _rounded(np.sqrt(split - act.y_min)))
    far = Piece(sympy.S.Zero, Y, Min(w, _f(w_cap)), _rounded(np.sqrt(-np.log(-split))), w_cap)
    return _two_pieces(act, "left", y, t, split, near, far, goal)


_DECAY_TAIL = 1e-3  # estimate_decay fits k where CUT < |q - 1| < this: the tail, past f' - 1's sign changes
_DECAY_POINTS = 8  # fewer tail samples than this: no estimate (k = 0, D = 1)


def estimate_decay(y: Numeric, t: Numeric) -> sympy.Expr:
    """k(y) = a y + b y^2 (coefficients to 6 digits, see _rounded) fitted to -log|q - 1| on the right
    branch's tail; 0 where the tail has too few samples (f' reaches 1 within the grid)."""
    excess = np.abs(t - 1)
    tail = (excess > CUT) & (excess < _DECAY_TAIL) & (y > 0)
    if np.count_nonzero(tail) < _DECAY_POINTS:
        return sympy.S.Zero
    basis = np.stack([y[tail], y[tail] ** 2, np.ones(np.count_nonzero(tail))], axis=1)
    (a, b, _), *_ = np.linalg.lstsq(basis, -np.log(excess[tail]), rcond=None)
    return _f(_rounded(a)) * Y + _f(_rounded(b)) * Y**2


def _limit_is_one(act: Activation, y: Numeric, t: Numeric) -> None:
    """The right form is 1 + D P: q must reach 1 (f' -> 1 as x -> inf) within the metric range."""
    if abs(t[-1] - 1) > _DECAY_TAIL:
        raise UnknownFamily(f"family 'floor' fits activations whose slope tends to 1 (f(x) ~ x as x -> inf); "
                            f"{act.name}'s f' is {t[-1]:.4g} at x = 20")  # fmt: skip


def right_form(act: Activation, split: float, goal: float = GOAL) -> Split:
    y, t = _samples(act, "right")
    _limit_is_one(act, y, t)
    if act.right_decay is None:
        decay = estimate_decay(y, t)
    else:
        decay = parse(act.right_decay, {"y": Y}, where=f"{act.name}: right_decay")
    decay = decay.subs(Y, Max(Y, _f(act.y_min)))
    s_cap = _rounded(np.sqrt(_last_y_beyond(y, np.abs(t - 1), goal) - act.y_min))
    s_split = _rounded(np.sqrt(split - act.y_min))
    near = Piece(sympy.S.Zero, sympy.S.One, _s(act), 0.0, s_split)
    far = Piece(sympy.S.One, exp(-decay), Min(_s(act), _f(s_cap)), s_split, s_cap)
    return _two_pieces(act, "right", y, t, split, near, far, goal)


# A monotone activation bounded on both sides (CDF- or sigmoid-shaped: laplace): q -> 0 at both ends.
# One branch, two pieces split at the steepest point y_mid = f(argmax f'): below it q = u P(w),
# u = y - y_min, w = sqrt(-log(u / U)); above it q = v P(w), v = y_max - y, the same form mirrored.
# q / u = f'/(f - y_min) is smooth in w out to u -> 0 (-z for a Gaussian tail, 1 - u for a logistic
# one), as on the left branch of a two-branch f. U = 2 (y_mid - y_min) (2 (y_max - y_mid) above)
# keeps u / U <= 1/2, so w >= sqrt(log 2) > 0. Measured for laplace: one piece of degree 7 reaches 2.5e-6
# by least squares on each side.
_FAR_X = 1e4  # y_max = f(_FAR_X): f is flat to float64 there when f'(20) < CUT


def _tail_piece(distance: sympy.Expr, scale: float, d: Numeric, t: Numeric, goal: float = GOAL) -> Piece:
    """q = distance * P(w), w = sqrt(-log(distance / scale)) capped where |q| < the cut; `d` the
    samples' distance, `t` their targets."""
    w = sqrt(-log(Max(distance * _f(1.0 / scale), _f(FP32_TINY))))
    cap = _rounded(np.sqrt(-np.log(d[np.flatnonzero(np.abs(t) > _cut(goal))].min() / scale)))
    return Piece(sympy.S.Zero, distance, Min(w, _f(cap)), _rounded(np.sqrt(np.log(2.0))), cap)


def monotone_form(act: Activation, goal: float = GOAL) -> Split:
    y, t = _samples(act, "right")
    with np.errstate(all="ignore"):
        y_max, slope_end = float(act.f(np.float64(_FAR_X))), float(act.df(np.float64(SHAPE_GRID[-1])))
    if not (np.isfinite(act.y_min) and np.isfinite(y_max) and abs(slope_end) < CUT and t[0] < CUT):
        raise UnknownFamily(f"family 'floor' fits a monotone activation bounded on both sides (CDF- or "
                            f"sigmoid-shaped, f' -> 0 at both ends); {act.name} has f' = {t[0]:.3g} at "
                            f"x = -20 and {slope_end:.3g} at x = 20")  # fmt: skip
    x_mid = SHAPE_GRID[np.argmax(act.df(SHAPE_GRID))]  # the steepest point, on the metric range
    split = _rounded(float(act.f(np.float64(x_mid))))
    lo_hi, lo_lo = _fp32_pair(act.y_min)
    hi_hi, hi_lo = _fp32_pair(y_max)
    u = Max(Y - lo_hi, sympy.S.Zero) - lo_lo  # y - y_min
    v = Max(hi_hi - Y, sympy.S.Zero) + hi_lo  # y_max - y
    below = y < split
    low = _tail_piece(u, 2 * (split - act.y_min), y[below] - act.y_min, t[below], goal)
    high = _tail_piece(v, 2 * (y_max - split), y_max - y[~below], t[~below], goal)
    return _two_pieces(act, "monotone", y, t, split, low, high, goal)


@register("floor", native=True, monotone=True)
def floor(act: Activation) -> Family:
    if act.monotone:
        return Family("floor", act.name, {"right": monotone_form(act).form}, published=False,
                      source="invact 'floor' family, monotone: u P(sqrt(-log u)) toward each end, u the "
                      "distance from y_min or y_max (fitting/families/floor.py)")  # fmt: skip
    left = best_split([left_form(act, f) for f in LEFT_SPLITS])
    right = best_split([right_form(act, s) for s in RIGHT_SPLITS])
    return Family(
        "floor",
        act.name,
        {"left": left.form, "right": right.form},
        published=False,
        source="invact 'floor' family: piecewise Horner polynomials in sqrt(y - y_min), sqrt(-log(-y)), "
        "times the activation's own right-tail decay (fitting/families/floor.py)",
    )


# The 'half' family: the same forms for 16-bit outputs (bf16, fp16), whose kernels run compute-bound
# on a GPU at the fp32 family's degrees (benchmarks/kernel_sass.py). A stored 16-bit y already moves q
# by the dtype's storage floor (gelu at the cusp: 1.4e-2 in bf16, 6.5e-3 in fp16, against 4.8e-5 in
# fp32), and dx is rounded to 16 bits (2^-12 relative in fp16): GOAL_16BIT keeps q's own error under a
# tenth of fp16's half-ulp at q ~ 1, so InvAct's 16-bit gradient error stays the stored y's. Every
# element of a GPU warp computes both pieces of its branch, so the split minimizes their degrees' sum.
GOAL_16BIT = 5e-5


@register("half", native=True, monotone=True)
def half(act: Activation) -> Family:
    source = ("invact 'half' family: the 'floor' forms at error 5e-5 for 16-bit outputs, splits chosen "
              "for GPU lanes (fitting/families/floor.py)")  # fmt: skip
    if act.monotone:
        return Family("half", act.name, {"right": monotone_form(act, GOAL_16BIT).form}, published=False,
                      source=source)  # fmt: skip
    left = best_split([left_form(act, f, GOAL_16BIT) for f in LEFT_SPLITS], lanes=True)
    right = best_split([right_form(act, s, GOAL_16BIT) for s in RIGHT_SPLITS], lanes=True)
    return Family("half", act.name, {"left": left.form, "right": right.form}, published=False, source=source)
