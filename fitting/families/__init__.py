"""Formula families: per branch, a sympy expression in y with free coefficients c0..cn and a start.

A family is built for one activation by a builder registered in FAMILIES. Derived activations
(quick_gelu = silu scaled) get their base's family with y replaced by a*y (see `derive`), and are not
refitted: their coefficients are the base's. A builder registered with `native=True` builds its forms
from the activation's own f and f', so derived activations get a family (and a fit) of their own.
A monotone activation has one branch ("right") and only families registered with `monotone=True`
(`exact`) fit it; the others fit the two branches of a non-monotone one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import sympy

from codegen.coeffs_json import Y
from fitting.activations import Activation, get_activation


def coefficient_symbols(n: int) -> list[sympy.Symbol]:
    return [sympy.Symbol(f"c{i}", real=True) for i in range(n)]


@dataclass(frozen=True)
class BranchForm:
    """q(y) on one branch: `expression` in Y and the symbols named in `start` (c0..cn, in order)."""

    expression: sympy.Expr
    start: dict[str, float]

    def substituted(self, coefficients: dict[str, float]) -> sympy.Expr:
        return self.expression.subs({sympy.Symbol(k, real=True): v for k, v in coefficients.items()})


@dataclass(frozen=True)
class Family:
    name: str
    activation: str
    branches: dict[str, BranchForm]  # Activation.branches: "left", "right", or "right" alone
    published: bool  # True when `start` holds coefficients published for this very activation
    source: str  # where the form and the start come from
    fitted_on: str = ""  # the activation whose fit gives the coefficients ("" = this one)

    @property
    def fit_activation(self) -> str:
        return self.fitted_on or self.activation


FamilyBuilder = Callable[[Activation], Family]
FAMILIES: dict[str, FamilyBuilder] = {}  # the fixed-form families, by name (see `register`)
# The family with no fixed form: a symbolic search proposes its forms (fitting/search), which
# `invact-fit --family search` fits and measures; it has no builder here.
SEARCH = "search"
NATIVE: set[str] = set()  # families built for derived activations directly, not derived from the base
MONOTONE: set[str] = set()  # families for monotone activations (one branch); the rest need two


def register(
    name: str, native: bool = False, monotone: bool = False
) -> Callable[[FamilyBuilder], FamilyBuilder]:
    def wrap(builder: FamilyBuilder) -> FamilyBuilder:
        FAMILIES[name] = builder
        if native:
            NATIVE.add(name)
        if monotone:
            MONOTONE.add(name)
        return builder

    return wrap


def family_names() -> list[str]:
    """Every family name `invact-fit --family` takes: the registered builders, and SEARCH."""
    return sorted([*FAMILIES, SEARCH])


class UnknownFamily(KeyError):
    def __str__(self) -> str:
        return str(self.args[0])


def require_two_branches(name: str, act: Activation) -> None:
    """Raise UnknownFamily when a two-branch family (any but MONOTONE; also SEARCH) meets a monotone
    activation."""
    if act.monotone and name not in MONOTONE:
        raise UnknownFamily(
            f"{act.name} is monotone (one branch, no bit), and family {name!r} fits two branches: "
            f"use --family {' or --family '.join(sorted(MONOTONE))}"
        )


def derive(
    base: Family,
    activation: str,
    scale: float,
    clip: tuple[float, float] | None = None,
    y_min: float = -math.inf,
) -> Family:
    """The family of f(x) = base(a x)/a: q(y) = q_base(a y), same coefficients. Clipped to [lo, hi]:
    q = 0 where y is at or past a bound: hi on the right branch, lo where f reaches it (lo > y_min)."""
    a = sympy.Float(scale, 17)

    def form(branch: str, expression: sympy.Expr) -> sympy.Expr:
        q = expression.subs(Y, a * Y) if scale != 1 else expression
        if clip is None:
            return q
        lo, hi = (sympy.Float(b, 17) for b in clip)
        flat = ([(0, Y >= hi)] if branch == "right" else []) + ([(0, Y <= lo)] if clip[0] > y_min else [])
        return sympy.Piecewise(*flat, (q, True)) if flat else q

    return Family(
        name=base.name,
        activation=activation,
        branches={k: BranchForm(form(k, b.expression), dict(b.start)) for k, b in base.branches.items()},
        published=base.published,
        source=f"{base.source}; derived from {base.activation} with y -> {scale!r}*y"
        + (f", clipped to {list(clip)}" if clip else ""),
        fitted_on=base.activation,
    )


def get_family(name: str, activation: str) -> Family:
    """The family `name` for `activation` (derived activations get their base's, rescaled)."""
    if name == SEARCH:
        raise UnknownFamily(
            f"family {SEARCH!r} has no fixed form: a symbolic search proposes it "
            f"(invact-fit {activation} --family {SEARCH})"
        )
    if name not in FAMILIES:
        raise UnknownFamily(f"unknown family {name!r} (choose from {', '.join(family_names())})")
    act = get_activation(activation)
    require_two_branches(name, act)
    if act.derivation is not None and (name not in NATIVE or act.derivation.clip):
        base = get_family(name, act.derivation.base)  # a clipped activation's q is always its base's
        return derive(base, activation, act.derivation.scale, act.derivation.clip, act.y_min)
    return FAMILIES[name](act)


# Builders register themselves on import.
from fitting.families import exact, floor, paper  # noqa: E402, F401
