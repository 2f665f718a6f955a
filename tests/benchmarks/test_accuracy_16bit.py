"""benchmarks/accuracy_16bit.py and the 16-bit accuracy it documents (docs/results/accuracy.md): for
x ~ N(0, 1) stored in bf16 or fp16, InvAct's input gradient against torch's own, with the 16-bit q the
kernels evaluate."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import accuracy_16bit  # noqa: E402

SIXTEEN = sorted(json.loads((ROOT / "coeffs" / "defaults_16bit.json").read_text()))
N = 2**18  # a quarter of the benchmark's 2^20: the ratios below moved by < 0.03 between the two
# The documented claim, RMS error at most this multiple of torch's: measured over 2^20 inputs
# 1.53-1.97 in bf16 and 2.36-3.13 in fp16 (results/accuracy_16bit_cpu.json). fp16's larger multiple is
# its finer dx rounding (torch's error is 8 times smaller) against the same cusp storage floor.
RMS_RATIO = {torch.bfloat16: 2.0, torch.float16: 3.3}
# The documented claim: the largest error at most 1.5 storage floors of the dtype on each branch
# (measured 0.92-1.44: dx's own rounding adds to the floor).
MAX_OVER_FLOOR = 1.5
# The 16-bit q against the fp32 family's q at the same stored y: their fits differ by < 1.3e-5, 1/16
# of torch's smallest RMS error here (fp16 silu: 1.3e-4), so the RMS ratios may move by about that.
Q16_RATIO_SHIFT = 0.0625


@pytest.mark.parametrize("name", SIXTEEN)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_gradient_is_within_the_documented_multiple_of_torchs(name, dtype):
    row = accuracy_16bit.measure(name, dtype, N)
    assert row["family_16bit"] == "half"
    assert row["ratio_q16"] <= RMS_RATIO[dtype], row
    assert abs(row["ratio_q16"] - row["ratio_fp32_q"]) <= Q16_RATIO_SHIFT, row
    for branch, share in row["max_over_floor"].items():
        assert share <= MAX_OVER_FLOOR, (branch, row)


def test_script_writes_its_table(tmp_path):
    out = tmp_path / "acc.json"
    args = ["--only", "relu6", "silu", "--n", "4096", "--out", str(out)]
    command = [sys.executable, "accuracy_16bit.py", *args]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT / "benchmarks")
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["activation"], r["dtype"]) for r in rows] == [
        ("relu6", "bfloat16"), ("relu6", "float16"), ("silu", "bfloat16"), ("silu", "float16")
    ]  # fmt: skip
    assert rows[0]["ratio_q16"] is None and rows[0]["rms_q16"] == 0  # relu6: torch and InvAct exact
    assert "| silu | float16 | half |" in proc.stdout


def test_script_refuses_bad_arguments():
    command = [sys.executable, "accuracy_16bit.py", "--only", "nope"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT / "benchmarks")
    assert proc.returncode == 2 and "unknown activation(s) nope" in proc.stderr
