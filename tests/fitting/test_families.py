"""The paper family: forms, guards, derived activations."""

import numpy as np
import pytest
import sympy
from scipy import special
from sympy.codegen.cfunctions import expm1

from codegen import spec
from codegen.coeffs_json import ALLOWED_FUNCTIONS
from fitting.activations import get_activation
from fitting.evaluate import FORMATS, compile_q, lattice
from fitting.families import UnknownFamily, Y, get_family
from fitting.families.paper import SILU_LEFT, SILU_RIGHT

ALL_16BIT = {name: lattice(FORMATS[name], -FORMATS[name].max, FORMATS[name].max) for name in ("fp16", "bf16")}


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "silu", "quick_gelu"])
def test_forms_use_only_y_coefficients_and_allowed_functions(activation):
    family = get_family("paper", activation)
    for form in family.branches.values():
        names = {s.name for s in form.expression.free_symbols}
        assert names == {"y", *form.start}
        used = {type(f).__name__ for f in form.expression.atoms(sympy.Function)}
        assert used <= ALLOWED_FUNCTIONS


@pytest.mark.parametrize("activation", ["gelu", "silu"])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_every_finite_16bit_input_gives_a_finite_value(activation, dtype):
    # Traps of naive paper formulas: exp(c3 (c4 - y~)^3) -> 0 times an infinite prefactor, SiLU's
    # (1 - y) factor, sqrt of a y rounded below y_min. Every finite 16-bit y, on both branches, must
    # stay finite.
    family = get_family("paper", activation)
    y = ALL_16BIT[dtype]
    for form in family.branches.values():
        assert np.isfinite(compile_q(form.substituted(form.start))(y)).all()


def test_silu_tables_are_assigned_as_facts_says():
    # The appendix swaps the labels: the 4-coefficient table is the left polynomial.
    family = get_family("paper", "silu")
    assert tuple(family.branches["left"].start.values()) == SILU_LEFT
    assert tuple(family.branches["right"].start.values()) == SILU_RIGHT


def test_silu_right_does_not_cancel_for_large_y():
    form = get_family("paper", "silu").branches["right"]
    q = compile_q(form.substituted(form.start))
    # f'(x) = 1 + x e^-x (1 + ...) -> 1: the printed p*(1 - y) + y would lose everything at y = 1e8.
    assert q(np.array([1e8, 3e38]))[0] == 1.0 and q(np.array([3e38]))[0] == 1.0


def test_quick_gelu_is_silu_rescaled():
    silu, quick = get_family("paper", "silu"), get_family("paper", "quick_gelu")
    a = get_activation("quick_gelu").derivation.scale
    y = np.linspace(-0.16, 3, 101)
    for branch in ("left", "right"):
        qs = compile_q(silu.branches[branch].substituted(silu.branches[branch].start))
        qq = compile_q(quick.branches[branch].substituted(quick.branches[branch].start))
        np.testing.assert_allclose(qq(y), qs(a * y), rtol=1e-15, atol=1e-16)
        assert quick.branches[branch].start == silu.branches[branch].start


def test_unknown_family_and_unsupported_activation():
    with pytest.raises(UnknownFamily, match="unknown family 'nope' \\(choose from exact, floor, half, paper"):
        get_family("nope", "gelu")
    assert Y.name == "y"


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "silu", "quick_gelu"])
def test_floor_forms_are_valid_and_finite_on_every_16bit_value(activation):
    family = get_family("floor", activation)
    assert family.fit_activation == activation  # native: quick_gelu gets its own fit
    act = get_activation(activation)
    for branch, form in family.branches.items():
        assert {type(f).__name__ for f in form.expression.atoms(sympy.Function)} <= ALLOWED_FUNCTIONS
        q = compile_q(form.substituted(form.start))
        for dtype in ("fp16", "bf16"):
            assert np.isfinite(q(ALL_16BIT[dtype])).all(), (branch, dtype)
        # A y rounded below y_min reads as y_min: q = 0 there to the start's accuracy (5e-6, GOAL/2).
        below = np.nextafter(np.float32(act.y_min), np.float32(-1))
        assert abs(q(np.array([below, act.y_min]))).max() <= 5e-6
    left = compile_q(family.branches["left"].substituted(family.branches["left"].start))
    right = compile_q(family.branches["right"].substituted(family.branches["right"].start))
    assert np.array_equal(left(np.array([0.0, -0.0])), np.zeros(2))  # the tail's limit, no 0 * inf
    assert abs(left(np.array([-1e-45]))[0]) <= 1e-43  # q = y * P(w_cap), |P(w_cap)| ~ |x| < 20
    assert np.array_equal(right(np.array([1e3, 3e38])), np.ones(2))  # past the cap: exactly 1


def test_floor_estimates_the_right_decay_where_none_is_given():
    from fitting.activations import Activation
    from fitting.families.floor import GOAL, _samples, right_form

    act = get_activation("silu")
    bare = Activation("bare", act.f, act.df)  # no right_decay: a user-defined activation's case
    form = right_form(bare, 1.0).form
    y, t = _samples(bare, "right")
    q = compile_q(form.substituted(form.start))
    # Each piece's start is within GOAL/2 of the target on the metric grid (floor.Piece.start); with
    # D = 1 instead of the estimate no degree up to MAX_DEGREE gets there (measured 2e-5 to 6e-5).
    assert np.abs(q(y) - t).max() <= GOAL / 2


def test_exact_family_is_the_registry_closed_form_without_coefficients():
    family = get_family("exact", "softplus")
    assert list(family.branches) == ["right"]
    form = family.branches["right"]
    assert form.start == {} and form.expression == -expm1(-Y)
    y = np.array([0.0, 1e-30, 1.0, 50.0])
    np.testing.assert_array_equal(compile_q(form.expression)(y), -np.expm1(-y))


@pytest.mark.parametrize("activation", ["gelu", "quick_gelu", "mish"])
def test_exact_family_needs_a_registered_closed_form(activation):
    with pytest.raises(UnknownFamily, match=f"family 'exact' has no form for '{activation}': no closed form"):
        get_family("exact", activation)


def test_two_branch_families_refuse_a_monotone_activation():
    with pytest.raises(UnknownFamily) as info:
        get_family("paper", "softplus")
    assert str(info.value) == (
        "softplus is monotone (one branch, no bit), and family 'paper' fits two branches: "
        "use --family exact or --family floor or --family half"
    )


@pytest.mark.parametrize(
    ("expr", "q_of_y"),
    [
        ("sigmoid(x)", lambda y: y * (1 - y)),  # logistic tails
        ("Phi(2*x)", lambda y: 2 * np.exp(-(special.ndtri(y) ** 2) / 2) / np.sqrt(2 * np.pi)),  # Gaussian
    ],
)
def test_floor_fits_bounded_monotone_activations(expr, q_of_y):
    from codegen.spec import formula
    from fitting.activations import Activation, numpy_function
    from fitting.families.floor import GOAL, monotone_form

    f = formula(expr, "test")
    act = Activation("bounded", numpy_function(f), numpy_function(f.diff(spec.X)), monotone=True)
    form = monotone_form(act).form
    y = act.f(np.linspace(-20, 20, 20001))
    y = y[(y > 0) & (y < 1)]
    q = compile_q(form.substituted(form.start))
    # Each side's start is within GOAL/2 on the metric grid (floor.Piece.start): here against closed forms.
    assert np.abs(q(y) - q_of_y(y)).max() <= GOAL / 2


def test_floor_refuses_an_unbounded_monotone_activation():
    from fitting.families.floor import monotone_form

    with pytest.raises(UnknownFamily, match="bounded on both sides"):
        monotone_form(get_activation("softplus"))
