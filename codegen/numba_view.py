"""The numba view, `<act>_cpu.py`: q per branch as fp32 scalar functions, split into near and far
pieces where a branch has both, the near pieces as one shared polynomial and as lookup tables
(codegen.near_tables) where they allow, and the backward kernels compiled from them (templates in
codegen.numba_templates)."""

from __future__ import annotations

import sympy

from codegen import spec
from codegen.coeffs_json import CoeffFile
from codegen.common import RUNTIME, header, per_branch, q_functions, rel, sha256
from codegen.half import numba16_view
from codegen.near_tables import near_table
from codegen.numba_templates import (
    BRANCH_BIT,
    NOTE,
    NUMBA_COMMON,
    NUMBA_EVERY_PIECE,
    NUMBA_FAR_LISTS,
    NUMBA_FAR_PASS,
    NUMBA_MONOTONE,
    NUMBA_SPANS,
    NUMBA_TABLE,
    NUMBA_TABLE_CHOICE,
    NUMBA_TAIL_PASS,
    NUMBA_TWO_BRANCHES,
    TABLE_NEEDS,
    WHOLE_JIT,
)
from codegen.printers import ScalarPrinter, function_body


def _split(expression: sympy.Expr) -> tuple[sympy.Expr, sympy.Expr, sympy.Expr] | None:
    """(near, far, split) of a branch q = Piecewise((near, y < split), (far, True)) whose far piece alone
    calls exp or log (the floor family's two-branch forms), else None: where both pieces cost alike,
    skipping one saves nothing."""
    if not (isinstance(expression, sympy.Piecewise) and len(expression.args) == 2):
        return None
    (near, condition), (far, otherwise) = expression.args
    is_split = isinstance(condition, sympy.StrictLessThan) and condition.lhs == spec.Y
    if not (is_split and condition.rhs.is_Number and otherwise == sympy.true):
        return None
    if not far.has(sympy.exp, sympy.log) or near.has(sympy.exp, sympy.log):
        return None
    return near, far, condition.rhs


def _affine_polynomial(piece: sympy.Expr) -> tuple[sympy.Expr, sympy.Expr, sympy.Expr, list] | None:
    """(g, scale, shift, coefficients, lowest degree first) with piece = sum_k c_k t^k, t = scale*g + shift,
    where g is the subexpression the piece's polynomial variable is affine in (the floor family's
    near pieces: Horner sums in t = s*sqrt(y - y_min) - 1); None if the piece is not of this form."""
    for candidate in sympy.preorder_traversal(piece):
        if not (candidate.is_Add and len(candidate.args) == 2):
            continue
        shift, term = sorted(candidate.args, key=lambda a: not a.is_Number)
        if not (shift.is_Number and term.is_Mul and len(term.args) == 2 and term.args[0].is_Number):
            continue
        scale, g = term.args
        t = sympy.Dummy("t")
        # sympy distributes a number over a sum, so a term c_k*t may appear as c_k*scale*g + c_k*shift:
        # put t back in for g there too.
        in_t = sympy.expand(piece.xreplace({candidate: t}).subs(g, (t - shift) / scale))
        if in_t.free_symbols != {t}:
            continue
        try:
            poly = sympy.Poly(in_t, t)
        except sympy.PolynomialError:
            continue
        if poly.degree() >= 1:
            return g, scale, shift, poly.all_coeffs()[::-1]
    return None


def _estrin(coefficients: list[str], variable: str, indent: str) -> tuple[list[str], str]:
    """(lines, expression) evaluating sum_k coefficients[k] * variable^k by Estrin's scheme: pairs
    c_2j + c_2j+1 t, then pairs of those with t^2, t^4, ...; a dependency chain of about log2(degree)
    multiply-adds instead of Horner's degree, which keeps a vector unit's FMA pipes busy with one loop
    iteration in flight (measured on Zen 4 for gelu's degree-14 piece: 0.54 against 0.65 ns/element)."""
    lines, level, power, k = [], coefficients, variable, 0
    while len(level) > 1:
        level = [f"({level[i]} + {level[i + 1]}*{power})" if i + 1 < len(level) else level[i]
                 for i in range(0, len(level), 2)]  # fmt: skip
        if len(level) > 1:
            lines.append(f"{indent}{variable}{2 ** (k + 1)} = {power}*{power}")
            power, k = f"{variable}{2 ** (k + 1)}", k + 1
    return lines, level[0]


def _shared_near(left: sympy.Expr, right: sympy.Expr, printer: ScalarPrinter) -> str | None:
    """q_near_scalar(y, left): both branches' near pieces as one polynomial whose coefficients each
    element selects by its bit, when both are polynomials in affine maps of one subexpression g (the
    floor family's). A vector unit then blends two constants per coefficient instead of evaluating
    both branches' polynomials and selecting: for gelu (degrees 12 and 14) 15 multiply-adds instead of
    27. None if the pieces do not share such a g."""
    forms = [_affine_polynomial(piece) for piece in (left, right)]
    if None in forms or forms[0][0] != forms[1][0]:
        return None
    (g, left_scale, left_shift, left_c), (_, right_scale, right_shift, right_c) = forms
    degree = max(len(left_c), len(right_c))
    left_c, right_c = (c + [sympy.Float(0)] * (degree - len(c)) for c in (left_c, right_c))

    def pick(a: sympy.Expr, b: sympy.Expr) -> str:
        a, b = printer.doprint(sympy.Float(a)), printer.doprint(sympy.Float(b))
        return a if a == b else f"{a} if left else {b}"

    body = function_body(g, printer).replace("    return ", "    g = ")
    lines = [body, f"    t = ({pick(left_scale, right_scale)})*g + ({pick(left_shift, right_shift)})"]
    lines += [f"    c{k} = {pick(a, b)}" for k, (a, b) in enumerate(zip(left_c, right_c, strict=True))]
    powers, expression = _estrin([f"c{k}" for k in range(degree)], "t", "    ")
    lines += [*powers, f"    return {expression}"]
    doc = ("q_left_near_scalar(y) where left, else q_right_near_scalar(y): one polynomial in t = s*g + h,"
           "\n    s, h and each coefficient selected by the bit, evaluated by Estrin's scheme.")  # fmt: skip
    return f'def q_near_scalar(y, left):\n    """{doc}"""\n' + "\n".join(lines) + "\n"


def _numba_pieces(c: CoeffFile) -> tuple[str, dict[str, bool]]:
    """The near and far piece of each split branch as scalar functions, and each split as a constant
    (NAME_SPLIT); with which branches have one."""
    blocks, has_split, nears, splits = [], {}, {}, {}
    printer = ScalarPrinter()
    for name, branch in c.branches.items():
        pieces = _split(branch.sympy_expression())
        has_split[name] = pieces is not None
        if pieces is None:
            continue
        near, far, split = pieces
        nears[name], splits[name] = near, split
        constant = f"{name.upper()}_SPLIT"
        blocks.append(f"{constant} = {printer.doprint(split)}  # q_{name}'s near piece below, far from it\n")
        for label, piece, side in (("near", near, "<"), ("far", far, ">=")):
            doc = f"q_{name}_scalar's {label} piece (y {side} {constant})."
            body = function_body(piece, printer)
            blocks.append(f'def q_{name}_{label}_scalar(y):\n    """{doc}"""\n{body}\n')
    shared = _shared_near(nears.get("left"), nears.get("right"), printer) if len(nears) == 2 else None
    has_split["shared"] = shared is not None
    if shared is not None:
        blocks.append(shared)
    table = None
    if shared is not None:  # both near pieces are polynomials in affine maps of one g
        table = near_table({name: _affine_polynomial(nears[name]) for name in ("left", "right")}, splits)
    has_split["tables"] = table[1] if table else []
    if table is not None:
        blocks.append(table[0])
    return "\n\n".join(blocks), has_split


def _numba_kernel(c: CoeffFile, has_split: dict[str, bool]) -> str:
    """The backward kernel's source for this coefficient file (see NUMBA_COMMON); `has_split`: which
    branches _numba_pieces printed near and far pieces for."""
    if c.monotone:
        return NUMBA_COMMON + WHOLE_JIT.format(name="right") + NUMBA_MONOTONE
    if not any(has_split.values()):
        wholes = WHOLE_JIT.format(name="right") + WHOLE_JIT.format(name="left")
        return NUMBA_COMMON + wholes + NUMBA_EVERY_PIECE + NUMBA_SPANS
    jits, near, notes, passes, tails = [], {}, [], [], []
    if has_split.get("shared"):
        jits.append('_q_near = numba.njit(inline="always", fastmath=_FASTMATH, cache=True)(q_near_scalar)')
    for name in ("left", "right"):
        if not has_split[name]:
            near[name] = f"_q_{name}"
            jits.append(WHOLE_JIT.format(name=name).rstrip())
            continue
        near[name] = f"_q_{name}_near"
        for label in ("far",) if has_split.get("shared") else ("near", "far"):
            jits.append(f"_q_{name}_{label} = numba.njit(inline=\"always\", fastmath=_FASTMATH, cache=True)"
                        f"(q_{name}_{label}_scalar)")  # fmt: skip
        bit, split, note = BRANCH_BIT[name], f"{name.upper()}_SPLIT", NOTE[name]
        notes.append(f"np.uint8({note}) * np.uint8({bit} & (y[i] >= {split}))")
        passes.append(NUMBA_FAR_PASS.format(name=name, bit=bit, split=split, note=note))
        tails.append(NUMBA_TAIL_PASS.format(name=name, note=note))
    near_q = f"{near['left']}(y[i]) if left else {near['right']}(y[i])"
    if has_split.get("shared"):
        near_q = "_q_near(y[i], left)"
    kernel = NUMBA_COMMON + NUMBA_TWO_BRANCHES.format(
        piece_jits="\n".join(jits), near_q=near_q, need=" | ".join(notes), far_passes="\n".join(passes),
        tail_passes="\n".join(tails),
    ) + NUMBA_SPANS  # fmt: skip
    if not has_split.get("tables"):
        return kernel
    tables = [NUMBA_TABLE.format(isa=isa, ISA=isa.upper(), needs=TABLE_NEEDS[isa])
              for isa in has_split["tables"]]  # fmt: skip
    entry = '    "{0}": (table_kernel_{0}, table_kernel_bits_{0}),'
    kernels = "\n".join(entry.format(isa) for isa in has_split["tables"])
    return kernel + NUMBA_FAR_LISTS + "".join(tables) + NUMBA_TABLE_CHOICE.format(kernels=kernels)


# What the numba view calls: sources of every file holding one.
CPU_RUNTIME = (RUNTIME / "activation" / "_cpu_math.py", RUNTIME / "activation" / "_lookup.py")


def cpu_runtime_sources() -> list[tuple[str, str]]:
    """(path, sha256) of each file in CPU_RUNTIME, for the header of a file holding a numba view: a
    cached kernel compiled their code in, so an edit there must regenerate the file (which renews
    numba's cache)."""
    return [(rel(path), sha256(path.read_bytes())) for path in CPU_RUNTIME]


def numba_view(c: CoeffFile) -> str:
    """The scalar functions, then the backward kernel compiled from them."""
    pieces, has_split = ("", {}) if c.monotone else _numba_pieces(c)
    pieces = f"\n\n{pieces}" if pieces else ""
    return f"{q_functions(c, ScalarPrinter(), '_scalar')}{pieces}{_numba_kernel(c, has_split)}"


def render_cpu(c: CoeffFile, sources: list[tuple[str, str]], c16: CoeffFile | None = None) -> str:
    """The numba view of `c`, and with `c16` its 16-bit q and kernel (codegen.half)."""
    title = f"{c.activation}, family {c.family!r}: q {per_branch(c)} as fp32 scalar functions for numba,"
    title += " and the backward kernel compiled from them"
    title += f"; q16 from family {c16.family!r} for 16-bit y." if c16 else "."
    sixteen = numba16_view(c16) if c16 else ""
    imports16 = (
        "from invact.activation._cpu_math import _f32_as_i32, _i32_as_f32  # noqa: F401\n" if c16 else ""
    )
    return f'''{header(sources)}"""{title}"""

import math  # noqa: F401

import numba
import numpy as np

from invact.activation import _lookup  # noqa: F401
from invact.activation._cpu_math import F, exp32, expm1_32, log32, prefer_512_bit_vectors  # noqa: F401
from invact.activation._cpu_math import unpack_bits  # noqa: F401
from invact.activation._cpu_math import f32_at, u8_at  # noqa: F401
{imports16}

{numba_view(c)}{sixteen}'''
