"""The float64 backend's backward: invert y on its branch exactly and return f'(x), so
torch.autograd.gradcheck holds (its forward is the portable one; float64 keeps packed bits in
precision-bit mode too, having no rounding to spare). Safeguarded Newton inside a bracket (bisection
when a step leaves it). Where f has one sign near the root (the left branch: f < 0; a monotone f with
y_min >= 0: f > 0) it solves log|f(x)| = log|y|, which stays well scaled as y -> 0 and x -> -inf."""

from __future__ import annotations

import torch

from invact.activation import _bits
from invact.activation.activations import Activation

_MAX_ITER = 200
_MAX_DOUBLINGS = 64  # of the upper end of a monotone bracket: from >= 1 to past 1.8e19
_LEFT_END = -800.0  # f(-800) is 0 or -0 in float64 for every activation here


def invert(act: Activation, y: torch.Tensor, left: torch.Tensor | None) -> torch.Tensor:
    """x with f(x) = y on the branch given by `left` (bool, same shape; None for a monotone f).
    float64 in, float64 out. y at or below y_min maps to T (-inf for a monotone f); y >= 0 on the left
    branch maps to -inf."""
    if act.monotone:
        return _invert_monotone(act, y)
    t = act.threshold
    y = torch.clamp_min(y, act.y_min)
    lo = torch.where(left, torch.full_like(y, _LEFT_END), torch.full_like(y, t))
    hi = torch.where(left, torch.full_like(y, t), torch.clamp_min(y, 0) + 1)  # f(x) >= x - 0.3 on the right
    x = _newton(act, y, lo, hi, log_residual=left, sign=-1.0)
    x = torch.where(y == act.y_min, torch.full_like(x, t), x)
    return torch.where(left & (y >= 0), torch.full_like(x, float("-inf")), x)


def _invert_monotone(act: Activation, y: torch.Tensor) -> torch.Tensor:
    """The monotone case: the root lies in [-800, hi], hi = max(y, 0) + 1 where f(x) >= x, doubled
    until f(hi) >= y where f lies below x (a bounded f, a CDF); y above sup f maps to +inf."""
    y = torch.clamp_min(y, act.y_min)
    lo, hi = torch.full_like(y, _LEFT_END), torch.clamp_min(y, 0) + 1
    for _ in range(_MAX_DOUBLINGS):
        short = act.f(hi) < y
        if not bool(short.any()):
            break
        hi = torch.where(short, 2 * hi, hi)
    beyond = act.f(hi) < y  # past sup f (a neighbour of y = sup f, say): x = +inf, as far as y tells
    positive = torch.full_like(y, act.y_min >= 0, dtype=torch.bool)
    inside = (y > act.y_min) & ~beyond
    x = _newton(act, torch.where(inside, y, act.f(hi)), lo, hi, log_residual=positive, sign=1.0)
    x = torch.where(beyond, torch.full_like(x, float("inf")), x)
    return torch.where(y > act.y_min, x, torch.full_like(x, float("-inf")))


def _newton(act, y, lo, hi, log_residual: torch.Tensor, sign: float) -> torch.Tensor:
    """Root of g(x) = f(x) - y in [lo, hi], or g = log(sign f) - log(sign y) where `log_residual`."""
    x = lo + 0.5 * (hi - lo)  # not (lo + hi) / 2: that overflows for y near the float64 maximum
    log_y = torch.log(torch.clamp_min(sign * y, 1e-320))
    for _ in range(_MAX_ITER):
        fx, dfx = act.f(x), act.df(x)
        g = torch.where(log_residual, torch.log(sign * fx) - log_y, fx - y)
        dg = torch.where(log_residual, dfx / fx, dfx)
        lo = torch.where(g < 0, x, lo)
        hi = torch.where(g > 0, x, hi)
        step = x - g / dg
        # The bracket is closed: for y past 2^53 on the right branch the root is y itself = hi.
        step = torch.where((step >= lo) & (step <= hi), step, lo + 0.5 * (hi - lo))
        done = (step - x).abs() <= 4e-16 * x.abs()
        x = torch.where(g == 0, x, step)
        if bool(done.all()):
            break
    return x


def derivative_from_output(act: Activation, y: torch.Tensor, left: torch.Tensor | None) -> torch.Tensor:
    """f'(f^-1(y)) in float64, 0 where x = -inf. NaN where torch's own backward gives NaN from what y
    tells: y NaN (x NaN, or x = -inf, where f is -inf * 0), and for two branches y = +-inf as well
    (the fp32 kernels' rule); a monotone f's y = +-inf is x = +-inf, whose f' it returns."""
    y = y.double()
    if act.closed_form:  # q is f'(f^-1(y)) itself: evaluated in float64, exact to float64 rounding
        gen = act.generated
        df = gen.q_right(y) if left is None else torch.where(left, gen.q_left(y), gen.q_right(y))
    else:
        x = invert(act, y, left)
        df = torch.where(torch.isneginf(x), torch.zeros_like(x), act.df(x))
    return torch.where(torch.isnan(y) if act.monotone else ~torch.isfinite(y), torch.nan, df)


def backward(act: Activation, y: torch.Tensor, bits: torch.Tensor, dy: torch.Tensor, precision_bit: bool
             ) -> torch.Tensor:  # fmt: skip
    """dx = dy f'(f^-1(y)) for flat float64 tensors (`precision_bit` changes nothing: see above)."""
    left = None if act.monotone else _bits.unpack(bits, y.numel())
    return (dy * derivative_from_output(act, y, left)).to(dy.dtype)
