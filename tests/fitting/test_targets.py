"""Inversion on each branch: backward error, the cusp, the tails, conventions."""

import numpy as np
import pytest

from fitting.activations import ACTIVATIONS
from fitting.targets import branch_of, invert, target

PAIRS = [(name, branch) for name in sorted(ACTIVATIONS) for branch in ACTIVATIONS[name].branches]
TWO_BRANCH = sorted(name for name, act in ACTIVATIONS.items() if not act.monotone)


def _branch_points(act, branch, n=20000):
    """x at distances d from T (geometric from 1e-13 and random) on the branch; both ways from 0 for a
    monotone activation. y = f(x), without the tails where |y| < 1e-300."""
    rng = np.random.default_rng(0)
    d = np.concatenate([np.geomspace(1e-13, 700, n), rng.exponential(3.0, n)])
    if act.monotone:
        x = np.concatenate([-d, d])
    else:
        x = act.threshold + (-d if branch == "left" else d)
    with np.errstate(all="ignore"):
        y = act.f(x)
    keep = np.isfinite(y) & ((y < -1e-300) if branch == "left" else (y > 1e-300) if act.monotone else True)
    return x[keep], y[keep]


@pytest.mark.parametrize(("name", "branch"), PAIRS)
def test_backward_error_within_a_few_ulp(name, branch):
    act = ACTIVATIONS[name]
    _, y = _branch_points(act, branch)
    x = invert(act, y, branch)
    assert np.all(branch_of(act, x) == (branch == "left")) or branch == "left"  # right includes T
    # The best float x can leave |f(x) - y| at ulp(y) + |f'(x)| ulp(x) (conditioning); f itself adds
    # ~2 ulp. Measured worst ratio: 5.6 (GELU left). 8 would catch a solver that stops early.
    bound = np.spacing(np.abs(y)) + np.abs(act.df(x)) * np.spacing(np.abs(x))
    assert np.max(np.abs(act.f(x) - y) / bound) <= 8


@pytest.mark.parametrize("name", TWO_BRANCH)
def test_recovers_x_at_the_cusp(name):
    act = ACTIVATIONS[name]
    for branch, sign in (("left", -1), ("right", 1)):
        d = np.geomspace(1e-6, 1e-1, 50)
        x = act.threshold + sign * d
        got = invert(act, act.f(x), branch)
        # x - T ~ sqrt(2 (y - y_min) / f''): a rounding of y by ulp(y_min) ~ 3e-17 moves x by
        # sqrt(2 * 3e-17 / 0.2) ~ 2e-8 at worst; far from the cusp the error shrinks like 1/d.
        assert np.max(np.abs(got - x) * d) <= 1e-15


def test_exactly_at_and_below_the_cusp():
    act = ACTIVATIONS["silu"]
    y = np.array([act.y_min, act.y_min - 1e-3, -0.279296875])  # bf16 rounds silu's y_min below it
    for branch in ("left", "right"):
        np.testing.assert_array_equal(invert(act, y, branch), act.threshold)
        np.testing.assert_allclose(target(act, y, branch), 0.0, atol=1e-15)


def test_tails_and_special_values():
    act = ACTIVATIONS["gelu"]
    y = np.array([0.0, -0.0, 1e-310, np.nan, np.inf])
    x_left = invert(act, y, "left")
    assert np.all(np.isneginf(x_left[:3])) and np.all(np.isnan(x_left[3:]))
    np.testing.assert_array_equal(target(act, y[:3], "left"), 0.0)
    # Huge y on the right: GELU(x) = x to the last bit there.
    big = np.array([1e3, 1e10, 3.0e38, 1e300])
    np.testing.assert_array_equal(invert(act, big, "right"), big)
    np.testing.assert_array_equal(target(act, big, "right"), 1.0)
    # Deep left tail: GELU(-37) ~ -1e-299, f' there ~ 4e-296.
    x = np.array([-37.0, -30.0, -20.0, -10.0])
    np.testing.assert_allclose(invert(act, act.f(x), "left"), x, rtol=1e-14)


def test_monotone_target_is_the_closed_form():
    act = ACTIVATIONS["softplus"]
    x, y = _branch_points(act, "right")  # x in [-700, 700], y from 1e-300 up
    t = target(act, y, "right")
    want = -np.expm1(-y)  # softplus: f'(f^-1(y)) = 1 - exp(-y), without cancellation for small y
    # Relative error: the inverted x is good to about ulp(x), which moves sigmoid(x) by ~|x| eps relative
    # in the left tail. Measured max |t - want| / (eps (1 + |x|) want) = 1.5; 3 allowed.
    assert np.max(np.abs(t - want) / (np.finfo(float).eps * (1 + np.abs(x)) * want)) <= 3
    # Conventions: y <= y_min = 0 is x = -inf with target 0; below the table (f(-700) ~ 1e-304) the
    # inversion still brackets; huge y is x = y; non-finite y gives NaN.
    y = np.array([0.0, -0.0, -1.0, 1e-310, 1e300, np.nan, np.inf])
    x = invert(act, y, "right")
    assert np.all(np.isneginf(x[:3])) and np.all(np.isnan(x[5:]))
    assert act.f(x[3]) == 1e-310 and x[4] == 1e300
    np.testing.assert_array_equal(target(act, y[:3], "right"), 0.0)
    assert np.all(branch_of(act, np.array([-1e300, 0.0, 1e300])) == 0)  # no bit: every x is "right"


def test_shape_is_kept():
    act = ACTIVATIONS["gelu"]
    y = np.linspace(-0.1, 3, 12).reshape(3, 4)
    assert invert(act, y, "right").shape == (3, 4)
    assert target(act, y, "left").shape == (3, 4)
