"""The committed coefficient files: valid, consistent with their family, as accurate as the README says."""

import json
from pathlib import Path

import numpy as np
import pytest

from codegen.coeffs_json import load
from fitting.activations import ACTIVATIONS, get_activation
from fitting.evaluate import compile_q, linf
from fitting.families import get_family

COEFFS = Path(__file__).resolve().parents[2] / "coeffs"
FILES = sorted(COEFFS.glob("*/*.json"))

# The published coefficients' L-inf on x in [-20, 20] (measured with a float64 reference); the committed
# refits must not be worse.
PUBLISHED_LINF = {("gelu", "left"): 1.25e-3, ("gelu", "right"): 1.87e-2, ("silu", "left"): 8.3e-4,
                  ("silu", "right"): 2.9e-3}  # fmt: skip


def test_every_activation_has_its_default_file():
    defaults = json.loads((COEFFS / "defaults.json").read_text())
    assert sorted(defaults) == sorted(ACTIVATIONS)
    for activation, family in defaults.items():
        assert (COEFFS / activation / f"{family}.json").is_file()


@pytest.mark.parametrize("activation", sorted(json.loads((COEFFS / "defaults.json").read_text())))
def test_default_families_reach_the_fp32_floor(activation):
    # The README's claim for the runtime's families: within 1e-5 on the fp32 lattice, both branches.
    defaults = json.loads((COEFFS / "defaults.json").read_text())
    coeffs = load(COEFFS / activation / f"{defaults[activation]}.json")
    for name, branch in coeffs.branches.items():
        assert branch.errors["linf_fp32"] <= 1e-5, name


@pytest.mark.parametrize("path", FILES, ids=[f"{p.parent.name}/{p.stem}" for p in FILES])
def test_committed_file_is_consistent(path):
    coeffs = load(path)
    act = get_activation(coeffs.activation)
    assert (path.parent.name, path.stem) == (coeffs.activation, coeffs.family)
    assert (coeffs.threshold, coeffs.y_min) == (None if act.monotone else act.threshold, act.y_min)
    assert tuple(coeffs.branches) == act.branches
    family = get_family(coeffs.family, coeffs.activation)
    for name, branch in coeffs.branches.items():
        assert branch.expression == str(family.branches[name].expression)
        # Re-measure: the recorded linf came from this same code; libm's last-bit differences
        # between machines move it by far less than 1e-9 relative.
        measured = linf(act, name, compile_q(branch.sympy_expression()))
        assert measured == pytest.approx(branch.errors["linf"], rel=1e-9)
        if (coeffs.activation, name) in PUBLISHED_LINF and coeffs.family == "paper":
            assert branch.errors["linf_fp32"] <= PUBLISHED_LINF[coeffs.activation, name]
        assert np.isfinite(list(branch.errors.values())).all()
