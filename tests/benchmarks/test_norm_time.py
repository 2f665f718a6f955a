"""benchmarks/norm_time.py --small runs and writes one row per norm variant and dtype."""

import json
import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_small_run(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "norm_time.json"
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "norm_time.py"),
        "--small",
        "--device",
        "cpu",
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT / "benchmarks")
    assert proc.returncode == 0, proc.stderr
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from norm_time import classes

    result = json.loads(out.read_text())
    rows = result["rows"]
    if platform.libc_ver()[0] == "glibc":  # its malloc thresholds fixed (the benchmark's docstring)
        assert result["allocator"].startswith("glibc malloc, mmap threshold 32 MiB")
    assert all(r["torch_faults_per_call"] >= 0 and r["invact_faults_per_call"] >= 0 for r in rows)
    assert sorted({r["variant"] for r in rows}) == sorted(classes())
    assert len(rows) == 2 * len(classes()) and all(r["torch_ms"] > 0 and r["invact_ms"] > 0 for r in rows)
    assert "| layer (LayerNorm) | float32 |" in proc.stdout


def test_bad_arguments():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "norm_time.py"), "--rows", "0"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT / "benchmarks")  # fmt: skip
    assert proc.returncode == 2 and "--rows must be positive" in proc.stderr
