"""The Triton view, `<act>_triton.py`: the forward and q per branch as @triton.jit device functions
(fp32 in and out), with the helpers libdevice would give where the interpreter has none."""

from __future__ import annotations

from codegen import spec
from codegen.coeffs_json import CoeffFile
from codegen.common import header, per_branch, q_functions
from codegen.functions import fold_constants
from codegen.printers import TritonPrinter, function_body

_LOG1P_TRITON = '''

@triton.jit
def _log1p(u):
    """log(1 + u) without libdevice (absent in the interpreter): log(1 + u) * u / ((1 + u) - 1) corrects
    the rounding of 1 + u, and is u itself where 1 + u rounds to 1."""
    w = 1.0 + u
    return tl.where(w == 1.0, u, tl.log(w) * (u / (w - 1.0)))
'''
_EXPM1_TRITON = '''

@triton.jit
def _expm1(z):
    """e^z - 1 without libdevice and without cancellation near z = 0: (w - 1) z / log(w) with w = e^z
    corrects w's rounding (Kahan's trick); z itself where w rounds to 1, w - 1 where z is large."""
    w = tl.exp(z)
    return tl.where(w == 1.0, z, tl.where(tl.abs(z) > 0.5, w - 1.0, (w - 1.0) * (z / tl.log(w))))
'''

_TRITON_JIT = "@triton.jit\n"


def triton_functions(c: CoeffFile, entry: spec.Entry, decorator: str = _TRITON_JIT, prefix: str = "") -> str:
    """The Triton view: {prefix}forward and q per branch, then the helpers they call, each under
    `decorator`."""
    body = function_body(fold_constants(entry.triton), TritonPrinter(), variable=spec.X)
    forward = f'{decorator}def {prefix}forward(x):\n    """f in fp32, the forward kernel\'s."""\n{body}\n'
    text = f"{forward}\n\n{q_functions(c, TritonPrinter(), '', decorator=decorator, prefix=prefix)}"
    helpers = (_LOG1P_TRITON if "_log1p(" in text else "") + (_EXPM1_TRITON if "_expm1(" in text else "")
    return text + helpers.replace(_TRITON_JIT, decorator)


def render_triton(c: CoeffFile, sources: list[tuple[str, str]], entry: spec.Entry) -> str:
    title = f"{c.activation}, family {c.family!r}: the forward and q {per_branch(c)} as Triton device"
    title += " functions (fp32 in and out)."
    return f'''{header(sources)}"""{title}"""

import triton
import triton.language as tl


{triton_functions(c, entry)}'''
