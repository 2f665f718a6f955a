"""The registry against mpmath at 30 digits: f, f', T and y_min."""

import re

import mpmath as mp
import numpy as np
import pytest
import sympy

from fitting.activations import ACTIVATIONS, Activation, UnknownActivation, get_activation

mp.mp.dps = 30


def _mp_f(name: str, x):
    # Written without 1 + erf / 1 + tanh, which cancel for x << 0 even at 30 digits.
    if name == "gelu":
        return x * mp.erfc(-x / mp.sqrt(2)) / 2
    if name == "gelu_tanh":
        return x / (1 + mp.exp(-2 * mp.sqrt(2 / mp.pi) * (x + mp.mpf("0.044715") * x**3)))
    if name == "silu":
        return x / (1 + mp.exp(-x))
    if name == "quick_gelu":
        return x / (1 + mp.exp(-mp.mpf("1.702") * x))
    if name == "mish":
        return x * mp.tanh(mp.log1p(mp.exp(x)))
    if name == "softplus":
        return mp.log1p(mp.exp(x))
    if name == "sqrtsoftplus":
        return mp.sqrt(mp.log1p(mp.exp(x)))
    if name == "laplace":  # transformers' LaplaceActivation: mu = 0.707107, sigma = 0.282095
        return mp.ncdf((x - mp.mpf("0.707107")) / mp.mpf("0.282095"))
    if name in _PIECEWISE:
        return _PIECEWISE[name][0](x)
    raise KeyError(name)


_SELU_SCALE, _SELU_ALPHA = (
    mp.mpf("1.0507009873554804934193349852946"),
    mp.mpf("1.6732632423543772848170429916717"),
)
# Piecewise activations: (f, f') written out, f' with torch's choice at each kink (a numerical
# derivative there would average the two sides). gelu_10's f' is 0 where the float64 y is at the clip:
# y cannot tell x = 10 from beyond it (fitting.activations._clipped).
_PIECEWISE = {
    "gelu_10": (lambda x: min(_mp_f("gelu", x), 10),
                lambda x: mp.mpf(0) if float(_mp_f("gelu", x)) >= 10 else _mp_df("gelu", x)),
    "relu2": (lambda x: x * x if x > 0 else mp.mpf(0), lambda x: 2 * x if x > 0 else mp.mpf(0)),
    "leaky_relu": (lambda x: x if x > 0 else x / 100, lambda x: mp.mpf(1) if x > 0 else mp.mpf(1) / 100),
    "elu": (lambda x: x if x > 0 else mp.expm1(x), lambda x: mp.mpf(1) if x > 0 else mp.exp(x)),
    "celu": (lambda x: x if x > 0 else mp.expm1(x), lambda x: mp.mpf(1) if x > 0 else mp.exp(x)),
    "selu": (lambda x: _SELU_SCALE * (x if x > 0 else _SELU_ALPHA * mp.expm1(x)),
             lambda x: _SELU_SCALE * (1 if x > 0 else _SELU_ALPHA * mp.exp(x))),
    "relu6": (lambda x: min(max(x, 0), 6), lambda x: mp.mpf(1) if 0 < x < 6 else mp.mpf(0)),
    "hardswish": (lambda x: mp.mpf(0) if x < -3 else x * (x + 3) / 6 if x <= 3 else x,
                  lambda x: mp.mpf(0) if x < -3 else x / 3 + mp.mpf(1) / 2 if x <= 3 else mp.mpf(1)),
}  # fmt: skip


def _mp_df(name: str, x):
    return _PIECEWISE[name][1](x) if name in _PIECEWISE else mp.diff(lambda t: _mp_f(name, t), x)


# f(x) = g(x - mu): its float64 form folds mu into g's argument as a rounded constant, which moves the
# argument by ulp(mu / scale) whatever x is, so the condition number counts |x| + mu where x alone
# would be 1 (laplace near x = 0: 5.6 ulps on x's count, 1.3 on this one).
_SHIFT = {"laplace": 0.707107}


X = np.concatenate([np.linspace(-30, 30, 241), [-0.75, -1.28, -1e-3, 1e-3]])


def _ulps(got: float, want) -> float:
    return abs(got - float(want)) / np.spacing(max(abs(float(want)), 1e-300))


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_f_and_derivative_match_mpmath(name):
    act = ACTIVATIONS[name]
    worst_f = worst_df_abs = worst_df_tail = 0.0
    for x in X:
        xm = mp.mpf(float(x))
        f_ref, df_ref = _mp_f(name, xm), _mp_df(name, xm)
        # f's error in ulp, over its condition number 1 + |x f'/f| (quick_gelu rounds 1.702 x first).
        if abs(f_ref) > 1e-300:  # below, f is subnormal and its relative error means nothing
            cond = 1 + (abs(float(xm)) + _SHIFT.get(name, 0.0)) * abs(float(df_ref / f_ref))
            worst_f = max(worst_f, _ulps(float(act.f(np.float64(x))), f_ref) / cond)
        df = float(act.df(np.float64(x)))
        # f' crosses 0 at T, so in the body measure its error in ulp(1), the scale of its terms ...
        worst_df_abs = max(worst_df_abs, abs(df - float(df_ref)) / np.spacing(1.0))
        # ... and in the left tail, where f' is tiny, relative to itself (catches cancellation).
        if 1e-300 < abs(float(df_ref)) < 1e-3 and x < -3:
            # (a shifted f's rounded mu moves f' by mu |f''/f'| relative ulps: see _SHIFT)
            shift = _SHIFT.get(name, 0.0)
            cond_df = 1 + shift * abs(float(mp.diff(lambda t: _mp_df(name, t), xm) / df_ref)) if shift else 1
            worst_df_tail = max(worst_df_tail, abs(df / float(df_ref) - 1) / cond_df)
    # Measured on this grid: worst_f <= 1.9, worst_df_abs = 1.0, worst_df_tail <= 6e-14 (gelu_tanh,
    # whose cubic argument is rounded before exp). Twice those, rounded up:
    assert worst_f <= 4
    assert worst_df_abs <= 2
    assert worst_df_tail <= 1.2e-13


TWO_BRANCH = sorted(n for n, a in ACTIVATIONS.items() if not a.monotone)


@pytest.mark.parametrize("name", TWO_BRANCH)
def test_threshold_is_the_root_of_the_derivative(name):
    act = ACTIVATIONS[name]
    t_ref = mp.findroot(lambda t: _mp_df(name, t), act.threshold)
    assert abs(act.threshold - float(t_ref)) <= 1e-14
    assert _ulps(act.y_min, _mp_f(name, t_ref)) <= 4  # f(T) in float64: measured 2 ulp for GELU


def test_paper_thresholds():
    # The paper: GELU T = -0.7517915246935646, SiLU T = -1.278464542761074 (printed to 16 digits).
    assert get_activation("gelu").threshold == pytest.approx(-0.7517915246935646, abs=2e-16)
    assert get_activation("silu").threshold == pytest.approx(-1.278464542761074, abs=2e-16)


def test_quick_gelu_is_scaled_silu():
    q, s = get_activation("quick_gelu"), get_activation("silu")
    a = q.derivation.scale
    assert q.derivation.base == "silu"
    assert q.threshold == pytest.approx(s.threshold / a, rel=1e-14)
    assert q.y_min == pytest.approx(s.y_min / a, rel=1e-14)
    x = np.linspace(-10, 10, 101)
    np.testing.assert_allclose(q.df(x), s.df(a * x), rtol=0, atol=0)


def test_monotone_entry_has_one_branch_and_its_infimum():
    act = get_activation("softplus")
    assert act.monotone and act.branches == ("right",) and act.threshold == -np.inf
    assert act.y_min == 0.0  # inf softplus = lim_{x -> -inf} log(1 + e^x), exactly 0 in float64
    assert get_activation("gelu").branches == ("left", "right")
    # exact_q is f'(f^-1(y)): at x, with y = f(x), it equals f'(x). Measured 1.1e-16 (ulp(1)/2) on this
    # grid; twice that allowed. Any wrong closed form is off by far more.
    x = np.linspace(-30, 30, 601)
    ((_, text),) = act.exact_q
    expression = sympy.sympify(text.replace("expm1", "_e"))  # sympify does not know expm1
    q = sympy.lambdify(sympy.Symbol("y"), expression, {"_e": np.expm1})(act.f(x))
    np.testing.assert_allclose(q, act.df(x), rtol=0, atol=2.3e-16)


def test_registry_rejects_inconsistent_entries():
    silu = get_activation("silu")
    with pytest.raises(ValueError, match=r"exact_q needs one formula per branch \('left', 'right'\)"):
        Activation("bad", silu.f, silu.df, "x", exact_q=(("right", "1"),))
    # SiLU decreases left of T: it is not monotone, and saying so must fail.
    with pytest.raises(ValueError, match=r"monotone=True needs f' >= 0 and f\(-inf\) < inf"):
        Activation("bad", silu.f, silu.df, "x", monotone=True)


def test_unknown_activation_message_lists_choices():
    choices = ", ".join(sorted(ACTIVATIONS))
    with pytest.raises(
        UnknownActivation, match=re.escape(f"unknown activation 'swish2' (choose from {choices})")
    ):
        get_activation("swish2")
