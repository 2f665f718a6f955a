"""benchmarks/hf_model_tests: transformers' own model tests, plain and with every model patched; and the
docs page's figures against the committed result."""

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]

# A stand-in for a transformers test file: one test that passes either way (a model built inside a
# meta-device context, as from_pretrained builds it, then materialized), one that passes only unpatched,
# one skipped.
TINY_TESTS = """
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from invact.norm import InvNorm

CONFIG = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
              num_key_value_heads=1, vocab_size=64)


def test_builds_on_the_meta_device_and_runs():
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**CONFIG))
    model.to_empty(device="cpu")
    model.init_weights()
    ids = torch.randint(0, 64, (1, 8))
    model(input_ids=ids, labels=ids).loss.backward()


def test_every_norm_is_torchs():
    model = LlamaForCausalLM(LlamaConfig(**CONFIG))
    assert not any(isinstance(m, InvNorm) for m in model.modules()), "a norm is InvNorm"


@pytest.mark.skip(reason="skipped in both runs")
def test_skipped():
    pass
"""


def test_a_tiny_tree_run_plain_and_patched(tmp_path):
    tree = tmp_path / "tree"
    folder = tree / "tests" / "models" / "tiny"
    folder.mkdir(parents=True)
    (folder / "test_modeling_tiny.py").write_text(textwrap.dedent(TINY_TESTS))
    out = tmp_path / "result.json"
    script = ROOT / "benchmarks" / "hf_model_tests" / "run.py"
    command = [sys.executable, str(script), "--tree", str(tree), "--models", "tiny", "--jobs", "1",
               "--out", str(out), "--logs", str(tmp_path / "logs")]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())["models"]["tiny"]
    kinds = ("passed", "failed", "skipped", "errors")
    counts = {run: {k: result[run][k] for k in kinds} for run in ("plain", "patched")}
    assert counts == {
        "plain": {"passed": 2, "failed": 0, "skipped": 1, "errors": 0},
        "patched": {"passed": 1, "failed": 1, "skipped": 1, "errors": 0},
    }
    (new,) = result["new_failures"]
    assert new["test"].endswith("test_every_norm_is_torchs") and "a norm is InvNorm" in new["error"]
    assert result["fixed"] == []
    assert out.with_suffix(".md").read_text().startswith("| model |")


RESULT = ROOT / "benchmarks" / "results" / "hf_model_tests_cpu.json"
PAGE = ROOT / "docs" / "results" / "hf-model-tests.md"


BEFORE = ROOT / "benchmarks" / "results" / "hf_model_tests_cpu_ddaf5ed.json"  # before the identity change
INDEX = ROOT / "docs" / "results" / "index.md"


def _text(path: Path) -> str:
    return re.sub(r"\s+", " ", path.read_text())


def test_the_docs_summary_is_the_committed_result():
    models = json.loads(RESULT.read_text())["models"]
    runs = sum(sum(r["patched"][k] for k in ("passed", "failed", "errors")) for r in models.values())
    new = sum(len(r["new_failures"]) for r in models.values())
    summary = f"{len(models)} model test files, {runs} tests run patched: {new} fail that pass unpatched"
    assert summary in _text(PAGE) and summary in _text(INDEX)


def test_the_docs_account_of_the_run_before_the_fix_is_its_result():
    failures = [
        f["error"] for r in json.loads(BEFORE.read_text())["models"].values() for f in r["new_failures"]
    ]
    meta = sum(e.startswith("NotImplementedError: aten::equal") for e in failures)
    init = sum("_init_weights" in e for e in failures)
    assert meta + init == len(failures)
    assert f"added {len(failures)} failures: {meta} from the norms' formula probe on meta tensors" in _text(
        PAGE
    )
    assert f"and {init} from `_init_weights`" in _text(PAGE)


LOSS_RESULT = ROOT / "benchmarks" / "results" / "hf_model_tests_cpu_loss.json"  # the loss path's models


def test_the_docs_account_of_the_loss_path_run_is_its_result():
    """The page's summary of the run on the models whose loss takes invact's path is the committed JSON's,
    and every new failure it reports is named on the page."""
    models = json.loads(LOSS_RESULT.read_text())["models"]
    runs = sum(sum(r["patched"][k] for k in ("passed", "failed", "errors")) for r in models.values())
    new = [f for r in models.values() for f in r["new_failures"]]
    summary = f"{len(models)} model test files, {runs} tests run patched: {len(new)} fail that pass unpatched"
    assert summary in _text(PAGE)
    assert all(f"`{f['test'].split('::')[-1]}`" in _text(PAGE) for f in new)
