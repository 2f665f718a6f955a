"""benchmarks/gpu_quick.py (`make gpu-quick`): --small runs every part on a CPU and writes its JSON, so the
short GPU check never rots between GPU sessions; without --small and without CUDA it refuses in one
line. The figures themselves come from a GPU run (benchmarks/results/gpu_quick_<device>.json)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "benchmarks" / "gpu_quick.py")
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_quick  # noqa: E402


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=900)


def test_small_run_writes_every_part(tmp_path):
    out = tmp_path / "quick.json"
    # a budget no part reaches: which parts run is the wall clock's (a busy machine's run left "host" out),
    # and the budget's own tests move the clock by hand (below)
    proc = _run("--small", "--rounds", "2", "--budget", "1e9", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    llama = data["llama"]
    for variant in gpu_quick.VARIANTS:  # each variant timed by the wall clock and the profiler
        assert llama[f"{variant}_wall_ms"] > 0 and llama[f"{variant}_busy_ms"] > 0
        assert len(llama[f"{variant}_wall_rounds_ms"]) == 2
    assert llama["compile_patch_wall_ratio"] == pytest.approx(
        llama["compile_patch_wall_ms"] / llama["compile_wall_ms"]
    )
    assert {"eager", "invact"} <= set(data["loss"]["variants"])
    assert (
        data["loss"]["variants"]["invact"]["held_after_forward_mib"]
        < data["loss"]["variants"]["eager"]["held_after_forward_mib"]
    )
    loss = data["loss"]
    assert {"eager compiled", "invact compiled"} <= set(loss["variants"])
    assert loss["floor_ms"] == pytest.approx(sum(m["ms"] for m in loss["matmuls"].values()))
    assert {row["kind"] for row in data["host"]} == {"activation", "mlp", "norm", "loss", "step"}
    assert data["profile"]["top"]
    # the whole steps: every model in every variant, named as the consumers read them
    steps = data["steps"]
    assert {(r["model"], r["variant"]) for r in steps} == {
        (m, v) for m in gpu_quick.STEP_MODELS for v in ("eager", "patch", "compile", "compile+patch")
    }
    assert all(r["ms"] > 0 and "peak_bytes" in r for r in steps)
    assert data["skipped"] == []
    assert "| compile + patch |" in proc.stdout and "top host costs" in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where no CUDA device exists")
def test_refuses_without_cuda():
    proc = _run()
    assert proc.returncode == 2 and "no CUDA device is visible" in proc.stderr


def test_check_refuses_a_figure_above_the_peak():
    row = {"flops": 1.5e12, **{f"{v}_{w}_ms": 1.0 for v in gpu_quick.VARIANTS for w in ("wall", "busy")}}
    result = {"peak_tflops": 989.5, "llama": row, "loss": {"variants": {"eager": {"tflops": 1.0}}}}
    assert len(gpu_quick.check(result)) == 2 * len(
        gpu_quick.VARIANTS
    )  # 1500 TFLOP/s on every figure, then 750
    row.update({f"{v}_{w}_ms": 2.0 for v in gpu_quick.VARIANTS for w in ("wall", "busy")})
    assert gpu_quick.check(result) == []


def test_check_takes_a_loss_only_result():
    """--loss-only's result has no Llama-shaped step: check() judges its loss figures alone."""
    result = {
        "peak_tflops": 989.5,
        "loss": {"variants": {"eager": {"tflops": 400.0}, "invact": {"tflops": 1200.0}}},
    }
    assert gpu_quick.check(result) == ["loss invact: 1200 TFLOP/s, above the 989.5 peak"]


class _Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_budget_starts_a_unit_only_where_the_longest_of_its_kind_fits():
    clock = _Clock()
    budget = gpu_quick.Budget(100.0, clock=clock)
    assert budget.allows("compiled step", "first")  # none of its kind measured yet: it starts
    clock.now = 40.0
    budget.done("compiled step", 40.0)
    assert budget.allows("compiled step", "second")  # 60 s left, the longest took 40
    clock.now = 70.0
    assert budget.allows("eager step", "an eager row")  # its own kind: nothing measured
    assert not budget.allows("compiled step", "third")  # 30 s left, the longest took 40
    clock.now = 101.0
    assert not budget.allows("eager step", "late")  # past the budget, whatever its kind
    assert budget.skipped == [{"what": "third", "seconds_left": 30.0}, {"what": "late", "seconds_left": -1.0}]


def test_steps_left_out_by_the_budget_are_listed_and_the_rest_measured(monkeypatch):
    """step_rows asks the budget before each row: with room for no compiled row after the first, the
    later compiled rows are skipped by name and the eager ones still run."""
    clock = _Clock()
    budget = gpu_quick.Budget(100.0, clock=clock)
    budget.done("compiled step", 1000.0)  # as if a compiled row had taken longer than the budget
    calls = []

    def fake_row(name, variant, *args, **kwargs):
        calls.append((name, variant))
        return {"model": name, "variant": variant, "ms": 1.0, "peak_bytes": None}

    monkeypatch.setattr(gpu_quick, "_step_row", fake_row)
    monkeypatch.setattr(gpu_quick.torch._dynamo, "reset", lambda: None)
    rows = gpu_quick.step_rows(True, "cpu", torch.bfloat16, 1, budget=budget)
    assert [(r["model"], r["variant"]) for r in rows] == [
        (m, v) for m in gpu_quick.STEP_MODELS for v in ("eager", "patch")
    ]
    assert [x["what"] for x in budget.skipped] == [
        f"{m} {v}" for m in gpu_quick.STEP_MODELS for v in ("compile", "compile+patch")
    ]


def test_refuses_a_budget_that_is_not_positive():
    proc = _run("--small", "--budget", "0")
    assert proc.returncode == 2 and "--budget must be a positive number of seconds" in proc.stderr


def test_budget_judges_a_part_not_yet_run_by_its_known_seconds():
    clock = _Clock()
    budget = gpu_quick.Budget(100.0, clock=clock, known={"part step": 67.0})
    clock.now = 40.0
    assert not budget.allows("part step", "part step")  # 60 s left: the known 67 s would not fit
    assert budget.allows("part host", "part host")  # nothing known of it
    assert set(gpu_quick.PART_SECONDS) == {f"part {p}" for p in gpu_quick.PARTS if p != "steps"}
