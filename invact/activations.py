"""The activations InvAct reproduces, each resolved once to its generated module
(invact/_generated/<name>.py, printed by codegen from the activation spec coeffs/activations.json and
the coefficient file of its default family): torch's own forward, float64 f and f', the threshold
T (bit 1 where x < T), y_min and q per branch. A monotone activation has no T and no bit:
its one branch is "right"."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from invact._generated import FAMILIES

Fn = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Activation:
    name: str

    @functools.cached_property
    def generated(self) -> ModuleType:
        return importlib.import_module(f"invact._generated.{self.name}")

    @property
    def torch_forward(self) -> Fn:
        """Exactly what torch (or Hugging Face) computes."""
        return self.generated.torch_forward

    @property
    def f(self) -> Fn:
        """f on float64 tensors (the exact path's reference)."""
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
