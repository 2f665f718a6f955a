"""The torch view, `<act>.py`: constants (threshold, y_min, measured errors), the forward torch
computes, f and f' in float64, and q per branch on tensors."""

from __future__ import annotations

import json

from codegen import spec
from codegen.coeffs_json import CoeffFile
from codegen.common import errors_doc, header, per_branch, q_functions
from codegen.functions import fold_constants
from codegen.half import LOG16_TORCH, Torch16Printer, q16_functions
from codegen.printers import ReferenceTorchPrinter, TorchPrinter, function_body

_SOFTPLUS_TORCH = '''

def _softplus(z: torch.Tensor) -> torch.Tensor:
    """log(1 + e^z) for every z (torch's softplus is z past 20), without overflow."""
    return torch.logaddexp(z, torch.zeros_like(z))
'''


def _float(v: float) -> str:
    """A float as Python source: repr, except that -inf has none."""
    return 'float("-inf")' if v == -float("inf") else repr(v)


def _torch_forward(entry: spec.Entry) -> str:
    """torch_forward(x): what torch computes, to reproduce bitwise."""
    t = entry.torch
    if t.function is not None:
        args = "".join(f", {k}={v!r}" for k, v in t.kwargs)
        call, what = f"torch.nn.functional.{t.function}(x{args})", f"torch.nn.functional.{t.function}"
        if t.clamp:
            call, what = f"torch.clamp({call}, {t.clamp[0]!r}, {t.clamp[1]!r})", f"torch.clamp of {what}"
        body = f"    return {call}"
    else:
        body, what = (
            function_body(t.formula, TorchPrinter(), variable=spec.X),
            "as the libraries that define it write it",
        )
    return f'''def torch_forward(x: torch.Tensor) -> torch.Tensor:
    """The forward InvAct reproduces bitwise ({what})."""
{body}'''


def _float64_views(entry: spec.Entry) -> str:
    """f64(x), df64(x): f and f' for the float64 (gradcheck) path, from the spec's formulas."""
    derived = "sympy's derivative of f" if not entry.df_given else "the spec's stable form"
    text = f'''def f64(x: torch.Tensor) -> torch.Tensor:
    """f in float64 (the float64 backward inverts it)."""
{function_body(fold_constants(entry.f), ReferenceTorchPrinter(), variable=spec.X)}


def df64(x: torch.Tensor) -> torch.Tensor:
    """f' in float64 ({derived})."""
{function_body(fold_constants(entry.df), ReferenceTorchPrinter(), variable=spec.X)}
'''
    return text + (_SOFTPLUS_TORCH if "_softplus(" in text else "")


def render_torch(c: CoeffFile, sources: list[tuple[str, str]], entry: spec.Entry, c16: CoeffFile | None = None
                 ) -> str:  # fmt: skip
    """The torch view of `c`, with q16_left/q16_right from `c16` (codegen.half) or aliases."""
    errors = {name: b.errors for name, b in c.branches.items()}
    floors = {name: b.storage_floor for name, b in c.branches.items()}
    errors16 = {name: b.errors for name, b in (c16 or c).branches.items()}
    title = f"{c.activation}, family {c.family!r}: q(y) ~ f'(f^-1(y)) {per_branch(c)}, on tensors."
    if c.monotone:
        split = f"""MONOTONE = True  # one branch ("right") for every x, no bit stored
THRESHOLD = None
Y_MIN = {_float(c.y_min)}  # inf f, the limit x -> -inf"""
    else:
        split = f"""MONOTONE = False
THRESHOLD = {c.threshold!r}  # T = argmin f; bit 1 (left branch) where x < T
Y_MIN = {c.y_min!r}  # f(T)"""
    q16 = q16_functions(c, c16, Torch16Printer(), annotate=True)
    q16 += LOG16_TORCH if "_log16(" in q16 else ""
    return f'''{header(sources)}"""{title}

{errors_doc(c)}.
"""

import torch

ACTIVATION = {c.activation!r}
FAMILY = {c.family!r}
FAMILY_16BIT = {(c16 or c).family!r}  # the family of q16_left/q16_right, q for y in bf16 or fp16
{split}
# Measured by invact-fit (docs/fitting.md, "Error metrics"): per branch, max |q - f'(f^-1(y))| etc.
ERRORS = {json.dumps(errors, sort_keys=True)}
# Per branch and dtype: the error of the exact estimator once y is stored in that dtype.
STORAGE_FLOOR = {json.dumps(floors, sort_keys=True)}
# The same metrics for q16_left/q16_right (FAMILY_16BIT's fit, log as printed there aside: codegen.half).
ERRORS_16BIT = {json.dumps(errors16, sort_keys=True)}


{_torch_forward(entry)}


{_float64_views(entry)}

{q_functions(c, TorchPrinter(), "", annotate=True)}

{q16}'''
