"""The step planner's committed results and the figures the README and docs quote from them:
benchmarks/plan_fits.py (the longest sequence that fits) and benchmarks/step_plan.py (predicted
against real CPU steps)."""

import importlib
import json
import sys
import weakref
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
RESULTS = BENCHMARKS / "results"


def _module(name: str):
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


def _text(page: str) -> str:
    return " ".join((ROOT / page).read_text().split())


def test_the_fits_table_is_its_result_and_the_readmes():
    result = json.loads((RESULTS / "plan_fits.json").read_text())
    table = _module("plan_fits").table(result)
    assert (RESULTS / "plan_fits.md").read_text() == table + "\n"
    readme = (ROOT / "README.md").read_text()
    assert table in readme


def test_the_qlora_fits_table_is_its_result_and_the_docs():
    """The docs' QLoRA rows (benchmarks/plan_fits.py --models Llama-3.1-8B --recipes qlora, included from
    its markdown), each answer's peak within its budget, and the seconds each search took quoted."""
    result = json.loads((RESULTS / "plan_fits_qlora.json").read_text())
    table = _module("plan_fits").table(result)
    assert (RESULTS / "plan_fits_qlora.md").read_text() == table + "\n"
    assert '--8<-- "benchmarks/results/plan_fits_qlora.md"' in _text("docs/patching.md")
    for plan in result["plans"]:
        assert {r["recipe"] for r in plan["rows"]} == {"qlora"}
        assert all(r["peak_bytes"] <= plan["fits_bytes"] for r in plan["rows"] if r["seq"]), plan["budget"]
    seconds = {p["budget"]: p["seconds"] for p in result["plans"]}
    assert f"{seconds['24GiB']:.1f} s for the QLoRA search in 24 GiB" in _text("docs/patching.md")


def test_the_fits_timings_and_step_counts_quoted_are_the_results():
    result = json.loads((RESULTS / "plan_fits.json").read_text())
    seconds = {(p["model"], p["budget"]): p["seconds"] for p in result["plans"]}
    peaks = [r["peaks"] for p in result["plans"] for r in p["rows"]]
    docs = [f"lands in {min(peaks)} to {max(peaks)} planned steps a row",
            f"{seconds['Llama-3.2-1B', '24GiB']:.1f} s for the Llama-3.2-1B shape in 24 GiB",
            f"{seconds['Llama-3.1-8B', '80GiB']:.1f} s for the Llama-3.1-8B shape in 80 GiB"]  # fmt: skip
    assert not [f for f in docs if f not in _text("docs/patching.md")]


def test_the_fits_table_answers_every_row_within_its_budget():
    result = json.loads((RESULTS / "plan_fits.json").read_text())
    for plan in result["plans"]:
        for row in plan["rows"]:
            if row["seq"]:
                assert row["peak_bytes"] <= plan["fits_bytes"], (plan["model"], row)


def test_the_step_plan_table_and_its_quoted_figures_are_the_result():
    result = json.loads((RESULTS / "step_plan_cpu.json").read_text())
    assert (RESULTS / "step_plan_cpu.md").read_text() == _module("step_plan").table(result) + "\n"
    rows = [r for r in result["rows"] if r["ratio"] is not None]
    eager = [r["ratio"] for r in rows if not r["patched"]]
    inside = sum(1 for r in rows if 0.98 <= r["ratio"] <= 1.05)
    exact = sum(1 for r in rows if r["predicted_bytes"] == r["measured_bytes"])
    ratios = [r["ratio"] for r in rows]
    figures = [
        f"{min(eager):.4f}-{max(eager):.4f}",
        f"{inside} of {len(result['rows'])} within 0.98-1.05",
    ]
    docs = figures + [f"{exact} of the {len(result['rows'])} rows", f"more than {max(ratios):.3f} high",
                      f"down to {min(ratios):.3f}"]  # fmt: skip
    missing = [f for f in docs if f not in _text("docs/patching.md")]
    assert not missing, f"docs/patching.md does not show {missing}"


@pytest.mark.parametrize("guess", [128, 1000, 4096, 5000, 5120, 9000, 40000])
@pytest.mark.parametrize("limit", [100, 128, 5000, 5120, 8191, 32768, 10**6])
def test_the_gpu_checks_bisection_finds_the_last_multiple_that_fits(guess, limit):
    """benchmarks/step_plan_gpu.py's boundary, which each real step on a GPU costs a probe of: from any
    guess, the largest multiple of 128 up to the cap (32768) that fits, 0 where none does."""
    boundary = _module("step_plan_gpu").boundary
    multiple, cap = 128, 32768
    found, probes = boundary(lambda x: x <= limit, guess, multiple, cap)
    assert found == (min(limit, cap) // multiple * multiple if limit >= multiple else 0)
    # the bracket's steps of a tenth of the guess (at least one multiple), then a bisection
    stride = max(multiple, int(guess * 0.1) // multiple * multiple)
    steps = abs(min(limit, cap) - guess) // stride + 2
    assert probes <= steps + max(1, stride // multiple).bit_length() + 1, probes


def _oom_holding(held: list) -> None:
    big = torch.empty(2**20)  # noqa: F841 - what the failing step's frame holds when it raises
    held.append(weakref.ref(big))
    raise torch.cuda.OutOfMemoryError("CUDA out of memory (a stand-in)")


def test_an_out_of_memory_probe_leaves_nothing_behind():
    """benchmarks/step_plan_gpu.py's attempt: a probe that runs out of memory is False, and the tensors
    its frames held are freed by the time it returns (the exception dropped first), which a GPU's
    allocated bytes then show; a probe that keeps memory raises. On CPU tensors, with a stand-in for
    torch.cuda.memory_allocated."""
    attempt, kept = _module("step_plan_gpu").attempt, _module("step_plan_gpu").KeptAfterOOM
    held: list = []
    assert attempt(lambda: _oom_holding(held), allocated=lambda: 0) is False
    assert held and held[0]() is None  # freed
    assert attempt(lambda: None, allocated=lambda: 0) is True
    leaked = iter([0, 512])  # before, after: 512 bytes more after the failed probe
    with pytest.raises(kept, match="512 bytes still allocated"):
        attempt(lambda: _oom_holding([]), allocated=lambda: next(leaked))
