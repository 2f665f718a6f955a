"""`invact.patch(model)`: swap every activation module InvAct reproduces exactly for its InvAct twin.

Classes are matched by their qualified name, so neither transformers nor timm is imported here. A
replacement computes the same function; torch's own op may differ from a Python composition (e.g.
transformers' NewGELUActivation) by float rounding only. Activation-like modules that are not
replaced are logged on the "invact" logger with the reason, and listed by `plan(model)`.
"""

from __future__ import annotations

import fnmatch
import logging
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from torch import nn

from invact.functional import softplus_unsupported
from invact.modules import InvActGELU, InvActMish, InvActQuickGELU, InvActSiLU, InvActSoftplus, _InvAct

log = logging.getLogger("invact")
Factory = Callable[[nn.Module, str], nn.Module]

_EXACT: Factory = lambda m, mode: InvActGELU("none", mode=mode)  # noqa: E731
_TANH: Factory = lambda m, mode: InvActGELU("tanh", mode=mode)  # noqa: E731
_SILU: Factory = lambda m, mode: InvActSiLU(mode=mode)  # noqa: E731
_QUICK: Factory = lambda m, mode: InvActQuickGELU(mode=mode)  # noqa: E731
_MISH: Factory = lambda m, mode: InvActMish(mode=mode)  # noqa: E731

# Qualified class name -> factory. Each formula checked against its source:
REPLACEABLE: dict[str, Factory] = {
    "torch.nn.modules.activation.GELU": lambda m, mode: InvActGELU(m.approximate, mode=mode),
    "torch.nn.modules.activation.SiLU": _SILU,
    "torch.nn.modules.activation.Mish": _MISH,
    "torch.nn.modules.activation.Softplus": lambda m, mode: InvActSoftplus(m.beta, m.threshold, mode=mode),
    # transformers.activations
    "transformers.activations.GELUActivation": _EXACT,  # F.gelu, or x/2 (1 + erf(x/sqrt 2)) in Python
    "transformers.activations.GELUTanh": _TANH,  # F.gelu(approximate="tanh"), or its Python formula
    "transformers.activations.PytorchGELUTanh": _TANH,  # older name of GELUTanh
    "transformers.activations.NewGELUActivation": _TANH,  # x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
    "transformers.activations.FastGELUActivation": _TANH,  # the same with sqrt(2/pi) to 10 digits
    "transformers.activations.AccurateGELUActivation": _TANH,  # the same, constant precomputed
    "transformers.activations.QuickGELUActivation": _QUICK,  # x sigmoid(1.702 x)
    "transformers.activations.SiLUActivation": _SILU,
    "transformers.activations.MishActivation": _MISH,  # F.mish, or x tanh(softplus(x)) in Python
    # x/2 (1 + tanh(0.79788456 x (1 + 0.044715 x^2))): sqrt(2/pi) to 8 digits, 2e-9 relative, below fp32
    "transformers.models.bloom.modeling_bloom.BloomGelu": _TANH,
    # timm.layers.activations (checked against its source; timm itself uses nn.SiLU for SiLU)
    "timm.layers.activations.GELU": _EXACT,  # F.gelu
    "timm.layers.activations.GELUTanh": _TANH,  # F.gelu(approximate="tanh")
    "timm.layers.activations.QuickGELU": _QUICK,  # x sigmoid(1.702 x)
    "timm.layers.activations.Swish": _SILU,  # x sigmoid(x)
    "timm.layers.activations.Mish": _MISH,  # x tanh(softplus(x)): F.mish to rounding
}

# Replaceable classes whose instances may be configured beyond what InvAct reproduces: module -> the
# reason to leave it alone, or None.
CONDITIONS: dict[str, Callable[[nn.Module], str | None]] = {
    "torch.nn.modules.activation.Softplus": lambda m: softplus_unsupported(m.beta, m.threshold),
}

# Activations deliberately left alone, with the reason.
SKIPPED: dict[str, str] = {
    "transformers.activations.ClippedGELUActivation": "clip(gelu(x)) is flat past its bounds: not invertible",
    "transformers.activations.LaplaceActivation": "no fitted family for this activation",
    "transformers.activations.XIELUActivation": "has trainable parameters: f changes during training",
    "transformers.activations.ReLUSquaredActivation": "no fitted family for relu^2",
    "transformers.activations.SqrtSoftplusActivation": "no fitted family for this activation",
    "transformers.activations.LinearActivation": "identity: saves nothing",
    "torch.nn.modules.activation.ReLU": "ReLU's backward needs only its output: nothing to save",
    "torch.nn.modules.activation.ReLU6": "needs only its output's range: nothing to save",
    "torch.nn.modules.activation.LeakyReLU": "invertible from its output already",
    "torch.nn.modules.activation.PReLU": "has a trainable slope",
    "torch.nn.modules.activation.Tanh": "torch already saves only its output",
    "torch.nn.modules.activation.Sigmoid": "torch already saves only its output",
    "torch.nn.modules.activation.Hardswish": "no fitted family for hardswish",
    "timm.layers.activations.Tanh": "torch already saves only its output",
    "timm.layers.activations.Sigmoid": "torch already saves only its output",
    "timm.layers.activations.HardSwish": "no fitted family for hardswish",
    "timm.layers.activations.HardSigmoid": "piecewise linear: needs only its output's range",
    "timm.layers.activations.HardMish": "no fitted family for hard mish",
    "timm.layers.activations.PReLU": "has a trainable slope",
}
_ACTIVATION_LIKE = re.compile(
    r"gelu|silu|swish|mish|relu|elu|tanh|sigmoid|softplus|activation", re.IGNORECASE
)


@dataclass(frozen=True)
class Decision:
    name: str  # qualified module name in the model
    cls: str  # qualified class name
    replace: bool
    reason: str


def _qualname(module: nn.Module) -> str:
    return f"{type(module).__module__}.{type(module).__qualname__}"


def _selected(name: str, include: Iterable[str] | None, exclude: Iterable[str] | None) -> bool:
    if include is not None and not any(fnmatch.fnmatchcase(name, p) for p in include):
        return False
    return not (exclude is not None and any(fnmatch.fnmatchcase(name, p) for p in exclude))


def plan(model: nn.Module, *, include=None, exclude=None) -> list[Decision]:
    """What patch() would do: one Decision per activation-like module (replaced or skipped, and why).
    `include`/`exclude` are glob patterns on module names, e.g. "encoder.layer.*.intermediate.*"."""
    decisions = []
    for name, module in model.named_modules(remove_duplicate=False):
        cls = _qualname(module)
        if isinstance(module, _InvAct):  # already patched
            continue
        unsupported = CONDITIONS[cls](module) if cls in CONDITIONS else None
        if cls in REPLACEABLE and unsupported:
            decisions.append(Decision(name, cls, False, unsupported))
        elif cls in REPLACEABLE:
            if _selected(name, include, exclude):
                decisions.append(Decision(name, cls, True, "reproduced exactly"))
            else:
                decisions.append(Decision(name, cls, False, "excluded by include/exclude"))
        elif cls in SKIPPED:
            decisions.append(Decision(name, cls, False, SKIPPED[cls]))
        elif not any(True for _ in module.children()) and _ACTIVATION_LIKE.search(type(module).__name__):
            decisions.append(Decision(name, cls, False, "not a function InvAct reproduces"))
    return decisions


def patch(model: nn.Module, *, include=None, exclude=None, mode: str = "bits") -> list[str]:
    """Replace, in place, every activation module that InvAct reproduces exactly; return their names.

    Works on any device and dtype (InvAct modules hold no parameters) and inside wrappers such as
    PEFT's. A module instance shared by several parents is replaced by one shared InvAct module.
    Skipped activation-like modules are logged on the "invact" logger (INFO) with the reason."""
    if mode not in ("bits", "precision_bit"):
        raise ValueError(f"mode must be 'bits' or 'precision_bit', got {mode!r}")
    replaced, swapped = [], {}
    for d in plan(model, include=include, exclude=exclude):
        if not d.replace:
            log.info("invact.patch: left %s (%s) alone: %s", d.name, d.cls, d.reason)
            continue
        parent_name, _, attr = d.name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, attr) if attr else model
        if not attr:
            raise ValueError("the model itself is an activation: wrap it or use invact's modules directly")
        new = swapped.get(id(old))
        if new is None:
            new = swapped[id(old)] = REPLACEABLE[d.cls](old, mode)
            new.train(old.training)
        setattr(parent, attr, new)
        replaced.append(d.name)
    return replaced
