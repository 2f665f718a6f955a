"""`invact.patch(model)`: make every activation module InvAct reproduces exactly its InvAct twin, and
every norm whose formula it reproduces an inverted norm, in place (each module stays the same object,
an instance of its own class: invact.identity).

Classes are matched by their qualified name, so neither transformers nor timm is imported here. A
replacement computes the same function; torch's own op may differ from a Python composition (as
transformers writes some activations) by float rounding only. Activation-like modules that are not
replaced are logged on the "invact" logger with the reason, and listed by `plan(model)`.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from invact import _generated
from invact._generated import modules as _classes
from invact.activations import ACTIVATIONS
from invact.callers import inplace_use
from invact.gated import multiply, recompute_products
from invact.identity import swap
from invact.loss import head_of, take
from invact.memory import parameter_storages
from invact.mlp import fuse
from invact.modules import InvAct
from invact.norm import invert, is_candidate, keeps_residual, match
from invact.ops import check_mode

log = logging.getLogger("invact")
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


@dataclass(frozen=True)
class Decision:
    """One activation and what patch() does with it. `saved_bytes` is measured when plan()/patch() get
    example inputs: how many fewer bytes one training forward saves for backward with this activation
    replaced (negative: more), None without example inputs."""

    name: str  # qualified module name in the model (a function attribute: "<module>.<attribute>")
    cls: str  # qualified class name (a function attribute: the function's)
    replace: bool
    reason: str
    saved_bytes: int | None = None  # the activation's own saving: gated products are in gated_bytes
    # The module patch() hooks so that nothing it runs saves a copy of a gated product act(g) * u
    # (invact.gated): the activation's parent, "" for the model itself; None where nothing is hooked
    # (gated=False, not replaced, or measured to hold no such product).
    gated: str | None = None
    # Measured with example inputs (else None): the bytes the hook saves beyond the activation's own
    # saving: the gated products act(g) * u (this activation's output a factor) that ops inside that
    # module save, and where g is half of a fused gate_up output, the half that copying u out frees.
    gated_bytes: int | None = None
    # "activation", or "norm": a normalization layer inverted by invact.norm (saves its output and rstd
    # instead of its input); `reason` then names the formula it was checked to compute; or "loss": a
    # causal LM's head whose loss is computed from hidden states (invact.loss)
    kind: str = "activation"


def _qualname(module: nn.Module) -> str:
    return f"{type(module).__module__}.{type(module).__qualname__}"


def _patterns(value, what: str) -> tuple[str, ...] | None:
    """include/exclude as a tuple of glob patterns: one string is one pattern (not its characters)."""
    if value is None:
        return None
    patterns = (value,) if isinstance(value, str) else tuple(value)
    bad = [p for p in patterns if not isinstance(p, str)]
    if bad:
        raise TypeError(f"{what} takes glob patterns (str or an iterable of str), got {bad[0]!r}")
    return patterns


def _selected(name: str, include: tuple[str, ...] | None, exclude: tuple[str, ...] | None) -> bool:
    if include is not None and not any(fnmatch.fnmatchcase(name, p) for p in include):
        return False
    return not (exclude is not None and any(fnmatch.fnmatchcase(name, p) for p in exclude))


def _parent(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    parent_name, _, attr = name.rpartition(".")
    return (model.get_submodule(parent_name) if parent_name else model), attr


# Names under which a Dropout beside an activation drops the activation's output: timm's Mlp (drop1),
# wav2vec2's feed-forward (intermediate_dropout), act_drop / activation_dropout styles. A name alone
# says nothing of order in forward (GPT-2's MLP registers its residual `dropout` after `act`), so
# other dropouts beside an activation module are not taken as following it.
_ACTIVATION_DROPOUT_NAME = re.compile(r"act|intermediate|^drop1$", re.IGNORECASE)


def _static_risk(model: nn.Module, name: str, function_attribute: bool) -> str | None:
    """Without example inputs: the known patterns where the activation's output is not what the next
    layer saves (so InvAct would add memory), or where an in-place op overwrites it (so backward would
    fail). None if none applies. Registration order is call order only in nn.Sequential."""
    parent, attr = _parent(model, name)
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
        cls = _qualname(module)
        yield name, cls, module, REPLACEABLE.get(cls), False
        if cls in REPLACEABLE or cls in SKIPPED or isinstance(module, InvAct) or _is_activation_like(module):
            continue  # an activation module's own function (a transformers class keeps its torch one)
        for attr, value in vars(module).items():
            if callable(value) and any(value is f for f in FUNCTIONS):
                full = f"{name}.{attr}" if name else attr
                yield full, _FUNCTION_NAMES[value], value, FUNCTIONS[value], True


def plan(
    model: nn.Module,
    *,
    include=None,
    exclude=None,
    mode: str = "bits",
    example_inputs=None,
    gated=True,
    norms: bool = True,
    loss: bool = True,
):
    """What patch() would do: one Decision per activation-like module or activation function attribute
    (replaced or left alone, and why). Changes nothing.

    `include`/`exclude`: glob patterns on module names (a string or several), e.g.
    `"encoder.layer.*.intermediate.*"`; a pattern that matches no activation is a ValueError.
    `example_inputs`: a tensor, a tuple of positional arguments or a dict of keyword arguments for
    one training-mode forward of the model (RNG state and train/eval modes are restored). With them
    each activation is replaced only where that saves memory, measured: its output must be what a
    later op saves (not so after dropout or a reduction) and nothing may modify it in place. Without
    them, known risky patterns are left alone: in nn.Sequential, Dropout(p > 0) or an in-place module
    right after it; a module that applies `activation_dropout` to it (transformers' BART- and
    wav2vec2-style layers) or holds a Dropout named for it (timm's Mlp `drop1`); and for an activation
    function attribute any Dropout(p > 0) in its module.

    `gated`: each replaced activation's Decision names in `gated` the module patch() hooks so that it
    saves no copy of a gated product act(g) * u (see patch()); with example inputs only where such a
    product is measured, and `gated_bytes` gives its bytes.

    `norms`: also one Decision (kind "norm") per normalization module (a class of the norm spec, or a
    leaf module named like one): replaced by invact.norm.InvNorm where its forward matches one of the
    spec's formulas bitwise on a probe, unless in nn.Sequential Dropout(p > 0) or an in-place module
    follows it (then the next layer saves another tensor than its output, or overwrites it). With
    `example_inputs` each norm is measured instead: replaced only where the bytes saved inside it
    (eager: x, its statistics, Hugging Face's fp32 copies) exceed what the inverted norm keeps (rstd,
    the 4-bit residuals of the variants that have them, and y itself where no later op saves it), and
    nothing modifies its output in place; `saved_bytes` gives the difference.

    `loss`: also one Decision (kind "loss") for a causal LM's head (invact.loss.head_of: a Hugging Face
    model whose loss is transformers' causal-LM loss and whose output embeddings are an nn.Linear),
    named for the head: replaced means a training forward with labels computes the loss from the
    hidden state and the head's weight a vocabulary block at a time (no logits kept, `logits=None` in
    its output). include/exclude do not apply to it."""
    if mode not in ("bits", "precision_bit"):
        raise ValueError(f"mode must be 'bits' or 'precision_bit', got {mode!r}")
    include, exclude = _patterns(include, "include"), _patterns(exclude, "exclude")
    found, decisions = [], []
    for name, cls, obj, which, function_attribute in _candidates(model):
        if isinstance(obj, InvAct):
            found.append(name)
            if obj.mode != mode and _selected(name, include, exclude):
                decisions.append(Decision(name, cls, True, f"already InvAct: mode {obj.mode!r} -> {mode!r}"))
            continue
        unsupported = (CONDITIONS[cls](obj) if cls in CONDITIONS else None) or (which and _clash(obj))
        if which is not None:
            if unsupported:
                decisions.append(Decision(name, cls, False, unsupported))
            elif not _selected(name, include, exclude):
                decisions.append(Decision(name, cls, False, "excluded by include/exclude"))
            else:
                risk = None if example_inputs is not None else _static_risk(model, name, function_attribute)
                decisions.append(Decision(name, cls, risk is None, risk or "reproduced exactly"))
        elif cls in SKIPPED:
            decisions.append(Decision(name, cls, False, SKIPPED[cls]))
        elif _is_activation_like(obj):
            decisions.append(Decision(name, cls, False, "not a function InvAct reproduces"))
    found += [d.name for d in decisions]  # skipped activations (torch's own, saving nothing) count too
    norm_decisions = _norm_decisions(model, include, exclude, example_inputs is None) if norms else []
    found += [d.name for d in norm_decisions]
    for what, patterns in (("include", include), ("exclude", exclude)):
        for p in patterns or ():
            if not any(fnmatch.fnmatchcase(n, p) for n in found):
                example = f" (they look like {found[0]!r})" if found else " (the model has none)"
                raise ValueError(f"{what} pattern {p!r} matches no activation's or norm's name{example}")
    loss_decisions = _loss_decisions(model) if loss else []
    if example_inputs is not None:
        measured = _measured(model, decisions, example_inputs, mode, gated)
        return measured + _measured_norms(model, norm_decisions, example_inputs) + loss_decisions
    # statically: hook the parent of every replaced activation (harmless where it holds no product)
    return (_hooking_parents(decisions) if gated else decisions) + norm_decisions + loss_decisions


def _loss_decisions(model: nn.Module) -> list[Decision]:
    """The loss's Decision for a model with a head (output embeddings), none for one without."""
    name, taken, why = head_of(model)
    if name is None:
        return []
    return [Decision(name, _qualname(model.get_submodule(name)), taken, why, kind="loss")]


def _norm_decisions(model: nn.Module, include, exclude, static: bool) -> list[Decision]:
    """One Decision (kind "norm") per normalization module (see plan's `norms`); `static`: the known
    risky patterns decide (without example inputs)."""
    decisions = []
    for name, module in model.named_modules(remove_duplicate=False):
        if not is_candidate(module):
            continue
        cls = _qualname(module)
        variant, why = match(module)
        if variant is None:
            decisions.append(Decision(name, cls, False, why, kind="norm"))
        elif not _selected(name, include, exclude):
            decisions.append(Decision(name, cls, False, "excluded by include/exclude", kind="norm"))
        elif not name:
            decisions.append(Decision(name, cls, False, "the model itself is a norm: use invact.norm.InvNorm",
                                      kind="norm"))  # fmt: skip
        else:
            risk = _norm_risk(model, name) if static else None
            decisions.append(Decision(name, cls, risk is None, risk or f"inverted: {why}", kind="norm"))
    return decisions


def _measured_norms(model: nn.Module, decisions: list[Decision], example_inputs) -> list[Decision]:
    """The norm decisions to replace, re-decided by one training-mode forward of the unpatched model
    under saved-tensor hooks (see plan's `norms`)."""
    todo = {d.name: d for d in decisions if d.replace}
    if not todo:
        return decisions
    modules = {name: model.get_submodule(name) for name in todo}
    first = {}  # id(module) -> its first name (a shared module is measured once)
    for name, m in modules.items():
        first.setdefault(id(m), name)
    excluded = parameter_storages(model)
    stack: list[str] = []
    inside: dict[str, dict[int, int]] = {}  # name -> storage -> bytes, saved while it ran
    outputs: dict[str, list] = {}  # name -> [(output, its version at return)]
    elsewhere: set[int] = set()  # storages saved outside every measured norm

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in excluded and storage.nbytes():
            if stack:
                inside.setdefault(stack[-1], {})[ptr] = storage.nbytes()
            else:
                elsewhere.add(ptr)
        return t

    def enter(name: str) -> None:
        stack.append(name)

    def leave(name: str, output) -> None:
        stack.pop()
        if isinstance(output, torch.Tensor):  # held until the end: no later tensor takes its address
            outputs.setdefault(name, []).append((output, output._version))

    hooks = []
    for name, m in modules.items():
        if first[id(m)] == name:
            hooks.append(m.register_forward_pre_hook(lambda _m, _a, n=name: enter(n)))
            hooks.append(m.register_forward_hook(lambda _m, _a, out, n=name: leave(n, out)))
    _training_forward(model, example_inputs, pack, hooks)
    result = []
    for d in decisions:
        if d.name not in todo:
            result.append(d)
            continue
        key = first[id(modules[d.name])]
        calls = outputs.get(key, [])
        if not calls:
            result.append(dataclasses.replace(d, replace=False, reason="not called by the example forward: "
                                              "nothing measured"))  # fmt: skip
            continue
        if any(y._version != version for y, version in calls):
            why = "an in-place op modifies its output later in the forward: the inverted norm saves it"
            result.append(dataclasses.replace(d, replace=False, reason=why))
            continue
        own = {y.untyped_storage().data_ptr() for y, _ in calls}
        freed = sum(n for ptr, n in inside.get(key, {}).items() if ptr not in own)
        cost = sum(
            _kept_bytes(modules[d.name], y, y.untyped_storage().data_ptr() in elsewhere) for y, _ in calls
        )
        if freed - cost <= 0:
            why = f"measured: inverting it would add {cost - freed} bytes (no later op saves its output)"
            result.append(dataclasses.replace(d, replace=False, saved_bytes=freed - cost, reason=why))
        else:
            why = f"measured: saves {freed - cost} bytes; {d.reason}"
            result.append(dataclasses.replace(d, saved_bytes=freed - cost, reason=why))
    return result


def _kept_bytes(module: nn.Module, y: torch.Tensor, saved_later: bool) -> int:
    """What an inverted norm keeps for one call with output y: rstd (fp32, one per row), the 4-bit
    residuals where its variant keeps them (invact.norm.keeps_residual), and y where no later op saves
    it."""
    rows = y.numel() // max(y.shape[-1], 1) if y.dim() else 1
    kept = 4 * rows + (0 if saved_later else y.untyped_storage().nbytes())
    variant, _ = match(module)
    if (
        variant is not None
        and getattr(module, "weight", None) is not None
        and keeps_residual(variant, y.dtype)
    ):
        kept += (y.numel() + 1) // 2
    return kept


def _norm_risk(model: nn.Module, name: str) -> str | None:
    """In nn.Sequential, the module after a norm: Dropout(p > 0) (the next layer saves the dropped-out
    tensor, not y) or in place (it would overwrite the y backward reads); elsewhere, forward code that
    calls it and then modifies its output in place (invact.callers); None otherwise."""
    parent, attr = _parent(model, name)
    if not isinstance(parent, nn.Sequential):
        use = inplace_use(model, name)
        if use is not None:
            return f"its output is modified in place after it ({use}): the inverted norm saves it"
        return None
    names = [n for n, _ in parent.named_children()]
    if attr not in names or names.index(attr) + 1 == len(names):
        return None
    after_name, after = list(parent.named_children())[names.index(attr) + 1]
    if isinstance(after, nn.modules.dropout._DropoutNd) and after.p > 0:
        return f"the next module, {after_name}, is Dropout(p={after.p}): the next layer saves another tensor"
    if getattr(after, "inplace", False) is True:
        return f"the next module, {after_name} ({type(after).__name__}), works in place on its output"
    return None


def _parent_name(name: str) -> str:
    return name.rpartition(".")[0]


def _hooking_parents(decisions: list[Decision], but: dict | tuple = ()) -> list[Decision]:
    """The decisions with `gated` set to the parent's name for each replaced activation not in `but`."""
    return [dataclasses.replace(d, gated=_parent_name(d.name)) if d.replace and d.name not in but else d
            for d in decisions]  # fmt: skip


def patch(
    model: nn.Module,
    *,
    include=None,
    exclude=None,
    mode: str = "bits",
    example_inputs=None,
    gated: bool = True,
    norms: bool = True,
    loss: bool = True,
) -> list[str]:
    """Replace, in place, every activation that InvAct reproduces exactly and that saves memory; return
    their names. Arguments as for plan(); with `example_inputs` the saving is measured per activation
    and nothing that would add memory is replaced.

    `gated` (default True): also hook the module holding each InvAct activation (its parent: the MLP)
    so that nothing in it saves a copy of a gated product act(g) * u (the down projection's input, be
    it nn.Linear, PEFT's LoRA layer or a functional call in MoE experts): it is recomputed from the y
    and u the multiply saves (invact.gated). With `example_inputs`, only modules where such a product
    is measured are hooked (plan()'s Decision.gated). gated=False keeps the activation-only behaviour.

    Each module is changed in place (invact.identity): the same object, still an instance of its
    class, under its class name, with its parameters, attributes and hooks, so a module shared by
    several parents stays shared. Works on any device and dtype, on a model whose parameters are on
    the meta device (inside `with torch.device("meta")` too), and inside wrappers such as PEFT's. An
    already patched module whose mode differs from `mode` is switched to it. Activations left alone
    are logged on the "invact" logger (INFO) with the reason. A model loaded again (from_pretrained,
    a fresh instance) holds torch's activations: patch it again.

    `norms` (default True): also make each normalization layer whose
    formula InvAct reproduces (RMSNorm, LayerNorm and their Hugging Face and timm variants, checked on
    a probe: see plan()) an invact.norm.InvNorm in place, which saves its output and rstd instead of
    its input. norms=False leaves every norm as it is (it does not undo an earlier
    patch(norms=True): a model loaded again holds torch's norms).

    `loss` (default True): a causal LM (see plan()) called in training mode with labels and gradients
    enabled computes its loss from the last hidden state and the head's weight, a vocabulary block at
    a time (invact.loss): no (tokens x vocab) logits kept for backward or materialized whole, the
    model's own loss semantics kept (label shift, ignore_index, num_items_in_batch, logits_to_keep,
    softcapping and logit scales); its output's `logits` is then None. Inference, eval mode and calls
    without labels are unchanged. loss=False leaves the head as it is."""
    decisions = plan(model, include=include, exclude=exclude, mode=mode, example_inputs=example_inputs,
                     gated=gated, norms=norms, loss=loss)  # fmt: skip
    replaced = []
    which = {name: w for name, _, _, w, _ in _candidates(model)}
    for d in decisions:
        if not d.replace:
            log.info("invact.patch: left %s (%s) alone: %s", d.name, d.cls, d.reason)
            continue
        if not d.name and d.kind != "norm":
            raise ValueError("the model itself is an activation: wrap it or use invact's modules directly")
        parent, attr = _parent(model, d.name)
        old = getattr(parent, attr)
        if d.kind == "loss":
            take(model, d.name)
        elif d.kind == "norm":
            invert(old, match(old)[0])  # in place: a module shared by several parents once
        elif isinstance(old, InvAct):
            old.mode = mode
        elif isinstance(old, nn.Module):
            patched(old, which[d.name](old), mode)
        else:  # a function attribute: a module of its own per attribute (measured so by plan)
            new = patched(old, which[d.name](old), mode)
            new.train(parent.training)
            setattr(parent, attr, new)
        replaced.append(d.name)
    decided = {d.name for d in decisions}
    earlier = [n for n, m in model.named_modules(remove_duplicate=False) if isinstance(m, InvAct)]
    earlier = {_parent_name(n) for n in earlier if n not in decided and _selected(n, include, exclude)}
    if gated:  # the plan's modules, and those beside InvAct modules an earlier patch(gated=False) made
        parents = {d.gated for d in decisions if d.replace and d.gated is not None}
        _hook_gated_products(model, sorted(parents | earlier))
    # Every plain MLP runs as one Function (invact.mlp: the same saved tensors, less host time), also
    # where no gated product was measured or gated=False.
    parents = {_parent_name(d.name) for d in decisions if d.replace and d.kind == "activation"}
    for name in sorted(parents | earlier):
        fuse(model.get_submodule(name), gated=False)
    return replaced


def _hook_gated_products(model: nn.Module, parents: list[str]) -> None:
    """invact.gated.recompute_products on these modules (names; "" is the model)."""
    for name in parents:
        if recompute_products(model.get_submodule(name)):
            log.info("invact.patch: %s saves no copy of a gated product (recomputed in backward)",
                     name or "the model")  # fmt: skip


def _training_forward(model: nn.Module, example_inputs, pack, hooks: list, restore=()) -> None:
    """One training-mode forward of `example_inputs` with `pack` as the saved-tensor hook, the RNG
    state and every module's train/eval mode kept; then, also when it raises, the forward hooks
    `hooks` removed and each (parent, attribute, object) of `restore` set back."""
    modes = {m: m.training for m in model.modules()}
    devices = sorted({t.device.index or 0 for t in model.parameters() if t.is_cuda})
    args, kwargs = _as_call(example_inputs)
    try:
        model.train()
        with torch.random.fork_rng(devices=devices), torch.enable_grad():
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = model(*args, **kwargs)
            del out
    finally:
        for h in hooks:
            h.remove()
        for parent, attr, obj in restore:
            setattr(parent, attr, obj)
        for m, training in modes.items():
            m.train(training)


def _as_call(example_inputs) -> tuple[tuple, dict]:
    if isinstance(example_inputs, dict):
        return (), example_inputs
    if isinstance(example_inputs, tuple):
        return example_inputs, {}
    return (example_inputs,), {}


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
    activation's output by another tensor needing grad (what invact.gated recomputes)."""
    todo = {d.name: d for d in decisions if d.replace and not d.reason.startswith("already InvAct")}
    if gated:  # a mode switch is not measured: its parent is hooked as without example inputs
        decisions = _hooking_parents(decisions, but=todo)
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
    parent_of = {key: _parent(model, key)[0] for key in key_of.values()}
    inside: dict[int, int] = {}  # id(parent module) -> its calls in progress
    output_of: dict[int, str] = {}  # id(autograd node of an activation call's output) -> its key
    products: dict[int, tuple[str, bool]] = {}  # storage -> (key, every save inside key's parent)
    outside: dict[int, int] = {}  # storage -> its saves outside activation calls
    parts: dict[int, list[tuple[int, set[int]]]] = {}  # storage -> (bytes, parents in progress) per
    # save, outside activation calls, of a part of it (what invact.gated copies out if it is an
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
            if keys:  # (the call outputs are held in `calls`, so their nodes' ids stay theirs)
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
            output_of[id(output.grad_fn)] = call.key

    def count(module, delta: int) -> None:
        inside[id(module)] = inside.get(id(module), 0) + delta

    hooks, restore = [], []
    for name, obj in objects.items():
        if isinstance(obj, nn.Module):
            if key_of[_object_key(name, obj)] == name:
                hooks.append(obj.register_forward_pre_hook(lambda m, a, key=name: enter(key, a)))
                hooks.append(obj.register_forward_hook(lambda m, a, out: leave(out)))
        else:  # a function attribute: a spy that records its calls, removed afterwards
            parent, attr = _parent(model, name)

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
    _training_forward(model, example_inputs, pack, hooks, restore)
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
            d = dataclasses.replace(d, replace=False, saved_bytes=saved,
                        reason=f"{modified[key]}: InvAct saves it, so backward would fail")  # fmt: skip
        else:
            saved = saved or 0
            product = recomputed.get(key, 0)
            gated_bytes = product if gated else None
            if saved + product <= 0:
                d = dataclasses.replace(
                    d,
                    replace=False,
                    saved_bytes=saved,
                    gated_bytes=gated_bytes,
                    reason=f"measured: replacing it would add {-saved - product} bytes: {_NO_GAIN}",
                )
            else:
                of = f" ({product} of them by the gated path, invact.gated)" if product else ""
                d = dataclasses.replace(d, saved_bytes=saved, gated_bytes=gated_bytes,
                                        gated=_parent_name(d.name) if product else None,
                                        reason=f"measured: saves {saved + product} bytes{of} in the example "
                                               "forward")  # fmt: skip
        out_decisions.append(d)
    return out_decisions
