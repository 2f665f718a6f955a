"""The embedded backend: pyoperon's multi-objective GP (accuracy and expression length)."""

from __future__ import annotations

import numpy as np
import sympy

from codegen.safe_expr import ExpressionError, parse
from fitting.search import SearchSettings, U

_SYMBOLS = "add,sub,mul,div,exp,log,sqrt,constant,variable"


def search(u: np.ndarray, target: np.ndarray, settings: SearchSettings) -> list[sympy.Expr]:
    """The Pareto front of (R^2, length) as sympy expressions in U. pyoperon's model strings are read
    by the safe reader (codegen.safe_expr); one it cannot read (a name other than u, ...) is skipped."""
    from pyoperon.sklearn import SymbolicRegressor

    reg = SymbolicRegressor(
        allowed_symbols=_SYMBOLS, objectives=["r2", "length"], max_length=settings.max_length,
        generations=settings.generations, population_size=settings.population, n_threads=1,
        random_state=settings.seed, max_evaluations=10**9,
    )  # fmt: skip
    reg.fit(u.reshape(-1, 1), target)
    expressions = []
    for model in reg.pareto_front_:
        text = reg.get_model_string(model["tree"], 17).replace("X1", "u")
        try:
            expressions.append(parse(text, {"u": U}, where="pyoperon model"))
        except ExpressionError:
            continue
    return expressions
