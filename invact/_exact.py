"""The float64 path: invert y on its branch exactly and return f'(x), so torch.autograd.gradcheck
holds. Safeguarded Newton inside a bracket (bisection when a step leaves it); on the left branch it
solves log(-f(x)) = log(-y), which stays well scaled as y -> 0- and x -> -inf."""

from __future__ import annotations

import torch

from invact.activations import Activation

_MAX_ITER = 200
_LEFT_END = -800.0  # f(-800) is 0 or -0 in float64 for every activation here


def invert(act: Activation, y: torch.Tensor, left: torch.Tensor) -> torch.Tensor:
    """x with f(x) = y on the branch given by `left` (bool, same shape). float64 in, float64 out.
    y below y_min maps to T; y >= 0 on the left branch maps to -inf."""
    t = act.threshold
    y = torch.clamp_min(y, act.y_min)
    lo = torch.where(left, torch.full_like(y, _LEFT_END), torch.full_like(y, t))
    hi = torch.where(left, torch.full_like(y, t), torch.clamp_min(y, 0) + 1)  # f(x) >= x - 0.3 on the right
    x = 0.5 * (lo + hi)
    log_neg_y = torch.log(-torch.clamp_max(y, -1e-320))
    for _ in range(_MAX_ITER):
        fx, dfx = act.f(x), act.df(x)
        g = torch.where(left, torch.log(-fx) - log_neg_y, fx - y)
        dg = torch.where(left, dfx / fx, dfx)
        lo = torch.where(g < 0, x, lo)
        hi = torch.where(g > 0, x, hi)
        step = x - g / dg
        step = torch.where((step > lo) & (step < hi), step, 0.5 * (lo + hi))
        done = (step - x).abs() <= 4e-16 * x.abs()
        x = torch.where(g == 0, x, step)
        if bool(done.all()):
            break
    x = torch.where(y == act.y_min, torch.full_like(x, t), x)
    return torch.where(left & (y >= 0), torch.full_like(x, float("-inf")), x)


def derivative_from_output(act: Activation, y: torch.Tensor, left: torch.Tensor) -> torch.Tensor:
    """f'(f^-1(y)) in float64, 0 where x = -inf."""
    x = invert(act, y.double(), left)
    return torch.where(torch.isneginf(x), torch.zeros_like(x), act.df(x))
