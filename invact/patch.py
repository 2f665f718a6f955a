"""`invact.patch(model)` and `invact.plan(model)`: each op kind InvAct replaces (the activation, the MLP,
the norm, the loss), in order, decides for its modules, then each in turn replaces them in place
(each module stays the same object, an instance of its own class: invact.identity).

This module only loops: what finds, decides and replaces lives in each kind's home (invact.activation,
invact.mlp, invact.norm, invact.loss), through the interface of invact.kinds. Classes are matched by
their qualified name, so neither transformers nor timm is imported here. Modules left alone are logged
on the "invact" logger with the reason, and listed by `plan(model)`.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
from collections.abc import Iterable, Mapping

import torch
from torch import nn

from invact import _warn, activation, loss, mlp, norm
from invact.kinds import Decision, Kind, Options, glob_patterns

log = logging.getLogger("invact")

# The op kinds, in the order plan() asks them to decide and patch() to apply: the MLP's decision
# follows the activations replaced, the norm's and the loss's stand alone.
KINDS: tuple[Kind, ...] = (activation.KIND, mlp.KIND, norm.KIND, loss.KIND)
_LOSS = loss.KIND  # patch()'s and plan()'s argument `loss` hides the module there

__all__ = ["KINDS", "Decision", "patch", "plan"]


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
    nothing modifies its output in place; `spared_bytes` gives the difference.

    `loss`: also one Decision (kind "loss") for a causal LM's head (invact.loss.head_of: a Hugging Face
    model whose loss is transformers' causal-LM loss and whose output embeddings are an nn.Linear),
    named for the head: replaced means a training forward with labels computes the loss from the
    hidden state and the head's weight a chunk of rows at a time (no logits kept; its output's
    `logits` computed on demand, invact.loss.PendingLogits). include/exclude do not apply to it."""
    return _plan(model, _checked("plan", model, include, exclude, mode, example_inputs, gated, norms, loss))


def _options(include, exclude, mode: str, example_inputs, gated: bool, norms: bool, loss: bool) -> Options:
    if mode not in ("bits", "precision_bit"):
        raise ValueError(f"mode must be 'bits' or 'precision_bit', got {mode!r}")
    return Options(glob_patterns(include, "include"), glob_patterns(exclude, "exclude"), mode,
                   example_inputs, gated, norms, loss)  # fmt: skip


def _checked(what: str, model, include, exclude, mode, example_inputs, gated, norms, loss) -> Options:
    """plan()'s or patch()'s arguments (`what`: "plan" or "patch") as Options, each checked before
    anything runs: a TypeError (a wrong type) or ValueError (a wrong value) of one line that names the
    function and the argument. A mapping that is not a dict (transformers' BatchEncoding) as
    example_inputs is taken as the dict of its items."""

    def refuse(error: type[Exception], text: str) -> Exception:
        return error(f"invact.{what}: {text}")

    if not isinstance(model, nn.Module):
        raise refuse(TypeError, f"model must be a torch.nn.Module, got {_described(model)}")
    for name, value in (("gated", gated), ("norms", norms), ("loss", loss)):
        if not isinstance(value, bool):
            raise refuse(TypeError, f"{name} must be True or False, got {value!r}")
    if not isinstance(mode, str):
        raise refuse(TypeError, f"mode must be 'bits' or 'precision_bit' (a str), got {type(mode).__name__}")
    for name, value in (("include", include), ("exclude", exclude)):
        if value is not None and not isinstance(value, (str, Iterable)):
            raise refuse(TypeError, f"{name} takes glob patterns (a str or an iterable of str), got "
                                    f"{type(value).__name__}")  # fmt: skip
    if isinstance(example_inputs, Mapping) and not isinstance(example_inputs, dict):
        example_inputs = dict(example_inputs)
    elif example_inputs is not None and not isinstance(example_inputs, (torch.Tensor, tuple, dict)):
        raise refuse(TypeError, "example_inputs must be a tensor, a tuple of positional arguments or a dict "
                                f"of keyword arguments, got {type(example_inputs).__name__} (one input of "
                                "another type: pass it as a 1-tuple)")  # fmt: skip
    try:
        return _options(include, exclude, mode, example_inputs, gated, norms, loss)
    except (TypeError, ValueError) as e:  # a pattern that is not a str, an unknown mode
        raise refuse(type(e), str(e)) from None


def _described(value) -> str:
    """What a value that is not a module is, for the error that refuses it, with the likely fix."""
    if value is None:
        return "None"
    if isinstance(value, Mapping):
        return f"{type(value).__name__} (a state_dict? pass the nn.Module it loads into)"
    if isinstance(value, str):
        return "str (a model's name or path? load the model first, e.g. AutoModelForCausalLM.from_pretrained)"
    return type(value).__name__


def _plan(model: nn.Module, options: Options) -> list[Decision]:
    """Each kind's decisions in turn (KINDS); a ValueError, before anything changes, for an include or
    exclude pattern that matches nothing any kind found."""
    decisions, names = [], []
    for kind in KINDS:
        decisions, found = kind.decide(model, options, decisions)
        names += found
    for what, patterns in (("include", options.include), ("exclude", options.exclude)):
        for p in patterns or ():
            if not any(fnmatch.fnmatchcase(n, p) for n in names):
                example = f" (they look like {names[0]!r})" if names else " (the model has none)"
                raise ValueError(f"{what} pattern {p!r} matches no activation's or norm's name{example}")
    return [_loss_state_told(model, d) for d in decisions]


# The loss's Decision where an earlier patch() took a head that has been replaced since
_HEAD_REPLACED = ("not in effect: the head was replaced after invact.patch() took it "
                  "(resize_token_embeddings or set_output_embeddings), so the loss computes full logits "
                  "until patch() runs again, which takes the new head: ")  # fmt: skip


def _on_path(model: nn.Module, name: str):
    """(module, the rest of the path below it) for each module on the path to `name`, the model first,
    `name`'s own module not included."""
    parts = name.split(".")
    for depth in range(len(parts)):
        yield model.get_submodule(".".join(parts[:depth])), tuple(parts[depth:])


def _loss_host(model: nn.Module, name: str) -> nn.Module | None:
    """The module on the path to the head `name` (the model itself included) whose forward an earlier
    patch() wrapped to compute the loss from the head at that path (invact.loss.take: it keeps the
    head's path in `_invact_head_path`); None where no patch() took a head there."""
    for module, rest in _on_path(model, name):
        state = vars(module)
        if state.get("_invact_loss_hooked") and state.get("_invact_head_path") == rest:
            return module
    return None


# The loss's Decision where the model's forward was wrapped to offer its own fused head (TRL's
# add_fused_lm_head, on every model its SFT, DPO, KTO, GRPO and RLOO trainers train)
_FUSED_HEAD = ("not in effect in calls with fused_lm_head=True (TRL's trainers), where the model's own fused "
               "head reads the head's weight and never calls it; in its other calls: ")  # fmt: skip


def _fused_head(model: nn.Module, name: str) -> bool:
    """Whether a module on the path to the head `name` (the model itself included) has a forward of its
    own, set on the instance, that takes `fused_lm_head` (read from its code, not its signature, which
    functools.wraps copies from the class's forward)."""
    for module, _ in _on_path(model, name):
        forward = vars(module).get("forward")
        code = getattr(getattr(forward, "__func__", forward), "__code__", None)
        arguments = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount] if code else ()
        if "fused_lm_head" in arguments:
            return True
    return False


def _loss_in_place(model: nn.Module, name: str) -> bool:
    """Whether an earlier patch() took the head `name` and it is still the module there."""
    return isinstance(model.get_submodule(name), loss.LossHead) and _loss_host(model, name) is not None


def _loss_state_told(model: nn.Module, d: Decision) -> Decision:
    """The loss's Decision to take a head, its reason saying so where an earlier patch() took the
    module that was there and it has been replaced since (the loss path is then off), and where the
    model's forward offers a fused head of its own (TRL's), in whose calls the loss path is off."""
    if d.kind != loss.KIND.name or not d.replace:
        return d
    if _fused_head(model, d.name):
        d = dataclasses.replace(d, reason=_FUSED_HEAD + d.reason)
    if _loss_in_place(model, d.name) or _loss_host(model, d.name) is None:
        return d
    return dataclasses.replace(d, reason=_HEAD_REPLACED + d.reason)


class _HeadWatch:
    """The set_output_embeddings patch() gives a model whose loss it computes from the head's input (an
    instance attribute, as invact.loss's forward): the model's own, then, where the module at the
    head's path is no longer the patched head (resize_token_embeddings builds a new nn.Linear and hands
    it here), one warning that the loss computes full logits until patch() runs again (each time
    patch() takes a head anew, one more). `own`: a set_output_embeddings set on the instance before,
    which it calls; None: the class's."""

    def __init__(self, module: nn.Module) -> None:
        own = vars(module).get("set_output_embeddings")
        self.module, self.own = module, own.own if isinstance(own, _HeadWatch) else own
        self.warned = False

    def __call__(self, *args, **kwargs):
        module, own = self.module, self.own
        result = (own or type(module).set_output_embeddings.__get__(module))(*args, **kwargs)
        path = vars(module).get("_invact_head_path")
        if path and not self.warned and not isinstance(_at(module, path), loss.LossHead):
            self.warned = True
            _warn.warn(f"invact: {'.'.join(path)} of {type(module).__name__} was replaced after "
                       "invact.patch() took it (resize_token_embeddings?): its loss computes full "
                       "(tokens x vocab) logits again; call invact.patch(model) again to compute it from "
                       "hidden states", through=("transformers", "torch"))  # fmt: skip
        return result


def _at(module: nn.Module, path: tuple[str, ...]) -> nn.Module | None:
    """The module at `path` (attribute names) below `module`; None where there is none."""
    for part in path:
        module = module._modules.get(part) if isinstance(module, nn.Module) else None
    return module


def _watch_head(model: nn.Module, name: str) -> None:
    """After patch() took the head `name`: the module whose forward computes the loss warns when its
    head is replaced (_HeadWatch), once per take."""
    host = _loss_host(model, name)
    if host is None or not callable(getattr(host, "set_output_embeddings", None)):
        return
    watch = vars(host).get("set_output_embeddings")
    if isinstance(watch, _HeadWatch) and watch.module is host:
        watch.warned = False
    else:
        host.set_output_embeddings = _HeadWatch(host)


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
    the names of the modules this call changed. Arguments as for plan(); with `example_inputs` the
    saving is measured per activation and nothing that would add memory is replaced. An argument of
    the wrong type is a TypeError, a wrong value a ValueError, each naming it, before anything changes.

    Idempotent: a second call on the same model changes nothing and returns [] (what is in place:
    plan(), whose Decisions list the patched head as replaced, the patched activations and norms not
    at all); a call with another `mode` returns the activations it switched. A head replaced after
    patch() (`model.resize_token_embeddings(...)` builds a new nn.Linear) is a plain head: the loss
    (`loss` below) computes full logits again, the model's set_output_embeddings warns once
    (UserWarning) and plan() says so; call patch() again, which takes the new head and returns its name.

    `gated` (default True): also hook the module holding each InvAct activation (its parent: the MLP)
    so that nothing in it saves a copy of a gated product act(g) * u (the down projection's input, be
    it nn.Linear, PEFT's LoRA layer or a functional call in MoE experts): it is recomputed from the y
    and u the multiply saves (invact.mlp.gated). With `example_inputs`, only modules where such a product
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
    enabled computes its loss and gradients from the last hidden state and the head's weight, a chunk of
    rows at a time (invact.loss): no (tokens x vocab) logits kept for backward or materialized whole, the
    model's own loss semantics kept (label shift, ignore_index, num_items_in_batch, logits_to_keep,
    softcapping and logit scales); its output's `logits` are computed when read, from the head as it is
    then (invact.loss.PendingLogits: reading them after optimizer.step() raises), and are None under
    torch.compile. Inference, eval mode and calls without labels are unchanged. loss=False leaves the
    head as it is."""
    options = _checked("patch", model, include, exclude, mode, example_inputs, gated, norms, loss)
    decisions = _plan(model, options)
    for d in decisions:
        if not d.replace:
            log.info("invact.patch: left %s (%s) alone: %s", d.name, d.cls, d.reason)
    # a head an earlier call took (and still in place) is in the plan, but nothing changes for it
    taken = {d.name for d in decisions if d.kind == _LOSS.name and _loss_in_place(model, d.name)}
    replaced = []
    for kind in KINDS:
        names = kind.apply(model, decisions, options)
        if kind is _LOSS:
            for name in names:
                if name not in taken:
                    _watch_head(model, name)
            names = [n for n in names if n not in taken]
        replaced += names
    return replaced
