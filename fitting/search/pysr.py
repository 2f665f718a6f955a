"""The PySR backend. PySR runs its search in Julia; where Julia is missing (as on this project's
machines, which cannot install it) the search fails at once, before anything is computed."""

from __future__ import annotations

import shutil

import numpy as np
import sympy

from fitting.search import SearchSettings, SearchUnavailable, U


def check_available() -> None:
    if shutil.which("julia") is None:
        raise SearchUnavailable(
            "--search-backend pysr needs Julia, which is not installed here; use --search-backend operon"
        )
    try:
        import pysr  # noqa: F401
    except ImportError:
        raise SearchUnavailable(
            "--search-backend pysr needs the pysr package: pip install invact[pysr]"
        ) from None


def search(u: np.ndarray, target: np.ndarray, settings: SearchSettings) -> list[sympy.Expr]:
    """Every equation on PySR's Pareto front, as sympy expressions in U."""
    check_available()
    from pysr import PySRRegressor

    model = PySRRegressor(
        niterations=settings.generations, populations=8, population_size=settings.population // 8,
        binary_operators=["+", "-", "*", "/"], unary_operators=["exp", "log", "sqrt"],
        maxsize=settings.max_length, random_state=settings.seed, deterministic=True, parallelism="serial",
    )  # fmt: skip
    model.fit(u.reshape(-1, 1), target, variable_names=["u"])
    return [model.sympy(i).subs(sympy.Symbol("u"), U) for i in range(len(model.equations_))]
