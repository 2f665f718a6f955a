"""invact-fit end to end: outputs, byte-stable reruns, one-line errors, no partial files."""

import json
import subprocess
import sys

import pytest

from codegen.coeffs_json import load
from fitting.cli import main


def _run(*args):
    return subprocess.run(
        [sys.executable, "-m", "fitting.cli", *args], capture_output=True, text=True, timeout=600
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["relu", "--family", "paper"],
            "unknown activation 'relu' (choose from gelu, gelu_tanh, mish, quick_gelu, silu, softplus)",
        ),
        (["gelu", "--family", "magic"], "unknown family 'magic' (choose from exact, floor, paper)"),
        (
            ["gelu", "--family", "exact"],
            "family 'exact' has no form for 'gelu': no closed form of f'(f^-1(y)) is registered for it "
            "(Activation.exact_q, monotone activations only)",
        ),
        *(
            (
                ["softplus", "--family", family],
                f"softplus is monotone (one branch, no bit), and family '{family}' fits two branches: "
                "use --family exact",
            )
            for family in ("paper", "floor", "search")
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
    # The bar: no worse than the published coefficients (FACTS.md: 8.3e-4 left, 2.9e-3 right).
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
    assert (right.expression, right.coefficients, right.flops) == ("1 - exp(-y)", {}, 4)
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
