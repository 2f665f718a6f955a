"""The activation's home: which modules and function attributes patch() makes InvAct (by class and
constructor arguments, printed from the activation spec into invact/_generated/), the decision for each
with its reason (static rules, or measured by one forward with example inputs), and the replacement
(in place: invact.identity). The op is invact.activation.ops (custom ops and autograd), the module InvAct
(invact.activation.modules), the kernels per backend invact/activation/_triton.py, invact/activation/_numba.py
and the portable torch ops (invact/activation/_portable.py), each printed per activation into
invact/_generated/.

With example inputs the one measuring forward also finds the gated products act(g) * u each
activation's output is a factor of (invact.mlp.gated.multiply), for the MLP kind (invact.mlp) to decide
which modules to hook: one forward serves both.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from invact import _generated, kinds
from invact._generated import modules as _classes
from invact.activation.activations import ACTIVATIONS
from invact.activation.modules import InvAct
from invact.activation.ops import check_mode
from invact.callers import inplace_use
from invact.identity import swap
from invact.kinds import Decision, Found, Kind, Options
from invact.memory import parameter_storages
from invact.mlp.gated import multiply

# For a replaceable class or function: the activation (a name in ACTIVATIONS) an instance computes.
Which = Callable[[object], str]


def module_for(activation: str, mode: str) -> nn.Module:
    """A new InvAct module that computes `activation` (its torch-compatible class, generated MODULES)."""
    cls, kwargs = _generated.MODULES[activation]
    return getattr(_classes, cls)(**kwargs, mode=mode)


def patched(obj, activation: str, mode: str) -> nn.Module:
    """`obj` computing `activation` through InvAct: a module becomes its InvAct class in place, keeping
    its own class's identity (invact.identity); a function (an activation function attribute) gets a
    new InvAct module."""
    if not isinstance(obj, nn.Module):
        return module_for(activation, mode)
    check_mode(mode)
    ACTIVATIONS[activation].generated  # noqa: B018 - resolved now, as InvAct.__init__ does (its comment)
    cls, _ = _generated.MODULES[activation]
    return swap(obj, getattr(_classes, cls), activation=activation, mode=mode)


# The attributes patching sets on an activation module (InvAct's state): a module that has one of its own
# is left alone, since the in-place patch would overwrite it.
_INVACT_STATE = ("activation", "mode")


def _clash(obj) -> str | None:
    """Why patching `obj` in place would overwrite an attribute of its own; None if it would not."""
    if not isinstance(obj, nn.Module):
        return None
    taken = [a for a in _INVACT_STATE if a in vars(obj) or hasattr(type(obj), a)]
    if not taken:
        return None
    return f"it has an attribute {taken[0]!r} of its own, which InvAct's in-place patch would overwrite"


def _matches(module, when: dict) -> bool:
    return all(getattr(module, k, None) == v for k, v in when.items())


def _which(options) -> Which:
    """For a replaced class: the first activation whose attribute values the instance has."""

    def which(module) -> str:
        for activation, when in options:
            if _matches(module, when):
                return activation
        raise ValueError(_unsupported(options)(module))  # plan() has left it alone already

    return which


def _unsupported(options) -> Callable[[nn.Module], str | None]:
    """Why an instance is left alone: its attributes match no activation; the reason is what the
    activation's own constructor says of those values (a `why` of the spec explains the argument)."""

    def reason(module) -> str | None:
        if any(_matches(module, when) for _, when in options):
            return None
        activation, when = options[0]
        cls, kwargs = _generated.MODULES[activation]
        given = {k: getattr(module, k, None) for k in when}
        try:
            getattr(_classes, cls)(**(kwargs | given))
        except (TypeError, ValueError) as e:
            return str(e)
        values = ", ".join(f"{k}={v!r}" for k, v in given.items())
        choices = " or ".join(", ".join(f"{k}={v!r}" for k, v in w.items()) for _, w in options)
        return f"{values}: InvAct reproduces this class with {choices} only"

    return reason


# Qualified class name -> the activation an instance computes, for every class the spec says patch()
# replaces (each checked against its source: the formulas are in invact/_generated/__init__.py, REPLACES).
REPLACEABLE: dict[str, Which] = {cls: _which(options) for cls, options in _generated.REPLACES.items()}

# Replaceable classes whose instances may be configured beyond what InvAct reproduces: module -> the
# reason to leave it alone, or None.
CONDITIONS: dict[str, Callable[[nn.Module], str | None]] = {
    cls: _unsupported(options) for cls, options in _generated.REPLACES.items() if any(w for _, w in options)
}

# Activations deliberately left alone, with the reason.
SKIPPED: dict[str, str] = dict(_generated.SKIPPED)
# A module whose class name contains the name of a class in the tables (or "activation") is reported
# when it is left alone: a user's own variant of a known class is worth a log line.
_ACTIVATION_LIKE = re.compile(
    "|".join(
        sorted(
            {q.rpartition(".")[2].lower() for q in (*_generated.REPLACES, *_generated.SKIPPED)}
            | {"activation"}
        )
    ),
    re.IGNORECASE,
)


# Ends every reason a static rule gives for leaving an activation alone (see _static_risk).
RISK_HINT = "; pass example_inputs= to measure it"

# Activations stored as plain function attributes of a module (nn.TransformerEncoderLayer keeps the
# torch.nn.functional function it is given in self.activation): the function -> the activation.
_FUNCTION_NAMES = {getattr(F, name.rpartition(".")[2]): name for name in _generated.FUNCTIONS}
FUNCTIONS: dict[Callable, Which] = {
    fn: (lambda f, a=_generated.FUNCTIONS[name]: a) for fn, name in _FUNCTION_NAMES.items()
}

# Names under which a Dropout beside an activation drops the activation's output: timm's Mlp (drop1),
# wav2vec2's feed-forward (intermediate_dropout), act_drop / activation_dropout styles. A name alone
# says nothing of order in forward (GPT-2's MLP registers its residual `dropout` after `act`), so
# other dropouts beside an activation module are not taken as following it.
_ACTIVATION_DROPOUT_NAME = re.compile(r"act|intermediate|^drop1$", re.IGNORECASE)


def _static_risk(model: nn.Module, name: str, function_attribute: bool) -> str | None:
    """Without example inputs: the known patterns where the activation's output is not what the next
    layer saves (so InvAct would add memory), or where an in-place op overwrites it (so backward would
    fail). None if none applies. Registration order is call order only in nn.Sequential."""
    parent, attr = kinds.parent(model, name)
    children = list(parent.named_children())
    names = [n for n, _ in children]
    drops = [n for n, m in children if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0]
    if function_attribute and drops:  # called from forward code we cannot see: any dropout may follow
        return f"its module also holds Dropout(p > 0) ({', '.join(drops)}), which may follow it{RISK_HINT}"
    if isinstance(parent, nn.Sequential) and attr in names and names.index(attr) + 1 < len(names):
        after_name, after = children[names.index(attr) + 1]
        if getattr(after, "inplace", False) is True and not isinstance(after, InvAct):
            return (f"the next module, {after_name} ({type(after).__name__}), works in place: it would "
                    "overwrite the output InvAct saves for backward")  # fmt: skip
        if after_name in drops:
            return (f"the next module, {after_name}, is Dropout(p={after.p}): the next layer saves the "
                    f"dropped-out tensor, not this output: InvAct would add memory{RISK_HINT}")  # fmt: skip
    # transformers' encoder-decoder layers (BART, Whisper, ...) apply F.dropout(p=self.activation_dropout)
    # to the activation's output in forward code.
    p = getattr(parent, "activation_dropout", 0.0)
    if isinstance(p, (int, float)) and p > 0:
        return (f"its module applies dropout (activation_dropout={p}) to this output, so the next layer "
                f"saves another tensor and InvAct would add memory{RISK_HINT}")  # fmt: skip
    named = [n for n in drops if _ACTIVATION_DROPOUT_NAME.search(n)]
    if named:
        return (f"its module holds {named[0]}, by its name a Dropout(p > 0) on the activation's output, "
                f"so the next layer saves another tensor and InvAct would add memory{RISK_HINT}")  # fmt: skip
    use = None if function_attribute else inplace_use(model, name)
    if use is not None:
        return f"its output is modified in place after it ({use}): InvAct saves it for backward"
    return None


def _is_activation_like(module: nn.Module) -> bool:
    return not any(True for _ in module.children()) and bool(_ACTIVATION_LIKE.search(type(module).__name__))


def _candidates(model: nn.Module):
    """(name, class name, the object, its Which or None, is a function attribute) for every
    activation-like module and every activation function stored as a module attribute."""
    for name, module in model.named_modules(remove_duplicate=False):
        cls = kinds.qualname(module)
        yield name, cls, module, REPLACEABLE.get(cls), False
        if cls in REPLACEABLE or cls in SKIPPED or isinstance(module, InvAct) or _is_activation_like(module):
            continue  # an activation module's own function (a transformers class keeps its torch one)
        for attr, value in vars(module).items():
            if callable(value) and any(value is f for f in FUNCTIONS):
                full = f"{name}.{attr}" if name else attr
                yield full, _FUNCTION_NAMES[value], value, FUNCTIONS[value], True


# Starts the reason of a decision that only switches an InvAct module's mode (nothing to measure).
ALREADY = "already InvAct"


def decide(model: nn.Module, options: Options, plan: list[Decision]) -> Found:
    """One Decision per activation-like module or activation function attribute (see invact.plan):
    replaced or left alone, and why; measured with options.example_inputs."""
    include, exclude, mode = options.include, options.exclude, options.mode
    found, decisions = [], []
    for name, cls, obj, which, function_attribute in _candidates(model):
        if isinstance(obj, InvAct):
            found.append(name)
            if obj.mode != mode and kinds.selected(name, include, exclude):
                decisions.append(Decision(name, cls, True, f"{ALREADY}: mode {obj.mode!r} -> {mode!r}"))
            continue
        unsupported = (CONDITIONS[cls](obj) if cls in CONDITIONS else None) or (which and _clash(obj))
        if which is not None:
            if unsupported:
                decisions.append(Decision(name, cls, False, unsupported))
            elif not kinds.selected(name, include, exclude):
                decisions.append(Decision(name, cls, False, "excluded by include/exclude"))
            else:
                static = options.example_inputs is None
                risk = _static_risk(model, name, function_attribute) if static else None
                decisions.append(Decision(name, cls, risk is None, risk or "reproduced exactly"))
        elif cls in SKIPPED:
            decisions.append(Decision(name, cls, False, SKIPPED[cls]))
        elif _is_activation_like(obj):
            decisions.append(Decision(name, cls, False, "not a function InvAct reproduces"))
    found += [d.name for d in decisions]  # skipped activations (torch's own, saving nothing) count too
    if options.example_inputs is not None:
        decisions = _measured(model, decisions, options.example_inputs, mode, options.gated)
    return Found(plan + decisions, found)


def apply(model: nn.Module, plan: list[Decision], options: Options) -> list[str]:
    """Make each activation the plan replaces InvAct in place (a function attribute: a new module per
    attribute), or switch an InvAct module's mode; their names."""
    mine = [d for d in plan if d.kind == KIND.name and d.replace]
    if any(not d.name for d in mine):
        raise ValueError("the model itself is an activation: wrap it or use invact's modules directly")
    which = {name: w for name, _, _, w, _ in _candidates(model)}
    for d in mine:
        owner, attr = kinds.parent(model, d.name)
        old = getattr(owner, attr)
        if isinstance(old, InvAct):
            old.mode = options.mode
        elif isinstance(old, nn.Module):
            patched(old, which[d.name](old), options.mode)
        else:  # a function attribute: a module of its own per attribute (measured so by plan)
            new = patched(old, which[d.name](old), options.mode)
            new.train(owner.training)
            setattr(owner, attr, new)
    return [d.name for d in mine]


@dataclass
class _Call:
    key: str  # the name of the first decision that watches the object called
    output: object
    version: int
    index: int
    input: int | None = None  # the storage of its input tensor


def _object_key(name: str, obj) -> object:
    return id(obj) if isinstance(obj, nn.Module) else name


_NO_GAIN = (
    "its input stays saved by another op (as the other half of a fused gate_up projection does), or "
    "its output is not what a later op saves (e.g. after dropout or a reduction)"
)


def _measured(
    model: nn.Module, decisions: list[Decision], example_inputs, mode: str, gated: bool
) -> list[Decision]:
    """The decisions to replace, re-decided by one training-mode forward under saved-tensor hooks.

    Per call of an activation: `freed` = bytes of the storages that only this call saved (torch's
    activation saving its input, or a Python composition's intermediates); `cost` = the bits InvAct
    would add, plus its output's bytes unless another op saves that storage anyway. Summed over the
    calls of one module (a shared module is decided once). With `gated`, also the gated products:
    storages saved by ops, all inside the activation's parent module, that are a multiply of the
    activation's output by another tensor needing grad (what invact.mlp.gated recomputes)."""
    todo = {d.name: d for d in decisions if d.replace and not d.reason.startswith(ALREADY)}
    if not todo:
        return decisions
    objects, activation = {}, {}  # name -> the object called, and the registry name it computes
    for name, _, obj, which, _ in _candidates(model):
        if name in todo:
            objects[name], activation[name] = obj, which(obj)
    # A module is one object wherever it is shared; a function attribute (one torch.nn.functional
    # function is the same object in every layer) is one per name. Each object's calls are recorded
    # under its first name.
    key_of: dict[object, str] = {}
    for name, obj in objects.items():
        key_of.setdefault(_object_key(name, obj), name)
    calls: list[_Call] = []
    stack: list[int] = []
    sizes: dict[int, int] = {}
    savers: dict[int, set[int]] = {}
    excluded = parameter_storages(model)
    parent_of = {key: kinds.parent(model, key)[0] for key in key_of.values()}
    inside: dict[int, int] = {}  # id(parent module) -> its calls in progress
    output_of: dict[int, str] = {}  # id(autograd node of an activation call's output) -> its key
    nodes: list = []  # those nodes, kept alive: before torch 2.13 `t.grad_fn` makes a new Python object
    # for a node no Python object holds, so an id kept without its node may name another node later
    products: dict[int, tuple[str, bool]] = {}  # storage -> (key, every save inside key's parent)
    outside: dict[int, int] = {}  # storage -> its saves outside activation calls
    parts: dict[int, list[tuple[int, set[int]]]] = {}  # storage -> (bytes, parents in progress) per
    # save, outside activation calls, of a part of it (what invact.mlp.gated copies out if it is an
    # activation's input: u beside g in a fused gate_up output)

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in excluded and storage.nbytes():
            sizes[ptr] = storage.nbytes()
            savers.setdefault(ptr, set()).add(stack[-1] if stack else -1)
            if gated and not stack:
                outside[ptr] = outside.get(ptr, 0) + 1
                if t.numel() * t.element_size() < storage.nbytes():
                    scopes = {i for i, n in inside.items() if n > 0}
                    parts.setdefault(ptr, []).append((t.numel() * t.element_size(), scopes))
            found = multiply(t) if gated else None
            keys = [output_of[id(n)] for n in found[1] if id(n) in output_of] if found else []
            if keys:  # (the nodes are held in `nodes`, so their ids stay theirs)
                scoped = inside.get(id(parent_of[keys[0]]), 0) > 0
                products[ptr] = (keys[0], scoped and products.get(ptr, (None, True))[1])
        return t

    def enter(key: str, args: tuple) -> None:
        x = args[0] if args and isinstance(args[0], torch.Tensor) else None
        storage = x.untyped_storage().data_ptr() if x is not None else None
        calls.append(_Call(key, None, 0, len(calls), storage))
        stack.append(len(calls) - 1)

    def leave(output) -> None:
        call = calls[stack.pop()]
        call.output = output
        call.version = output._version if isinstance(output, torch.Tensor) else 0
        if isinstance(output, torch.Tensor) and output.grad_fn is not None:
            nodes.append(output.grad_fn)
            output_of[id(nodes[-1])] = call.key

    def count(module, delta: int) -> None:
        inside[id(module)] = inside.get(id(module), 0) + delta

    hooks, restore = [], []
    for name, obj in objects.items():
        if isinstance(obj, nn.Module):
            if key_of[_object_key(name, obj)] == name:
                hooks.append(obj.register_forward_pre_hook(lambda m, a, key=name: enter(key, a)))
                hooks.append(obj.register_forward_hook(lambda m, a, out: leave(out)))
        else:  # a function attribute: a spy that records its calls, removed afterwards
            parent, attr = kinds.parent(model, name)

            def spy(*args, _f=obj, _key=name, **kwargs):
                enter(_key, args)
                out = _f(*args, **kwargs)
                leave(out)
                return out

            restore.append((parent, attr, obj))
            setattr(parent, attr, spy)
    for parent in {id(m): m for m in parent_of.values()}.values() if gated else ():
        hooks.append(parent.register_forward_pre_hook(lambda m, a: count(m, 1)))
        hooks.append(parent.register_forward_hook(lambda m, a, out: count(m, -1)))
    kinds.training_forward(model, example_inputs, pack, hooks, restore)
    if not savers:
        raise ValueError("the example forward saved nothing for backward (does any input or parameter "
                         "require grad?): no saving can be measured")  # fmt: skip
    net: dict[str, int] = {}
    called: set[str] = set()
    modified: dict[str, str] = {}
    only_by: dict[int, int] = {}  # call index -> bytes of the storages that call alone saved
    for ptr, who in savers.items():
        if len(who) == 1:
            only_by[next(iter(who))] = only_by.get(next(iter(who)), 0) + sizes[ptr]
    for call in calls:
        y = call.output
        called.add(call.key)
        if not isinstance(y, torch.Tensor) or not y.requires_grad:
            continue  # no graph through it: neither torch nor InvAct saves anything
        if y._version != call.version:
            modified[call.key] = "an in-place op modifies its output later in the forward"
        freed = only_by.get(call.index, 0)
        ptr = y.untyped_storage().data_ptr()
        kept = 0 if savers.get(ptr, set()) - {call.index} else y.untyped_storage().nbytes()
        act = ACTIVATIONS[activation[call.key]]
        no_bits = act.monotone or (mode == "precision_bit" and y.dtype != torch.float64)
        net[call.key] = net.get(call.key, 0) + freed - kept - (0 if no_bits else (y.numel() + 7) // 8)
    recomputed: dict[str, int] = {}  # key -> bytes the gated path saves beyond the activation's own
    for ptr, (key, scoped) in products.items():
        recomputed[key] = recomputed.get(key, 0) + (sizes[ptr] if scoped else 0)
    for call in calls:  # an input storage the call saved and ops inside its parent saved parts of
        part = parts.pop(call.input, None)  # (each storage once)
        if (part and savers[call.input] == {call.index, -1} and outside[call.input] == len(part)
                and all(id(parent_of[call.key]) in scopes for _, scopes in part)):  # fmt: skip
            copies = sum(nbytes for nbytes, _ in part)
            recomputed[call.key] = recomputed.get(call.key, 0) + sizes[call.input] - copies
    out_decisions = []
    for d in decisions:
        if d.name not in todo:
            out_decisions.append(d)
            continue
        key = key_of[_object_key(d.name, objects[d.name])]
        saved = net.get(key)
        if key not in called:
            d = dataclasses.replace(
                d, replace=False, reason="not called by the example forward: nothing measured"
            )
        elif key in modified:
            d = dataclasses.replace(d, replace=False, spared_bytes=saved,
                        reason=f"{modified[key]}: InvAct saves it, so backward would fail")  # fmt: skip
        else:
            saved = saved or 0
            product = recomputed.get(key, 0)
            gated_bytes = product if gated else None
            if saved + product <= 0:
                d = dataclasses.replace(
                    d,
                    replace=False,
                    spared_bytes=saved,
                    gated_bytes=gated_bytes,
                    reason=f"measured: replacing it would add {-saved - product} bytes: {_NO_GAIN}",
                )
            else:
                of = f" ({product} of them by the gated path, invact.mlp.gated)" if product else ""
                d = dataclasses.replace(d, spared_bytes=saved, gated_bytes=gated_bytes,
                                        gated=kinds.parent_name(d.name) if product else None,
                                        reason=f"measured: saves {saved + product} bytes{of} in the example "
                                               "forward")  # fmt: skip
        out_decisions.append(d)
    return out_decisions


KIND = Kind("activation", decide, apply)
