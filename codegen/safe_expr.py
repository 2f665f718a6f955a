"""The one way text becomes a sympy expression: an allow-listed walk over Python's `ast`, never eval.

Coefficient files, --init files, the activation registry's strings and a search backend's output are
all read here (docs/how-it-works.md, "Coefficient files"). The text is parsed with ``ast.parse(mode="eval")``,
which only builds a syntax tree and runs nothing; the tree is then walked, and every node must be one of

- a number literal (int or float; no complex, no strings, no bytes),
- a name from the caller's allow-list (y, u, c0..cn, ...),
- unary + or -, binary + - * / **,
- a call, positional arguments only, of one of FUNCTIONS (sqrt, exp, expm1, log, Abs, Max, Min,
  Piecewise),
- inside Piecewise only: (expression, condition) pairs, a condition being one comparison
  (< <= > >=) or ``True``.

The sympy expression is built from the walked nodes with sympy's own operators and functions, exactly
as ``sympy.parse_expr(text, evaluate=True)`` would build it (a float literal becomes
``sympy.Float(<its text>)``, an int ``sympy.Integer``), so accepted text gives the identical
expression. Anything else, and input that would be slow or huge to build, raises ExpressionError with
a one-line message naming the field (`where`) and what was refused.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable, Mapping

import sympy
from sympy.codegen.cfunctions import expm1

FUNCTIONS: dict[str, Callable[..., sympy.Basic]] = {
    "sqrt": sympy.sqrt,
    "exp": sympy.exp,
    "expm1": expm1,  # e^z - 1 without cancellation near z = 0 (softplus's exact q at tiny y)
    "log": sympy.log,
    "Abs": sympy.Abs,
    "Max": sympy.Max,
    "Min": sympy.Min,
    "Piecewise": sympy.Piecewise,
}
ALLOWED_FUNCTIONS = frozenset(FUNCTIONS)
# Every other function takes one argument (log(x, base) is refused: printers take one).
_MANY_ARGUMENTS = frozenset({"Max", "Min", "Piecewise"})

# The longest committed branch expression is 2,189 characters (coeffs/silu/floor.json, right): ten
# times that leaves room for larger families and keeps the parse and the walk well under a second.
MAX_LENGTH = 20_000
# Nesting of the syntax tree. The deepest committed expression nests 33 levels (a floor family's
# Horner chain); Python's own recursion limit (1000 frames) is the hard ceiling the walk must stay under.
MAX_DEPTH = 200
# A float64 repr has at most 17 significant digits plus sign, point and exponent (24 characters);
# a literal longer than this carries digits no kernel can use, and costs time at sympy's precision.
MAX_LITERAL_CHARS = 64
# |constant exponent|: the committed files use 2 and 3. Past this a power is a typo or an attack
# (2**99999999 would build a 100-million-bit integer).
MAX_EXPONENT = 64
# Exact integers and rationals sympy folds out of literals: float64 overflows past 2**1024, so a larger
# exact number means nothing to a kernel; bounding it bounds the cost of every later step.
MAX_INT_BITS = 1024

_BINARY: dict[type[ast.operator], Callable[[sympy.Basic, sympy.Basic], sympy.Basic]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[sympy.Basic], sympy.Basic]] = {
    ast.UAdd: operator.pos,
    ast.USub: operator.neg,
}
_COMPARE: dict[type[ast.cmpop], Callable[[sympy.Basic, sympy.Basic], sympy.Basic]] = {
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
}
# How a refused node is named in the message (the rest: "<NodeType> is not allowed").
_REFUSED: dict[type[ast.AST], str] = {
    ast.Attribute: "attribute access is not allowed",
    ast.Subscript: "subscripts are not allowed",
    ast.Slice: "slices are not allowed",
    ast.Lambda: "lambda is not allowed",
    ast.List: "lists are not allowed",
    ast.Tuple: "tuples are allowed only as Piecewise's (expression, condition) pairs",
    ast.Dict: "dicts are not allowed",
    ast.Set: "sets are not allowed",
    ast.ListComp: "comprehensions are not allowed",
    ast.SetComp: "comprehensions are not allowed",
    ast.DictComp: "comprehensions are not allowed",
    ast.GeneratorExp: "comprehensions are not allowed",
    ast.IfExp: "conditional expressions are not allowed (use Piecewise)",
    ast.BoolOp: "and/or are not allowed (one comparison per Piecewise condition)",
    ast.Compare: "comparisons are allowed only as Piecewise conditions",
    ast.NamedExpr: "assignment expressions are not allowed",
    ast.JoinedStr: "strings are not allowed",
    ast.Starred: "starred arguments are not allowed",
    ast.Await: "await is not allowed",
    ast.Yield: "yield is not allowed",
    ast.YieldFrom: "yield is not allowed",
}


_NOT_FINITE = (sympy.zoo, sympy.oo, -sympy.oo, sympy.nan)


class ExpressionError(ValueError):
    """Text that is not an allowed expression; the message is one line naming the field."""


def real_symbols(names: list[str] | tuple[str, ...]) -> dict[str, sympy.Symbol]:
    """name -> real Symbol, the symbols every expression in this project uses."""
    return {name: sympy.Symbol(name, real=True) for name in names}


def parse(
    text: str,
    symbols: Mapping[str, sympy.Basic],
    where: str,
    functions: Mapping[str, Callable[..., sympy.Basic]] = FUNCTIONS,
) -> sympy.Expr:
    """Parse `text` into a sympy expression in `symbols` (name -> symbol or constant) and `functions`
    (name -> sympy function; default FUNCTIONS, what coefficient files may use) only. Every function
    but Max, Min and Piecewise takes exactly one argument.

    Raises ExpressionError("<where>: <what was refused>"), one line, for anything else."""
    return _Reader(text, symbols, where, functions).read()


def _one_line(message: str) -> str:
    return " ".join(message.split())


def _snippet(text: str, limit: int = 40) -> str:
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


class _Reader:
    def __init__(self, text: str, symbols: Mapping[str, sympy.Basic], where: str, functions) -> None:
        self.text = text
        self.symbols = dict(symbols)
        self.where = where
        self.functions = dict(functions)

    def fail(self, problem: str, node: ast.AST | None = None) -> ExpressionError:
        if node is not None and hasattr(node, "col_offset"):
            segment = ast.get_source_segment(self.text, node)
            problem += f" at column {node.col_offset + 1}" + (f" ({_snippet(segment)})" if segment else "")
        return ExpressionError(_one_line(f"{self.where}: {problem}" if self.where else problem))

    def read(self) -> sympy.Expr:
        text = self.text
        if not isinstance(text, str):
            raise self.fail(f"expected a string, got {type(text).__name__}")
        if len(text) > MAX_LENGTH:
            raise self.fail(f"expression is {len(text)} characters long, more than the {MAX_LENGTH} allowed")
        if not (text.isascii() and text.isprintable()):
            bad = next(ch for ch in text if not (ch.isascii() and ch.isprintable()))
            raise self.fail(f"character {bad!r} is not allowed (printable ASCII only)")
        if not text.strip():
            raise self.fail("empty expression")
        try:
            tree = ast.parse(text, mode="eval")
        except SyntaxError as e:
            raise self.fail(
                f"cannot parse expression {_snippet(text)}: {e.msg} at column {e.offset}"
            ) from None
        except (RecursionError, MemoryError):
            raise self.fail(f"expression nests too deeply (more than {MAX_DEPTH} levels)") from None
        except ValueError as e:  # e.g. an integer literal past Python's digit limit
            raise self.fail(f"cannot parse expression: {e}") from None
        try:
            expr = self.expression(tree.body, 1)
        except RecursionError:  # not expected below MAX_DEPTH; kept so no input can escape as a traceback
            raise self.fail(f"expression nests too deeply (more than {MAX_DEPTH} levels)") from None
        if not isinstance(expr, sympy.Expr):
            raise self.fail("the whole expression must be a number-valued expression, not a condition")
        allowed = {getattr(f, "__name__", name) for name, f in self.functions.items()} | set(self.functions)
        functions = {type(f).__name__ for f in expr.atoms(sympy.Function)} - allowed
        if functions:  # sympy's evaluation introduced one (not expected; checked so printers never see it)
            raise self.fail(f"evaluates to functions {sorted(functions)}, which are not allowed")
        return expr

    # --- expressions -------------------------------------------------------------------------------
    def expression(self, node: ast.AST, depth: int) -> sympy.Expr:
        if depth > MAX_DEPTH:
            raise self.fail(f"expression nests too deeply (more than {MAX_DEPTH} levels)")
        if isinstance(node, ast.Constant):
            return self.number(node)
        if isinstance(node, ast.Name):
            return self.name(node)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return self.apply(_UNARY[type(node.op)], [self.expression(node.operand, depth + 1)], node)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left = self.expression(node.left, depth + 1)
            right = self.expression(node.right, depth + 1)
            if isinstance(node.op, ast.Pow):
                self.check_power(left, right, node)
            return self.apply(_BINARY[type(node.op)], [left, right], node)
        if isinstance(node, ast.Call):
            return self.call(node, depth)
        raise self.refuse(node)

    def refuse(self, node: ast.AST) -> ExpressionError:
        if isinstance(node, (ast.UnaryOp, ast.BinOp)):
            op = type(node.op).__name__
            return self.fail(f"operator {op} is not allowed (only unary + -, binary + - * / **)", node)
        return self.fail(_REFUSED.get(type(node), f"{type(node).__name__} is not allowed"), node)

    def number(self, node: ast.Constant) -> sympy.Expr:
        value = node.value
        if isinstance(value, bool) or value is None or value is Ellipsis:
            raise self.fail(f"{value!r} is allowed only as the last Piecewise condition", node)
        if isinstance(value, (str, bytes)):
            raise self.fail("strings are not allowed", node)
        if isinstance(value, complex):
            raise self.fail("complex numbers are not allowed", node)
        source = ast.get_source_segment(self.text, node) or ""
        if len(source) > MAX_LITERAL_CHARS:
            raise self.fail(f"number literal longer than {MAX_LITERAL_CHARS} characters", node)
        if isinstance(value, int):
            return self.checked(sympy.Integer(value), node)
        if isinstance(value, float):
            if not math.isfinite(value):
                raise self.fail("number literal outside float64's range", node)
            # What parse_expr builds: Float of the literal's own text, whose digits set the precision.
            return self.apply(sympy.Float, [source], node)
        raise self.fail(f"{type(value).__name__} literals are not allowed", node)

    def name(self, node: ast.Name) -> sympy.Basic:
        name = node.id
        if name in self.symbols:
            return self.symbols[name]
        if name.startswith("__") or name.endswith("__"):
            raise self.fail(f"dunder name {name!r} is not allowed", node)
        if name in self.functions:
            raise self.fail(f"function {name!r} must be called", node)
        allowed = ", ".join(sorted(self.symbols)) or "none"
        raise self.fail(f"unknown symbol {name!r} (allowed: {allowed})", node)

    def call(self, node: ast.Call, depth: int) -> sympy.Basic:
        if not isinstance(node.func, ast.Name):
            raise self.refuse(node.func)
        name = node.func.id
        if name not in self.functions:
            if name.startswith("__") or name.endswith("__"):
                raise self.fail(f"dunder name {name!r} is not allowed", node.func)
            allowed = ", ".join(sorted(self.functions))
            raise self.fail(f"function {name!r} is not allowed (allowed: {allowed})", node.func)
        if node.keywords:
            raise self.fail(f"{name}() takes no keyword arguments", node)
        if any(isinstance(a, ast.Starred) for a in node.args):
            raise self.fail("starred arguments are not allowed", node)
        if name not in _MANY_ARGUMENTS and len(node.args) != 1:
            raise self.fail(f"{name}() takes exactly one argument, got {len(node.args)}", node)
        if not node.args:
            raise self.fail(f"{name}() needs at least one argument", node)
        if name == "Piecewise":
            pieces = [
                self.piece(arg, depth + 1, last=i == len(node.args) - 1) for i, arg in enumerate(node.args)
            ]
            return self.apply(self.functions[name], pieces, node)
        return self.apply(self.functions[name], [self.expression(arg, depth + 1) for arg in node.args], node)

    def piece(self, node: ast.AST, depth: int, last: bool) -> tuple[sympy.Expr, sympy.Basic | bool]:
        if not (isinstance(node, ast.Tuple) and len(node.elts) == 2):
            raise self.fail("Piecewise takes (expression, condition) pairs", node)
        value, condition = node.elts
        return self.expression(value, depth + 1), self.condition(condition, depth + 1, last)

    def condition(self, node: ast.AST, depth: int, last: bool) -> sympy.Basic | bool:
        if isinstance(node, ast.Constant) and node.value is True:
            if not last:
                raise self.fail("True is allowed only as the last Piecewise condition", node)
            return True  # what parse_expr passes: Piecewise turns it into sympy.true
        if not isinstance(node, ast.Compare):
            raise self.fail("a Piecewise condition is one comparison (< <= > >=) or True", node)
        if len(node.ops) != 1:
            raise self.fail("chained comparisons are not allowed", node)
        op = type(node.ops[0])
        if op not in _COMPARE:
            raise self.fail(f"comparison {op.__name__} is not allowed (only < <= > >=)", node)
        left = self.expression(node.left, depth + 1)
        right = self.expression(node.comparators[0], depth + 1)
        return self.apply(_COMPARE[op], [left, right], node)

    # --- size guards --------------------------------------------------------------------------------
    def check_power(self, base: sympy.Basic, exponent: sympy.Basic, node: ast.AST) -> None:
        if isinstance(exponent, sympy.Number) and (not exponent.is_finite or abs(exponent) > MAX_EXPONENT):
            value = str(exponent) if len(str(exponent)) <= 24 else str(exponent)[:21] + "..."
            raise self.fail(f"constant exponent {value} is larger than {MAX_EXPONENT} in magnitude", node)

    def checked(self, value: sympy.Basic, node: ast.AST) -> sympy.Basic:
        """Refuse exact numbers past MAX_INT_BITS and non-finite constants (1/0 is zoo) in the value."""
        for atom in value.atoms():
            if atom.is_Rational and max(atom.p.bit_length(), atom.q.bit_length()) > MAX_INT_BITS:
                raise self.fail(f"exact number larger than 2**{MAX_INT_BITS}", node)
            if atom in _NOT_FINITE:
                raise self.fail(f"the expression evaluates to the non-finite constant {atom}", node)
        return value

    def apply(self, function: Callable[..., sympy.Basic], args: list, node: ast.AST) -> sympy.Basic:
        """function(*args), sympy's errors (a Piecewise it refuses, ...) turned into ExpressionError."""
        try:
            return self.checked(function(*args), node)
        except (TypeError, ValueError, ArithmeticError) as e:
            if isinstance(e, ExpressionError):
                raise
            raise self.fail(f"cannot evaluate: {_one_line(str(e))}", node) from None
