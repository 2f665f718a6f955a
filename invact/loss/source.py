"""Which models take the loss path, read from their classes' source (Python's ast; nothing is run): the
head (`output_head`), the module whose forward takes the labels (`_host`), what the forward
does between the head and its loss (`_steps`, read again at each call by `_ops`), and the same decision
for a class alone (`class_decision`, `class_route`), which benchmarks/loss_classes.py runs over every
language-model class of transformers. invact.loss acts on these answers."""

from __future__ import annotations

import ast
import functools
import inspect
import logging
import re
import sys
import textwrap

from torch import nn

from invact.callers import forward_tree

log = logging.getLogger("invact")


def _steps(owner: type, attr: str) -> tuple | None:
    """What `owner`'s forward does to the head's output before handing it to `self.loss_function`, read
    from its source: () where it hands it straight; a tuple of steps where it only scales it and takes
    its tanh (Gemma 2/3's soft-cap, Cohere's logit_scale, Granite's logits_scaling); None where the
    code between does anything else, or the source cannot be read.

    A step is (kind, value, guard): kind "mul", "div" or "tanh"; value a number or the path of an
    attribute of self (a tuple of names: `self.config.final_logit_softcapping` is ("config",
    "final_logit_softcapping")), None for tanh; guard such a path where the step sits under `if <path>
    is not None:`, else None. Recognized, in the block that assigns `name = self.<attr>(...)` (once in
    the whole forward): `name = name / v`, `name = name * v`, `name = v * name`, `name = torch.tanh(name)`,
    bare or under one such `if` with no else; statements that do not read `name`; then the statement
    that calls `self.loss_function` with `name` as its logits, and reads `name` nowhere else."""
    tree = forward_tree(owner)
    if tree is None:
        return None
    found = _head_block(tree, attr)
    if found is None:
        return None
    name, rest = found
    steps: list[tuple] = []
    for stmt in rest:
        reads = [n for n in ast.walk(stmt) if isinstance(n, ast.Name) and n.id == name]
        if not reads:
            continue
        if (step := _step(stmt, name)) is not None:
            steps.append((*step, None))
        elif (guarded := _guarded(stmt, name)) is not None:
            steps.extend(guarded)
        elif _loss_takes(stmt, name) and len(reads) == 1:
            assigned = [t for n in ast.walk(tree) for t in _targets(n) if t == name]
            return tuple(steps) if len(assigned) == 1 + len(steps) else None
        else:
            return None
    return None


def _targets(node: ast.AST) -> list[str]:
    """The plain names node assigns (an =, an augmented or an annotated assignment)."""
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
        node, (ast.AugAssign, ast.AnnAssign)) else []  # fmt: skip
    return [t.id for t in targets if isinstance(t, ast.Name)]


def _head_block(tree: ast.AST, attr: str, chained: bool = False) -> tuple[str, list[ast.stmt]] | None:
    """(name, the statements after it in its block) for the statement `name = self.<attr>(...)`, or with
    `chained` also `name = self.<attr>(...).float()`, `... + bias` and the like (_from_call)."""
    for node in ast.walk(tree):
        for field in ("body", "orelse", "finalbody"):
            block = getattr(node, field, None)
            if not isinstance(block, list):
                continue
            for i, stmt in enumerate(block):
                if not isinstance(stmt, ast.Assign):
                    continue
                if _calls_self(stmt.value, attr) or (chained and _from_call(stmt.value, attr)):
                    names = _targets(stmt)
                    if len(stmt.targets) == 1 and names:
                        return names[0], block[i + 1 :]
    return None


def _from_call(node: ast.AST, attr: str) -> bool:
    """node is `self.<attr>(...)` under method calls and arithmetic (`.float()`, `.contiguous()`,
    `+ self.final_logits_bias`): what PendingLogits records or computes the logits for."""
    return any(_calls_self(n, attr) for n in _chain(node))


def _chain(node: ast.AST):
    """node, then each receiver of its method calls and left operand of its arithmetic, inward."""
    while True:
        yield node
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            node = node.func.value
        elif isinstance(node, ast.BinOp):
            node = node.left
        else:
            return


def _attribute_path(node: ast.AST) -> tuple[str, ...] | None:
    """node is `self.a.b...`: ("a", "b", ...)."""
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    return tuple(reversed(names)) if names and isinstance(node, ast.Name) and node.id == "self" else None


def _operand(node: ast.AST):
    """A number, or the path of an attribute of self; None for anything else."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return float(node.value)
    return _attribute_path(node)


def _step(stmt: ast.stmt, name: str) -> tuple | None:
    """(kind, value) where stmt is `name = name / v`, `name * v`, `v * name` or `torch.tanh(name)`."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and _targets(stmt) == [name]):
        return None
    value = stmt.value
    is_name = lambda n: isinstance(n, ast.Name) and n.id == name  # noqa: E731
    if isinstance(value, ast.BinOp) and isinstance(value.op, (ast.Div, ast.Mult)):
        kind = "div" if isinstance(value.op, ast.Div) else "mul"
        if is_name(value.left) and (v := _operand(value.right)) is not None:
            return kind, v
        if kind == "mul" and is_name(value.right) and (v := _operand(value.left)) is not None:
            return kind, v
    if (
        isinstance(value, ast.Call)
        and isinstance(value.func, ast.Attribute)
        and value.func.attr == "tanh"
        and isinstance(value.func.value, ast.Name)
        and value.func.value.id == "torch"
        and len(value.args) == 1
        and not value.keywords
        and is_name(value.args[0])
    ):
        return "tanh", None
    return None


def _guarded(stmt: ast.stmt, name: str) -> list[tuple] | None:
    """The steps of `if <path> is not None: <steps>` (no else), each guarded by the path."""
    if not (isinstance(stmt, ast.If) and not stmt.orelse and isinstance(stmt.test, ast.Compare)):
        return None
    test = stmt.test
    guard = _attribute_path(test.left)
    if guard is None or not (
        len(test.ops) == 1
        and isinstance(test.ops[0], ast.IsNot)
        and isinstance(test.comparators[0], ast.Constant)
        and test.comparators[0].value is None
    ):
        return None
    steps = [_step(s, name) for s in stmt.body]
    return None if None in steps else [(*step, guard) for step in steps]


def _loss_takes(stmt: ast.stmt, name: str) -> bool:
    """stmt calls `self.loss_function` with `name` as its logits (first argument or keyword)."""
    for node in ast.walk(stmt):
        if isinstance(node, ast.Call) and _calls_self(node, "loss_function", call=False):
            given = [k.value for k in node.keywords if k.arg == "logits"] + node.args[:1]
            return bool(given) and isinstance(given[0], ast.Name) and given[0].id == name
    return False


def _resolve(owner: nn.Module, path: tuple[str, ...]):
    """The attribute at `path` from owner; None where one is missing."""
    value = owner
    for part in path:
        value = getattr(value, part, None)
    return value


def _ops(owner: nn.Module, steps: tuple) -> tuple:
    """The transform (linear_cross_entropy's `ops`) the steps make on `owner` as it is configured now:
    guarded steps whose guard is None dropped, paths read; None where a value is not a number (a
    tensor, a missing setting)."""
    ops = []
    for kind, value, guard in steps:
        if guard is not None and _resolve(owner, guard) is None:
            continue
        if kind == "tanh":
            ops.append(("tanh",))
            continue
        number = value if isinstance(value, float) else _resolve(owner, value)
        if type(number) not in (int, float):
            return None
        ops.append((kind, float(number)))
    return tuple(ops)


def _calls_self(node, attr: str, call: bool = True) -> bool:
    """node is `self.<attr>(...)` (call=False: node is a Call of `self.<attr>`)."""
    if call and not isinstance(node, ast.Call):
        return False
    f = node.func
    return (
        isinstance(f, ast.Attribute)
        and f.attr == attr
        and isinstance(f.value, ast.Name)
        and f.value.id == "self"
    )


def output_head(model: nn.Module) -> nn.Module | None:
    """The model's output embeddings (Hugging Face's get_output_embeddings()); None where it has none."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return head if isinstance(head, nn.Module) else None


def class_decision(cls: type) -> tuple[bool, str]:
    """head_of's decision for a class, from its source alone (no instance: what tests and
    benchmarks/loss_classes.py enumerate over transformers' classes): its head's path (what its
    get_output_embeddings returns: transformers' default, `self.lm_head`, or the `return self.<path>`
    of its own), whether its forward takes labels, what its forward does with the head's output
    (class_route), and for transformers' causal-LM loss its loss type, named for the class as
    transformers' PreTrainedModel names it. What only an instance shows (the head an nn.Linear, a loss
    function set on it, the modules between it and its head) head_of checks besides."""
    path = _output_embeddings_path(cls)
    if isinstance(path, str):
        return False, path
    if _labels_at(cls) is None:
        return False, "its forward takes no labels"
    route, why = class_route(cls, path[0])
    if route is None:
        return False, why
    if route == "loss_function":
        utils = sys.modules.get("transformers.loss.loss_utils")
        loss_type = None if utils is None else _class_loss_type(cls, utils.LOSS_MAPPING)
        why = _not_causal(cls, loss_type)
        return (False, why) if why else (True, "transformers' causal-LM loss")
    return True, "its cross-entropy on the head's output"


def _class_loss_type(cls: type, mapping: dict) -> str | None:
    """The loss_type transformers' PreTrainedModel.__init__ gives an instance of cls: its class name
    where LOSS_MAPPING has it, else the first key of LOSS_MAPPING found in the name, else None (a test
    compares it with instances' loss_type)."""
    name = cls.__name__
    if name in mapping:
        return name
    found = re.findall(f"({'|'.join(mapping)})", name)
    return found[0] if found else None


def _output_embeddings_path(cls: type) -> tuple[str, ...] | str:
    """The attribute path cls.get_output_embeddings returns: ("lm_head",) for transformers' default,
    the path of its `return self.<path>` where it defines its own; else why there is none to read."""
    method = getattr(cls, "get_output_embeddings", None)
    modeling = sys.modules.get("transformers.modeling_utils")
    if method is None:
        return "it has no get_output_embeddings (no head to take)"
    if modeling is not None and method is modeling.PreTrainedModel.get_output_embeddings:
        return ("lm_head",)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(method)))
    except (OSError, TypeError, SyntaxError):
        return "its get_output_embeddings' source cannot be read"
    values = [n.value for n in ast.walk(tree) if isinstance(n, ast.Return) and n.value is not None]
    paths = {_attribute_path(v) for v in values}
    if len(paths) == 1 and None not in paths:
        return paths.pop()
    if (
        len(values) == 1
        and isinstance(values[0], ast.Call)
        and (isinstance(values[0].func, ast.Attribute) and values[0].func.attr == "get_output_embeddings")
    ):
        inner = _attribute_path(values[0].func.value)
        where = "self." + ".".join(inner) if inner else "another module"
        return f"its get_output_embeddings is {where}'s: decided on an instance, by that module's forward"
    return "its get_output_embeddings returns no attribute of its own (no head to take)"


def _host(model: nn.Module, name: str) -> tuple[nn.Module | None, str]:
    """(the module whose training forward takes the labels and computes the loss on the head's output,
    the head's name within it), found from the model down the modules that hold the head: the first
    whose forward takes labels and hands the head's output to a loss (class_route); past a module that
    takes no labels (a wrapper's forward(*args, **kwargs): PEFT's PeftModel) or hands them on to the
    next by name or **kwargs (PeftModelForCausalLM); (None, name) where none does. A module that takes
    labels and keeps them (Llama 4's multimodal model, computing its loss on its language model's
    output) is where the search stops: its class_route gives the reason."""
    parts = name.split(".")
    module, last = model, (None, name)
    for depth, part in enumerate(parts[:-1] or parts):
        if _labels_at(type(module)) is not None:
            last = module, ".".join(parts[depth:])
            if class_route(type(module), part)[0] is not None or not _passes_labels(type(module), part):
                return last
        module = module._modules.get(part)
        if module is None:
            break
    if module is not None and len(parts) > 1 and _labels_at(type(module)) is not None:
        return module, parts[-1]
    return last


@functools.cache
def _passes_labels(cls: type, attr: str) -> bool:
    """cls.forward calls self.<attr>(...) with labels=... or **kwargs (the labels handed on)."""
    tree = forward_tree(cls)
    if tree is None:
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _calls_self(node, attr, call=False):
            if any(k.arg in ("labels", None) for k in node.keywords):
                return True
    return False


def _not_causal(cls: type, loss_type: str | None) -> str | None:
    """None where an instance of cls with this loss_type computes transformers' causal-LM loss
    (ForCausalLMLoss) as its loss_function: transformers' PreTrainedModel property, which gives
    LOSS_MAPPING[loss_type] and falls back to the causal-LM loss for a type it does not know (None:
    GPT-2's, CTRL's, BERT's LM head); else why not."""
    utils = sys.modules.get("transformers.loss.loss_utils")
    modeling = sys.modules.get("transformers.modeling_utils")
    if utils is None or modeling is None or not issubclass(cls, modeling.PreTrainedModel):
        return "its loss_function is not transformers' (not a PreTrainedModel)"
    if (
        inspect.getattr_static(cls, "loss_function", None)
        is not modeling.PreTrainedModel.__dict__["loss_function"]
    ):
        return "it defines a loss_function of its own"
    mapping = utils.LOSS_MAPPING
    if mapping.get(loss_type if loss_type in mapping else "ForCausalLM") is not mapping["ForCausalLM"]:
        return f"its loss type {loss_type!r} is not transformers' causal-LM loss"
    return None


@functools.cache
def class_route(cls: type, attr: str) -> tuple[str | None, str]:
    """What cls.forward does with the output of `self.<attr>(...)` (the child holding the head), read
    from its source: ("loss_function", why) where it hands it to self.loss_function, ("cross_entropy",
    why) where to nn.CrossEntropyLoss or F.cross_entropy (as it is, or through `.view`, `.reshape`, a
    scaling or `.float()`: PendingLogits records those), else (None, what it does instead)."""
    tree = forward_tree(cls)
    if tree is None:
        return None, "its forward's source cannot be read"
    found = _head_block(tree, attr, chained=True)
    if found is None:
        calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and _calls_self(n, attr)]
        if not calls:
            return None, f"its forward does not call self.{attr}"
        return None, f"its forward does not keep the head's output under a name: {_quote(calls[0], tree)}"
    name, rest = found
    losses = _cross_entropy_modules(tree)
    first = None  # the first simple statement that does something else with it
    for stmt in rest:
        if first is None:
            simple = (n for n in ast.walk(stmt) if isinstance(n, ast.stmt) and not isinstance(n, _COMPOUND))
            first = next((n for n in simple if any(isinstance(r, ast.Name) and r.id == name
                                                   for r in ast.walk(n))), None)  # fmt: skip
        for node in ast.walk(stmt):
            if not isinstance(node, ast.Call):
                continue
            if _calls_self(node, "loss_function", call=False):
                given = [k.value for k in node.keywords if k.arg == "logits"] + node.args[:1]
                if given and _reads(given[0], name):
                    return "loss_function", "its forward hands the head's output to self.loss_function"
            elif _is_cross_entropy(node.func, losses) and node.args and _reads(node.args[0], name):
                return "cross_entropy", "its forward computes a cross-entropy on the head's output"
    if first is None:
        return None, "its forward hands the head's output to no loss"
    return None, f"its forward hands the head's output to no cross-entropy; it does {_quote(first, tree)}"


_COMPOUND = (ast.If, ast.For, ast.While, ast.With, ast.Try)


def _quote(node: ast.AST, tree: ast.AST) -> str:
    """node's source line, shortened: `line N: code`, the line numbered in the model's file."""
    code = ast.unparse(node).splitlines()[0]
    code = code if len(code) <= 60 else code[:57] + "..."
    return f"`{code}` (line {getattr(node, 'lineno', '?')})"


def _reads(node: ast.AST, name: str) -> bool:
    """node is `name` or a method call chain or arithmetic on it (`name.view(-1, v)`, `name.float()`,
    `name / t`): what PendingLogits records or the loss takes."""
    return any(isinstance(n, ast.Name) and n.id == name for n in _chain(node))


def _cross_entropy_modules(tree: ast.AST) -> set[str]:
    """The names the forward binds to a CrossEntropyLoss(...) (`loss_fct = CrossEntropyLoss()`)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            func = node.value.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if called == "CrossEntropyLoss":
                names.update(_targets(node))
    return names


def _is_cross_entropy(func: ast.AST, losses: set[str]) -> bool:
    """func is F.cross_entropy (under any module path), or a name bound to a CrossEntropyLoss."""
    if isinstance(func, ast.Attribute):
        return func.attr == "cross_entropy"
    return isinstance(func, ast.Name) and (func.id == "cross_entropy" or func.id in losses)


@functools.cache
def _returns_child(cls: type, attr: str) -> bool:
    """cls.forward returns `self.<attr>(...)`'s output as it is (BERT's LM head modules hand their
    decoder's output back): `return self.<attr>(...)`, or `x = self.<attr>(...)` then `return x`."""
    tree = forward_tree(cls)
    if tree is None:
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.Return) and _calls_self(node.value, attr):
            return True
    found = _head_block(tree, attr)
    if found is None:
        return False
    name, rest = found
    return (
        bool(rest)
        and isinstance(rest[0], ast.Return)
        and isinstance(rest[0].value, ast.Name)
        and (rest[0].value.id == name)
    )


@functools.cache
def _labels_at(cls: type) -> int | None:
    """The position of `labels` among the positional arguments of cls.forward (self excluded); None
    where it takes no labels. Once per class: _arm runs on every training forward."""
    forward = getattr(cls, "forward", None)
    if forward is None:
        return None
    names = list(inspect.signature(forward).parameters)[1:]
    return names.index("labels") if "labels" in names else None
