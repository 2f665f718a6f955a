"""The torch and transformers versions invact supports: the one home of the range.

pyproject.toml's requirement lines and the README's sentence say the same (tests/invact/test_versions.py
checks both against SUPPORTED), and `make compat` (tests/compat.py) runs the core tests at its ends.

Importing this module (invact's first import) runs `check()`: it refuses a torch below the range
with one line (ImportError) and warns once, one line, on a torch or transformers newer than the
newest tested (nothing is known to break: untested) or on a transformers below the range (whose
models invact may not recognise). transformers is optional, and its version is read from the
installed distribution's metadata, not by importing it (which takes seconds).
"""

from __future__ import annotations

import re
import warnings
from importlib import metadata

import torch

# package -> (oldest supported, newest tested): "major.minor" for torch, "major.minor" for transformers.
SUPPORTED = {"torch": ("2.11", "2.15"), "transformers": ("4.57", "5.24")}


def _release(version: str) -> tuple[int, ...]:
    """The leading numeric release of a version: "2.11.0+cu130" -> (2, 11, 0), "5.0.0rc1" -> (5, 0, 0)."""
    match = re.match(r"\d+(\.\d+)*", version)
    return tuple(int(p) for p in match.group(0).split(".")) if match else ()


def outside(package: str, version: str) -> str | None:
    """Why `version` of `package` is outside SUPPORTED ("older", "newer"), or None inside it. A
    release compares by as many parts as the bound names: torch 2.15.3 is inside "2.15"."""
    oldest, newest = (_release(v) for v in SUPPORTED[package])
    release = _release(version)
    if release[: len(oldest)] < oldest:
        return "older"
    if release[: len(newest)] > newest:
        return "newer"
    return None


def message(package: str, version: str, why: str) -> str:
    oldest, newest = SUPPORTED[package]
    if why == "older":
        return (f"invact supports {package} >= {oldest}; this is {package} {version}: "
                f"upgrade it (pip install '{package}>={oldest}')")  # fmt: skip
    return (f"invact is tested with {package} {oldest} to {newest}; this is {package} {version}, newer: "
            "it may work, untested")  # fmt: skip


def check(torch_version: str) -> None:
    """Raise ImportError on a torch below the range; warn (once a process) on anything else outside it."""
    why = outside("torch", torch_version)
    if why == "older":
        raise ImportError(message("torch", torch_version, why))
    found = [("torch", torch_version, why)]
    try:
        found.append(("transformers", (v := metadata.version("transformers")), outside("transformers", v)))
    except metadata.PackageNotFoundError:
        pass
    for package, version, why in found:
        if why is not None:
            warnings.warn(message(package, version, why), stacklevel=3)


check(torch.__version__)
