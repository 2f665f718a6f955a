"""benchmarks/saved_bytes.py: every activation's row, and the committed table against the spec."""

import json
import subprocess
import sys
from pathlib import Path

from invact.activation.activations import ACTIVATIONS

ROOT = Path(__file__).resolve().parents[2]
FP32_BYTES = 4


def test_each_activation_saves_at_most_its_bit(tmp_path):
    script = str(ROOT / "benchmarks" / "saved_bytes.py")
    cmd = [sys.executable, script, "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads((tmp_path / "saved_bytes.json").read_text())
    assert sorted(rows) == sorted(ACTIVATIONS)
    for name, r in rows.items():
        assert r["invact_bits"] == (0 if ACTIVATIONS[name].monotone else 1 / 8), name  # one bit, or none
        assert r["invact_precision_bit"] == 0, name
        assert r["torch"] >= FP32_BYTES, name  # torch holds the input, or more
    assert "| gelu | 2 | 4 | 0.125 | 0 |" in (tmp_path / "saved_bytes.md").read_text()
