"""Code generation: the committed invact/_generated/ is exactly what the coefficient files print."""

import hashlib
import importlib
import json
import math
import shutil

import numpy as np
import pytest
import sympy
import torch

import codegen.__main__ as codegen_main
from codegen.coeffs_json import Y, load
from codegen.printers import ScalarPrinter, TorchPrinter, TritonPrinter, function_body
from codegen.render import COEFFS, GENERATED, ROOT, render_all
from fitting.activations import ACTIVATIONS
from fitting.evaluate import compile_q

DEFAULTS = json.loads((COEFFS / "defaults.json").read_text())
DEFAULT_FILES = sorted(COEFFS / activation / f"{family}.json" for activation, family in DEFAULTS.items())
DEFAULTS_16BIT = json.loads((COEFFS / "defaults_16bit.json").read_text())
FILES_16BIT = sorted(COEFFS / activation / f"{family}.json" for activation, family in DEFAULTS_16BIT.items())


def test_generated_files_are_up_to_date():
    files = render_all()
    for name, text in files.items():
        assert (GENERATED / name).read_text() == text, f"stale: run `python -m codegen` ({name})"
    assert sorted(p.name for p in GENERATED.glob("*.py")) == sorted(files)
    assert codegen_main.main(["--check"]) == 0


def test_check_reports_a_hand_edit(tmp_path, monkeypatch, capsys):
    for name, text in render_all().items():
        (tmp_path / name).write_text(text)
    (tmp_path / "silu.py").write_text((tmp_path / "silu.py").read_text() + "# edited by hand\n")
    monkeypatch.setattr(codegen_main, "GENERATED", tmp_path)
    assert codegen_main.main(["--check"]) == 1
    assert "stale: invact/_generated/silu.py" in capsys.readouterr().out
    assert codegen_main.main([]) == 0  # regenerates
    assert codegen_main.main(["--check"]) == 0


def _source_line(path) -> str:
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return f"# source: {path.relative_to(ROOT).as_posix()} (sha256 {digest})"


def test_headers_name_the_sources_and_their_sha256():
    spec = _source_line(ROOT / "coeffs" / "activations.json")
    runtime = ROOT / "invact" / "activation"
    cpu_runtime = [_source_line(runtime / name) for name in ("_cpu_math.py", "_lookup.py")]
    for path in DEFAULT_FILES:
        # every module prints the 16-bit q from its family's file too; the torch and Triton modules
        # print views of the spec entry, and the numba one names the runtime code its cached kernels
        # compile in (an edit there regenerates it)
        activation = path.parent.name
        sixteen = [_source_line(COEFFS / activation / f"{DEFAULTS_16BIT[activation]}.json")] if (
            activation in DEFAULTS_16BIT) else []  # fmt: skip
        for suffix, want in (("", [spec, _source_line(path), *sixteen]),
                             ("_cpu", [_source_line(path), *sixteen, *cpu_runtime]),
                             ("_triton", [spec, _source_line(path), *sixteen])):  # fmt: skip
            lines = (GENERATED / f"{path.parent.name}{suffix}.py").read_text().splitlines()
            assert [line for line in lines if line.startswith("# source: ")] == want


@pytest.mark.parametrize("path", DEFAULT_FILES, ids=[p.parent.name for p in DEFAULT_FILES])
def test_generated_torch_functions_equal_the_expression(path):
    coeffs = load(path)
    gen = importlib.import_module(f"invact._generated.{coeffs.activation}")
    y = np.concatenate([np.linspace(coeffs.y_min - 0.01, 25.0, 20001), [-3e38, 3e38, 0.0, coeffs.y_min]])
    for name, branch in coeffs.branches.items():
        want = compile_q(branch.sympy_expression())(y)
        got = getattr(gen, f"q_{name}")(torch.from_numpy(y)).numpy()
        # The same float64 operations up to reassociation by the printers: measured <= 4.7e-16 relative.
        np.testing.assert_allclose(got, want, rtol=1e-15, atol=1e-15)


@pytest.mark.parametrize("path", FILES_16BIT, ids=[p.parent.name for p in FILES_16BIT])
def test_generated_16bit_functions_equal_the_expression_but_for_log(path):
    """q16 prints the 16-bit family's expression with log as _log16 (codegen.half): in float64 with
    log in its place, the same values as the expression to reassociation (the bound above)."""
    coeffs = load(path)
    gen = importlib.import_module(f"invact._generated.{coeffs.activation}")
    assert gen.FAMILY_16BIT == coeffs.family
    y = np.concatenate([np.linspace(coeffs.y_min - 0.01, 25.0, 20001), [-3e38, 3e38, 0.0, coeffs.y_min]])
    for name, branch in coeffs.branches.items():
        want = compile_q(branch.sympy_expression())(y)
        q16 = getattr(gen, f"q16_{name}")
        with pytest.MonkeyPatch.context() as m:
            m.setattr(gen, "_log16", torch.log, raising=False)
            got = q16(torch.from_numpy(y)).numpy()
        np.testing.assert_allclose(got, want, rtol=1e-15, atol=1e-15)


def test_an_activation_without_a_16bit_family_aliases_q():
    for activation in sorted(set(DEFAULTS) - set(DEFAULTS_16BIT)):
        gen = importlib.import_module(f"invact._generated.{activation}")
        trit = importlib.import_module(f"invact._generated.{activation}_triton")
        assert gen.q16_right is gen.q_right and trit.q16_right is trit.q_right, activation
        assert gen.FAMILY_16BIT == gen.FAMILY


def test_monotone_module_has_one_branch_and_no_threshold():
    gen = importlib.import_module("invact._generated.softplus")
    assert (gen.MONOTONE, gen.THRESHOLD, gen.Y_MIN, gen.FAMILY) == (True, None, 0.0, "exact")
    assert list(gen.ERRORS) == list(gen.STORAGE_FLOOR) == ["right"]
    texts = {s: (GENERATED / f"softplus{s}.py").read_text() for s in ("", "_cpu", "_triton")}
    for suffix, name in (("", "q_right"), ("_cpu", "q_right_scalar"), ("_triton", "q_right")):
        assert f"def {name}(" in texts[suffix] and "q_left" not in texts[suffix], suffix
        # comments and docstrings (torch_forward passes torch's own softplus threshold, its cut-off at 20)
        prose = texts[suffix].replace("THRESHOLD = None\n", "").replace(", threshold=20)", ")").lower()
        assert "threshold" not in prose and "bit 0" not in prose and "bit 1" not in prose, suffix
        assert "monotone: one branch, no bit" in texts[suffix], suffix
    y = torch.tensor([0.0, 1e-3, 1.0, 30.0], dtype=torch.float64)
    torch.testing.assert_close(gen.q_right(y), -torch.expm1(-y), rtol=0, atol=2.3e-16)  # 1 - exp(-y)
    for activation in DEFAULTS:  # the others keep two branches and a threshold, with MONOTONE = False
        other = importlib.import_module(f"invact._generated.{activation}")
        assert other.MONOTONE == ACTIVATIONS[activation].monotone == (other.THRESHOLD is None)


def test_printers_on_small_expressions():
    e = sympy.Max(Y, -1) ** 3 + sympy.sqrt(Y) / (Y**2) + sympy.Piecewise((Y, Y < 0), (2 * Y, True))
    torch_body = function_body(e, TorchPrinter())
    assert "torch.clamp_min(y, -1.0)" in torch_body and "**" not in torch_body
    assert "torch.where((y < 0.0), y, 2.0*y)" in torch_body
    assert "torch.exp(-1.5 * torch.log(y))" in torch_body  # sympy folds sqrt(y)/y**2 into y**(-3/2)
    triton_body = function_body(e, TritonPrinter())
    assert "tl.maximum(-1.0, y)" in triton_body and "tl.exp(-1.5 * tl.log(y))" in triton_body
    scalar_body = function_body(sympy.exp(Y) + 1, ScalarPrinter())
    assert scalar_body.strip() == "return exp32(y) + F(1.0)"
    piecewise = function_body(sympy.Piecewise((Y, Y < 0), (2 * Y, True)), ScalarPrinter())
    assert piecewise.strip() == "return (y if (y < F(0.0)) else F(2.0)*y)"
    with pytest.raises(ValueError, match="free symbols besides y"):
        function_body(Y + sympy.Symbol("c0"), TorchPrinter())


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"swish2": "half"}', "defaults_16bit.json: 'swish2' is not in .*defaults.json"),
        ('{"gelu": 3}', "defaults_16bit.json: expected an object of activation -> family names"),
        ("{gelu", "defaults_16bit.json: not valid JSON"),
    ],
)
def test_a_bad_16bit_table_is_one_line(tmp_path, text, message):
    shutil.copytree(COEFFS, tmp_path / "coeffs")
    (tmp_path / "coeffs" / "defaults_16bit.json").write_text(text)
    with pytest.raises(ValueError, match=message):
        render_all(tmp_path / "coeffs")


def test_a_default_without_a_spec_entry_is_one_line(tmp_path):
    shutil.copytree(COEFFS, tmp_path / "coeffs")
    defaults = json.loads((COEFFS / "defaults.json").read_text()) | {"swish2": "floor"}
    (tmp_path / "coeffs" / "defaults.json").write_text(json.dumps(defaults))
    with pytest.raises(ValueError, match="defaults.json: 'swish2' has no entry in .*activations.json"):
        render_all(tmp_path / "coeffs")


def _shared_near_function(left: sympy.Expr, right: sympy.Expr):
    """codegen's q_near_scalar for two near pieces, executed from its printed source (or None)."""
    from codegen.numba_view import _shared_near

    source = _shared_near(left, right, ScalarPrinter())
    if source is None:
        return None
    from invact.activation._cpu_math import F, exp32, expm1_32, log32  # noqa: F401  (names the source uses)

    namespace = {"math": math, "F": F, "exp32": exp32, "log32": log32, "expm1_32": expm1_32}
    exec(compile(source, "q_near_scalar", "exec"), namespace)  # our own printed code, not user input
    return namespace["q_near_scalar"]


def test_shared_near_polynomial_selects_each_branchs_coefficients():
    # Two Horner sums in affine maps of one g = sqrt(y + 1), as the floor family writes them; sympy
    # distributes the innermost c*t, which the rewrite must fold back.
    g = sympy.sqrt(Y + 1)
    t_left, t_right = 3 * g - 1, sympy.Float(0.5) * g - 1
    left = 2 + t_left * (sympy.Float(0.25) + t_left * sympy.Float(-0.125))
    right = -1 + t_right * (3 + t_right * (sympy.Float(0.5) + t_right * 7))
    q_near = _shared_near_function(left, right)
    for y in (-0.75, 0.0, 0.3, 2.0):
        for piece, side in ((left, True), (right, False)):
            want = float(piece.subs(Y, y))
            assert q_near(np.float32(y), side) == pytest.approx(want, rel=1e-5, abs=1e-5), (y, side)


def test_no_shared_near_polynomial_without_a_common_variable():
    left = 1 + 2 * (3 * sympy.sqrt(Y + 1) - 1)
    right = 1 + 2 * (3 * sympy.sqrt(Y + 2) - 1)
    assert _shared_near_function(left, right) is None
    assert _shared_near_function(left, sympy.exp(Y)) is None


def test_the_tables_fill_the_lookups_the_runtime_reads():
    """codegen sizes each instruction set's near table by the entries of its lookup instruction, which
    invact.activation._lookup emits: the two must agree."""
    pytest.importorskip("numba")
    from codegen.near_tables import NEAR_TABLE_LOOKUPS
    from invact.activation import _lookup

    assert NEAR_TABLE_LOOKUPS == _lookup.LOOKUPS
