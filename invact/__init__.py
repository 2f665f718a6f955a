"""invact: Inverted Activations for PyTorch training.

Drop-in activations that save their output (which the next layer saves anyway) plus one bit per
element instead of their input, and compute the gradient from the output with a fitted
approximation of f'(f^-1(y)). Imports torch alone; uses triton (CUDA) and numba (fast CPU
backward) when installed.

`InvAct(activation, mode)` serves any generated activation (invact.activation.activations.ACTIVATIONS); the
torch-compatible classes (one per module class of the activation spec, printed into
invact/_generated/modules.py) take torch's constructor arguments.
"""

import os
import sys
from typing import TYPE_CHECKING

__version__ = "0.1.0"
_loaded = False

if TYPE_CHECKING:  # what _load() binds, for type checkers and editors
    from invact._generated.modules import *  # noqa: F403


def _load() -> None:
    """The runtime, imported into this namespace once (torch, invact's modules, the torch-compatible
    classes), and torch.compile's cache key tagged: what `import invact` runs, deferred only where this
    process is the invact command (_the_command), which calls it once its input is checked."""
    global _loaded, __all__, _generated_modules, functional, memory, InvAct, backend_for, load_activation
    global patch, plan, tag_compile_cache
    if _loaded:
        return
    _loaded = True
    from invact import _versions  # noqa: F401, I001 - first: one line where torch is outside the range
    from invact import functional, memory
    from invact._generated import modules as _generated_modules
    from invact._traced import tag_compile_cache
    from invact.activation.modules import InvAct
    from invact.activation.ops import backend_for
    from invact.loader import load_activation
    from invact.patch import patch, plan

    globals().update({name: getattr(_generated_modules, name) for name in _generated_modules.__all__})
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


def _the_command() -> bool:
    """Whether this process runs the invact command: `python -m invact` (runpy imports this package
    while sys.argv[0] is "-m") or its console script. Then the command parses its arguments and reads
    its config file before torch and transformers load (seconds), so bad input answers at once."""
    argv = getattr(sys, "argv", None) or [""]
    if argv[0] == "-m":
        given = getattr(sys, "orig_argv", [])
        for i, arg in enumerate(given[1:], 1):
            if arg.startswith("-m"):
                return (arg[2:] or "".join(given[i + 1 : i + 2])) == "invact"
        return False
    return os.path.basename(argv[0]) in ("invact", "invact.exe", "invact-script.py")


if _the_command():

    def __getattr__(name: str):
        """Any of the runtime's names: loads the runtime first (_load)."""
        if name.startswith("__") and name != "__all__":
            raise AttributeError(f"module 'invact' has no attribute {name!r}")
        _load()
        try:
            return globals()[name]
        except KeyError:
            raise AttributeError(f"module 'invact' has no attribute {name!r}") from None

else:
    _load()
