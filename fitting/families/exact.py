"""The 'exact' family: f'(f^-1(y)) in closed form on each branch, with no coefficients.

Where f'(f^-1(y)) has a closed form, the spec holds it as `exact_q` (softplus: -expm1(-y) on its one
branch; hardswish: one square root per branch) and this family is that expression. Nothing is
fitted; the pipeline measures it like any family (its error is float64 rounding).
"""

from __future__ import annotations

from codegen.safe_expr import parse
from fitting.activations import Activation
from fitting.families import BranchForm, Family, UnknownFamily, Y, register


@register("exact", native=True, monotone=True)
def exact(act: Activation) -> Family:
    if act.exact_q is None:
        raise UnknownFamily(
            f"family 'exact' has no form for {act.name!r}: no closed form of f'(f^-1(y)) is given "
            "for it (exact_q in coeffs/activations.json)"
        )
    return Family(
        "exact",
        act.name,
        {b: BranchForm(parse(q, {"y": Y}, where=f"{act.name}: exact_q {b}"), {}) for b, q in act.exact_q},
        published=False,
        source=f"the spec's closed form of f'(f^-1(y)) for {act.name} (coeffs/activations.json)",
    )
