"""The activation spec, coeffs/activations.json: one entry per activation holding everything that
differs between activations. fitting/ and codegen/ read it here; the runtime reads only what codegen
prints from it.

Schema `invact-activations/1`: {"schema", "about", "activations": {name: entry}}. An entry:

- `f` (required): f as a formula in x, in a form that stays accurate in float64 (no cancellation, no
  overflow to NaN);
- `df`: f' in x, where sympy's derivative of `f` would cancel or overflow; else derived;
- `torch` (required): the forward torch computes, which InvAct reproduces bitwise:
  `{"function": a name in torch.nn.functional, "kwargs": {...}}`, or `{"formula": a formula in x}`
  printed with torch's functions;
- `triton`: the fp32 forward of the Triton kernels, as a formula in x, where `f` uses a function with no
  Triton form (tanh, erfc, softplus) or needs torch's own cut-offs (softplus is x past 20); else `f`;
- `monotone`: true for an increasing f: one branch, no bit (default false);
- `exact_q`: f'(f^-1(y)) as a formula in y, where it has a closed form (the `exact` family);
- `right_decay`: k(y) with f' - 1 ~ exp(-k) as x -> inf (the `floor` family's right branch);
- `derivation`: `{"base", "scale"}`, f(x) = base(scale x) / scale, so fits derive from the base's;
- `notes`: field -> why it is written as it is (not read).

Formulas are parsed by codegen.safe_expr (never evaluated) with the functions of codegen.functions:
sqrt, exp, log, log1p, erf, erfc, tanh, Phi, sigmoid, softplus, Abs, Max, Min, Piecewise, and the constant
pi. Every problem is a SpecError, one line naming the entry and field.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sympy

from codegen.functions import ACTIVATION_FUNCTIONS, CONSTANTS
from codegen.safe_expr import ExpressionError, parse

SCHEMA = "invact-activations/1"
SPEC = Path(__file__).resolve().parents[1] / "coeffs" / "activations.json"
X = sympy.Symbol("x", real=True)
Y = sympy.Symbol("y", real=True)
_FIELDS = {"f", "df", "torch", "triton", "monotone", "exact_q", "right_decay", "derivation", "notes"}
# torch.nn.functional functions an entry's `torch` may name, with the keyword arguments each takes.
TORCH_FUNCTIONS: dict[str, set[str]] = {
    "gelu": {"approximate"},
    "silu": set(),
    "mish": set(),
    "softplus": {"beta", "threshold"},
}


class SpecError(ValueError):
    """A spec that cannot be used; the message is one line naming the entry and field."""


@dataclass(frozen=True)
class TorchForward:
    """What torch computes: torch.nn.functional.<function>(x, **kwargs), or `formula` (a sympy
    expression in x) printed with torch's functions."""

    function: str | None = None
    kwargs: tuple[tuple[str, Any], ...] = ()
    formula: sympy.Expr | None = None


@dataclass(frozen=True)
class Entry:
    name: str
    f: sympy.Expr  # in X
    df: sympy.Expr  # in X: the entry's `df`, or sympy.diff(f, X)
    torch: TorchForward
    triton: sympy.Expr  # in X: the entry's `triton`, or f
    monotone: bool = False
    exact_q: str | None = None  # formula text in y (fitting's exact family parses it)
    right_decay: str | None = None  # formula text in y (fitting's floor family parses it)
    derivation: tuple[str, float] | None = None  # (base activation, scale)
    df_given: bool = field(default=False, compare=False)


def formula(text: Any, where: str, variable: sympy.Symbol = X) -> sympy.Expr:
    """A formula in one variable (x or y) with the activation functions and pi, as a sympy expression."""
    try:
        return parse(text, {variable.name: variable, **CONSTANTS}, where, ACTIVATION_FUNCTIONS)
    except ExpressionError as e:
        raise SpecError(str(e)) from None


def _entry(name: str, doc: Any) -> Entry:
    where = f"activation {name!r}"
    if not isinstance(doc, dict):
        raise SpecError(f"{where}: expected an object, got {type(doc).__name__}")
    unknown = set(doc) - _FIELDS
    if unknown:
        raise SpecError(f"{where}: unknown field(s) {sorted(unknown)} (known: {', '.join(sorted(_FIELDS))})")
    for required in ("f", "torch"):
        if required not in doc:
            raise SpecError(f"{where}: missing field {required!r}")
    f = formula(doc["f"], f"{where}: f")
    df_given = "df" in doc
    df = formula(doc["df"], f"{where}: df") if df_given else sympy.diff(f, X)
    monotone = doc.get("monotone", False)
    if not isinstance(monotone, bool):
        raise SpecError(f"{where}: monotone must be true or false")
    for key in ("exact_q", "right_decay"):
        if key in doc:
            formula(doc[key], f"{where}: {key}", Y)  # checked here; its readers parse the text again
    if "exact_q" in doc and not monotone:
        raise SpecError(f"{where}: exact_q is one formula in y, for a monotone activation only")
    derivation = None
    if "derivation" in doc:
        d = doc["derivation"]
        scale = d.get("scale") if isinstance(d, dict) else None
        positive = isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0
        if not (positive and set(d) == {"base", "scale"} and isinstance(d["base"], str)):
            raise SpecError(f'{where}: derivation must be {{"base": name, "scale": a positive number}}')
        derivation = (d["base"], float(d["scale"]))
    triton = formula(doc["triton"], f"{where}: triton") if "triton" in doc else f
    return Entry(name, f, df, _torch(doc["torch"], where), triton, monotone, doc.get("exact_q"),
                 doc.get("right_decay"), derivation, df_given)  # fmt: skip


def _torch(doc: Any, where: str) -> TorchForward:
    where = f"{where}: torch"
    if not isinstance(doc, dict) or len({"function", "formula"} & set(doc)) != 1:
        raise SpecError(f'{where}: expected {{"function": name, "kwargs": {{...}}}} or {{"formula": text}}')
    if "formula" in doc:
        if set(doc) != {"formula"}:
            raise SpecError(f"{where}: a formula takes no other field")
        return TorchForward(formula=formula(doc["formula"], f"{where}: formula"))
    function, kwargs = doc["function"], doc.get("kwargs", {})
    if set(doc) - {"function", "kwargs"}:
        raise SpecError(f"{where}: unknown field(s) {sorted(set(doc) - {'function', 'kwargs'})}")
    if function not in TORCH_FUNCTIONS:
        raise SpecError(f"{where}: function {function!r} is not one of {', '.join(sorted(TORCH_FUNCTIONS))}")
    if not isinstance(kwargs, dict):
        raise SpecError(f"{where}: kwargs must be an object")
    for key, value in kwargs.items():
        if key not in TORCH_FUNCTIONS[function]:
            raise SpecError(f"{where}: {function}() takes no keyword {key!r}")
        if not (isinstance(value, str) and value.isidentifier()) and not (
            isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        ):
            raise SpecError(f"{where}: {key} must be a finite number or a name, got {value!r}")
    return TorchForward(function=function, kwargs=tuple(sorted(kwargs.items())))


def loads(text: str, source: str = "activation spec") -> dict[str, Entry]:
    """name -> Entry, in name order."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise SpecError(f"{source}: not valid JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise SpecError(f'{source}: expected an object with "schema": "{SCHEMA}"')
    activations = doc.get("activations")
    if not isinstance(activations, dict) or not activations:
        raise SpecError(f'{source}: "activations" must be a non-empty object of name -> entry')
    entries = {}
    for name in sorted(activations):
        if not name.isidentifier() or not name.islower():
            raise SpecError(f"{source}: activation name {name!r} must be a lower-case Python identifier")
        entries[name] = _entry(name, activations[name])
    for entry in entries.values():
        if entry.derivation and entry.derivation[0] not in entries:
            base = entry.derivation[0]
            raise SpecError(f"activation {entry.name!r}: derivation base {base!r} is not in the spec")
    return entries


def load(path: str | os.PathLike = SPEC) -> dict[str, Entry]:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise SpecError(f"{path}: cannot read ({e})") from None
    return loads(text, str(path))
