"""Sympy printers: one branch expression in y, printed as a Triton, a torch or a scalar (numba) function.

Every printer works on the common-subexpression-eliminated form (sympy.cse), so a clamp such as
Max(y, y_min) that appears five times in the expression is computed once. Integer powers become
multiplications (x**3 -> x*x*x): pow() is slower and does not vectorize on CPU. Floats are printed
with repr, all 17 significant digits; kernels compute in fp32, where they round once.
"""

from __future__ import annotations

import sympy
from sympy.printing.pycode import PythonCodePrinter

Y = sympy.Symbol("y", real=True)


class _ElementwisePrinter(PythonCodePrinter):
    """Shared logic; subclasses name the library calls."""

    SQRT = EXP = LOG = ABS = ""

    def _print_Float(self, expr: sympy.Float) -> str:
        return self._literal(repr(float(expr)))

    def _print_Rational(self, expr: sympy.Rational) -> str:
        return self._literal(repr(float(expr)))

    def _print_Integer(self, expr: sympy.Integer) -> str:
        return self._literal(f"{int(expr)}.0")

    def _literal(self, text: str) -> str:
        return text

    def _print_Pow(self, expr: sympy.Pow, rational: bool = False) -> str:
        base, k = expr.base, expr.exp
        b = self.parenthesize(base, sympy.printing.precedence.PRECEDENCE["Mul"] + 1)
        if k == sympy.S.Half:
            return f"{self.SQRT}({self._print(base)})"
        if k == -sympy.S.Half:
            return f"{self._literal('1.0')} / {self.SQRT}({self._print(base)})"
        if k.is_Integer and 1 <= abs(int(k)) <= 8:
            product = "*".join([b] * abs(int(k)))
            return f"({product})" if k > 0 else f"({self._literal('1.0')} / ({product}))"
        return f"{self.EXP}({self._print(k)} * {self.LOG}({self._print(base)}))"

    def _print_exp(self, expr: sympy.exp) -> str:
        return f"{self.EXP}({self._print(expr.args[0])})"

    def _print_log(self, expr: sympy.log) -> str:
        return f"{self.LOG}({self._print(expr.args[0])})"

    def _print_Abs(self, expr: sympy.Abs) -> str:
        return f"{self.ABS}({self._print(expr.args[0])})"

    # The activation formulas' functions (codegen.functions), by their printed form with {} for the
    # argument; a function missing here cannot be printed for this backend.
    FUNCTIONS: dict[str, str] = {}

    def _print_Function(self, expr: sympy.Function) -> str:
        name = type(expr).__name__
        if name not in self.FUNCTIONS:
            raise ValueError(f"{name}() has no {type(self).__name__[:-7]} form")
        return self.FUNCTIONS[name].format(self._print(expr.args[0]))

    _print_erf = _print_erfc = _print_tanh = _print_log1p = _print_expm1 = _print_Function

    def _fold(self, fn: str, args: tuple[sympy.Expr, ...]) -> str:
        text = self._print(args[0])
        for a in args[1:]:
            text = f"{fn}({text}, {self._print(a)})"
        return text

    variable = "y"  # the function's argument (function_body sets it)

    def _print_Piecewise(self, expr: sympy.Piecewise) -> str:
        *rest, (last_value, last_cond) = expr.args
        if last_cond is not sympy.true:
            raise ValueError("Piecewise needs a final True branch to be printed elementwise")
        text = self._print_last_piece(last_value, [v for v, _ in rest])
        for value, cond in reversed(rest):
            text = self._select(self._print(cond), self._print(value), text)
        return text

    def _select(self, cond: str, if_true: str, if_false: str) -> str:
        return f"{self.WHERE}({cond}, {if_true}, {if_false})"

    def _print_last_piece(self, value: sympy.Expr, others: list[sympy.Expr]) -> str:
        return self._print(value)


class TritonPrinter(_ElementwisePrinter):
    # tl.sqrt is CUDA's approximate square root (tl.sqrt_rn the correctly rounded one): relu2's q = 2 sqrt(y)
    # came out within 1.3 ulp on an H100, inside the tests' fp32 margin, while sqrt_rn slowed the bf16
    # backward, which is compute-bound there, by 15% (gelu, 2^25 elements).
    SQRT, EXP, LOG, ABS, WHERE = "tl.sqrt", "tl.exp", "tl.log", "tl.abs", "tl.where"
    # fp32 forms that need no libdevice (the CPU interpreter has none): no tanh or erfc here (an
    # activation that uses them gives its Triton forward as a formula without them, spec `triton`).
    FUNCTIONS = {
        "erf": "tl.erf({})",
        "log1p": "_log1p({})",  # a helper printed in the module (codegen.triton_view)
        "expm1": "_expm1({})",  # a helper printed in the module (codegen.triton_view)
        "softplus": "_softplus({})",  # a helper printed in the module (codegen.triton_view)
        "Phi": "(0.5 * (1.0 + tl.erf(0.7071067811865476 * ({}))))",
        "sigmoid": "(1.0 / (1.0 + tl.exp(-({}))))",
    }

    def _print_Max(self, expr: sympy.Max) -> str:
        return self._fold("tl.maximum", expr.args)

    def _print_Min(self, expr: sympy.Min) -> str:
        return self._fold("tl.minimum", expr.args)


class TorchPrinter(_ElementwisePrinter):
    """Tensor code: Max/Min with a number become clamp_min/clamp_max (torch.maximum needs tensors)."""

    SQRT, EXP, LOG, ABS, WHERE = "torch.sqrt", "torch.exp", "torch.log", "torch.abs", "torch.where"
    FUNCTIONS = {
        "erf": "torch.erf({})",
        "erfc": "torch.erfc({})",
        "tanh": "torch.tanh({})",
        "log1p": "torch.log1p({})",
        "expm1": "torch.expm1({})",
        "Phi": "torch.special.ndtr({})",
        "sigmoid": "torch.sigmoid({})",
        # torch's own (x past its threshold 20): what a library's formula computes, reproduced bitwise
        "softplus": "torch.nn.functional.softplus({})",
    }

    def _clamp(self, expr: sympy.Expr, tensor_fn: str, clamp_fn: str) -> str:
        numbers = [a for a in expr.args if a.is_number]
        others = [a for a in expr.args if not a.is_number]
        text = self._fold(tensor_fn, tuple(others))
        for n in numbers:
            text = f"torch.{clamp_fn}({text}, {self._print(n)})"
        return text

    def _print_Max(self, expr: sympy.Max) -> str:
        return self._clamp(expr, "torch.maximum", "clamp_min")

    def _print_last_piece(self, value: sympy.Expr, others: list[sympy.Expr]) -> str:
        """A Piecewise of numbers alone (relu6's q) would be torch.where of Python floats, which is
        float32 whatever y is: its last piece becomes a tensor like y, so the result has y's dtype."""
        if value.is_number and all(v.is_number for v in others):
            return f"torch.full_like({self.variable}, {self._print(value)})"
        return self._print(value)

    def _print_Min(self, expr: sympy.Min) -> str:
        return self._clamp(expr, "torch.minimum", "clamp_max")


class ReferenceTorchPrinter(TorchPrinter):
    """The float64 reference views (f, f'): a product's constant factor is printed last, so bounded
    factors meet a huge x first (mish's f' at x = 1e308: x * sigmoid(-2 softplus x) * ... * 4 is 0,
    where 4 * x * ... overflows to inf * 0 = NaN). softplus is the math function, without torch's
    threshold: a helper printed in the module."""

    FUNCTIONS = TorchPrinter.FUNCTIONS | {"softplus": "_softplus({})"}

    def _print_Mul(self, expr: sympy.Mul) -> str:
        coeff, rest = expr.as_coeff_Mul()
        if coeff.is_Number and coeff not in (1, -1) and rest is not sympy.S.One:
            factor = self._print(coeff)
            rest_text = self.parenthesize(rest, sympy.printing.precedence.PRECEDENCE["Mul"])
            return f"{rest_text}*({factor})" if coeff < 0 else f"{rest_text}*{factor}"
        return super()._print_Mul(expr)


class ScalarPrinter(_ElementwisePrinter):
    """fp32 scalar code for numba: literals typed F(...) (np.float32), exp/log from
    invact.activation._cpu_math, whose versions vectorize (libm's do not)."""

    SQRT, EXP, LOG, ABS = "math.sqrt", "exp32", "log32", "abs"
    # invact.activation._cpu_math's expm1_32: no cancellation near 0 (sqrtsoftplus's q)
    FUNCTIONS = {"expm1": "expm1_32({})"}

    def _literal(self, text: str) -> str:
        return f"F({text})"

    def _print_Max(self, expr: sympy.Max) -> str:
        return self._fold("max", expr.args)

    def _print_Min(self, expr: sympy.Min) -> str:
        return self._fold("min", expr.args)

    def _select(self, cond: str, if_true: str, if_false: str) -> str:
        return f"({if_true} if {cond} else {if_false})"


def _hoist_power_bases(expr: sympy.Expr, symbols, out: list) -> sympy.Expr:
    """Replace the compound base of each small integer power by a temporary appended to `out`, so
    (a + b)**3 prints as t*t*t instead of repeating a + b three times."""

    def is_target(e: sympy.Expr) -> bool:
        return e.is_Pow and e.exp.is_Integer and 2 <= abs(int(e.exp)) <= 8 and not e.base.is_Symbol

    def hoist(e: sympy.Expr) -> sympy.Expr:
        name = next(symbols)
        out.append((name, e.base))
        return sympy.Pow(name, e.exp)

    return expr.replace(is_target, hoist)


def function_body(
    expression: sympy.Expr, printer: _ElementwisePrinter, indent: str = "    ", variable: sympy.Symbol = Y
) -> str:
    """Lines computing `expression` of `variable` (y): temporaries t0, t1, ... then `return ...`."""
    extra = expression.free_symbols - {variable}
    if extra:
        raise ValueError(f"free symbols besides {variable}: {sorted(map(str, extra))}")
    symbols = sympy.numbered_symbols("t")
    replacements, (reduced,) = sympy.cse(expression, symbols=symbols)
    steps: list[tuple[sympy.Symbol, sympy.Expr]] = []
    for name, value in replacements:
        value = _hoist_power_bases(value, symbols, steps)
        steps.append((name, value))
    reduced = _hoist_power_bases(reduced, symbols, steps)
    printer.variable = str(variable)
    lines = [f"{indent}{name} = {printer.doprint(value)}" for name, value in steps]
    lines.append(f"{indent}return {printer.doprint(reduced)}")
    return "\n".join(lines)
