"""What patch() and plan() ask of an op kind, and what every kind's home shares.

An op kind (the activation, the MLP, the norm, the loss) lives in one package, its home
(invact/<kind>/): what finds its modules (by formula or structure), the decision for each with its
reason, the replacement, its custom ops and its kernels per backend. The finder and the decision are
its __init__.py; the rest sits in modules beside it (docs/how-it-works.md, "Layout", lists them).
Each home exposes `KIND`, a Kind; invact.patch lists them in order and loops: plan() asks each kind
in turn to decide (a later kind may refine what an earlier one decided: the MLP's gated hooks follow
the activations replaced), patch() then asks each in turn to apply the plan. A home imports this
module, never invact.patch.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn


@dataclass(frozen=True)
class Decision:
    """One module (an activation, a norm, a causal LM's head: `kind`, the name of the Kind that decided)
    and what patch() does with it. `spared_bytes` is measured when plan()/patch() get example inputs: how
    many fewer bytes one training forward saves for backward with it replaced (negative: more), None
    without example inputs. ("Saved" bytes, as in invact.memory's reports, are the bytes kept for
    backward; "spared" bytes are the fewer of them a replacement keeps.)"""

    name: str  # qualified module name in the model (a function attribute: "<module>.<attribute>")
    cls: str  # qualified class name (a function attribute: the function's)
    replace: bool
    reason: str
    spared_bytes: int | None = None  # the activation's own: the gated products' are in gated_bytes
    # The module patch() hooks so that nothing it runs saves a copy of a gated product act(g) * u
    # (invact.mlp.gated): the activation's parent, "" for the model itself; None where nothing is hooked
    # (gated=False, not replaced, or measured to hold no such product).
    gated: str | None = None
    # Measured with example inputs (else None): the bytes the hook spares beyond the activation's own
    # spared_bytes: the gated products act(g) * u (this activation's output a factor) that ops inside that
    # module save, and where g is half of a fused gate_up output, the half that copying u out frees.
    gated_bytes: int | None = None
    # "activation", or "norm": a normalization layer inverted by invact.norm (saves its output and rstd
    # instead of its input); `reason` then names the formula it was checked to compute; or "loss": a
    # causal LM's head whose loss is computed from hidden states (invact.loss)
    kind: str = "activation"


@dataclass(frozen=True)
class Options:
    """plan()'s and patch()'s arguments (see plan()), include/exclude as tuples of glob patterns."""

    include: tuple[str, ...] | None
    exclude: tuple[str, ...] | None
    mode: str
    example_inputs: object
    gated: bool
    norms: bool
    loss: bool


class Found(NamedTuple):
    """A kind's answer to decide(): the plan so far with its own decisions added (an earlier kind's may
    be refined), and the module names include/exclude patterns may match among what it found (also
    those it has nothing to do for, such as InvAct modules already in the mode asked)."""

    decisions: list[Decision]
    names: list[str]


@dataclass(frozen=True)
class Kind:
    """One op kind, as patch() and plan() see it.

    decide(model, options, plan) -> Found: the plan so far (earlier kinds' decisions) extended by this
    kind's (changes nothing). apply(model, plan, options) -> names: the whole plan's decisions of this
    kind carried out, in place; the names of the modules it replaced."""

    name: str
    decide: Callable[[nn.Module, Options, list[Decision]], Found]
    apply: Callable[[nn.Module, list[Decision], Options], list[str]]


def qualname(module: nn.Module) -> str:
    """The module's class, qualified by its module: how patch() matches classes without importing them."""
    return f"{type(module).__module__}.{type(module).__qualname__}"


def glob_patterns(value, what: str) -> tuple[str, ...] | None:
    """include/exclude as a tuple of glob patterns: one string is one pattern (not its characters)."""
    if value is None:
        return None
    patterns = (value,) if isinstance(value, str) else tuple(value)
    bad = [p for p in patterns if not isinstance(p, str)]
    if bad:
        raise TypeError(f"{what} takes glob patterns (str or an iterable of str), got {bad[0]!r}")
    return patterns


def selected(name: str, include: tuple[str, ...] | None, exclude: tuple[str, ...] | None) -> bool:
    """Whether include/exclude (glob patterns, None: no filter) keep the module `name`."""
    if include is not None and not any(fnmatch.fnmatchcase(name, p) for p in include):
        return False
    return not (exclude is not None and any(fnmatch.fnmatchcase(name, p) for p in exclude))


def parent(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    """(the module holding `name`, the attribute it holds it under); "" names the model itself."""
    owner, _, attr = name.rpartition(".")
    return (model.get_submodule(owner) if owner else model), attr


def parent_name(name: str) -> str:
    return name.rpartition(".")[0]


def training_forward(model: nn.Module, example_inputs, pack, hooks: list, restore=()) -> None:
    """One training-mode forward of `example_inputs` with `pack` as the saved-tensor hook, the RNG
    state and every module's train/eval mode kept; then, also when it raises, the forward hooks
    `hooks` removed and each (parent, attribute, object) of `restore` set back."""
    modes = {m: m.training for m in model.modules()}
    devices = sorted({t.device.index or 0 for t in model.parameters() if t.is_cuda})
    args, kwargs = as_call(example_inputs)
    try:
        model.train()
        with torch.random.fork_rng(devices=devices), torch.enable_grad():
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = model(*args, **kwargs)
            del out
    finally:
        for h in hooks:
            h.remove()
        for owner, attr, obj in restore:
            setattr(owner, attr, obj)
        for m, training in modes.items():
            m.train(training)


def as_call(example_inputs) -> tuple[tuple, dict]:
    """example_inputs (a tensor, a tuple of positional arguments or a dict of keyword arguments) as
    (args, kwargs)."""
    if isinstance(example_inputs, dict):
        return (), example_inputs
    if isinstance(example_inputs, tuple):
        return example_inputs, {}
    return (example_inputs,), {}
