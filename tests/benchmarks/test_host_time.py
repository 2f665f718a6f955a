"""benchmarks/host_time.py --device cpu --small runs and writes its JSON (so the script never rots): the
four setups InvAct against torch, interleaved, and the layer-by-layer rows. Timings are not checked
here (the script's results are the evidence), only that each was taken and reported."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "benchmarks" / "host_time.py")
SMALL_ROUNDS = 3  # what --small sets (benchmarks/host_time.py)
SETUPS = ("GELU (4, 16)", "GELU MLP 16-64-16, batch 4", "SwiGLU MLP 16-32-16, batch 4, gated path",
          "SwiGLU MLP 16-32-16, batch 4, gated path by hooks")  # fmt: skip


def _run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=timeout)


def test_small_cpu_run(tmp_path):
    out = tmp_path / "host.json"
    proc = _run("--device", "cpu", "--small", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert {"device", "cpu", "torch", "threads", "batch", "calls", "rounds", "setups", "rows"} <= set(data)
    assert data["threads"] == 1 and data["batch"] == 4 and data["rounds"] == SMALL_ROUNDS
    assert data["cpu"] and data["cpu"] in data["device"]
    assert [row["setup"] for row in data["setups"]] == list(SETUPS)
    for row in data["setups"]:
        # every round timed both sides (interleaved); the medians and their ratio are what is reported
        assert len(row["torch_rounds_us"]) == len(row["invact_rounds_us"]) == SMALL_ROUNDS
        assert row["torch_us"] > 0 and row["invact_us"] > 0 and row["paired_ratio"] > 0
        assert row["ratio"] == pytest.approx(row["invact_us"] / row["torch_us"])
        assert f"| {row['setup']} | {row['torch_us']:.1f} | {row['invact_us']:.1f} |" in proc.stdout
    layers = [row["layer"] for row in data["rows"]]
    assert "InvAct GELU forward + backward, autograd on one thread" in layers
    assert all(row["us"] > 0 for row in data["rows"])
    assert "| setup | torch us | InvAct us | InvAct / torch |" in proc.stdout


@pytest.mark.parametrize("flag", ["--batch", "--threads"])
def test_bad_arguments(flag):
    proc = _run("--device", "cpu", flag, "0", timeout=120)
    assert proc.returncode == 2 and f"{flag} must be positive" in proc.stderr
