"""The activations InvAct reproduces: torch's own forward op, exact float64 f and f', and the
generated approximation module. T (bit 1 where x < T) comes from the generated module, i.e. from
the coefficient file that fitting wrote. A monotone activation (softplus) has no T and no bit: its
one branch is "right"."""

from __future__ import annotations

import functools
import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

Fn = Callable[[torch.Tensor], torch.Tensor]
_SQRT_2PI = math.sqrt(2 * math.pi)
_TANH_C = math.sqrt(2 / math.pi)
_QUICK = 1.702
SOFTPLUS_THRESHOLD = 20.0  # torch's default: softplus(x) = x for x > 20


@dataclass(frozen=True)
class Activation:
    name: str
    torch_forward: Fn  # exactly what torch (or Hugging Face) computes
    f: Fn  # float64 reference, same values as torch_forward in float64
    df: Fn  # f'

    @functools.cached_property
    def generated(self) -> ModuleType:
        return importlib.import_module(f"invact._generated.{self.name}")

    @property
    def monotone(self) -> bool:
        """f is monotone: y alone gives x, so no branch bit is stored."""
        return self.generated.MONOTONE

    @property
    def threshold(self) -> float | None:
        """T = argmin f; None for a monotone activation."""
        return self.generated.THRESHOLD

    @property
    def y_min(self) -> float:
        return self.generated.Y_MIN


def _gelu_df(x):
    return torch.special.ndtr(x) + x * torch.exp(-0.5 * x * x) / _SQRT_2PI


def _tanh_parts(x):
    u = _TANH_C * (x + 0.044715 * x**3)
    return torch.sigmoid(2 * u), _TANH_C * (1 + 3 * 0.044715 * x * x)


def _gelu_tanh_f(x):
    return x * _tanh_parts(x)[0]  # 0.5 x (1 + tanh u) without the cancellation of 1 + tanh


def _gelu_tanh_df(x):
    s, du = _tanh_parts(x)
    return s + x * s * (1 - s) * 2 * du


def _silu_df(x):
    s = torch.sigmoid(x)
    return s * (1 + x * torch.sigmoid(-x))


def _mish_f(x):
    return x * torch.tanh(F.softplus(x))


def _mish_df(x):
    sp = F.softplus(x)
    sech2 = 4 * torch.sigmoid(-2 * sp) * torch.sigmoid(2 * sp)  # 1 - tanh^2 without cancellation
    return torch.tanh(sp) + x * sech2 * torch.sigmoid(x)


def _softplus_df(x):
    return torch.where(x > SOFTPLUS_THRESHOLD, 1.0, torch.sigmoid(x))  # torch's backward: 1 past 20


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """Hugging Face's QuickGELUActivation: x * sigmoid(1.702 x)."""
    return x * torch.sigmoid(_QUICK * x)


ACTIVATIONS: dict[str, Activation] = {
    a.name: a
    for a in (
        Activation("gelu", lambda x: F.gelu(x), lambda x: x * torch.special.ndtr(x), _gelu_df),
        Activation("gelu_tanh", lambda x: F.gelu(x, approximate="tanh"), _gelu_tanh_f, _gelu_tanh_df),
        Activation("silu", F.silu, lambda x: x * torch.sigmoid(x), _silu_df),
        Activation("quick_gelu", quick_gelu, quick_gelu, lambda x: _silu_df(_QUICK * x)),
        Activation("mish", F.mish, _mish_f, _mish_df),
        Activation("softplus", F.softplus, F.softplus, _softplus_df),
    )
}
