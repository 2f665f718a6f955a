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
    # --trainer defaults to gpt2: it also trains through transformers.Trainer, torch against bits
    assert set(data["runs"]) == {"gpt2/fp32", "vit/fp32", "gpt2+Trainer/fp32"}
    for key, by_variant in data["runs"].items():
        assert set(by_variant) == ({"torch", "bits"} if "Trainer" in key else {"torch", "bits", "fewbit1"})
        for seeds in by_variant.values():
            assert set(seeds) == {"0", "1"}
            for run in seeds.values():
                assert len(run["train"]) == 4 and all(math.isfinite(v) for v in run["train"])
                assert [s for s, _ in run["val"]] == [2, 4]
    torch_rows = [r for r in data["summary"] if r["variant"] == "torch"]
    assert torch_rows and all(r["max_diff_over_spread"] == 0 for r in torch_rows)  # torch against itself
    assert {p.name for p in tmp_path.glob("*.png")} == {"training_gpt2.png", "training_vit.png",
                                                        "training_gpt2_trainer.png"}  # fmt: skip
    # The statistic, recomputed from the curves: |mean over seeds of (variant - torch)| / torch's stdev
    fewbit = next(r for r in data["summary"] if r["variant"] == "fewbit1" and r["model"] == "vit")
    runs = data["runs"]["vit/fp32"]
    at = [s for s, _ in runs["torch"]["0"]["val"]].index(fewbit["at_step"])
    torch_v = [runs["torch"][s]["val"][at][1] for s in ("0", "1")]
    diff = sum(runs["fewbit1"][s]["val"][at][1] - runs["torch"][s]["val"][at][1] for s in ("0", "1")) / 2
    spread = abs(torch_v[0] - torch_v[1]) / math.sqrt(2)  # the sample stdev of two values
    assert fewbit["max_diff_over_spread"] == pytest.approx(abs(diff) / spread, rel=1e-9)


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
