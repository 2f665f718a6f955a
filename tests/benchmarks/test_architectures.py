"""benchmarks/architectures.py: patch() against the unpatched model, per transformers model type."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    command = [sys.executable, str(ROOT / "benchmarks" / "architectures.py"), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT / "benchmarks")


def test_rows_for_two_models(tmp_path):
    out = tmp_path / "architectures.json"
    proc = _run("--only", "llama", "gpt2", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {r["model_type"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"llama", "gpt2"} and all(r["status"] == "ok" for r in rows.values())
    assert rows["llama"]["output_rel"] == 0  # every op patch() puts in a Llama forward is bitwise torch's
    assert all(r["memory_change"] < 0 and r["norms"] > 0 and r["activations"] > 0 for r in rows.values())
    assert out.with_suffix(".md").read_text().startswith("| model type |")


def test_a_model_too_large_at_tiny_settings_is_skipped_unbuilt(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import architectures

    monkeypatch.setattr(architectures, "MAX_PARAMETERS", 1000)
    row = architectures.measure("llama")
    assert row["status"] == "skipped" and "M parameters at the tiny settings" in row["reason"]


def test_unknown_model_type_is_refused():
    proc = _run("--only", "no_such_model", timeout=120)
    assert proc.returncode == 2 and "not a causal-LM or masked-LM model type here" in proc.stderr
