"""The GPU figures quoted in the README and docs are the committed GPU results (benchmarks/results/,
written by `make gpu` on a machine that CI never has): every row of the quoted tables is found, to
the digit shown, in the JSON of its device and dtype."""

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
MIB = 2**20
DTYPE_FILES = {"fp32": "train_memory_h100-80gb-hbm3.json",
               "bf16": "train_memory_h100-80gb-hbm3_bfloat16.json"}  # fmt: skip


def _table_rows(text: str, heading: str) -> list[list[str]]:
    """The cells of each body row of the first markdown table whose header row starts with `heading`."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(heading))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def _result_row(label: str, dtype: str) -> dict:
    """The JSON row whose model the table's label names (the label starts with the model's name)."""
    rows = json.loads((RESULTS / DTYPE_FILES[dtype]).read_text())["rows"]
    (row,) = [r for r in rows if label.startswith(r["model"].split(" (")[0])]
    return row


def _mib(nbytes: int) -> str:
    return f"{nbytes / MIB:,.0f} MiB"


@pytest.mark.parametrize(
    ("page", "heading", "columns"),
    [
        ("docs/results/memory.md", "| model | dtype | saved, torch |", ("saved", "peak", "share")),
    ],
)
def test_the_gpu_peak_memory_tables_are_the_committed_results(page, heading, columns):
    rows = _table_rows((ROOT / page).read_text(), heading)
    assert rows, f"{page}: no table under {heading!r}"
    for label, dtype, *cells in rows:
        result = _result_row(label, dtype)
        expected = []
        for column in columns:
            if column == "share":
                expected.append(f"{result['peak_drop_share']:.0%}")
            else:
                key = f"{column}_bytes"
                expected += [_mib(result["torch"][key]), _mib(result["invact"][key])]
        assert cells == expected, f"{page}: {label} ({dtype})"


def _speed_rows(name: str) -> dict:
    return {r["name"]: r for r in json.loads((RESULTS / name).read_text())["rows"]}


def test_the_second_gpu_runs_bf16_time_table_is_the_committed_result():
    text = (ROOT / "docs" / "results" / "speed-gpu.md").read_text()
    rows = _table_rows(text, "| setup | torch (ms) | InvAct | GPU busy, torch (ms) |")
    results = _speed_rows("speed_h100-80gb-hbm3_bfloat16.json")
    assert [name for name, *_ in rows] == list(results)
    for name, *cells in rows:
        r = results[name]
        if "error" in r:
            assert cells[0] == "out of memory" and r["error"].startswith("out of memory"), name
            continue
        assert cells == [f"{r['torch_ms']:.3f}", f"{r['invact_ratio']:.2f}x", f"{r['torch_gpu_ms']:.3f}",
                         f"{r['invact_gpu_ratio']:.2f}x", f"{r['compile_ms']:.3f}",
                         f"{r['invact_compile_ratio']:.2f}x"], name  # fmt: skip


def test_the_gpu_quick_figures_are_the_committed_results():
    """The README's eager-and-compiled table and the docs' gpu-quick section come from the committed
    gpu-quick results (benchmarks/gpu_quick.py on the H200): the docs hold its tables as the script
    prints them, the README its figures to the digit shown."""
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_quick

    new = json.loads((RESULTS / "gpu_quick_h200.json").read_text())
    main = json.loads((RESULTS / "gpu_quick_h200_main.json").read_text())
    loss = json.loads((RESULTS / "gpu_quick_loss_h200.json").read_text())["loss"]
    docs = (ROOT / "docs" / "results" / "speed-gpu.md").read_text()
    for table in (gpu_quick.llama_report(main), gpu_quick.llama_report(new), gpu_quick.loss_report(loss)):
        assert table in docs
    readme_rows = _table_rows((ROOT / "README.md").read_text(), "| setup | torch | invact | torch.compile |")
    llama, head, _ = readme_rows
    r = new["llama"]
    assert llama[1:] == [f"{r['eager_wall_ms']:.2f} ms", f"{r['patch_wall_ratio']:.2f}x",
                         f"{r['compile_wall_ms']:.2f} ms",
                         f"{r['compile_patch_wall_ratio']:.2f}x"]  # fmt: skip
    quick = json.loads((RESULTS / "gpu_quick_h200_steps.json").read_text())
    v = quick["loss"]["variants"]
    assert head[1:] == [f"{v['eager']['ms']:.2f} ms", f"{v['invact']['ratio_to_eager']:.2f}x",
                        f"{v['eager compiled']['ms']:.2f} ms",
                        f"{v['invact compiled']['ms'] / v['eager compiled']['ms']:.2f}x"]  # fmt: skip
    readme = " ".join((ROOT / "README.md").read_text().split())
    steps = {r["variant"]: r for r in quick["steps"] if r["model"].startswith("Llama-3.2-1B")}
    assert (f"| {steps['eager']['ms']:.1f} ms | {steps['patch']['ms'] / steps['eager']['ms']:.2f}x | "
            f"{steps['compile']['ms']:.1f} ms |") in readme  # fmt: skip
    gib = {k: f"{r['peak_bytes'] / 2**30:.2f}" for k, r in steps.items()}
    peaks = f"{gib['patch']} GiB patched against eager's {gib['eager']} and compiled torch's {gib['compile']}"
    assert f"peaks at {peaks}" in readme
    assert f"holds {v['invact']['held_after_forward_mib']:.0f} MiB after its forward" in readme
    for table in (gpu_quick.loss_report(quick["loss"]).strip(), gpu_quick.steps_report(quick["steps"])):
        assert table in docs
