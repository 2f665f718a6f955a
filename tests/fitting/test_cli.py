"""invact-fit end to end: outputs, byte-stable reruns, one-line errors, no partial files."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import codegen.__main__ as codegen_main
import fitting.pipeline
import fitting.plot
from codegen.coeffs_json import load
from codegen.render import COEFFS, ROOT
from fitting.activations import ACTIVATIONS
from fitting.cli import MAX_SEED, _start_from, main
from fitting.families import FAMILIES, family_names, get_family


def _run(*args):
    return subprocess.run(
        [sys.executable, "-m", "fitting.cli", *args], capture_output=True, text=True, timeout=600
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["relu", "--family", "paper"],
            f"unknown activation 'relu' (choose from {', '.join(sorted(ACTIVATIONS))})",
        ),
        (["gelu", "--family", "magic"], f"unknown family 'magic' (choose from {', '.join(family_names())})"),
        (
            ["gelu", "--family", "exact"],
            "family 'exact' has no form for 'gelu': no closed form of f'(f^-1(y)) is given for it "
            "(exact_q in coeffs/activations.json)",
        ),
        *(
            (
                ["softplus", "--family", family],
                f"softplus is monotone (one branch, no bit), and family '{family}' fits two branches: "
                "use --family exact or --family floor or --family half",
            )
            for family in ("paper", "search")
        ),
        (
            ["softplus", "--family", "floor"],
            "family 'floor' fits a monotone activation bounded on both sides (CDF- or sigmoid-shaped, "
            "f' -> 0 at both ends); softplus has f' = 2.06e-09 at x = -20 and 1 at x = 20",
        ),
    ],
)
def test_unknown_names_fail_in_one_line(tmp_path, capsys, args, message):
    assert main([*args, "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err
    assert err == f"invact-fit: error: {message}\n"
    assert list(tmp_path.iterdir()) == []


def test_unwritable_output_fails_before_fitting(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["gelu", "--family", "paper", "--out", str(blocker / "sub" / "x.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not a directory" in err
    assert main(["gelu", "--family", "paper", "--out", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err


def test_corrupt_or_mismatched_init_fails_in_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{ not json")
    assert main(["gelu", "--family", "paper", "--init", str(bad), "--out", str(tmp_path / "o.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"invact-fit: error: {bad}: not valid JSON") and err.count("\n") == 1
    assert not (tmp_path / "o.json").exists()


@pytest.mark.slow
def test_full_run_writes_valid_json_byte_identically_and_a_plot(tmp_path):
    out, plot = tmp_path / "c" / "silu.json", tmp_path / "silu.png"
    first = _run("silu", "--family", "paper", "--out", str(out), "--plot", str(plot))
    assert first.returncode == 0, first.stderr
    assert "published" in first.stdout and "minimax" in first.stdout and "storage floor" in first.stdout
    data = out.read_bytes()
    coeffs = load(out)
    assert coeffs.provenance["command"] == "invact-fit silu --family paper"
    # No worse than the published coefficients (the paper's SiLU, measured: 8.3e-4 left, 2.9e-3 right).
    assert coeffs.branches["left"].errors["linf_fp32"] <= 8.3e-4
    assert coeffs.branches["right"].errors["linf_fp32"] <= 2.9e-3
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # --init from its own output, then a plain rerun: the plain rerun gives the same bytes.
    mismatch = _run("gelu", "--family", "paper", "--init", str(out), "--out", str(tmp_path / "g.json"))
    assert mismatch.returncode == 2 and "holds silu/paper, not gelu/paper" in mismatch.stderr
    again = _run("silu", "--family", "paper", "--out", str(out))
    assert again.returncode == 0 and out.read_bytes() == data
    assert sorted(p.name for p in out.parent.iterdir()) == ["silu.json"]
    assert json.loads(data)["schema"] == "invact-coeffs/1"


@pytest.mark.slow
def test_monotone_exact_fit_writes_one_branch_byte_identically(tmp_path):
    out = tmp_path / "softplus.json"
    first = _run("softplus", "--family", "exact", "--out", str(out))
    assert first.returncode == 0, first.stderr
    assert "exact *" in first.stdout and "lstsq" not in first.stdout and "better" not in first.stdout
    data = out.read_bytes()
    coeffs = load(out)
    assert coeffs.threshold is None and coeffs.monotone and list(coeffs.branches) == ["right"]
    right = coeffs.branches["right"]
    assert (right.expression, right.coefficients, right.flops) == ("-expm1(-y)", {}, 4)
    assert coeffs.provenance["selected"] == {"right": "exact"}
    # A closed form: float64 rounding only (measured linf 2.2e-16), far below the fp32 floor (2.2e-8).
    assert right.errors["linf_fp32"] <= 1e-15 < right.storage_floor["fp32"]
    assert _run("softplus", "--family", "exact", "--out", str(out)).returncode == 0
    assert out.read_bytes() == data


@pytest.mark.slow
def test_codegen_flag_regenerates_the_runtime_modules(tmp_path, monkeypatch, capsys):
    import codegen.__main__ as codegen_main

    monkeypatch.setattr(codegen_main, "GENERATED", tmp_path / "generated")
    assert main(["silu", "--family", "paper", "--out", str(tmp_path / "silu.json"), "--codegen"]) == 0
    written = sorted(p.name for p in (tmp_path / "generated").iterdir())
    assert "silu_triton.py" in written and "gelu_cpu.py" in written and "__init__.py" in written
    assert "wrote invact/_generated/silu.py" in capsys.readouterr().out


def test_codegen_adds_a_new_activation_to_the_defaults(tmp_path, monkeypatch, capsys):
    """A spec entry's second step: `invact-fit NAME --family exact --codegen` writes its coefficient
    file, adds it to defaults.json and generates it (here relu6, removed first from a copy of coeffs/)."""
    import codegen.__main__ as codegen_main
    import fitting.cli

    coeffs = tmp_path / "coeffs"
    shutil.copytree(COEFFS, coeffs)
    shutil.rmtree(coeffs / "relu6")
    defaults = json.loads((coeffs / "defaults.json").read_text())
    del defaults["relu6"]
    (coeffs / "defaults.json").write_text(json.dumps(defaults))
    monkeypatch.setattr(fitting.cli, "default_coeffs_dir", lambda: coeffs)
    monkeypatch.setattr(codegen_main, "COEFFS", coeffs)
    monkeypatch.setattr(codegen_main, "GENERATED", tmp_path / "generated")
    assert main(["relu6", "--family", "exact", "--codegen"]) == 0
    assert json.loads((coeffs / "defaults.json").read_text())["relu6"] == "exact"
    assert (coeffs / "relu6" / "exact.json").read_bytes() == (COEFFS / "relu6" / "exact.json").read_bytes()

    def body(path):  # without the header naming the source files, whose folder differs
        return [line for line in path.read_text().splitlines() if not line.startswith("# source:")]

    assert body(tmp_path / "generated" / "relu6.py") == body(ROOT / "invact" / "_generated" / "relu6.py")
    assert "added 'relu6': 'exact'" in capsys.readouterr().out
    # written elsewhere, it could not be generated: refused before any work, in one line
    del defaults["elu"]
    (coeffs / "defaults.json").write_text(json.dumps(defaults))
    assert main(["elu", "--family", "exact", "--codegen", "--out", str(tmp_path / "elu.json")]) == 2
    assert "elu is not in" in capsys.readouterr().err and not (tmp_path / "elu.json").exists()


# --- bad values fail at once, in one line ------------------------------------------------------------


def _one_line_exit(capsys, args) -> str:
    """argparse's refusal: SystemExit(2) and one line on stderr (no usage block, no traceback)."""
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("invact-fit: error: argument "), err
    return err


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--seed", "-5", f"must be between 0 and {MAX_SEED}, got -5"),
        ("--seed", str(MAX_SEED + 1), f"must be between 0 and {MAX_SEED}, got {MAX_SEED + 1}"),
        ("--seed", "1.5", "expected an integer, got '1.5'"),
        ("--max-flops", "0", "must be at least 1, got 0"),
        ("--max-flops", "-1", "must be at least 1, got -1"),
    ],
)
def test_bad_search_numbers_are_refused_by_argparse(tmp_path, capsys, flag, value, message):
    # --budget 1: were the value accepted, the search would run (briefly) and exit 0.
    args = ["gelu", "--family", "search", "--budget", "1", flag, value, "--out", str(tmp_path / "s.json")]
    assert f"argument {flag}: {message}" in _one_line_exit(capsys, args)
    assert list(tmp_path.iterdir()) == []


def test_unknown_family_lists_every_registered_family(tmp_path, capsys, monkeypatch):
    """The list is derived from the registry: a newly registered family shows up in the message."""
    monkeypatch.setitem(FAMILIES, "zeta", FAMILIES["paper"])
    assert main(["gelu", "--family", "magic", "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err
    assert err == (
        "invact-fit: error: unknown family 'magic' (choose from exact, floor, half, paper, search, zeta)\n"
    )


@pytest.mark.parametrize("flag", [["--plot", "x.png"], ["--codegen"], ["--init", "x.json"]])
def test_search_refuses_options_it_would_ignore(tmp_path, capsys, flag):
    out = tmp_path / "s.json"
    assert main(["gelu", "--family", "search", "--budget", "1", *flag, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err == f"invact-fit: error: {flag[0]} does not apply to --family search\n"
    assert list(tmp_path.iterdir()) == []


# --- nothing is written unless everything succeeded ----------------------------------------------------


def _no_fit(*args, **kwargs):
    raise AssertionError("the fit started although an option was invalid")


@pytest.mark.parametrize("plot", ["x.xyz", "x.PNG.docx", "plots/x.notaformat"])
def test_unknown_plot_format_fails_before_any_work(tmp_path, capsys, monkeypatch, plot):
    monkeypatch.setattr(fitting.pipeline, "fit_family", _no_fit)
    out = tmp_path / "c.json"
    assert main(["gelu", "--family", "paper", "--out", str(out), "--plot", str(tmp_path / plot)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"invact-fit: error: cannot write plot {tmp_path / plot}: format ")
    assert err.count("\n") == 1
    assert "is not one matplotlib writes; use one of" in err and "png" in err
    assert list(tmp_path.iterdir()) == []


def test_plot_that_fails_to_render_writes_nothing(tmp_path, capsys, monkeypatch):
    """The figure is rendered after the fit but before any file is written (softplus/exact: a fast fit)."""

    def broken(*args, **kwargs):
        raise RuntimeError("renderer broke")

    monkeypatch.setattr(fitting.plot, "figure_bytes", broken, raising=False)
    out, plot = tmp_path / "s.json", tmp_path / "s.png"
    assert main(["softplus", "--family", "exact", "--out", str(out), "--plot", str(plot)]) == 1
    assert capsys.readouterr().err == "invact-fit: error: RuntimeError: renderer broke\n"
    assert list(tmp_path.iterdir()) == []


def _coeffs_copy(tmp_path, monkeypatch) -> Path:
    """A copy of coeffs/ that `--codegen` renders from, and a scratch invact/_generated/."""
    coeffs = tmp_path / "coeffs"
    shutil.copytree(COEFFS, coeffs)
    monkeypatch.setattr(codegen_main, "COEFFS", coeffs)
    monkeypatch.setattr(codegen_main, "GENERATED", tmp_path / "generated")
    return coeffs


def test_codegen_failure_leaves_coeffs_unchanged(tmp_path, capsys, monkeypatch):
    coeffs = _coeffs_copy(tmp_path, monkeypatch)
    out = coeffs / "softplus" / "exact.json"
    out.write_text(out.read_text().replace("invact-fit softplus --family exact", "an older command"))
    before = out.read_bytes()

    def broken(*args, **kwargs):
        raise ValueError("printer broke")

    monkeypatch.setattr(codegen_main, "plan", broken)
    assert main(["softplus", "--family", "exact", "--out", str(out), "--codegen"]) == 1
    assert capsys.readouterr().err == "invact-fit: error: ValueError: printer broke\n"
    assert out.read_bytes() == before
    assert not (tmp_path / "generated").exists()


def test_codegen_renders_the_new_file(tmp_path, capsys, monkeypatch):
    """--codegen renders from the JSON about to be written (not the one on disk before it), so the
    generated header names the new file's sha256."""
    coeffs = _coeffs_copy(tmp_path, monkeypatch)
    out = coeffs / "softplus" / "exact.json"
    out.write_text(out.read_text().replace("invact-fit softplus --family exact", "an older command"))
    assert main(["softplus", "--family", "exact", "--out", str(out), "--codegen"]) == 0
    assert "wrote invact/_generated/softplus.py" in capsys.readouterr().out
    lines = (tmp_path / "generated" / "softplus.py").read_text().splitlines()
    header = next(line for line in lines if line.startswith("# source: ") and "exact.json" in line)
    assert header.endswith(f"(sha256 {hashlib.sha256(out.read_bytes()).hexdigest()})")
    assert "an older command" not in out.read_text()


# --- Ctrl-C -------------------------------------------------------------------------------------------

_INTERRUPT_ON_IMPORT = """
import sys

class Interrupt:  # Ctrl-C arriving while `{module}` is being imported
    def find_spec(self, name, path=None, target=None):
        if name == {module!r}:
            raise KeyboardInterrupt
        return None

sys.meta_path.insert(0, Interrupt())
from fitting.cli import main  # what the invact-fit console script does
sys.exit(main({args!r}))
"""


@pytest.mark.parametrize("module", ["rich", "numpy", "sympy", "scipy"])
def test_ctrl_c_while_importing_exits_130_in_one_line(tmp_path, module):
    args = ["gelu", "--family", "paper", "--out", str(tmp_path / "g.json")]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", _INTERRUPT_ON_IMPORT.format(module=module, args=args)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert (result.returncode, result.stderr) == (130, "invact-fit: interrupted\n")
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_during_the_fit_exits_130_in_one_line(tmp_path, capsys, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(fitting.pipeline, "fit_family", interrupted)
    assert main(["gelu", "--family", "paper", "--out", str(tmp_path / "g.json")]) == 130
    assert capsys.readouterr().err == "invact-fit: interrupted\n"
    assert list(tmp_path.iterdir()) == []


# --- --init -------------------------------------------------------------------------------------------

_FLOOR_FILES = sorted(COEFFS.glob("*/floor.json"))
_SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "path",
    [
        # The floor family builds its starts by fitting (about 5 s per activation on this machine):
        # gelu's runs every time (it was refused before: c10 sorts before c2), the others with the slow ones.
        *(pytest.param(p, marks=() if p.parent.name == "gelu" else _SLOW, id=f"{p.parent.name}/floor")
          for p in _FLOOR_FILES),
        *(pytest.param(p, id=f"{p.parent.name}/{p.stem}") for p in sorted(COEFFS.glob("*/*.json"))
          if p.stem != "floor" and p.name != "defaults.json"),
    ],
)  # fmt: skip
def test_init_accepts_every_committed_file(path):
    """Files store coefficients with sorted keys (c0, c1, c10, ..., c2); --init matches them by name and
    hands them over in the family's order, with the file's values."""
    coeffs = load(path)
    family = get_family(coeffs.family, coeffs.activation)
    start = _start_from(path, coeffs.activation, coeffs.family)
    for name, form in family.branches.items():
        assert list(start[name]) == list(form.start)
        assert start[name] == coeffs.branches[name].coefficients


def test_init_with_other_names_fails_in_one_line(tmp_path, capsys):
    doc = json.loads((COEFFS / "gelu" / "paper.json").read_text())
    right = doc["branches"]["right"]
    right["coefficients"]["c9"] = right["coefficients"].pop("c4")
    right["expression"] = right["expression"].replace("c4", "c9")
    init = tmp_path / "init.json"
    init.write_text(json.dumps(doc))
    assert main(["gelu", "--family", "paper", "--init", str(init), "--out", str(tmp_path / "o.json")]) == 2
    assert capsys.readouterr().err == (
        f"invact-fit: error: {init}: branches.right.coefficients: names differ from the family's "
        "(missing ['c4'], unexpected ['c9'])\n"
    )
    assert not (tmp_path / "o.json").exists()


@pytest.mark.slow
def test_init_from_the_committed_floor_file_fits(tmp_path):
    """The README's command (about 20 s here):
    invact-fit gelu --family floor --init coeffs/gelu/floor.json."""
    out = tmp_path / "gelu.json"
    init = Path("coeffs") / "gelu" / "floor.json"
    args = ["gelu", "--family", "floor", "--init", str(init), "--out", str(out)]
    result = subprocess.run(
        [sys.executable, "-m", "fitting.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr
    coeffs = load(out)
    assert coeffs.provenance["command"] == f"invact-fit gelu --family floor --init {init}"
    committed = load(ROOT / init)
    # The start is itself a measured candidate, so the chosen fit is no worse than the committed one
    # (measured: left 1.74e-6 vs 1.75e-6, right equal), with no tolerance needed.
    for name, branch in coeffs.branches.items():
        assert branch.errors["linf_fp32"] <= committed.branches[name].errors["linf_fp32"]
