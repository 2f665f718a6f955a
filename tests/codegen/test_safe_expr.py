"""The safe expression reader: every path that reads an expression refuses hostile text in one line,
runs nothing, and reads every committed coefficient file to exactly the expression sympy would."""

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import sympy

import codegen.safe_expr as safe_expr
from codegen.coeffs_json import CoeffsError, load
from codegen.render import COEFFS, ROOT
from codegen.safe_expr import ExpressionError, parse, real_symbols

SYMBOLS = real_symbols(["y", "c0", "c1"])
WHERE = "evil.json: branches.left.expression"
# Run by a reader that evaluated its input, this creates the file `pwned` in the working directory.
PWN = "__import__('os').system('touch pwned')"
COMMITTED = sorted(p for p in COEFFS.glob("*/*.json"))  # every coefficient file (not defaults.json)
DEEP = 100_000  # nesting of the deep inputs: far past Python's recursion limit (1000)

HOSTILE = {
    "import call": f"{PWN}+y",
    "import call alone": PWN,
    "dunder call": "__import__('os')",
    "attribute access": "y.__class__",
    "attribute call": "y.subs(y, 1)",
    "dunder name": "__builtins__",
    "dunder name as a value": "y + __name__",
    "lambda": "(lambda: 1)()",
    "bare lambda": "lambda: y",
    "open": "open('pwned', 'w')",
    "eval": "eval('1')",
    "exec": "exec('1')",
    "getattr": "getattr(y, 'func')",
    "sympy function not on the list": "sin(y)",
    "sympy name not on the list": "Symbol('pwned')",
    "sympy constant": "pi*y",
    "string": "'abc'",
    "string argument": "sqrt('y')",
    "bytes": "b'y'",
    "f-string": "f'{y}'",
    "complex": "1j*y",
    "subscript": "y[0]",
    "list": "[y]",
    "comprehension": "Max(*[y for y in (1, 2)])",
    "keyword argument": "sqrt(y, evaluate=False)",
    "conditional expression": "y if y else 1",
    "and/or": "y and 1",
    "walrus": "(z := y)",
    "xor (not a power)": "y ^ 2",
    "bit shift": "1 << 99999999",
    "huge exponent": "2**99999999",
    "huge negative exponent": "y**-99999999",
    "huge float exponent": "y**1e300",
    "exponent tower": "((2**64)**64)**64",
    "huge hex literal": "0x" + "f" * 1000,
    "huge decimal literal": "9" * 5000,
    "float literal past float64": "1e999*y",
    "division by zero": "y + 1/0",
    "comparison outside Piecewise": "y < 1",
    "chained comparison": "Piecewise((y, 0 < y < 1), (1, True))",
    "equality condition": "Piecewise((y, Eq(y, 0)), (1, True))",
    "True before the last piece": "Piecewise((y, True), (1, y < 0))",
    "Piecewise without pairs": "Piecewise(y)",
    "log with a base": "log(y, 2)",
    "Max of nothing": "Max()",
    "non-ASCII lookalike": "\uff59",  # fullwidth y: Python would normalize it to y
    "newline": "y\n+1",
    "null byte": "y\x00",
    "empty": "",
    "unknown symbol": "x",
    "function used as a value": "sqrt",
    "symbol called": "y(1)",
    "syntax error": "c0*(y",
    "statement": "import os",
    "deep unary minus": "-" * DEEP + "y",
    "deep parentheses": "(" * DEEP + "y" + ")" * DEEP,
    "deep calls": "sqrt(" * DEEP + "y" + ")" * DEEP,
    "long power chain": "y**" * DEEP + "y",
    "long sum": "y+" * DEEP + "y",
    "deep unary minus within the length limit": "-" * (safe_expr.MAX_LENGTH - 1) + "y",
    "long power chain within the length limit": "y**" * (safe_expr.MAX_LENGTH // 3 - 1) + "y",
    "deep parentheses within the length limit": "(" * 250 + "y" + ")" * 250,
    "deep calls within the length limit": "exp(" * (safe_expr.MAX_DEPTH + 1)
    + "y"
    + ")" * (safe_expr.MAX_DEPTH + 1),
    "very long input": "+".join(["y"] * (safe_expr.MAX_LENGTH // 2 + 1)),
}


def _refused(text: str, tmp_path: Path, monkeypatch) -> str:
    """The one-line message parse() refuses `text` with, run in an empty working directory."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ExpressionError) as info:
        parse(text, SYMBOLS, WHERE)
    message = str(info.value)
    assert list(tmp_path.iterdir()) == []  # nothing ran: no `pwned`
    assert "\n" not in message and message.startswith(f"{WHERE}: ")
    return message


@pytest.mark.parametrize("text", HOSTILE.values(), ids=HOSTILE.keys())
def test_hostile_text_is_refused_in_one_line(text, tmp_path, monkeypatch):
    _refused(text, tmp_path, monkeypatch)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (f"{PWN}+y", "attribute access is not allowed"),
        ("__import__('os')", "dunder name '__import__' is not allowed"),
        ("y.__class__", "attribute access is not allowed"),
        ("open('pwned')", "function 'open' is not allowed (allowed: Abs, Max, Min, Piecewise, exp"),
        ("sin(y)", "function 'sin' is not allowed"),
        ("'abc'", "strings are not allowed"),
        ("2**99999999", f"constant exponent 99999999 is larger than {safe_expr.MAX_EXPONENT} in magnitude"),
        ("(2**64)**64", f"exact number larger than 2**{safe_expr.MAX_INT_BITS}"),
        ("x", "unknown symbol 'x' (allowed: c0, c1, y)"),
        ("y < 1", "comparisons are allowed only as Piecewise conditions"),
        ("-" * (safe_expr.MAX_LENGTH - 1) + "y", f"nests too deeply (more than {safe_expr.MAX_DEPTH} level"),
        ("y+" * DEEP + "y", f"more than the {safe_expr.MAX_LENGTH} allowed"),
    ],
)
def test_messages_say_what_was_refused(text, message, tmp_path, monkeypatch):
    assert message in _refused(text, tmp_path, monkeypatch)


@pytest.mark.parametrize(
    "text",
    ["-" * DEEP + "y", "(" * DEEP + "y" + ")" * DEEP, "y**" * DEEP + "y", "y+" * DEEP + "y"],
    ids=["unary minus", "parentheses", "power chain", "sum"],
)
def test_python_parser_failures_on_deep_input_become_one_line(text, tmp_path, monkeypatch):
    """With the length limit lifted, Python's own parser meets the deep input: its MemoryError,
    RecursionError or SyntaxError ("too many nested parentheses") becomes the one-line error."""
    monkeypatch.setattr(safe_expr, "MAX_LENGTH", 10 * DEEP)
    assert "nest" in _refused(text, tmp_path, monkeypatch)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("c0*sqrt(Max(0, y + c1)) + exp(-y)", "c0*sqrt(Max(0, c1 + y)) + exp(-y)"),
        ("Piecewise((c0, y < -0.5), (y**2, True))", "Piecewise((c0, y < -0.5), (y**2, True))"),
        ("Piecewise((1, y >= 2), (2, y <= 1), (3, y > 0), (0, True))", None),
        ("Abs(Min(y, 1.5e-3)) / log(2) - +y**-2 + y**(1/2)", None),
        ("(y + 1)**64 * 2**-64", None),
    ],
)
def test_allowed_text_reads_as_sympy_reads_it(text, expected):
    """Our own, trusted strings: sympy.parse_expr is the reference here (and only here)."""
    got = parse(text, SYMBOLS, WHERE)
    assert sympy.srepr(got) == sympy.srepr(sympy.parse_expr(text, local_dict=SYMBOLS, evaluate=True))
    if expected is not None:
        assert str(got) == expected


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_committed_coefficient_files_read_to_the_same_expression(path):
    """The committed files are ours, so parse_expr may read them in this test: the safe reader must
    build the identical tree, Float precisions included (srepr shows them), so generated code cannot
    drift (test_codegen.py regenerates and diffs it too)."""
    coeffs = load(path)
    for name, branch in coeffs.branches.items():
        symbols = real_symbols([*branch.coefficients, "y"])
        names = symbols | {"expm1": safe_expr.FUNCTIONS["expm1"]}  # parse_expr does not know expm1
        reference = sympy.parse_expr(branch.expression, local_dict=names, evaluate=True)
        got = parse(branch.expression, symbols, f"{path}: branches.{name}.expression")
        assert sympy.srepr(got) == sympy.srepr(reference)


# --- every way in: coeffs_json.load, python -m codegen, invact-fit --init -------------------------------


def _evil_copy(folder: Path, activation: str = "gelu", family: str = "paper") -> Path:
    """A copy of a committed coefficient file whose left branch expression starts with PWN."""
    doc = json.loads((COEFFS / activation / f"{family}.json").read_text())
    doc = copy.deepcopy(doc)
    doc["branches"]["left"]["expression"] = f"{PWN}+" + doc["branches"]["left"]["expression"]
    path = folder / activation / f"{family}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))
    return path


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def _assert_refused_in_one_line(result: subprocess.CompletedProcess, cwd: Path, prefix: str) -> None:
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.startswith(prefix)
    assert "branches.left.expression: attribute access is not allowed" in result.stderr
    assert not (cwd / "pwned").exists()


def test_load_refuses_an_evil_file(tmp_path, monkeypatch):
    evil = _evil_copy(tmp_path / "in")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CoeffsError, match=r"branches\.left\.expression: attribute access") as info:
        load(evil)
    assert "\n" not in str(info.value) and str(info.value).startswith(str(evil))
    assert not (tmp_path / "pwned").exists()


def test_invact_fit_init_refuses_an_evil_file(tmp_path):
    evil = _evil_copy(tmp_path / "in")
    out = tmp_path / "out.json"
    args = ["gelu", "--family", "paper", "--init", str(evil), "--out", str(out)]
    result = subprocess.run(
        [sys.executable, "-m", "fitting.cli", *args],
        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    _assert_refused_in_one_line(result, tmp_path, f"invact-fit: error: {evil}: ")
    assert not out.exists()


def test_codegen_refuses_an_evil_coeffs_dir(tmp_path):
    """python -m codegen --coeffs-dir DIR, DIR a copy of coeffs/ with one file made evil."""
    coeffs = tmp_path / "coeffs"
    coeffs.mkdir()
    (coeffs / "defaults.json").write_text(json.dumps({"gelu": "paper"}))
    shutil.copy(COEFFS / "activations.json", coeffs)
    _evil_copy(coeffs)
    for command in (["--check"], []):
        result = subprocess.run(
            [sys.executable, "-m", "codegen", *command, "--coeffs-dir", str(coeffs)],
            cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        _assert_refused_in_one_line(result, tmp_path, "codegen: error: ")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["coeffs"]
