"""The targets benchmark script runs (small) and writes its JSON; it is not a timed test."""

import json
import subprocess
import sys
from pathlib import Path

from fitting.activations import ACTIVATIONS

ROOT = Path(__file__).resolve().parents[2]


def test_small_run_writes_results(tmp_path):
    out = tmp_path / "t.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "targets.py"), "--points", "2000", "--repeats", "1"]
    proc = subprocess.run([*cmd, "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    rows = [(r["activation"], r["branch"]) for r in data["rows"]]
    assert rows == [(name, b) for name, act in ACTIVATIONS.items() for b in act.branches]
    assert all(r["seconds"] > 0 for r in data["rows"])
    assert "| gelu | left |" in proc.stdout


def test_bad_arguments_fail(tmp_path):
    cmd = [sys.executable, str(ROOT / "benchmarks" / "targets.py"), "--points", "0"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "must be positive" in proc.stderr
