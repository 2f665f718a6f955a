"""The activations InvAct reproduces, each resolved once to its generated views: the torch view
(invact/_generated/<name>.py: torch's own forward, float64 f and f', the threshold T (bit 1 where
x < T), y_min and q per branch), the numba view (<name>_cpu.py: q as fp32 scalar functions) and the
Triton view (<name>_triton.py: the forward and q as device functions), all printed by codegen from the
activation spec coeffs/activations.json and the coefficient file of the default family. A monotone
activation has no T and no bit: its one branch is "right".

An activation loaded with invact.load_activation has all three views in the one module
`invact-fit --emit` printed; `register` adds it to ACTIVATIONS.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import NamedTuple

import torch

from invact._generated import FAMILIES

Fn = Callable[[torch.Tensor], torch.Tensor]
# The storage dtypes whose y the backends read with q16 (Activation.q16), the 16-bit family's q.
SIXTEEN_BIT = (torch.bfloat16, torch.float16)


class TritonView(NamedTuple):
    """The @triton.jit device functions: forward f(x) and q per branch (q_left None when monotone),
    and q16 per branch, q for y stored in bf16 or fp16 (the same functions as q where the activation
    has no 16-bit family)."""

    forward: Callable
    q_left: Callable | None
    q_right: Callable
    q16_left: Callable | None
    q16_right: Callable


@dataclass(frozen=True)
class Activation:
    name: str
    # The module `invact-fit --emit` printed, holding every view (a loaded activation); None for the
    # built-in ones, whose views are modules of invact._generated.
    emitted: ModuleType | None = field(default=None, compare=False, repr=False)

    def _view(self, suffix: str) -> ModuleType:
        return self.emitted or importlib.import_module(f"invact._generated.{self.name}{suffix}")

    @functools.cached_property
    def generated(self) -> ModuleType:
        """The torch view: torch_forward, f64, df64, q_left/q_right on tensors, the constants."""
        return self._view("")

    @functools.cached_property
    def cpu(self) -> ModuleType:
        """The numba view: q_left_scalar/q_right_scalar, plain Python on fp32 scalars, and
        backward_kernel, which numba compiles from them (imports numba)."""
        return self._view("_cpu")

    @functools.cached_property
    def triton(self) -> TritonView:
        """The Triton view (imports triton)."""
        if self.emitted is not None:  # one module: its Triton functions carry a prefix, q serves 16 bits
            m = self.emitted
            q_left = getattr(m, "triton_q_left", None)
            return TritonView(m.triton_forward, q_left, m.triton_q_right, q_left, m.triton_q_right)
        m = self._view("_triton")
        q_left, q16_left = getattr(m, "q_left", None), getattr(m, "q16_left", None)
        return TritonView(m.forward, q_left, m.q_right, q16_left, m.q16_right)

    @functools.cached_property
    def threshold_f32(self):
        """T as a numpy float32 scalar (as torch rounds a Python float it compares an fp32 tensor
        with), made once: np.float32(T) took 1.1 us per call inside a training step (measured on a
        2-core Intel Xeon); None for a monotone activation."""
        import numpy as np

        return None if self.threshold is None else np.float32(self.threshold)

    @property
    def torch_forward(self) -> Fn:
        """Exactly what torch (or Hugging Face) computes."""
        return self.generated.torch_forward

    @property
    def f(self) -> Fn:
        """f on float64 tensors (the float64 path's reference)."""
        return self.generated.f64

    @property
    def df(self) -> Fn:
        """f' on float64 tensors."""
        return self.generated.df64

    @property
    def monotone(self) -> bool:
        """f is monotone: y alone gives x, so no branch bit is stored."""
        return self.generated.MONOTONE

    @property
    def q16(self) -> tuple[Fn | None, Fn]:
        """(q16_left, q16_right) on fp32 tensors: q for y stored in bf16 or fp16 (q_left, q_right
        where the activation has no 16-bit family, as an emitted activation)."""
        g = self.generated  # an emitted module has no q16: its q serves every dtype
        return getattr(g, "q16_left", getattr(g, "q_left", None)), getattr(g, "q16_right", g.q_right)

    @property
    def has_16bit_q(self) -> bool:
        """Its 16-bit q is another family's than its fp32 q (coeffs/defaults_16bit.json)."""
        return getattr(self.generated, "q16_right", None) not in (None, self.generated.q_right)

    @property
    def closed_form(self) -> bool:
        """q is f'(f^-1(y)) itself, in closed form (the `exact` family): no inversion needed."""
        return self.generated.FAMILY == "exact"

    @property
    def threshold(self) -> float | None:
        """T = argmin f; None for a monotone activation."""
        return self.generated.THRESHOLD

    @property
    def y_min(self) -> float:
        return self.generated.Y_MIN


ACTIVATIONS: dict[str, Activation] = {name: Activation(name) for name in FAMILIES}


def register(act: Activation) -> Activation:
    """Add a loaded activation to ACTIVATIONS (the ops look activations up by name). ValueError if the
    name is taken: compiled kernels are cached by name."""
    if act.name in ACTIVATIONS:
        known = ACTIVATIONS[act.name].emitted
        where = "a built-in activation" if known is None else f"loaded already from {known.__file__}"
        raise ValueError(f"an activation named {act.name!r} is {where}: give yours another name")
    ACTIVATIONS[act.name] = act
    return act
