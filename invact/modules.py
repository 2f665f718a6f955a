"""Drop-in nn.Modules: InvActGELU, InvActSiLU, InvActQuickGELU, InvActMish, InvActSoftplus."""

import torch
from torch import nn

from invact import functional


class _InvAct(nn.Module):
    activation: str  # the registry name (invact.activations.ACTIVATIONS) of the function it computes

    def __init__(self, mode: str = "bits") -> None:
        super().__init__()
        if mode not in ("bits", "precision_bit"):
            raise ValueError(f"mode must be 'bits' or 'precision_bit', got {mode!r}")
        self.mode = mode

    def extra_repr(self) -> str:
        return f"mode={self.mode!r}"


class InvActGELU(_InvAct):
    """nn.GELU(approximate="none"|"tanh") that saves its output and one bit instead of its input."""

    def __init__(self, approximate: str = "none", mode: str = "bits") -> None:
        super().__init__(mode)
        if approximate not in ("none", "tanh"):
            raise ValueError(f"approximate argument must be either none or tanh, got {approximate!r}")
        self.approximate = approximate

    @property
    def activation(self) -> str:
        return "gelu" if self.approximate == "none" else "gelu_tanh"

    @torch.jit.ignore  # TorchScript calls back into Python: the op is an autograd.Function
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return functional.gelu(x, self.approximate, self.mode)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}, {super().extra_repr()}"


class InvActSiLU(_InvAct):
    """nn.SiLU that saves its output and one bit instead of its input. `inplace` is accepted for
    drop-in compatibility and ignored: InvAct never keeps the input, so it saves the memory anyway."""

    activation = "silu"

    def __init__(self, inplace: bool = False, mode: str = "bits") -> None:
        super().__init__(mode)
        self.inplace = inplace

    @torch.jit.ignore  # TorchScript calls back into Python: the op is an autograd.Function
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return functional.silu(x, self.mode)


class InvActQuickGELU(_InvAct):
    """x * sigmoid(1.702 x) (CLIP's quick_gelu) that saves its output and one bit."""

    activation = "quick_gelu"

    @torch.jit.ignore  # TorchScript calls back into Python: the op is an autograd.Function
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return functional.quick_gelu(x, self.mode)


class InvActMish(_InvAct):
    """nn.Mish that saves its output and one bit instead of its input (`inplace` accepted and
    ignored, as for InvActSiLU)."""

    activation = "mish"

    def __init__(self, inplace: bool = False, mode: str = "bits") -> None:
        super().__init__(mode)
        self.inplace = inplace

    @torch.jit.ignore  # TorchScript calls back into Python: the op is an autograd.Function
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return functional.mish(x, self.mode)


class InvActSoftplus(_InvAct):
    """nn.Softplus that saves only its output: softplus is monotone, so no bit is stored. beta and
    threshold must be torch's defaults, 1 and 20 (ValueError otherwise: softplus_unsupported says why)."""

    activation = "softplus"

    def __init__(self, beta: float = 1.0, threshold: float = 20.0, mode: str = "bits") -> None:
        super().__init__(mode)
        reason = functional.softplus_unsupported(beta, threshold)
        if reason:
            raise ValueError(reason)
        self.beta, self.threshold = beta, threshold

    @torch.jit.ignore  # TorchScript calls back into Python: the op is an autograd.Function
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return functional.softplus(x, self.beta, self.threshold, self.mode)

    def extra_repr(self) -> str:
        return f"beta={self.beta!r}, threshold={self.threshold!r}, {super().extra_repr()}"
