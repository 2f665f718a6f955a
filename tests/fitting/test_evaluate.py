"""Metrics: dtype rounding, lattices, and the published coefficients' errors, measured."""

import numpy as np
import pytest
import sympy

from fitting.activations import get_activation
from fitting.evaluate import (
    FORMATS,
    branch_x_range,
    compile_q,
    count_flops,
    dtype_eval_points,
    errors,
    l2,
    lattice,
    metric_x_grid,
    round_to,
    storage_floors,
)
from fitting.families import Y, get_family

RNG = np.random.default_rng(7)
VALUES = RNG.standard_normal(200_000) * np.exp(RNG.uniform(-110, 110, 200_000))


def test_rounding_matches_numpy_casts():
    with np.errstate(over="ignore"):
        for name, dtype in (("fp32", np.float32), ("fp16", np.float16)):
            np.testing.assert_array_equal(
                round_to(VALUES, FORMATS[name]), VALUES.astype(dtype).astype(np.float64)
            )


def test_bf16_rounding_matches_torch():
    torch = pytest.importorskip("torch")
    v32 = VALUES[np.abs(VALUES) < 3e38].astype(np.float32)
    want = torch.from_numpy(v32).to(torch.bfloat16).double().numpy()
    np.testing.assert_array_equal(round_to(v32.astype(np.float64), FORMATS["bf16"]), want)


def test_lattices():
    all_fp16 = lattice(FORMATS["fp16"], -1.0, 1.0)
    assert all_fp16.size == 2 * 15361 - 1  # 15360 values in (0, 1] and in [-1, 0), and 0 once
    assert np.all(np.diff(all_fp16) > 0)
    fp32 = lattice(FORMATS["fp32"], -0.17, 1.0)
    assert fp32.size == 2**16 and fp32[0] == np.float32(-0.17)
    np.testing.assert_array_equal(np.diff(fp32.astype(np.float32).view(np.int32)), -1)  # consecutive


# Measured with a float64 reference over x in [-20, 20]: max |q - f'(f^-1(y))| of the
# published coefficients. Printed to 2-3 digits, hence rel=0.01. A swapped SiLU table (the appendix's
# label error) or a mistyped coefficient moves these by far more.
PUBLISHED_LINF = {("gelu", "left"): 1.25e-3, ("gelu", "right"): 1.87e-2, ("silu", "left"): 8.3e-4,
                  ("silu", "right"): 2.9e-3}  # fmt: skip


@pytest.mark.parametrize(("activation", "branch"), sorted(PUBLISHED_LINF))
def test_published_coefficients_reproduce_the_measured_errors(activation, branch):
    act = get_activation(activation)
    form = get_family("paper", activation).branches[branch]
    e = errors(act, branch, compile_q(form.substituted(form.start)))
    assert e["linf"] == pytest.approx(PUBLISHED_LINF[activation, branch], rel=0.01)
    # y stored in fp32 changes q's input by 6e-8 relative: the error moves by less than 1e-6.
    assert e["linf_fp32"] == pytest.approx(e["linf"], abs=1e-6)
    assert 0 < e["l2"] < e["linf"]


@pytest.mark.parametrize("activation", ["gelu", "silu"])
def test_storage_floors_order_by_precision(activation):
    act = get_activation(activation)
    for branch in ("left", "right"):
        f = storage_floors(act, branch)
        # sqrt(f''(T) * ulp(y_min) / 2)-like at the cusp: each 16-bit format loses ~sqrt of its ulp.
        assert 1e-5 < f["fp32"] < 1e-4 < 1e-3 < f["fp16"] < f["bf16"] < 0.05


def test_dtype_points_cover_every_bf16_value_of_the_branch():
    act = get_activation("silu")
    y = dtype_eval_points(act, "left", FORMATS["bf16"])
    assert y.min() == -0.279296875  # bf16 rounds y_min below itself: the kernel sees that value
    every = lattice(FORMATS["bf16"], act.y_min, float(act.f(np.float64(-20.0))))
    assert np.isin(every, y).all()


def test_compile_q_and_flops():
    q = compile_q(sympy.sqrt(sympy.Max(Y, 0)) * 2 + 1)
    np.testing.assert_array_equal(q(np.array([-1.0, 4.0])), [1.0, 5.0])
    assert q(np.float64(4.0)).shape == ()
    with pytest.raises(ValueError, match="free symbols besides y"):
        compile_q(Y + sympy.Symbol("c0"))
    x = sympy.Symbol("x")
    assert count_flops(x**3 + 2 * x) == 4  # x*x*x (2), 2*x (1), + (1)
    assert count_flops(sympy.sqrt(x) * (sympy.sqrt(x) + 1)) == 3  # sqrt once after CSE, +, *


def test_monotone_grids_cover_the_whole_line_without_a_cusp():
    act = get_activation("softplus")
    x = metric_x_grid(act, "right")
    np.testing.assert_array_equal(x, np.linspace(-20.0, 20.0, x.size))  # uniform only: no point near T
    assert branch_x_range(act, "right") == (-20.0, 20.0)
    # The dtype lattices start at f(-20) (y_min = 0 is at x = -inf, outside the range): for fp32 the
    # first 2^16 values from round(f(-20)), every one of them evaluated.
    y = dtype_eval_points(act, "right", FORMATS["fp32"])
    first = lattice(FORMATS["fp32"], float(act.f(np.float64(-20.0))), 20.0)
    assert y.min() == first[0] == np.float32(act.f(np.float64(-20.0))) and np.isin(first, y).all()
    assert y.max() == np.float32(act.f(np.float64(20.0)))


def test_monotone_l2_weighs_the_whole_line():
    act = get_activation("softplus")
    # q = f'(f^-1(y)) + 1 everywhere: RMS 1 exactly when every x of the N(0, 1) quadrature counts.
    assert l2(act, "right", lambda y: 2.0 - np.exp(-y)) == pytest.approx(1.0, rel=1e-12)
    # A q that is 0 for x < 0 (y < log 2) is off by sigmoid(x) there: RMS sqrt(E[sigmoid(x)^2; x < 0])
    # = 0.24344 by quadrature (scipy.integrate.quad); 0 if the metric dropped the left half of the line.
    half = l2(act, "right", lambda y: np.where(y >= np.log(2.0), 1.0 - np.exp(-y), 0.0))
    assert half == pytest.approx(0.24344, rel=1e-4)
