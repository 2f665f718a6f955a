"""invact: Inverted Activations for PyTorch training.

Drop-in activations that save their output (which the next layer saves anyway) plus one bit per
element instead of their input, and compute the gradient from the output with a fitted
approximation of f'(f^-1(y)). Imports torch alone; uses triton (CUDA) and numba (fast CPU
backward) when installed.

`InvAct(activation, mode)` serves any generated activation (invact.activation.activations.ACTIVATIONS); the
torch-compatible classes (one per module class of the activation spec, printed into
invact/_generated/modules.py) take torch's constructor arguments.
"""

from invact import functional, memory
from invact._generated import modules as _generated_modules
from invact._generated.modules import *  # noqa: F403 - the torch-compatible classes
from invact._traced import tag_compile_cache
from invact.activation.modules import InvAct
from invact.activation.ops import backend_for
from invact.loader import load_activation
from invact.patch import patch, plan

__version__ = "0.1.0"
tag_compile_cache()  # torch.compile's caches keyed by invact's sources too (invact._traced)
__all__ = [
    *_generated_modules.__all__,
    "InvAct",
    "backend_for",
    "functional",
    "load_activation",
    "memory",
    "patch",
    "plan",
]
