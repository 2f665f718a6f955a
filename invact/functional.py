"""Functional InvAct activations: same values as torch's, saving y and one bit per element.

`mode="bits"` (default) saves ceil(n/8) extra bytes; `mode="precision_bit"` stores the bit in the
lowest mantissa bit of y itself (y within 1 ulp of torch's, no extra bytes).
"""

from __future__ import annotations

import torch

from invact.ops import invact


def gelu(x: torch.Tensor, approximate: str = "none", mode: str = "bits") -> torch.Tensor:
    """torch.nn.functional.gelu(x, approximate) with InvAct's memory footprint."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"approximate argument must be either none or tanh, got {approximate!r}")
    return invact(x, "gelu" if approximate == "none" else "gelu_tanh", mode)


def silu(x: torch.Tensor, mode: str = "bits") -> torch.Tensor:
    """torch.nn.functional.silu(x) with InvAct's memory footprint."""
    return invact(x, "silu", mode)


def mish(x: torch.Tensor, mode: str = "bits") -> torch.Tensor:
    """torch.nn.functional.mish(x) with InvAct's memory footprint."""
    return invact(x, "mish", mode)


def quick_gelu(x: torch.Tensor, mode: str = "bits") -> torch.Tensor:
    """x * sigmoid(1.702 x) (Hugging Face's QuickGELUActivation) with InvAct's memory footprint."""
    return invact(x, "quick_gelu", mode)
