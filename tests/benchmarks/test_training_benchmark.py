"""benchmarks/training.py's smoke run (so the script never rots) and the FewBit baseline's gradient."""

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "training.py"
pytest.importorskip("transformers")
pytest.importorskip("sklearn")


def test_small_run_writes_curves_and_the_statistic(tmp_path):
    out = tmp_path / "training.json"
    args = [
        "--small",
        "--models",
        "gpt2",
        "vit",
        "--variants",
        "bits",
        "fewbit1",
        "--dtypes",
        "fp32",
        "--out",
    ]
    proc = subprocess.run([sys.executable, str(SCRIPT), *args, str(out)], capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert set(data["runs"]) == {"gpt2/fp32", "vit/fp32"}
    for by_variant in data["runs"].values():
        assert set(by_variant) == {"torch", "bits", "fewbit1"}
        for seeds in by_variant.values():
            assert set(seeds) == {"0", "1"}
            for run in seeds.values():
                assert len(run["train"]) == 4 and all(math.isfinite(v) for v in run["train"])
                assert [s for s, _ in run["val"]] == [2, 4]
    torch_rows = [r for r in data["summary"] if r["variant"] == "torch"]
    assert torch_rows and all(r["max_diff_over_spread"] == 0 for r in torch_rows)  # torch against itself
    assert (tmp_path / "training_gpt2.png").exists()


def test_too_few_seeds_is_refused():
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--seeds", "1"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2 and "--seeds must be at least 2" in proc.stderr


@pytest.mark.parametrize("bits", [1, 4])
def test_fewbit_gradient_is_the_quantizer(bits):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from fewbit import FewBitActivation, quantizer
    finally:
        sys.path.pop(0)
    x = (torch.randn(4096) * 3).requires_grad_()
    FewBitActivation("gelu", bits)(x).sum().backward()
    borders, levels = quantizer("gelu", bits)
    want = levels.numpy()[np.searchsorted(borders.numpy(), x.detach().numpy(), side="right")]
    assert torch.equal(x.grad, torch.from_numpy(want))  # dy = 1 times the level of x's interval
    assert len(torch.unique(x.grad)) <= 2**bits
