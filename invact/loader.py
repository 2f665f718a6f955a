"""load_activation: a user-defined activation, fitted and printed by `invact-fit NAME --expr TEXT
--family floor --emit NAME_invact.py`, as an InvAct module class, without changing the package.

The emitted file is Python that invact-fit printed from your expression and fit: loading it imports
(runs) it, as any import does, so load only files you made or trust. It is checked to be an emitted
module before its activation is added to invact.activation.activations.ACTIVATIONS for this process.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from pathlib import Path

from invact import _warn
from invact.activation.activations import Activation, register
from invact.activation.modules import InvAct

EMITTED_FORMAT = 2  # the layout codegen.emitted.render_emitted prints
# Formats this loader reads: 1 differs only in importing numba unconditionally (its numba view is there).
_READS = (1, 2)
# What the runtime reads from an emitted module: the torch and Triton views and the constants; the
# numba view's scalar functions where the module imported numba.
_REQUIRED = ("ACTIVATION", "MODULE_CLASS", "FAMILY", "MONOTONE", "THRESHOLD", "Y_MIN", "torch_forward", "f64",
             "df64", "q_right", "triton_forward", "triton_q_right")  # fmt: skip
_BRANCHED = ("q_left", "triton_q_left")  # also required unless MONOTONE
_NUMBA_VIEW = {"right": "q_right_scalar", "left": "q_left_scalar"}  # where numba is installed
_LOADED: dict[tuple[Path, str], type[InvAct]] = {}  # (resolved path, sha256 of its bytes) -> class


def load_activation(path: str | os.PathLike) -> type[InvAct]:
    """The module class of the activation in the file `invact-fit --emit` wrote: `Cls(mode="bits")`
    behaves like the built-in classes (bits or precision-bit mode, Triton on CUDA, the numba backward
    on CPU, torch.compile, gradcheck in float64); `invact.InvAct(name)` and
    `invact.functional.invact(x, name)` serve it too. Loading the same file again returns the same
    class. ValueError (one line) for a file that is not an emitted module, or whose activation's
    name is taken (a built-in, or another file loaded already)."""
    path = Path(path).resolve()
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror or e}") from None
    key = (path, hashlib.sha256(data).hexdigest())
    if key in _LOADED:
        return _LOADED[key]
    module = _import(path, key[1])
    name = module.ACTIVATION
    if getattr(module, "numba", None) is None and importlib.util.find_spec("numba") is not None:
        # numba is here but the file's numba view did not import: it names modules of another invact
        # (a file emitted before the package-per-kind layout imports invact._cpu_math)
        _warn.warn(f"{path}: its CPU kernels did not import with this invact, so its CPU backward runs "
                   "the portable torch path (correct, several times slower); emit it again with this "
                   "invact-fit (invact-fit NAME --expr TEXT --emit FILE)")  # fmt: skip
    cls = type(module.MODULE_CLASS, (InvAct,), {
        "__init__": _init(name),
        "__doc__": f"{name}: f(x) = {module.FORMULA}, saving its output"
        + ("" if module.MONOTONE else " and one bit per element") + f" (loaded from {path}).",
        "__module__": module.__name__,
    })  # fmt: skip
    register(Activation(name, emitted=module))
    _LOADED[key] = cls
    return cls


def _init(name: str):
    def __init__(self, mode: str = "bits") -> None:
        InvAct.__init__(self, name, mode)

    return __init__


def _import(path: Path, digest: str):
    """Import the file under a name of its own, checking that it is an emitted module; on any failure
    it leaves nothing behind in sys.modules."""
    if path.suffix != ".py":
        raise ValueError(f"{path}: expected the .py file invact-fit --emit wrote")
    module_name = f"invact_user_{path.stem}_{digest[:12]}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # inspect (Triton reads the source) and pickling find it there
    try:
        spec.loader.exec_module(module)
        _check(module, path)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


def _check(module, path: Path) -> None:
    """ValueError unless the module is in the format render_emitted prints."""
    if getattr(module, "EMITTED_FORMAT", None) not in _READS:
        raise ValueError(f"{path}: not a module printed by invact-fit --emit (format {EMITTED_FORMAT})")
    required = _REQUIRED + (() if module.MONOTONE else _BRANCHED)
    if getattr(module, "numba", None) is not None:
        required += tuple(_NUMBA_VIEW[b] for b in (("right",) if module.MONOTONE else ("right", "left")))
    missing = [n for n in required if not hasattr(module, n)]
    if missing:
        raise ValueError(f"{path}: an emitted module lacks {', '.join(missing)}")
    if not (isinstance(module.ACTIVATION, str) and module.ACTIVATION.isidentifier()):
        raise ValueError(f"{path}: ACTIVATION must be a name, got {module.ACTIVATION!r}")
