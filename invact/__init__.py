"""invact: Inverted Activations for PyTorch training.

Drop-in activations that save their output (which the next layer saves anyway) plus one bit per
element instead of their input, and compute the gradient from the output with a fitted
approximation of f'(f^-1(y)). Imports torch alone; uses triton (CUDA) and numba (fast CPU
backward) when installed.
"""

from invact import functional, memory
from invact.modules import InvActGELU, InvActMish, InvActQuickGELU, InvActSiLU, InvActSoftplus
from invact.ops import backend_for
from invact.patch import patch, plan

__version__ = "0.1.0"
__all__ = [
    "InvActGELU",
    "InvActMish",
    "InvActQuickGELU",
    "InvActSiLU",
    "InvActSoftplus",
    "backend_for",
    "functional",
    "memory",
    "patch",
    "plan",
]
