"""Functional InvAct activations: same values as torch's, saving y and one bit per element.

`mode="bits"` (default) saves ceil(n/8) extra bytes; `mode="precision_bit"` stores the bit in the
lowest mantissa bit of y itself (y within 1 ulp of torch's, no extra bytes).
"""

from __future__ import annotations

import torch

from invact.activations import SOFTPLUS_THRESHOLD
from invact.ops import invact


def softplus_unsupported(beta: float, threshold: float) -> str | None:
    """Why InvAct cannot reproduce torch's softplus(x, beta, threshold), or None when it can."""
    if beta != 1:
        return (f"beta={beta!r}: InvAct's softplus needs beta=1 (torch computes softplus(beta x) / beta; "
                "inverting that needs the unscaled output, which the next layer does not save)")  # fmt: skip
    if threshold != SOFTPLUS_THRESHOLD:
        return (f"threshold={threshold!r}: InvAct's softplus is torch's default, threshold="
                f"{SOFTPLUS_THRESHOLD} (a low one also makes it non-invertible: its linear and curved "
                "parts overlap in y)")  # fmt: skip
    return None


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


def softplus(
    x: torch.Tensor, beta: float = 1.0, threshold: float = SOFTPLUS_THRESHOLD, mode: str = "bits"
) -> torch.Tensor:
    """torch.nn.functional.softplus(x) saving only its output: softplus is monotone, so y alone gives
    x and no bit is stored (`mode` changes nothing). beta and threshold must be torch's defaults, 1 and
    20 (ValueError otherwise, see softplus_unsupported)."""
    reason = softplus_unsupported(beta, threshold)
    if reason:
        raise ValueError(reason)
    return invact(x, "softplus", mode)


def quick_gelu(x: torch.Tensor, mode: str = "bits") -> torch.Tensor:
    """x * sigmoid(1.702 x) (Hugging Face's QuickGELUActivation) with InvAct's memory footprint."""
    return invact(x, "quick_gelu", mode)
