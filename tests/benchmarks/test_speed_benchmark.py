"""benchmarks/speed.py --device cpu --small runs and writes its JSON (so the script never rots)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "benchmarks" / "speed.py")
ALLOCATORS = ("the C library's malloc", "tcmalloc", "jemalloc", "mimalloc")  # what speed.allocator names


def test_small_cpu_run(tmp_path):
    out = tmp_path / "speed.json"
    proc = subprocess.run([sys.executable, SCRIPT, "--device", "cpu", "--small", "--out", str(out)],
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert {"device", "torch", "triton", "dtype", "rows", "first_call_s"} <= set(data)
    names = [row["name"] for row in data["rows"]]
    for setup in ("gelu (", "silu (", "Linear+GELU", "MLP", "GeGLU", "BERT-base", "Llama-3.1-8B-shaped"):
        assert any(name.startswith(setup) for name in names), setup
    for row in data["rows"]:
        assert row["torch_ms"] > 0 and row["invact_ms"] > 0 and row["precision_bit_ms"] > 0
        # what each time implies (benchmarks/physics.py): FLOPs and a lower bound of bytes per step
        assert row["flops"] >= 0 and row["min_bytes"]["torch"] > 0 and row["input_shapes"]
        assert set(row["tflops"]) == set(row["gbps"]) == {"torch_ms", "invact_ms", "precision_bit_ms"}
        assert row["gbps"]["torch_ms"] == pytest.approx(row["min_bytes"]["torch"] / row["torch_ms"] / 1e6)
    linear = next(row for row in data["rows"] if row["name"] == "Linear+GELU (64 x 32)")
    assert linear["flops"] == 3 * 2 * 64 * 32 * 32  # forward, and backward's dx and dW products
    assert linear["tflops"]["invact_ms"] == pytest.approx(linear["flops"] / linear["invact_ms"] / 1e9)
    assert data["physics"]["peak"] is None and "not checked" in data["physics"]["note"]
    assert "| torch: TFLOP/s, GB/s |" in proc.stdout and "rows not checked against a peak" in proc.stdout
    assert "| GeGLU (64, 32 -> 128) |" in proc.stdout
    assert all(row["torch_page_faults"] >= 0 and row["invact_system_ms"] >= 0 for row in data["rows"])
    assert "page faults per step" in proc.stdout and data["allocator"] in ALLOCATORS
    first = data["first_call_s"]
    assert set(first) == {"cold", "warm", "warm_runs"} and first["cold"] > 0 and first["warm"] > 0
    assert min(first["warm_runs"]) <= first["warm"] <= max(first["warm_runs"]) and min(first["warm_runs"]) > 0
    bandwidth = {row["activation"]: row for row in data["cpu_backward"]}
    assert "gelu" in bandwidth and all(row["same_bytes_ms"] > 0 for row in bandwidth.values())
    assert all(row["kernel_ms"] > 0 and row["kernel_ratio_to_same_bytes"] > 0 for row in bandwidth.values())
    assert all(row["kernel_from_memory_ms"] > 0 and row["kernel_ratio_from_memory"] > 0
               for row in bandwidth.values())  # fmt: skip
    # the read between calls "from memory" covers the last-level cache several times over (sysfs's size)
    assert all(row["evict_bytes"] >= 2 * data["last_level_cache_bytes"] for row in bandwidth.values())
    assert "From memory (each call timed after reading" in proc.stdout


@pytest.mark.parametrize(
    ("sizes", "expected"),
    [({"index0": "32K", "index2": "1024K", "index3": "32768K"}, 32 * 2**20), ({"index3": "2M"}, 2 * 2**20),
     ({"index0": "48K", "index1": "unknown"}, 48 * 2**10), ({}, 0)],
)  # fmt: skip
def test_last_level_cache_bytes_reads_sysfs_sizes(tmp_path, monkeypatch, sizes, expected):
    """The largest size among sysfs's cache entries, in bytes; what it cannot read counts for nothing."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from speed import last_level_cache_bytes

    for index, size in sizes.items():
        (tmp_path / index).mkdir()
        (tmp_path / index / "size").write_text(size + "\n")
    assert last_level_cache_bytes(tmp_path) == expected


def test_bad_arguments():
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--repeats", "0"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2 and "must be positive" in proc.stderr


def test_small_cpu_run_with_compile(tmp_path):
    """--compile adds torch.compile of the torch model and of InvAct's, and InvAct's ratio to it."""
    out = tmp_path / "speed.json"
    args = ["--device", "cpu", "--small", "--compile", "--only", "Linear", "--out", str(out)]
    proc = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr
    (row,) = json.loads(out.read_text())["rows"]
    assert row["compile_ms"] > 0 and row["invact_compile_ms"] > 0 and row["invact_compile_ratio"] > 0
    assert "| InvAct + torch.compile (ms) |" in proc.stdout


def test_device_busy_ms_sums_the_ops_of_the_calls(monkeypatch):
    """The profiler-based busy time speed.py reports per CUDA row, exercised on CPU ops: nothing for
    no work, something for a matrix product."""
    import torch

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from timing import device_busy_ms

    a = torch.randn(64, 64)
    assert device_busy_ms(lambda: None, 3, "cpu") == 0
    assert device_busy_ms(lambda: torch.mm(a, a), 3, "cpu") > 0


def test_counting_sees_each_fresh_page_a_step_touches(monkeypatch):
    """The page faults speed.py reports per CPU step: a step that writes one byte into each page of a
    fresh anonymous mapping (huge pages refused, so each page faults alone) takes at least one fault
    a page, and the usage of each call is appended."""
    import mmap

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from speed import _counting

    pages = 2048

    def touch():
        memory = mmap.mmap(-1, pages * mmap.PAGESIZE)
        memory.madvise(mmap.MADV_NOHUGEPAGE)
        for page in range(pages):
            memory[page * mmap.PAGESIZE] = 1
        memory.close()

    usage = []
    step = _counting(touch, usage)
    step()
    step()
    assert len(usage) == 2 and all(faults >= pages and system >= 0 for faults, system in usage)


def test_the_compile_ratios_in_the_docs_are_the_committed_result():
    """docs/results/speed-cpu.md quotes each row of speed_cpu_compile.json: compile + patch() over
    compile alone, with its quartiles."""
    import json

    result = json.loads((ROOT / "benchmarks" / "results" / "speed_cpu_compile.json").read_text())
    text = " ".join((ROOT / "docs" / "results" / "speed-cpu.md").read_text().split())
    for row in result["rows"]:
        q1, q3 = row["invact_compile_ratio_quartiles"]
        assert f"{row['invact_compile_ratio']:.3f}x ({q1:.2f}-{q3:.2f})" in text, row["name"]


def test_rows_are_released_one_by_one_and_an_out_of_memory_row_keeps_the_others(monkeypatch):
    """main() times the first call in a fresh interpreter before any row holds device memory, reports
    a row that runs out of memory as an error row, and releases each row (Dynamo's frames, cached
    blocks) only once no exception is being handled: a live traceback would keep the row's tensors."""
    import torch

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import speed

    events, results = [], []

    def measure_row(setup, *args):
        events.append(("row", setup.name))
        if setup.name.startswith("silu"):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.00 GiB")
        return {"name": setup.name}

    monkeypatch.setattr(speed, "first_call_seconds", lambda device: events.append(("first call",)) or {})
    monkeypatch.setattr(speed, "measure_row", measure_row)
    monkeypatch.setattr(speed, "release_row", lambda: events.append(("release", sys.exc_info()[0])))
    monkeypatch.setattr(speed, "markdown", lambda result: "")
    monkeypatch.setattr(speed, "finish", lambda result, *args: results.append(result) or 0)
    assert speed.main(["--device", "cpu", "--small", "--only", "silu", "softplus"]) == 0
    silu, softplus = (row["name"] for row in results[0]["rows"])
    assert events == [("first call",), ("row", silu), ("release", None), ("row", softplus), ("release", None)]
    assert results[0]["rows"][0]["error"].startswith("out of memory: CUDA out of memory")


def test_a_compiled_steps_events_are_held_to_its_gpu_busy_time(monkeypatch):
    """On CUDA the compiled pair's busy time is measured too (is a compiled step's extra time the
    host's or the device's?), and its CUDA-event time is held to it like eager's: an event median far
    below the device's busy time for the same step (physics.EVENT_TOLERANCE, a factor 2) is refused."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from speed import check_result

    row = {"name": "row", "torch_ms": 1.0, "invact_ms": 1.0, "compile_ms": 1.0, "invact_compile_ms": 0.4}
    row |= {"torch_gpu_ms": 0.9, "invact_gpu_ms": 0.9, "compile_gpu_ms": 0.9, "invact_compile_gpu_ms": 0.9}
    (error,) = check_result({"rows": [row], "dtype": "bfloat16"}, None)
    assert error.startswith("row: invact_compile_ms 0.400 ms by CUDA events, but 0.900 ms by the profiler")
