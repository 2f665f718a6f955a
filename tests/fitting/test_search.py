"""--family search: the operon backend end to end, the Pareto front, and PySR's clean failure."""

import json
import shutil

import numpy as np
import pytest
import sympy

from codegen.coeffs_json import load
from fitting.activations import get_activation
from fitting.cli import main
from fitting.evaluate import compile_q, linf
from fitting.families import Y
from fitting.search import U, parametrize
from fitting.search.front import Measured, pareto

pytest.importorskip("pyoperon")


def test_parametrize_frees_every_constant_and_measures_from_the_cusp():
    act = get_activation("silu")
    form = parametrize(sympy.Float(1.5) * sympy.exp(sympy.Float(-2.0) * U) + sympy.Float(0.25), act)
    assert sorted(form.start.values()) == [-2.0, 0.25, 1.5]
    q = compile_q(form.substituted(form.start))
    np.testing.assert_allclose(q(np.array([act.y_min, act.y_min - 1.0])), 1.75)  # clamped at the cusp
    assert form.expression.free_symbols == {Y, *(sympy.Symbol(n, real=True) for n in form.start)}


def test_pareto_keeps_only_undominated_members():
    def m(flops, err):
        return Measured(None, {}, {"linf_fp32": err}, flops)

    front = pareto([m(10, 1e-2), m(5, 5e-2), m(12, 2e-2), m(20, 1e-3), m(5, 4e-2)])
    assert [(x.flops, x.errors["linf_fp32"]) for x in front] == [(5, 4e-2), (10, 1e-2), (20, 1e-3)]


@pytest.mark.slow
def test_operon_search_writes_a_valid_choice_and_front_deterministically(tmp_path, capsys):
    out = tmp_path / "silu.json"
    args = ["silu", "--family", "search", "--budget", "10", "--seed", "3", "--out", str(out)]
    assert main(args) == 0
    first = (out.read_bytes(), (tmp_path / "silu_front.json").read_bytes())
    assert "Pareto front" in capsys.readouterr().out
    assert main(args) == 0
    assert (out.read_bytes(), (tmp_path / "silu_front.json").read_bytes()) == first  # same seed, same bytes
    coeffs = load(out)
    act = get_activation("silu")
    for name, branch in coeffs.branches.items():
        # The recorded error is what the written formula measures.
        assert linf(act, name, compile_q(branch.sympy_expression())) == pytest.approx(
            branch.errors["linf"], rel=1e-9
        )
        assert branch.flops <= {"left": 14, "right": 20}[name]  # the paper family's flops
    front = json.loads(first[1])
    assert front["schema"] == "invact-front/1" and set(front["branches"]) == {"left", "right"}


@pytest.mark.skipif(shutil.which("julia") is not None, reason="Julia is installed: PySR would run")
def test_pysr_without_julia_fails_at_once_in_one_line(tmp_path, capsys):
    out = tmp_path / "x.json"
    assert main(["gelu", "--family", "search", "--search-backend", "pysr", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err == (
        "invact-fit: error: --search-backend pysr needs Julia, which is not installed here; "
        "use --search-backend operon\n"
    )
    assert list(tmp_path.iterdir()) == []


def test_search_usage_errors(tmp_path, capsys):
    assert main(["quick_gelu", "--family", "search", "--out", str(tmp_path / "q.json")]) == 2
    assert "invact-fit silu --family search" in capsys.readouterr().err
    assert main(["gelu", "--family", "search", "--budget", "0", "--out", str(tmp_path / "g.json")]) == 2
    assert "--budget must be at least 1" in capsys.readouterr().err
