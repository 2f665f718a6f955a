"""The 'exact' family: f'(f^-1(y)) in closed form, with no coefficients, for a monotone activation.

A monotone f has one branch ("right") and no bit; where f'(f^-1(y)) has a closed form, the registry
holds it as `Activation.exact_q` (softplus: 1 - exp(-y)) and this family is that expression. Nothing
is fitted; the pipeline measures it like any family (its error is float64 rounding).
"""

from __future__ import annotations

from codegen.safe_expr import parse
from fitting.activations import Activation
from fitting.families import BranchForm, Family, UnknownFamily, Y, register


@register("exact", native=True, monotone=True)
def exact(act: Activation) -> Family:
    if act.exact_q is None:
        raise UnknownFamily(
            f"family 'exact' has no form for {act.name!r}: no closed form of f'(f^-1(y)) is registered "
            "for it (Activation.exact_q, monotone activations only)"
        )
    expression = parse(act.exact_q, {"y": Y}, where=f"{act.name}: exact_q")
    return Family(
        "exact",
        act.name,
        {"right": BranchForm(expression, {})},
        published=False,
        source=f"the registry's closed form of f'(f^-1(y)) for {act.name} (fitting/activations.py)",
    )
