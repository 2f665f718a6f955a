"""benchmarks/speed.py --small runs on CPU and writes its JSON (so the script never rots)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_small_cpu_run(tmp_path):
    out = tmp_path / "speed.json"
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "speed.py"),
        "--device",
        "cpu",
        "--small",
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert {"device", "torch", "triton", "dtype", "rows"} <= set(data)
    assert len(data["rows"]) == 4
    for row in data["rows"]:
        assert row["torch_ms"] > 0 and row["invact_ms"] > 0 and row["precision_bit_ms"] > 0
    assert "| gelu (4096 elements) |" in proc.stdout
