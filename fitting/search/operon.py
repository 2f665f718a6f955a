"""The embedded backend: pyoperon's multi-objective GP (accuracy and expression length)."""

from __future__ import annotations

import numpy as np
import sympy

from fitting.search import SearchSettings, U

_SYMBOLS = "add,sub,mul,div,exp,log,sqrt,constant,variable"


def search(u: np.ndarray, target: np.ndarray, settings: SearchSettings) -> list[sympy.Expr]:
    """The Pareto front of (R^2, length) as sympy expressions in U."""
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
        expr = sympy.sympify(text, locals={"u": U})
        if expr.free_symbols <= {U}:
            expressions.append(expr)
    return expressions
