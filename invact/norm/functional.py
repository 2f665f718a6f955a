"""Norms called as functions: `rms_norm` and `layer_norm` with torch's signatures (F.rms_norm, F.layer_norm)
that save their output and per-row rstd instead of their input (invact.norm.op's _Norm, the variants
"rms_torch" and "layer": the ops of nn.RMSNorm and nn.LayerNorm, whose forwards are these functions), and
patch()'s rewriting of a forward that calls torch's.

Models written as plain PyTorch call their norms as functions: nanochat's `norm(x)` is
`F.rms_norm(x, (x.size(-1),))` (no weight), called in each block's forward before the attention and the
MLP, whose first projections save its output anyway. Such a forward is rewritten (`rewrite`) where it can be
read safely: its own Python, and that of the plain functions it calls by name (nanochat's `norm`), has no
branch, loop or identity test (a trace would follow one path for every call: `_straight`), and it traces
one level deep (torch.fx, child modules left as calls). The rewritten forward is the traced one with each
call of torch's norm function replaced by the one here, bound to the module (an instance attribute, as
invact.mlp's Forward): the same ops in the same order otherwise. A forward that cannot be read so is left as
it is, and plan() says why.

Where a call is not over the last dimension alone, needs no gradient, or runs under torch.compile or
torch.func's transforms, the functions here are torch's (under compile the compiler's own memory plan).
"""

from __future__ import annotations

import ast
import dis
import inspect
import textwrap
import types
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from invact._budget import _transforms_active
from invact.norm.op import VARIANTS, _apply_norm, default_eps, invertible

RMS, LAYER = VARIANTS["rms_torch"], VARIANTS["layer"]
# id(weight) -> (a weak reference to it, its version, y's dtype, invertible()): the check of a weight made
# again only where it changed (keyed by id: a tensor's == is elementwise, so it is no dictionary key)
_CHECKED: dict[int, tuple] = {}


def _check(weight, bias, v):
    """The _Norm's check: whether h can be recovered from a y of a dtype, for these parameters (always
    without a weight: w_eff is 1); cached per weight and its version (an optimizer step bumps it)."""
    if weight is None and bias is None:
        return _always
    if weight is None or bias is not None:  # a bias alone, or both: checked each call (a few ops over d)
        return lambda dtype: invertible(weight, bias, v, dtype)

    def check(dtype):
        kept = _CHECKED.get(id(weight))
        if kept is not None and kept[0]() is weight and kept[1] == weight._version and kept[2] == dtype:
            return kept[3]
        answer = invertible(weight, None, v, dtype)
        _CHECKED[id(weight)] = (weakref.ref(weight), weight._version, dtype, answer)
        return answer

    return check


def _always(dtype) -> bool:
    return True


def _inverts(input, normalized_shape, params) -> bool:
    """Whether a call saves y: over the last dimension alone, a gradient wanted, eager, no transform."""
    shape = tuple(normalized_shape) if not isinstance(normalized_shape, int) else (normalized_shape,)
    return (
        len(shape) == 1
        and input.dim() >= 1
        and shape[0] == input.shape[-1]
        and torch.is_grad_enabled()
        and (input.requires_grad or any(p is not None and p.requires_grad for p in params))
        and input.dtype != torch.float64
        and not hasattr(input, "_local_tensor")  # a DTensor (tensor parallel): torch's DTensor ops
        and not torch.compiler.is_compiling()
        and not _transforms_active()
    )


def rms_norm(input, normalized_shape, weight=None, eps=None):  # noqa: A002 - torch's argument names
    """F.rms_norm(input, normalized_shape, weight, eps): the same values; saves the output and per-row
    rstd (torch's saves the input) where it can (see the module docstring), else it is torch's."""
    if not _inverts(input, normalized_shape, (weight,)):
        return F.rms_norm(input, normalized_shape, weight, eps)
    eps = default_eps(RMS, input.dtype) if eps is None else eps
    return _apply_norm(input, weight, None, eps, RMS, _check(weight, None, RMS))


def layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):  # noqa: A002 - torch's names
    """F.layer_norm(input, normalized_shape, weight, bias, eps): the same values; saves the output and
    per-row rstd where it can (see the module docstring), else it is torch's."""
    if not _inverts(input, normalized_shape, (weight, bias)):
        return F.layer_norm(input, normalized_shape, weight, bias, eps)
    return _apply_norm(input, weight, bias, eps, LAYER, _check(weight, bias, LAYER))


# torch's norm functions a rewritten forward calls ours in place of, and the variant each computes
REPLACES = {
    F.rms_norm: rms_norm,
    torch.rms_norm: rms_norm,
    F.layer_norm: layer_norm,
    torch.layer_norm: layer_norm,
}
_NAMES = {"rms_norm", "layer_norm"}
# Python that makes a trace follow one path for every call, or a forward that changes state
_BRANCHES = (ast.If, ast.IfExp, ast.For, ast.AsyncFor, ast.While, ast.Try, ast.With, ast.Match, ast.BoolOp,
             ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp, ast.Lambda, ast.Global, ast.Nonlocal,
             ast.Yield, ast.YieldFrom, ast.Await, ast.Assert, ast.Raise, ast.Delete)  # fmt: skip


def _straight(function, depth: int = 2) -> str | None:
    """Why `function`'s Python cannot be traced as it runs (None where it can): a branch, loop, identity
    test, state change or anything a one-path trace would freeze, in its own source or in that of the
    plain Python functions it calls by a global name (to `depth` levels; torch's are not read)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return "its source cannot be read"
    body = tree.body[0]
    for node in ast.walk(body):
        if node is not body and isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            return "it defines a function or class inside"
        if isinstance(node, _BRANCHES):
            return f"it has a {type(node).__name__} (a trace would follow one path)"
        if isinstance(node, ast.Compare) and any(isinstance(op, ast.Is | ast.IsNot | ast.In | ast.NotIn)
                                                   for op in node.ops):  # fmt: skip
            return "it tests identity or membership (a trace would follow one path)"
        if isinstance(node, ast.Attribute | ast.Subscript) and isinstance(node.ctx, ast.Store | ast.Del):
            return "it changes an attribute or item"
    if depth:
        names = getattr(function, "__globals__", {})
        for node in ast.walk(body):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                called = names.get(node.func.id)
                if isinstance(called, types.FunctionType) and not called.__module__.startswith("torch"):
                    why = _straight(called, depth - 1)
                    if why:
                        return f"{node.func.id}(): {why}"
    return None


def _calls_norm(code, globals_: dict, depth: int = 2) -> bool:
    """Whether a code object names rms_norm or layer_norm, or calls a plain function (by a global name)
    that does (to `depth` levels): a cheap filter before reading any source."""
    names = set(code.co_names)
    if names & _NAMES:
        return True
    if depth:
        for name in names:
            called = globals_.get(name)
            if isinstance(called, types.FunctionType) and not called.__module__.startswith("torch"):
                if _calls_norm(called.__code__, called.__globals__, depth - 1):
                    return True
    return False


class _OneLevel(torch.fx.Tracer):
    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return True


def _probe_equal(function) -> bool:
    """Whether ours gives torch's values bitwise on probes (fp32 and bf16; with and without parameters)."""
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(3, 5, 32, generator=g) * 3).to(dtype)
        w = (torch.randn(32, generator=g) + 1).to(dtype)
        b = torch.randn(32, generator=g).to(dtype)
        x.requires_grad_()
        if function is rms_norm:
            pairs = [
                (F.rms_norm(x, (32,)), rms_norm(x, (32,))),
                (F.rms_norm(x, (32,), w, 1e-6), rms_norm(x, (32,), w, 1e-6)),
            ]
        else:
            pairs = [
                (F.layer_norm(x, (32,)), layer_norm(x, (32,))),
                (F.layer_norm(x, (32,), w, b), layer_norm(x, (32,), w, b)),
            ]
        if not all(torch.equal(a, b) for a, b in pairs):
            return False
    return True


_EQUAL: dict = {}


def calls(module: nn.Module) -> tuple[list[str], str]:
    """(the norm functions `module`'s forward calls that rewrite() replaces, in call order, why or why not):
    [] where it calls none, or cannot be rewritten (the reason says which)."""
    forward = type(module).forward
    code = getattr(forward, "__code__", None)
    if code is None or "forward" in module.__dict__ or not _calls_norm(code, forward.__globals__):
        return [], ""
    why = _straight(forward)
    if why:
        return [], f"its forward calls a norm as a function but cannot be rewritten: {why}"
    if any(i.opname in ("STORE_ATTR", "DELETE_ATTR", "STORE_GLOBAL") for i in dis.get_instructions(code)):
        return [], "its forward calls a norm as a function but stores an attribute"
    try:
        graph = _OneLevel().trace(module)
    except Exception as e:  # noqa: BLE001 - any failure to trace means: left as it is
        return [], f"its forward calls a norm as a function but does not trace ({type(e).__name__})"
    found = [
        REPLACES[n.target].__name__ for n in graph.nodes if n.op == "call_function" and n.target in REPLACES
    ]
    for name in set(found):
        if name not in _EQUAL:
            _EQUAL[name] = _probe_equal(globals()[name])
        if not _EQUAL[name]:
            return [], f"its forward calls {name}, which invact's does not reproduce bitwise on this torch"
    return found, ""


def rewrite(module: nn.Module) -> list[str]:
    """Set on `module` its forward traced one level deep with each call of torch's norm functions replaced by
    rms_norm / layer_norm here (an instance attribute, bound to the module: its children and parameters
    as they are at each call); the names of the calls replaced ([] where calls() finds none)."""
    found, _ = calls(module)
    if not found:
        return []
    tracer = _OneLevel()
    graph = tracer.trace(module)
    for node in graph.nodes:
        if node.op == "call_function" and node.target in REPLACES:
            node.target = REPLACES[node.target]
    traced = torch.fx.GraphModule(module, graph, class_name=f"{type(module).__name__}Inverted")
    # the generated forward, bound to the module itself (its code reads self.<child> and self.<parameter>)
    module.forward = types.MethodType(type(traced).forward, module)
    module.__dict__["_invact_norm_calls"] = tuple(found)
    return found
