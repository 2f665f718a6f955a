"""The Triton view, `<act>_triton.py`: the forward and q per branch as @triton.jit device functions
(fp32 in and out), with the helpers libdevice would give where the interpreter has none."""

from __future__ import annotations

from codegen import spec
from codegen.coeffs_json import CoeffFile
from codegen.common import header, per_branch, q_functions
from codegen.functions import fold_constants
from codegen.half import LOG16_TRITON, Triton16Printer, q16_functions
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
    """e^z - 1 without libdevice and without cancellation near z = 0: e^z - 1 where |z| > 0.5, else
    the Taylor polynomial to z^8 (the next term is under 5.4e-9 there, a tenth of fp32's half-ulp),
    in 8 fused multiply-adds where a log and a division would take 33 instructions (sm_90)."""
    w = tl.exp(z)
    p = z * (1.0 + z * (0.5 + z * (1.0 / 6.0 + z * (1.0 / 24.0 + z * (1.0 / 120.0 + z * (1.0 / 720.0
        + z * (1.0 / 5040.0 + z * (1.0 / 40320.0))))))))
    return tl.where(tl.abs(z) > 0.5, w - 1.0, p)
'''
_SOFTPLUS_TRITON = '''

@triton.jit
def _softplus(z):
    """log(1 + e^z) without libdevice, for every z: max(z, 0) + log1p(u) with u = e^-|z| in (0, 1], and
    log1p(u) = 2 atanh(s), s = u / (2 + u) in (0, 1/3], by its odd series to s^15 (the next term is
    under 1.5e-9 relative). Past z = 17 the sum rounds to z in fp32, as torch's softplus returns z past 20."""
    u = tl.exp(-tl.abs(z))
    s = u / (2.0 + u)
    s2 = s * s
    series = 1.0 + s2 * (1.0 / 3.0 + s2 * (1.0 / 5.0 + s2 * (1.0 / 7.0 + s2 * (1.0 / 9.0 + s2 * (1.0 / 11.0
             + s2 * (1.0 / 13.0 + s2 * (1.0 / 15.0)))))))
    return tl.maximum(z, 0.0) + 2.0 * s * series
'''

_TRITON_JIT = "@triton.jit\n"


def triton_functions(c: CoeffFile, entry: spec.Entry, decorator: str = _TRITON_JIT, prefix: str = "",
                     c16: CoeffFile | None = None, sixteen: bool = False) -> str:  # fmt: skip
    """The Triton view: {prefix}forward and q per branch, with `sixteen` the 16-bit q16 per branch
    from `c16` (codegen.half), then the helpers they call, each under `decorator`."""
    body = function_body(fold_constants(entry.triton), TritonPrinter(), variable=spec.X)
    forward = f'{decorator}def {prefix}forward(x):\n    """f in fp32, the forward kernel\'s."""\n{body}\n'
    text = f"{forward}\n\n{q_functions(c, TritonPrinter(), '', decorator=decorator, prefix=prefix)}"
    if sixteen:
        text += f"\n\n{q16_functions(c, c16, Triton16Printer(), decorator=decorator, prefix=prefix)}"
    helpers = (_LOG1P_TRITON if "_log1p(" in text else "") + (_EXPM1_TRITON if "_expm1(" in text else "")
    helpers += _SOFTPLUS_TRITON if "_softplus(" in text else ""
    helpers += LOG16_TRITON if "_log16(" in text else ""
    return text + helpers.replace(_TRITON_JIT, decorator)


def render_triton(
    c: CoeffFile, sources: list[tuple[str, str]], entry: spec.Entry, c16: CoeffFile | None = None
) -> str:
    title = f"{c.activation}, family {c.family!r}: the forward and q {per_branch(c)} as Triton device"
    title += " functions (fp32 in and out)."
    return f'''{header(sources)}"""{title}"""

import triton
import triton.language as tl


{triton_functions(c, entry, c16=c16, sixteen=True)}'''
