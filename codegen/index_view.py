"""The runtime's tables: `__init__.py` (the activations, their families and module classes, what
patch() replaces and skips) and the torch-compatible classes `modules.py` and `functional.py`."""

from __future__ import annotations

import textwrap

from codegen import spec
from codegen.common import header


def render_index(defaults: dict[str, str], the_spec: spec.Spec, sources: list[tuple[str, str]],
                 sixteen: dict[str, str]) -> str:  # fmt: skip
    """The runtime's tables: the activations and their families, the module class of each, the
    classes and functions patch() replaces, and the classes it leaves alone on purpose."""
    names = sorted(defaults)
    families = "\n".join(f"    {a!r}: {defaults[a]!r}," for a in names)
    families_16bit = "\n".join(f"    {a!r}: {sixteen.get(a, defaults[a])!r}," for a in names)
    module_of_entries = {a: the_spec.entries[a] for a in names}
    module_of = {a: e.module for a, e in module_of_entries.items()}
    modules = "\n".join(f"    {a!r}: ({m.cls!r}, {dict(m.kwargs)!r})," for a, m in module_of.items())
    why = "\n".join(
        f"    {cls!r}: {dict(g[0].module.why)!r},"
        for cls, g in spec.classes(module_of_entries).items()
        if g[0].module.why
    )
    replaces: dict[str, list[str]] = {}
    for a in names:
        for cls, when, checked in the_spec.entries[a].patch:
            replaces.setdefault(cls, []).append(f"        ({a!r}, {dict(when)!r}),  # {checked}")
    patch = "\n".join(f"    {cls!r}: (\n" + "\n".join(rows) + "\n    )," for cls, rows in replaces.items())
    functions = "\n".join(f"    {fn!r}: {a!r}," for a in names for fn in the_spec.entries[a].functions)
    skipped = "\n".join(f"    {cls!r}: {why!r}," for cls, why in sorted(the_spec.skipped.items()))
    title = "The generated activations and the runtime's tables, from coeffs/defaults.json and the spec."
    return f'''{header(sources)}"""{title}"""

# activation -> the coefficient family its generated module was printed from
FAMILIES = {{
{families}
}}

# activation -> the family of its q for y stored in bf16 or fp16 (coeffs/defaults_16bit.json)
FAMILIES_16BIT = {{
{families_16bit}
}}

# activation -> (its module class in invact._generated.modules, the keyword arguments that select it)
MODULES = {{
{modules}
}}

# module class -> argument -> why values other than its activations' are not reproduced
WHY = {{
{why}
}}

# qualified class name -> ((activation, attribute values the instance must have), ...): the classes
# patch() replaces, each with the formula it was checked to compute
REPLACES = {{
{patch}
}}

# qualified name of a torch.nn.functional function held as a module attribute -> activation
FUNCTIONS = {{
{functions}
}}

# activation classes patch() leaves alone on purpose -> why
SKIPPED = {{
{skipped}
}}
'''


def _argument_default(value):
    """A constructor default as torch writes it: numbers as floats (Softplus(beta=1.0))."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value


def _annotation(value) -> str:
    return "bool" if isinstance(value, bool) else "str" if isinstance(value, str) else "float"


def _class_views(group: list[spec.Entry]) -> tuple[str, str, str]:
    """(parameters, the activation expression, what it computes) shared by a class and its function."""
    first = group[0]
    arguments = [*first.module.kwargs, *first.module.ignored]
    params = "".join(f", {k}: {_annotation(v)} = {_argument_default(v)!r}" for k, v in arguments)
    selecting = [k for k, _ in first.module.kwargs]
    if selecting:
        activation = f"select({first.module.cls!r}, " + ", ".join(f"{k}={k}" for k in selecting) + ")"
    else:
        activation = repr(first.name)
    if first.torch.function:
        computes = f"torch.nn.functional.{first.torch.function}"
    else:
        computes = f"{first.name} (x -> {first.torch.formula})"
    saves = (
        "its output alone (monotone: no bit)"
        if all(e.monotone for e in group)
        else ("its output and one bit per element")
    )
    choices = "; ".join(
        f"{e.name} where " + ", ".join(f"{k}={_argument_default(v)!r}" for k, v in e.module.kwargs)
        for e in group
        if e.module.kwargs
    )
    what = f"{computes}, saving {saves} instead of its input"
    if choices:
        what += f". Computes {choices}; other values raise ValueError"
    ignored = ", ".join(k for k, _ in first.module.ignored)
    if ignored:
        what += f". {ignored}: accepted and ignored (InvAct never keeps the input)"
    return params, activation, what


def _docstring(text: str) -> str:
    """A docstring body indented for a top-level def or class, wrapped at 100 columns."""
    lines = textwrap.wrap(f'"""{text}"""', width=96, break_long_words=False)
    return "\n    ".join(lines)


def render_modules(entries: dict[str, spec.Entry], sources: list[tuple[str, str]]) -> tuple[str, str]:
    """(modules.py, functional.py): per module class of the spec, the class and its functional form."""
    classes, functions = [], []
    groups = spec.classes(entries)
    for cls, group in groups.items():
        params, activation, what = _class_views(group)
        first = group[0]
        shown = [k for k, _ in first.module.kwargs]
        stores = "".join(
            f"\n        self.{k} = {k}" for k, _ in [*first.module.kwargs, *first.module.ignored]
        )
        doc = _docstring(what + ".")
        arguments = f"\n    _ARGUMENTS = {tuple(shown)!r}\n" if shown else ""
        classes.append(f"""class {cls}(InvAct):
    {doc}
{arguments}
    def __init__(self{params}, mode: str = "bits") -> None:
        super().__init__({activation}, mode){stores}
""")
        signature = f'def {first.functional}(x: torch.Tensor{params}, mode: str = "bits") -> torch.Tensor:'
        functions.append(f"""{signature}
    {doc}
    return invact(x, {activation}, mode)
""")
    names = list(groups)
    fnames = [g[0].functional for g in groups.values()]
    modules = f'''{header(sources)}"""The torch-compatible InvAct module classes, one per class of the
activation spec: each selects its activation from its arguments and is an invact.activation.modules.InvAct."""

from invact.activation.modules import InvAct, select  # noqa: F401

__all__ = {names!r}


''' + "\n\n".join(classes)
    functional = f'''{header(sources)}"""The functional forms of the generated module classes: the same
arguments, the same values as torch's function, InvAct's memory footprint."""

import torch

from invact.activation.modules import select  # noqa: F401
from invact.activation.ops import invact

__all__ = {fnames!r}


''' + "\n\n".join(functions)
    return modules, functional
