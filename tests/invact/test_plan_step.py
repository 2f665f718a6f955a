"""`invact plan --step / --explain / --fits` (invact.planner.step): sizes, the search for the longest
sequence or the largest batch that fits, the terms of a peak, and the command's errors. Whether the
predicted peaks are a real step's: tests/invact/test_step_peak.py."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from invact.planner.fits import largest
from invact.planner.options import SEQ_MULTIPLE, TERMS, PlanError, parse_size
from invact.planner.step import Step, step_peaks

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
TINY = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False,
            max_position_embeddings=8192)  # fmt: skip


@pytest.mark.parametrize(
    "text, size",
    [
        ("24GiB", 24 * 2**30),
        ("24 GiB", 24 * 2**30),
        ("24G", 24 * 2**30),
        ("80GB", 80 * 10**9),
        ("1.5TiB", 3 * 2**39),
        ("512MiB", 2**29),
        ("100", 100),
        ("4kb", 4000),
    ],  # fmt: skip
)
def test_sizes(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "GiB", "24 parsecs", "-1GiB", "0GiB", "1e3", "24GiBs"])
def test_bad_sizes_are_one_line_errors(text):
    with pytest.raises(PlanError, match="size"):
        parse_size(text)


def _peaks(seed: int):
    """A peak as the step's has them: flat (the optimizer step's) up to where forward and backward's,
    affine or a little convex (attention that keeps seq x seq), pass it."""
    r = random.Random(seed)
    base, slope, square = r.randint(0, 10**6), r.uniform(0.1, 100), r.choice([0.0, r.uniform(0, 0.01)])
    flat = r.randint(0, 3 * 10**6)

    def peak(x: int) -> dict:
        grows = int(base + slope * x + square * x * x)
        return {"peak_bytes": max(flat, grows), "activation_peak_bytes": grows}

    return peak, r.randint(0, 10**7), r.choice([1, 64]), r.choice([64, 100, 4096, 10**5])


@pytest.mark.parametrize("seed", range(40))
def test_the_search_finds_what_trying_every_size_finds(seed):
    peak, budget, step, cap = _peaks(seed)
    fitting = [x for x in range(step, max(cap, step) + 1, step) if peak(x)["peak_bytes"] <= budget]
    found, at, _ = largest(peak, budget, step, cap)
    assert found == (fitting[-1] if fitting else 0)
    assert at == peak(found or step)


@pytest.fixture(scope="module")
def fitted():
    return step_peaks(dict(TINY), 2, None, fits="20MiB", device="cpu")


def test_each_answer_fits_and_the_next_size_does_not(fitted):
    # the search against the planner itself: the answer's peak fits, one multiple more does not
    assert fitted["searched"] == "seq" and fitted["cap"] == TINY["max_position_embeddings"]
    for row in fitted["rows"]:
        step = Step(dict(TINY), row["recipe"], device="cpu")
        if row["patched"]:
            step.patch()
        seq = row["seq"]
        assert 0 < seq < fitted["cap"], row
        assert step.peak(2, seq, checkpointing=row["checkpointing"])["peak_bytes"] <= fitted["fits_bytes"]
        after = step.peak(2, seq + SEQ_MULTIPLE, checkpointing=row["checkpointing"])
        assert after["peak_bytes"] > fitted["fits_bytes"]


def test_the_terms_add_up_to_the_peak(fitted):
    for row in fitted["rows"]:
        assert set(row["terms"]) == set(TERMS)
        assert sum(row["terms"].values()) == row["peak_bytes"], row
        assert row["terms"]["weights"] > 0 and row["terms"]["optimizer"] > 0


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "invact", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)  # fmt: skip


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "config.json"
    path.write_text(json.dumps(TINY))
    return path


def test_largest_batch_and_explain(tiny_config):
    done = _run("plan", str(tiny_config), "--fits", "60MiB", "--seq", "256", "--recipe", "lora", "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["searched"] == "batch" and [r["recipe"] for r in result["rows"]] == ["lora"] * 4
    assert all(r["batch"] >= 1 and r["seq"] == 256 for r in result["rows"])
    shown = _run("plan", str(tiny_config), "--batch", "2", "--seq", "128", "--explain", "--recipe", "bf16")
    assert shown.returncode == 0, shown.stderr
    for label in ("weights: ", "optimizer state: ", "eager peak", "patch() peak"):
        assert label in shown.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (("--fits", "24 parsecs"), "cannot read '24 parsecs' as a size"),
        (("--step", "--batch", "1"), "--step, --explain, --gpus and --tp need --batch and --seq"),
        (("--fits", "1GiB", "--dtype", "float32"), "leave --dtype at bfloat16"),
        (("--fits", "1GiB", "--no-loss"), "drop --no-gated"),
        (("--fits", "1GiB", "--recipe", "dora"), "invalid choice: 'dora'"),
        (("--fits", "1GiB", "--recipe", "qlora", "--gpus", "2", "--fsdp"), "FSDP-QLoRA) is not planned"),
        (("--batch", "1"), "the following argument is required: --seq"),
    ],
)
def test_errors_are_one_line(tiny_config, args, message):
    done = _run("plan", str(tiny_config), *args)
    assert done.returncode == 2 and message in done.stderr and done.stderr.count("\n") == 1, done.stderr
