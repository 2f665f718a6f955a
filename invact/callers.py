"""Whether the forward code that calls a module modifies the module's output in place, read from that
code's source (Python's ast; nothing is run).

A module InvAct replaces saves its output for backward. Where the caller then modifies that output in
place, autograd's version check fails the backward ("one of the variables needed for gradient
computation has been modified by an inplace operation"). Without example inputs patch() cannot watch
a forward, so it reads the forward of the module's caller (its parent, or the parent of the ModuleList
or ModuleDict holding it): an assignment `name = self.<child>(...)` or `name = self.<child>[i](...)`,
then, before `name` is bound to a new tensor, `name op= ...`, `name.<method>_(...)` or
`name[...] = ...`. A rebinding through an op that may return its input or a view of it (dropout,
which returns its input at p = 0; view, reshape, transpose, to, contiguous, ...) keeps following the
same storage. Found in transformers' XLM and FlauBERT: `tensor = self.layer_norm2[i](tensor)` then
`tensor *= mask`.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap

from torch import nn

# Ops that may hand back their input or a view of its storage: a name rebound through one of them
# may still be the module's output.
_ALIASING_METHODS = frozenset({
    "view", "view_as", "reshape", "reshape_as", "transpose", "permute", "contiguous", "to", "type_as",
    "float", "flatten", "unflatten", "unsqueeze", "squeeze", "expand", "expand_as", "narrow", "t",
    "detach", "requires_grad_", "as_strided",
})  # fmt: skip
_ALIASING_FUNCTIONS = frozenset({"dropout", "alpha_dropout", "feature_alpha_dropout", "identity"})


def inplace_use(model: nn.Module, name: str) -> str | None:
    """Where the forward that calls the module at `name` (a dotted path in `model`) modifies its
    output in place: "<Class>.forward, line N: `<statement>`"; None where no such use is found. The
    caller is the module's parent (`self.<child>(...)`), or the parent of the ModuleList or
    ModuleDict holding it (`self.<child>[i](...)`)."""
    parts = name.split(".")
    if not parts[-1]:
        return None
    callers = [(len(parts) - 1, False)]
    if len(parts) >= 2:
        holder = model.get_submodule(".".join(parts[:-1]))
        if isinstance(holder, (nn.ModuleList, nn.ModuleDict)):
            callers.append((len(parts) - 2, True))
    for k, indexed in callers:
        ancestor = model.get_submodule(".".join(parts[:k])) if k else model
        tree = forward_tree(type(ancestor))
        if tree is None:
            continue
        found = _search(tree.body, [], parts[k], indexed)
        if found is not None:
            return f"{type(ancestor).__name__}.forward, line {found[0]}: `{found[1]}`"
    return None


@functools.cache
def forward_tree(cls: type) -> ast.AST | None:
    """The parsed source of cls.forward, or None where it has none to read (a builtin, a C extension,
    source not on disk)."""
    forward = getattr(cls, "forward", None)
    if forward is None or forward is nn.Module.forward:
        return None
    try:
        lines, start = inspect.getsourcelines(forward)
        tree = ast.parse(textwrap.dedent("".join(lines)))
    except (OSError, TypeError, SyntaxError):
        return None
    ast.increment_lineno(tree, start - 1)
    return tree


def _calls_child(node: ast.AST, child: str, indexed: bool) -> bool:
    """node is `self.<child>(...)`, or where `indexed`, `self.<child>[...](...)`."""
    if not isinstance(node, ast.Call) or isinstance(node.func, ast.Subscript) != indexed:
        return False
    func = node.func.value if indexed else node.func
    return (
        isinstance(func, ast.Attribute)
        and func.attr == child
        and isinstance(func.value, ast.Name)
        and func.value.id == "self"
    )


def _search(block: list[ast.stmt], after: list[ast.stmt], child: str, indexed: bool):
    """(line, statement): in `block` (then followed by the statements `after` it, up the enclosing
    blocks), an assignment from the child's call whose target is modified in place before it is bound
    to a new tensor; None where there is none."""
    for i, stmt in enumerate(block):
        rest = block[i + 1 :] + after
        if (
            isinstance(stmt, ast.Assign)
            and len(stmt.targets) == 1
            and isinstance(stmt.targets[0], ast.Name)
            and _calls_child(stmt.value, child, indexed)
        ):
            found = _follow(rest, stmt.targets[0].id)
            if found is not None:
                return found
        for field in ("body", "orelse", "finalbody"):  # a branch, a loop, a with: then what follows it
            inner = getattr(stmt, field, None)
            if isinstance(inner, list) and inner and isinstance(inner[0], ast.stmt):
                found = _search(inner, rest, child, indexed)
                if found is not None:
                    return found
    return None


def _follow(statements: list[ast.stmt], name: str) -> tuple[int, str] | None:
    """The first statement that modifies `name` in place before `name` is bound to a new tensor."""
    for stmt in statements:
        for node in ast.walk(stmt):
            if _modifies(node, name):
                return stmt.lineno, ast.unparse(stmt)
        if _bound_anew(stmt, name):
            return None
    return None


def _bound_anew(stmt: ast.stmt, name: str) -> bool:
    """stmt binds `name` to a new tensor: an assignment from anything but an alias of it, or a branch
    whose every arm does so."""
    if isinstance(stmt, ast.Assign):
        rebinds = any(isinstance(t, ast.Name) and t.id == name for t in stmt.targets)
        return rebinds and not _aliases(stmt.value, name)
    if isinstance(stmt, ast.If) and stmt.orelse:
        return all(any(_bound_anew(s, name) for s in arm) for arm in (stmt.body, stmt.orelse))
    return False


def _modifies(node: ast.AST, name: str) -> bool:
    if isinstance(node, ast.AugAssign):
        target = node.target.value if isinstance(node.target, ast.Subscript) else node.target
        return isinstance(target, ast.Name) and target.id == name
    if isinstance(node, ast.Assign):
        return any(
            isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name) and t.value.id == name
            for t in node.targets
        )
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        method = node.func.attr
        owner = node.func.value
        return (
            isinstance(owner, ast.Name)
            and owner.id == name
            and method.endswith("_")
            and not method.startswith("_")
            and method != "requires_grad_"
        )
    return False


def _aliases(value: ast.AST, name: str) -> bool:
    """value may be `name` itself or share its storage: `name`, `name.<aliasing method>(...)`,
    `name[...]`, or a dropout-like call (a function, or a module attribute named for dropout) on it."""
    if isinstance(value, ast.Name):
        return value.id == name
    if isinstance(value, ast.Subscript):
        return _aliases(value.value, name)
    if not isinstance(value, ast.Call):
        return False
    func = value.func
    if isinstance(func, ast.Attribute) and func.attr in _ALIASING_METHODS:
        return _aliases(func.value, name)
    called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    first = value.args[0] if value.args else None
    dropout_like = called in _ALIASING_FUNCTIONS or "drop" in called.lower()
    return dropout_like and first is not None and _aliases(first, name)
