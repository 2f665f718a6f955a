"""benchmarks/rope_inversion.py: its bit-pattern ordering and inverse rotation, and a --small run."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import rope_inversion  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_ordered_patterns_order_like_values_and_round_trip(dtype):
    values = torch.tensor([-3.0, -1.0, -1e-3, -0.0, 0.0, 1e-3, 1.0, 3.0]).to(dtype)
    o = rope_inversion._ordered(values)
    assert torch.all(o[1:] >= o[:-1])
    assert torch.equal(rope_inversion._from_ordered(o, dtype), values)
    one = torch.tensor([1.0], dtype=dtype)  # one unit in the last place up: 1 + eps
    assert (
        rope_inversion._from_ordered(rope_inversion._ordered(one) + 1, dtype).item()
        == 1 + torch.finfo(dtype).eps
    )


# _unrotate runs in fp32 on a rotation rounded to fp32: each input carries one fp32 rounding, the two
# products, their sum and the divide one each, det = c^2 + s^2 (1 within two roundings) two more;
# |c|, |s| <= 1, so each recovered element is within 16 roundings (2^-24) of the row's largest |q|.
UNROTATE_REL = 16 * 2.0**-24


def test_unrotate_inverts_the_rotation():
    cos, sin = rope_inversion._rotary(16, 8, torch.float32)
    q = torch.randn(2, 16, 8, dtype=torch.float64)
    rotated = q * cos.double() + rope_inversion._rotate_half(q) * sin.double()
    back = rope_inversion._unrotate(rotated.float(), cos, sin).double()
    assert ((back - q).abs() <= UNROTATE_REL * q.abs().amax(-1, keepdim=True)).all()


def test_small_run(tmp_path):
    out = tmp_path / "rope.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "rope_inversion.py"), "--small",
                           "--out", str(out)], capture_output=True, text=True, timeout=600,
                          cwd=ROOT / "benchmarks")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 9 and {r["dtype"] for r in rows} == {"bfloat16", "float16", "float32"}
    assert all(0 < r["exact_share"] <= r["within_code_share"] <= 1 for r in rows)
    assert "| bfloat16 | 0.1 |" in proc.stdout


def test_odd_dim_is_refused():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "rope_inversion.py"), "--dim", "7"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT / "benchmarks")  # fmt: skip
    assert proc.returncode == 2 and "--dim must be even" in proc.stderr
