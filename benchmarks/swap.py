"""Swap the activation modules invact.patch would replace for another module (the training
comparison's baselines and control), so every variant touches exactly the same activations."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

import invact
from invact import kinds
from invact.activation import REPLACEABLE


def replace_activations(model: nn.Module, make: Callable[[nn.Module, str], nn.Module]) -> list[str]:
    """In place: each activation module invact.plan(model) would replace becomes make(old, name),
    name the activation it computes ("gelu", "silu", ...). Returns the replaced modules' names."""
    replaced = []
    for d in invact.plan(model):
        if not d.replace or d.cls not in REPLACEABLE:  # modules only (the models here hold no functions)
            continue
        parent, attr = kinds.parent(model, d.name)
        old = getattr(parent, attr)
        setattr(parent, attr, make(old, REPLACEABLE[d.cls](old)))
        replaced.append(d.name)
    return replaced
