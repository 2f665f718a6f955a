"""The activation spec, coeffs/activations.json: one entry per activation holding everything that
differs between activations. fitting/ and codegen/ read it here; the runtime reads only what codegen
prints from it.

Schema `invact-activations/1`: {"schema", "about", "activations": {name: entry}}. An entry:

- `f` (required): f as a formula in x, in a form that stays accurate in float64 (no cancellation, no
  overflow to NaN);
- `df`: f' in x, where sympy's derivative of `f` would cancel or overflow; else derived;
- `torch` (required): the forward torch computes, which InvAct reproduces bitwise:
  `{"function": a name in torch.nn.functional, "kwargs": {...}}` (and `"clamp": [lo, hi]`, torch.clamp
  of its result), or `{"formula": a formula in x}` printed with torch's functions;
- `triton`: the fp32 forward of the Triton kernels, as a formula in x, where `f` uses a function with no
  Triton form (tanh, erfc) or needs torch's own cut-offs; else `f`;
- `monotone`: true for an increasing f: one branch, no bit (default false);
- `exact_q`: f'(f^-1(y)) as a formula in y, where it has a closed form (the `exact` family): one
  formula for a monotone f, else `{"left": ..., "right": ...}`, one per branch (hardswish);
- `right_decay`: k(y) with f' - 1 ~ exp(-k) as x -> inf (the `floor` family's right branch);
- `derivation`: `{"base", "scale", "clip"}`, f(x) = clip(base(scale x) / scale, lo, hi) with `scale`
  (default 1) and `clip` ([lo, hi], default none) optional, so fits derive from the base's: q is the
  base's q(scale y), and 0 where y is clipped (a flat piece; torch's clamp passes the gradient on the
  bounds themselves, which y cannot tell from beyond them);
- `module` (required): the runtime's torch-compatible module class (printed into
  invact/_generated/modules.py with its functional form) and the keyword arguments that select this
  activation: `{"class": "InvActGELU", "kwargs": {"approximate": "tanh"}}`. Optional: `ignored`,
  arguments torch's class takes that change nothing here, with their defaults (`{"inplace": false}`:
  InvAct never keeps x), and `why`, argument -> why other values are not reproduced (one line). A
  class's constructor takes the union of its entries' kwargs; the first entry (in name order) that
  names the class gives their defaults, so list torch's default there. Its functional form is named
  after the torch function (`torch.function`), or the activation where torch has none;
- `patch`: the classes `invact.patch()` replaces with it, by qualified name -> the formula the class
  was checked to compute, or `{"when": {attribute: value}, "checked": ...}` where the class computes
  this activation only for those attribute values (nn.GELU's approximate);
- `functions`: functions in `torch.nn.functional` that patch() replaces where a module holds them as
  an attribute (nn.TransformerEncoderLayer(activation="gelu"));
- `notes`: field -> why it is written as it is (not read).

Top level, `skipped`: activation classes patch() leaves alone on purpose -> the reason.

Formulas are parsed by codegen.safe_expr (never evaluated) with the functions of codegen.functions:
sqrt, exp, expm1, log, log1p, erf, erfc, tanh, Phi, sigmoid, softplus, Abs, Max, Min, Piecewise, and
the constant pi. Every problem is a SpecError, one line naming the entry and field.
"""

from __future__ import annotations

import json
import math
import os
import re
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
_FIELDS = {"f", "df", "torch", "triton", "monotone", "exact_q", "right_decay", "derivation", "module",
           "patch", "functions", "notes"}  # fmt: skip
_QUALNAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+")
_FUNCTION_PREFIX = "torch.nn.functional."
# torch.nn.functional functions an entry's `torch` may name, with the keyword arguments each takes.
TORCH_FUNCTIONS: dict[str, set[str]] = {
    "gelu": {"approximate"},
    "silu": set(),
    "mish": set(),
    "softplus": {"beta", "threshold"},
    "leaky_relu": {"negative_slope"},
    "elu": {"alpha"},
    "celu": {"alpha"},
    "selu": set(),
    "relu6": set(),
    "hardswish": set(),
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
    clamp: tuple[float, float] | None = None  # torch.clamp(function(x), lo, hi)


@dataclass(frozen=True)
class Module:
    """An entry's torch-compatible module class (see the module docstring, `module`)."""

    cls: str
    kwargs: tuple[tuple[str, Any], ...] = ()  # the constructor arguments that select this activation
    ignored: tuple[tuple[str, Any], ...] = ()  # accepted for torch compatibility, with their defaults
    why: tuple[tuple[str, str], ...] = ()  # argument -> why other values are not reproduced


@dataclass(frozen=True)
class Entry:
    name: str
    f: sympy.Expr  # in X
    df: sympy.Expr  # in X: the entry's `df`, or sympy.diff(f, X)
    torch: TorchForward
    triton: sympy.Expr  # in X: the entry's `triton`, or f
    monotone: bool = False
    # (branch, formula text in y) per branch: fitting's exact family parses them
    exact_q: tuple[tuple[str, str], ...] | None = None
    right_decay: str | None = None  # formula text in y (fitting's floor family parses it)
    # (base activation, scale, (lo, hi) or None)
    derivation: tuple[str, float, tuple[float, float] | None] | None = None
    df_given: bool = field(default=False, compare=False)
    module: Module = Module("")
    patch: tuple[tuple[str, tuple[tuple[str, Any], ...], str], ...] = ()  # (class, when, checked)
    functions: tuple[str, ...] = ()

    @property
    def functional(self) -> str:
        """The name of its functional form: torch's function, or the activation's where torch has
        none or clamps its result (gelu_10)."""
        return self.torch.function if self.torch.function and not self.torch.clamp else self.name


@dataclass(frozen=True)
class Spec:
    entries: dict[str, Entry]
    skipped: dict[str, str]  # class -> why patch() leaves it alone


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
    if "right_decay" in doc:
        formula(doc["right_decay"], f"{where}: right_decay", Y)  # checked here; its reader parses it again
    exact_q = None
    if "exact_q" in doc:
        given = doc["exact_q"]
        branches = ("right",) if monotone else ("left", "right")
        if monotone and isinstance(given, str):
            exact_q = (("right", given),)
        elif not monotone and isinstance(given, dict) and set(given) == set(branches):
            exact_q = tuple((b, given[b]) for b in branches)
        else:
            expected = 'an object {"left": formula, "right": formula}'
            expected = "one formula (monotone)" if monotone else expected
            raise SpecError(f"{where}: exact_q must be {expected}")
        for _, text in exact_q:
            formula(text, f"{where}: exact_q", Y)  # checked here; the exact family parses it again
    derivation = None
    if "derivation" in doc:
        d = doc["derivation"]
        scale = d.get("scale", 1) if isinstance(d, dict) else None
        positive = isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0
        clip = d.get("clip") if isinstance(d, dict) else None
        if not (positive and isinstance(d.get("base"), str) and set(d) <= {"base", "scale", "clip"}) or (
            clip is not None and not _bounds(clip)
        ):
            raise SpecError(f'{where}: derivation must be {{"base": name, "scale": a positive number, '
                            '"clip": [lo, hi]}} (scale and clip optional)')  # fmt: skip
        derivation = (d["base"], float(scale), None if clip is None else (float(clip[0]), float(clip[1])))
    triton = formula(doc["triton"], f"{where}: triton") if "triton" in doc else f
    if "module" not in doc:
        raise SpecError(f"{where}: missing field 'module'")
    patch, functions = _patch(doc.get("patch", {}), where), _functions(doc.get("functions", []), where)
    return Entry(name, f, df, _torch(doc["torch"], where), triton, monotone, exact_q,
                 doc.get("right_decay"), derivation, df_given, _module(doc["module"], where), patch,
                 functions)  # fmt: skip


def _triton_form(f: sympy.Expr) -> sympy.Expr:
    """f with the functions that have no Triton form rewritten into ones that do: tanh z =
    2 sigmoid(2z) - 1, erfc z = 1 - erf z."""
    from codegen.functions import sigmoid

    f = f.replace(sympy.tanh, lambda z: 2 * sigmoid(2 * z) - 1)
    return f.replace(sympy.erfc, lambda z: 1 - sympy.erf(z))


def expression_entry(name: str, text: str, monotone: bool = False) -> Entry:
    """The entry of a user-defined activation f(x) = `text` (invact-fit NAME --expr TEXT): torch's
    forward is the formula itself, f' sympy's derivative, the module class InvAct<Name>. Whether f is
    monotone is the caller's finding (fitting.activations.from_expression)."""
    if not (name.isidentifier() and name.islower()):
        raise SpecError(f"activation name {name!r} must be a lower-case Python identifier")
    f = formula(text, "--expr")
    if X not in f.free_symbols:
        raise SpecError(f"--expr: {text!r} does not depend on x")
    cls = "InvAct" + "".join(part.capitalize() for part in name.split("_"))
    return Entry(name, f, sympy.diff(f, X), TorchForward(formula=f), _triton_form(f), monotone,
                 module=Module(cls))  # fmt: skip


def _bounds(v: Any) -> bool:
    """[lo, hi]: two finite numbers, lo < hi."""
    ok = isinstance(v, list) and len(v) == 2
    ok = ok and all(isinstance(b, (int, float)) and not isinstance(b, bool) and math.isfinite(b) for b in v)
    return ok and v[0] < v[1]


def _constants(doc: Any, where: str) -> tuple[tuple[str, Any], ...]:
    """{name: number, bool or identifier-like string} as sorted pairs."""
    if not isinstance(doc, dict):
        raise SpecError(f"{where}: expected an object of name -> value")
    for key, value in doc.items():
        if not key.isidentifier():
            raise SpecError(f"{where}: {key!r} is not a name")
        number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not (number or isinstance(value, bool) or (isinstance(value, str) and value.isidentifier())):
            raise SpecError(f"{where}: {key} must be a finite number, true/false or a name, got {value!r}")
    return tuple(sorted(doc.items()))


def _module(doc: Any, where: str) -> Module:
    where = f"{where}: module"
    if not (isinstance(doc, dict) and "class" in doc and set(doc) <= {"class", "kwargs", "ignored", "why"}):
        raise SpecError(
            f'{where}: expected {{"class": name, "kwargs": {{...}}, "ignored": {{...}}, "why": {{...}}}}'
        )
    cls = doc["class"]
    if not (isinstance(cls, str) and cls.isidentifier() and cls.startswith("InvAct") and cls != "InvAct"):
        raise SpecError(f"{where}: class must be a name InvAct<Something>, got {cls!r}")
    kwargs = _constants(doc.get("kwargs", {}), f"{where}: kwargs")
    ignored = _constants(doc.get("ignored", {}), f"{where}: ignored")
    why = doc.get("why", {})
    if not (
        isinstance(why, dict)
        and all(isinstance(v, str) and v.isascii() and v.isprintable() for v in why.values())
    ):
        raise SpecError(f"{where}: why must be an object of argument -> one line of printable ASCII")
    names = {k for k, _ in kwargs}
    if set(why) - names:
        raise SpecError(f"{where}: why names {sorted(set(why) - names)}, which are not in kwargs")
    if names & {k for k, _ in ignored} or "mode" in names | {k for k, _ in ignored}:
        raise SpecError(f"{where}: an argument is both in kwargs and ignored, or is named mode")
    return Module(cls, kwargs, ignored, tuple(sorted(why.items())))


def _patch(doc: Any, where: str) -> tuple[tuple[str, tuple[tuple[str, Any], ...], str], ...]:
    where = f"{where}: patch"
    if not isinstance(doc, dict):
        raise SpecError(f"{where}: expected an object of qualified class name -> check")
    out = []
    for cls, check in doc.items():
        text = check["checked"] if isinstance(check, dict) else check
        if isinstance(text, str) and not (text.isascii() and text.isprintable()):
            # codegen prints it as a comment in invact/_generated/__init__.py: a newline would start code
            raise SpecError(f"{where}: {cls}: the checked formula must be one line of printable ASCII")
        if not _QUALNAME.fullmatch(cls):
            raise SpecError(f"{where}: {cls!r} is not a qualified class name (module.Class)")
        if isinstance(check, str):
            out.append((cls, (), check))
        elif (
            isinstance(check, dict)
            and set(check) == {"when", "checked"}
            and isinstance(check["checked"], str)
        ):  # noqa: E501
            when = _constants(check["when"], f"{where}: {cls}: when")
            if not when:
                raise SpecError(f"{where}: {cls}: an empty when: give the check as a string")
            out.append((cls, when, check["checked"]))
        else:
            expected = '{"when": {...}, "checked": text}'
            raise SpecError(f"{where}: {cls}: expected the checked formula, or {expected}")
    return tuple(out)


def _functions(doc: Any, where: str) -> tuple[str, ...]:
    if not (isinstance(doc, list) and all(isinstance(n, str) for n in doc)):
        raise SpecError(f"{where}: functions must be a list of names")
    for name in doc:
        rest = name.removeprefix(_FUNCTION_PREFIX)
        if rest == name or not rest.isidentifier():
            raise SpecError(f"{where}: functions: {name!r} is not a function of {_FUNCTION_PREFIX[:-1]}")
    return tuple(doc)


def _torch(doc: Any, where: str) -> TorchForward:
    where = f"{where}: torch"
    if not isinstance(doc, dict) or len({"function", "formula"} & set(doc)) != 1:
        raise SpecError(f'{where}: expected {{"function": name, "kwargs": {{...}}}} or {{"formula": text}}')
    if "formula" in doc:
        if set(doc) != {"formula"}:
            raise SpecError(f"{where}: a formula takes no other field")
        return TorchForward(formula=formula(doc["formula"], f"{where}: formula"))
    function, kwargs = doc["function"], doc.get("kwargs", {})
    if set(doc) - {"function", "kwargs", "clamp"}:
        raise SpecError(f"{where}: unknown field(s) {sorted(set(doc) - {'function', 'kwargs', 'clamp'})}")
    clamp = doc.get("clamp")
    if clamp is not None and not _bounds(clamp):
        raise SpecError(f"{where}: clamp must be [lo, hi], two finite numbers with lo < hi")
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
    clamp = None if clamp is None else (float(clamp[0]), float(clamp[1]))
    return TorchForward(function=function, kwargs=tuple(sorted(kwargs.items())), clamp=clamp)


def loads(text: str, source: str = "activation spec") -> dict[str, Entry]:
    """name -> Entry, in name order."""
    return read(text, source).entries


def read(text: str, source: str = "activation spec") -> Spec:
    """The whole spec: the entries, in name order, and the classes patch() skips."""
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
    skipped = doc.get("skipped", {})
    if not (isinstance(skipped, dict) and all(isinstance(v, str) for v in skipped.values())):
        raise SpecError(f"{source}: skipped must be an object of qualified class name -> reason")
    claimed: dict[str, tuple[str, tuple]] = {}  # class -> (the activation that claims it, its when)
    for entry in entries.values():
        for cls, when, _ in entry.patch:
            if cls in skipped:
                raise SpecError(f"activation {entry.name!r}: patch: {cls} is also in skipped")
            if cls in claimed and (not when or not claimed[cls][1]):
                raise SpecError(f"activation {entry.name!r}: patch: {cls} is claimed by {claimed[cls][0]!r} "
                                "too, without a when to tell them apart")  # fmt: skip
            claimed[cls] = (entry.name, when)
    _check_classes(entries)
    for entry in entries.values():
        if entry.derivation and entry.derivation[0] not in entries:
            base = entry.derivation[0]
            raise SpecError(f"activation {entry.name!r}: derivation base {base!r} is not in the spec")
    return Spec(entries, dict(skipped))


def classes(entries: dict[str, Entry]) -> dict[str, list[Entry]]:
    """Module class -> the entries it computes, in name order (the first gives the defaults)."""
    out: dict[str, list[Entry]] = {}
    for entry in entries.values():
        out.setdefault(entry.module.cls, []).append(entry)
    return out


def _check_classes(entries: dict[str, Entry]) -> None:
    """Entries sharing a class take the same arguments, are told apart by them, and share one
    functional form; no two classes share a functional form."""
    functional: dict[str, str] = {}
    for cls, group in classes(entries).items():
        first = group[0]
        names = [e.name for e in group]
        for e in group[1:]:
            if {k for k, _ in e.module.kwargs} != {k for k, _ in first.module.kwargs} or (
                e.module.ignored != first.module.ignored
            ):
                raise SpecError(
                    f"activation {e.name!r}: module: {cls} takes other arguments in {first.name!r}"
                )
            if e.functional != first.functional:
                raise SpecError(f"activation {e.name!r}: {cls}'s entries must share one torch function")
        if len({e.module.kwargs for e in group}) != len(group):
            raise SpecError(f"module {cls}: entries {names} have the same kwargs: nothing tells them apart")
        if functional.setdefault(first.functional, cls) != cls:
            other = functional[first.functional]
            raise SpecError(f"module {cls}: its functional form {first.functional!r} is {other}'s too")


def load(path: str | os.PathLike = SPEC) -> dict[str, Entry]:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise SpecError(f"{path}: cannot read ({e})") from None
    return loads(text, str(path))
