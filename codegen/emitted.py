"""One self-contained module for a user-defined activation (invact-fit NAME --expr TEXT --emit FILE),
which invact.load_activation imports: every view in one file."""

from __future__ import annotations

import textwrap

from codegen import spec
from codegen.coeffs_json import CoeffFile
from codegen.common import errors_doc, header
from codegen.numba_view import numba_view
from codegen.torch_view import render_torch
from codegen.triton_view import triton_functions

# What invact.load_activation checks: the layout of render_emitted's module. 2: the numba view is
# defined only where numba imports (1 imported numba unconditionally).
EMITTED_FORMAT = 2


def render_emitted(c: CoeffFile, entry: spec.Entry, sources: list[tuple[str, str]], command: str) -> str:
    """One self-contained module with every view of a user-defined activation (invact-fit NAME --expr
    TEXT --emit FILE), which invact.load_activation imports: the constants, the torch view (as
    <name>.py), the numba view (as <name>_cpu.py) and the Triton view (as <name>_triton.py, its
    functions named triton_*, jitted only where triton is installed). `command`: the invact-fit
    command that printed it, named in the header."""
    if c.activation != entry.name:
        raise ValueError(f"coefficients of {c.activation!r} cannot be emitted for {entry.name!r}")
    torch_view = render_torch(c, sources, entry)
    torch_view = torch_view[torch_view.index("\nACTIVATION = ") + 1 :]  # its constants and functions
    # Inside `if numba is not None:`, so that a user with torch alone (and the toolkit's numpy) can load
    # it: invact's CPU backward is then its portable torch path, which reads the torch view.
    cpu_view = textwrap.indent(numba_view(c), "    ")
    triton_view = triton_functions(c, entry, decorator="@_jit\n", prefix="triton_")
    title = f"{c.activation}: a user-defined InvAct activation, f(x) = {entry.f}; family {c.family!r}."
    head = header(sources).replace("`python -m codegen`", f"`{command}`")
    return _EMITTED.format(
        header=head.replace("change the source and regenerate", "rerun it"),
        title=title, errors=errors_doc(c), format=EMITTED_FORMAT,
        cls=repr(entry.module.cls), formula=repr(str(entry.f)), torch_view=torch_view, cpu_view=cpu_view,
        triton_view=triton_view,
    )  # fmt: skip


_EMITTED = '''{header}"""{title}

Printed by invact-fit --emit; invact.load_activation(path) imports it and returns its module class.
Every view of the activation in one module: the torch functions, the fp32 scalar functions the numba
kernels compile, and the Triton device functions (jitted where triton is installed).
{errors}.
"""

import math  # noqa: F401

import torch

try:
    import numba
    import numpy as np

    from invact.activation import _lookup  # noqa: F401
    from invact.activation._cpu_math import F, exp32, expm1_32, log32, prefer_512_bit_vectors  # noqa: F401
    from invact.activation._cpu_math import unpack_bits  # noqa: F401
    from invact.activation._cpu_math import f32_at, u8_at  # noqa: F401
except ImportError:  # without numba, invact's CPU backward is its portable torch path: no numba view
    numba = None

try:
    import triton
    import triton.language as tl  # noqa: F401
except ImportError:  # the torch and numba views serve without it
    triton = None


def _jit(fn):
    return fn if triton is None else triton.jit(fn)


EMITTED_FORMAT = {format}
MODULE_CLASS = {cls}
FORMULA = {formula}
{torch_view}

# The numba view (where numba is installed): q as fp32 scalar functions, and the backward kernel
# compiled from them.

if numba is not None:
{cpu_view}

# The Triton view.


{triton_view}'''
