"""Symbolic search for q(y) ~ f'(f^-1(y)): candidate forms from a search backend, refined and measured
by this toolkit.

A backend proposes expressions in u = y - y_min >= 0 (the distance from the cusp) with numeric
constants. Each is turned into a BranchForm whose constants become free coefficients c0..cn, fitted
like any family (least squares, then minimax), and measured with the error metrics of
docs/fitting.md. The result per branch is the Pareto front of (flops, linf_fp32).

Backends: "operon" (pyoperon, embedded, runs anywhere) and "pysr" (needs Julia, which cannot be
installed on this project's machines; without it the search fails at once, writing nothing).
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy

from fitting.activations import Activation
from fitting.families import BranchForm, Y

BACKENDS = ("operon", "pysr")
U = sympy.Symbol("u", real=True)  # u = y - y_min, what the backends see as their one variable


class SearchUnavailable(RuntimeError):
    """The backend cannot run here; the message says why and what to use instead."""


@dataclass(frozen=True)
class SearchSettings:
    backend: str = "operon"
    generations: int = 100  # the budget: deterministic for a given seed, unlike a time limit
    population: int = 500
    max_length: int = 25  # expression tree nodes
    seed: int = 0


def parametrize(expr_in_u: sympy.Expr, act: Activation) -> BranchForm:
    """u -> max(y, y_min) - y_min, every numeric constant -> a free coefficient started at its value."""
    floats = sorted(expr_in_u.atoms(sympy.Float), key=lambda f: sympy.default_sort_key(f))
    names = [sympy.Symbol(f"c{i}", real=True) for i in range(len(floats))]
    expr = expr_in_u.xreplace(dict(zip(floats, names, strict=True)))
    y_min = sympy.Float(act.y_min, 17)
    expr = expr.subs(U, sympy.Max(Y, y_min) - y_min)
    return BranchForm(expr, {n.name: float(f) for n, f in zip(names, floats, strict=True)})


def propose(act: Activation, u, target, settings: SearchSettings) -> list[sympy.Expr]:
    """Candidate expressions in U from the chosen backend (raises SearchUnavailable)."""
    if settings.backend == "operon":
        from fitting.search import operon

        return operon.search(u, target, settings)
    if settings.backend == "pysr":
        from fitting.search import pysr

        return pysr.search(u, target, settings)
    raise ValueError(f"unknown search backend {settings.backend!r} (choose from {', '.join(BACKENDS)})")
