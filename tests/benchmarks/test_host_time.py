"""benchmarks/host_time.py --device cpu --small runs and writes its JSON (so the script never rots): every
op kind's setups InvAct against torch, eager and compiled, interleaved, the compiled patched step's
profile, and the layer-by-layer rows. Timings are not checked here (the script's results are the
evidence), only that each was taken and reported."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "benchmarks" / "host_time.py")
SMALL_ROUNDS = 3  # what --small sets (benchmarks/host_time.py)
KINDS = ("activation", "mlp", "norm", "loss", "step")  # invact.kinds' op kinds, and a whole model's step


def _run(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("host") / "host.json"
    proc = _run("--device", "cpu", "--small", "--profile", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    return proc, json.loads(out.read_text())


def test_small_cpu_run(small_run):
    proc, data = small_run
    assert {"device", "cpu", "torch", "threads", "batch", "calls", "rounds", "setups", "rows"} <= set(data)
    assert data["threads"] == 1 and data["batch"] == 4 and data["rounds"] == SMALL_ROUNDS
    assert data["cpu"] and data["cpu"] in data["device"]
    for row in data["setups"]:
        # every round timed both sides (interleaved); the medians and their ratio are what is reported
        assert len(row["torch_rounds_us"]) == len(row["invact_rounds_us"]) == SMALL_ROUNDS
        assert row["torch_us"] > 0 and row["invact_us"] > 0 and row["paired_ratio"] > 0
        assert row["ratio"] == pytest.approx(row["invact_us"] / row["torch_us"])
        mode = "compiled" if row["compiled"] else "eager"
        assert f"| {row['kind']} | {row['setup']} | {mode} | {row['torch_us']:.1f} |" in proc.stdout
    layers = [row["layer"] for row in data["rows"]]
    assert "InvAct GELU forward + backward, autograd on one thread" in layers
    assert all(row["us"] > 0 for row in data["rows"])
    assert "| op kind | setup | mode | torch us | InvAct us | InvAct / torch |" in proc.stdout


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_timed(small_run, kind, compiled):
    _, data = small_run
    assert any(row["kind"] == kind and row["compiled"] == compiled for row in data["setups"])


def test_profile_of_the_compiled_step(small_run):
    proc, data = small_run
    profile = data["profile"]
    assert profile["top"] and all(r["self_us_per_step"] >= 0 for r in profile["top"])
    assert all(r["name"].startswith("invact::") for r in profile["invact_ops"])
    assert "invact op calls per compiled step" in proc.stdout


@pytest.mark.parametrize("flag", ["--batch", "--threads"])
def test_bad_arguments(flag):
    proc = _run("--device", "cpu", flag, "0", timeout=120)
    assert proc.returncode == 2 and f"{flag} must be positive" in proc.stderr


def test_docs_quote_the_committed_step_ratios():
    """docs/patching.md states the tiny Llama step's ratios (eager and compiled) of the committed
    benchmarks/results/host_time_cpu.json, as `python benchmarks/host_time.py` printed them."""
    data = json.loads((ROOT / "benchmarks" / "results" / "host_time_cpu.json").read_text())
    ratios = {row["compiled"]: row["ratio"] for row in data["setups"] if row["kind"] == "step"}
    text = " ".join((ROOT / "docs" / "patching.md").read_text().split())
    assert f"`benchmarks/results/host_time_cpu.json`: {ratios[True]:.2f}x" in text
    assert f"eager `patch()` {ratios[False]:.2f}x eager's" in text
