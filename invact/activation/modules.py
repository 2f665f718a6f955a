"""InvAct as an nn.Module: `InvAct(activation, mode)` for any generated activation, and `select`,
which the torch-compatible classes (printed from the activation spec into
invact/_generated/modules.py) use to pick their activation from torch's constructor arguments."""

import threading

import torch
from torch import nn

from invact import _generated
from invact.activation.activations import ACTIVATIONS
from invact.activation.ops import check_mode, invact

# module class -> ((activation, the constructor arguments that select it), ...)
_CLASSES: dict[str, list[tuple[str, dict]]] = {}
for _activation, (_cls, _kwargs) in _generated.MODULES.items():
    _CLASSES.setdefault(_cls, []).append((_activation, _kwargs))


def _values(values) -> str:
    return " or ".join(repr(v) for v in values)


def select(cls: str, **given) -> str:
    """The activation that module class `cls` computes with these constructor arguments. ValueError,
    naming the first argument no activation of the class has and why, otherwise."""
    options = _CLASSES[cls]
    for activation, kwargs in options:
        if all(given[k] == v for k, v in kwargs.items()):
            return activation
    for key, value in given.items():  # the first argument whose value no option has
        allowed = [kwargs[key] for _, kwargs in options]
        if value not in allowed:
            why = _generated.WHY.get(cls, {}).get(key)
            note = f" ({why})" if why else ""
            raise ValueError(f"{key}={value!r}: {cls} reproduces {key}={_values(allowed)} only{note}")
    combos = "; ".join(", ".join(f"{k}={v!r}" for k, v in kwargs.items()) for _, kwargs in options)
    raise ValueError(
        f"{cls} reproduces {combos} only, got " + ", ".join(f"{k}={v!r}" for k, v in given.items())
    )


class _Calls(threading.local):
    """The modules hooked by invact.mlp.gated whose calls are in progress in this thread (as saved-tensor
    hooks are: nn.DataParallel runs its replicas' forwards in threads), innermost last: each a scope
    whose `calls` list gets (x, y) of every InvAct module inside that records its calls."""

    def __init__(self) -> None:
        self.scopes: list = []


_CALLS = _Calls()


class InvAct(nn.Module):
    """y = f(x) for the activation `activation` (a name in invact.activation.activations.ACTIVATIONS), saving
    y and, unless f is monotone, one bit per element for backward instead of x. `mode`: "bits" (packed
    bits, ceil(n/8) bytes) or "precision_bit" (the bit in y's lowest mantissa bit: y within 1 ulp of
    torch's, no extra bytes). The torch-compatible classes are this with torch's
    constructor arguments."""

    _ARGUMENTS: tuple[str, ...] = ()  # the constructor arguments a subclass shows in its repr
    # Set by invact.mlp.recompute_products on the InvAct modules inside a module it hooks: forward
    # then records (x, y) in the innermost hooked call in progress (_CALLS). A flag read in forward
    # rather than a forward hook: a module with any hook takes nn.Module's slower call path (measured
    # on a 2-core Intel Xeon: 1.75 us per call of an identity module with one forward hook against 0.71
    # without).
    _invact_notes_calls = False

    def __init__(self, activation: str, mode: str = "bits") -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(
                f"unknown activation {activation!r} (choose from {', '.join(sorted(ACTIVATIONS))})"
            )
        check_mode(mode)
        self.activation, self.mode = activation, mode
        # Resolved here, not on the first call: torch.compile cannot trace the first read of a
        # functools.cached_property (it takes a lock), which the forward under compile may make.
        ACTIVATIONS[activation].generated  # noqa: B018

    @torch.jit.ignore  # TorchScript calls back into Python: the op is an autograd.Function
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = invact(x, self.activation, self.mode)
        # Recorded for invact.mlp.gated (see _invact_notes_calls), not while traced (no state touched);
        # getattr: under TorchScript self is a ScriptModule, without the class's attributes.
        if getattr(self, "_invact_notes_calls", False) and not torch.compiler.is_compiling():
            scopes = _CALLS.scopes
            if scopes and isinstance(x, torch.Tensor):
                scopes[-1].calls.append((x, y))
        return y

    def invact_repr(self) -> str:
        """What the patch is, for the repr of a patched module (invact.identity)."""
        return f"{self.activation!r}, mode={self.mode!r}"

    def extra_repr(self) -> str:
        shown = [f"{k}={getattr(self, k)!r}" for k in self._ARGUMENTS]
        if type(self) is InvAct:
            shown = [repr(self.activation)]
        return ", ".join([*shown, f"mode={self.mode!r}"])
