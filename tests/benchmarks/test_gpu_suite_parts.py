"""The CPU-side smoke runs of the GPU suite's scripts (benchmarks/tune.py, benchmarks/train_memory.py),
so they never rot between the sessions that have a GPU, and the suite's refusal without one."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip("triton")


def _run(*args, timeout=600):
    return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, timeout=timeout)


def test_tune_small_cpu_run(tmp_path):
    out = tmp_path / "tune.json"
    proc = _run(ROOT / "benchmarks" / "tune.py", "--device", "cpu", "--small", "--out", out)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    for dtype in ("float32", "bfloat16"):
        entry = data["dtypes"][dtype]
        assert [(c["block"], c["num_warps"]) for c in entry["configs"]] == [(1024, 4), (2048, 4)]
        for kernel in ("forward", "backward"):
            assert entry["best"][kernel]["gbps"] == max(c[f"{kernel}_gbps"] for c in entry["configs"])
            assert entry["default"][kernel]["gbps"] > 0
    assert "| forward | float32 |" in proc.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--device", "cpu"], "--device cpu needs --small"),
        (["--device", "cpu", "--small", "--blocks", "12"], "block must be a power of two >= 8, got 12"),
        (["--device", "cpu", "--small", "--warps", "3"], "num_warps must be a power of two, got 3"),
        (["--device", "cpu", "--small", "--repeats", "0"], "must be positive"),
    ],
)
def test_tune_bad_arguments(args, message):
    proc = _run(ROOT / "benchmarks" / "tune.py", *args, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr


def test_train_memory_small_cpu_run(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "train.json"
    proc = _run(ROOT / "benchmarks" / "train_memory.py", "--device", "cpu", "--small", "--out", out)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["model"].split()[0] for r in rows] == ["BERT-base", "GPT-2", "Llama-shaped"]
    for r in rows:
        assert r["replaced"] > 0 and r["saved_drop"] > 0  # patching saved memory, in every model
        assert r["invact"]["peak_bytes"] is None  # peak memory is CUDA's alone
        assert r["flops"] > 0 and r["min_bytes"]["torch"] > r["min_bytes"]["invact"] > 0
        # invact's loss computes its logits again in backward: one (tokens x hidden x vocab) matmul more
        assert r["flops_invact"] >= r["flops"]
        for variant, flops in (("torch", r["flops"]), ("invact", r["flops_invact"])):  # each step timed,
            step = r[variant]  # with the rates it implies
            assert step["step_ms"] > 0 and step["tflops"] == flops / step["step_ms"] / 1e9
    assert "| GPT-2 |" in proc.stdout and "steps not checked against a peak" in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where no CUDA device exists")
def test_gpu_suite_refuses_without_cuda():
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "PYTHON": sys.executable}
    script = ROOT / "benchmarks" / "gpu_suite.sh"
    proc = subprocess.run(["bash", str(script), "tune"], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2 and "no CUDA device visible" in proc.stderr


def test_host_time_cpu_run(tmp_path):
    out = tmp_path / "host.json"
    args = ["--device", "cpu", "--elements", "1024", "--calls", "20", "--rounds", "2", "--no-compile"]
    args += ["--out", out]
    proc = _run(ROOT / "benchmarks" / "host_time.py", *args)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())["rows"]
    layers = [r["layer"] for r in rows]
    for who in ("torch", "InvAct"):  # each side timed with autograd's device threads on and off
        assert f"{who} GELU forward + backward" in layers
        assert f"{who} GELU forward + backward, autograd on one thread" in layers
    assert all(r["us"] > 0 for r in rows)
    assert "| InvAct backend backward alone |" in proc.stdout


@pytest.mark.parametrize("flag", ["--elements", "--calls", "--rounds"])
def test_host_time_bad_arguments(flag):
    proc = _run(ROOT / "benchmarks" / "host_time.py", "--device", "cpu", flag, "0", timeout=120)
    assert proc.returncode == 2 and f"{flag} must be positive" in proc.stderr


def test_kernel_sass_counts_instructions_against_the_budget(tmp_path):
    """Compiled for sm_90 here (no GPU needed): relu2's kernels (the activation's and the gated MLP's),
    whose backward is a square root, with the masked (tail) kernels too; fp16 takes bf16's copy (the
    tune file times no fp16 copy)."""
    out = tmp_path / "sass.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = str(ROOT / "benchmarks" / "kernel_sass.py")
    command = [sys.executable, script, "--only", "relu2", "--tails", "--out", str(out)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())["rows"]
    dtypes = ("float32", "bfloat16", "float16")
    masks = ("none", "rows", "elements")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from kernel_sass import GATED_DTYPES

    from invact.activation._triton import KERNELS

    want = [(k, d, m) for k in KERNELS for d in (GATED_DTYPES if "gated" in k else dtypes) for m in masks]
    assert [(r["kernel"], r["dtype"], r["masks"]) for r in rows] == want
    copy = {r["dtype"]: r["copy_gbps"] for r in rows}
    assert copy["float16"] == copy["bfloat16"] != copy["float32"]
    for r in rows:
        assert r["instructions_per_element"] > 0 and sum(r["top_opcodes"].values()) > 0
        share = min(1, r["budget_per_element"] / r["instructions_per_element"])
        assert r["predicted_gbps"] == r["copy_gbps"] * share
    assert all(f"| relu2 | backward | bfloat16 | {m} |" in proc.stdout for m in masks)


@pytest.mark.parametrize(
    ("args", "env_extra", "message"),
    [
        (["--only", "nonesuch"], {}, "unknown activation(s) nonesuch"),
        (["--tune", "/nonexistent.json"], {}, "no such file"),
        ([], {"TRITON_INTERPRET": "1"}, "unset TRITON_INTERPRET"),
    ],
)
def test_kernel_sass_bad_arguments(args, env_extra, message):
    env = {**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}, **env_extra}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernel_sass.py"), *args],
                          capture_output=True, text=True, timeout=120, env=env)  # fmt: skip
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
