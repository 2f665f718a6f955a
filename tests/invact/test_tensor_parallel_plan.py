"""The per-GPU plan of a tensor parallel step (invact.planner.tensor_parallel, invact.planner.step with `tp`):
each rank's shards as transformers' tp_plan cuts them, the refusals, the command, and the committed check
against real tensor parallel steps over gloo (benchmarks/fsdp_peaks.py --tp measures,
benchmarks/fsdp_plan.py --tp predicts beside them)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import transformers

from invact.planner.config import build_model
from invact.planner.options import PlanError
from invact.planner.step import Step
from invact.planner.tensor_parallel import TensorParallel, tp_plan
from tests.invact.test_sharding import MOST_OVER, MOST_UNDER, RESULTS, ROOT, _module

# A Llama whose dimensions 2 and 3 ranks split unevenly where nothing requires them to divide (the
# vocabulary, the MLP's features), heads that 2 ranks divide
TINY = dict(vocab_size=513, hidden_size=64, intermediate_size=130, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512)  # fmt: skip


def _model(config=transformers.LlamaConfig, **overrides):
    return build_model(config(**{**TINY, **overrides}), torch.bfloat16)[0]


def _shapes(model) -> dict[str, tuple]:
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


@pytest.mark.parametrize("tied", [False, True])
def test_each_planned_parameter_is_the_widest_ranks_shard(tied):
    """Colwise projections keep ceil(out / N) rows, rowwise ones ceil(in / N) columns, the embeddings and
    the head ceil(vocab / N) rows (torch.chunk's first chunk: DTensor's Shard); norms stay whole; a tied
    head and embedding share one shard."""
    model = _model(tie_word_embeddings=tied)
    whole = _shapes(model)
    TensorParallel(model, 2)
    shard = _shapes(model)
    for name, shape in whole.items():
        if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight",
                          "up_proj.weight", "embed_tokens.weight", "lm_head.weight")):  # fmt: skip
            want = (math.ceil(shape[0] / 2), *shape[1:])
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            want = (shape[0], math.ceil(shape[1] / 2))
        else:
            want = shape
        assert shard[name] == want, (name, shard[name], want)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    assert shard["model.embed_tokens.weight"] == (257, 64)  # 513 rows: 257 and 256


def test_the_plan_is_the_models_own():
    """The plan followed is the one transformers applies (model.tp_plan): every style in it is one the
    planner follows, and every pattern names modules of the model."""
    model = _model()
    plan = tp_plan(model)
    assert plan == dict(model.tp_plan)
    assert {"colwise", "rowwise", "colwise_gather_output", "embedding_rowwise"} <= set(plan.values())


@pytest.mark.parametrize("make, message", [
    (lambda: build_model(transformers.GPT2Config(n_embd=64, n_layer=1, n_head=4, vocab_size=128),
                         torch.bfloat16)[0], "has no tp_plan"),
    (lambda: build_model(transformers.Phi3Config(**TINY, pad_token_id=0, eos_token_id=1, bos_token_id=1),
                         torch.bfloat16)[0], "rowwise_split_input"),
    (lambda: _model(num_attention_heads=4, num_key_value_heads=1), "num_key_value_heads 1"),
])  # fmt: skip
def test_what_cannot_be_planned_is_refused_in_one_line(make, message):
    with pytest.raises(PlanError, match=message) as caught:
        TensorParallel(make(), 2)
    assert "\n" not in str(caught.value)


def test_a_lora_recipe_under_tp_is_refused():
    with pytest.raises(PlanError, match="LoRA adapters"):
        Step(None, "lora", model=_model(), device="cpu", tp=2)


@pytest.mark.parametrize("patched", [False, True])
def test_more_ranks_lower_a_ranks_peak_and_the_step_leaves_no_hooks(patched):
    peaks = []
    for tp in (1, 2):
        step = Step(None, "bf16", model=_model(num_key_value_heads=4), device="cpu", tp=tp)
        if patched:
            step.patch()
        peaks.append(step.peak(1, 128)["peak_bytes"])
        hooked = [n for n, m in step.model.named_modules() if m._forward_hooks or m._forward_pre_hooks]
        assert not [n for n in hooked if n.endswith(("proj", "embed_tokens", "lm_head"))], hooked
    assert peaks[1] < peaks[0], peaks


def test_the_command_plans_per_gpu_under_tensor_parallelism(tmp_path, capsys):
    """`invact plan CONFIG --tp 2`: the header says tensor parallel per GPU, --json carries tp, and the
    peaks are step_peaks's with tp=2; bad combinations are refused in one line."""
    from invact.cli import main
    from invact.planner.step import step_peaks

    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", **TINY}))
    args = ["plan", str(config), "--tp", "2", "--batch", "1", "--seq", "64"]
    assert main(args) == 0
    assert "per GPU of 2 training with transformers' tensor parallelism" in capsys.readouterr().out
    assert main([*args, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    expected = step_peaks(str(config), 1, 64, recipes=("bf16",), device="cuda", tp=2)
    assert result["tp"] == 2 and [r["recipe"] for r in result["rows"]] == ["bf16"] * 4
    assert [r["peak_bytes"] for r in result["rows"]] == [r["peak_bytes"] for r in expected["rows"]]
    for extra, message in ((["--recipe", "lora"], "--recipe lora under tensor parallelism"),
                           (["--gpus", "3", "--fsdp"], "--gpus 3 does not split")):  # fmt: skip
        assert main([*args, *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and "\n" not in err, err


def test_the_committed_tensor_parallel_check_holds_and_is_what_the_planner_predicts_now():
    """results/tp_plan_cpu.json: every real tensor parallel step (transformers' tp_plan, 2 architectures, 2
    and 4 ranks, and 4 as 2 x 2 with its fsdp_plan, eager and patch()) within the planner's bounds; its
    table is its .md; and the planner predicts the same bytes today."""
    result = json.loads((RESULTS / "tp_plan_cpu.json").read_text())
    peaks = json.loads((RESULTS / "tp_peaks_cpu.json").read_text())
    fsdp_plan = _module("fsdp_plan")
    assert (RESULTS / "tp_plan_cpu.md").read_text() == fsdp_plan.table(result) + "\n"
    rows = result["rows"]
    assert len({r["model"] for r in rows}) >= 2 and {r["ranks"] for r in rows} >= {2, 4}
    assert {r["tp"] for r in rows} >= {2, 4} and any(r["tp"] < r["ranks"] for r in rows)  # and FSDP2 x TP
    assert {r["patched"] for r in rows} == {False, True}
    assert len(rows) == len(peaks["runs"])  # no run failed
    # TP alone within the bounds; under FSDP2 x TP the plan wraps FSDP2 as --gpus does (each layer, then
    # the root), not as transformers' fsdp_plan (the embeddings a unit of their own): reported, not bounded
    outside = [r for r in rows if r["tp"] == r["ranks"] and not MOST_UNDER <= r["ratio"] <= MOST_OVER]
    assert not outside, outside
    if (torch.__version__, transformers.__version__) != (result["torch"], result["transformers"]):
        pytest.skip(f"the committed predictions are torch {result['torch']}'s and transformers "
                    f"{result['transformers']}'s (their models allocate otherwise)")  # fmt: skip
    runs = {(r["config"]["name"], r["ranks"], r["tp"], r["patched"], r["seq"], r["checkpointing"]): r
            for r in peaks["runs"]}  # fmt: skip
    for row in rows:
        run = runs[row["model"], row["ranks"], row["tp"], row["patched"], row["seq"], row["checkpointing"]]
        assert run["parallel"] == "tp"
        assert row["measured_bytes"] == fsdp_plan.measured(run)
        assert fsdp_plan.predict(run)["peak_bytes"] == row["predicted_bytes"], row


@pytest.mark.parametrize("alone", [True, False], ids=["tp alone", "fsdp2 x tp"])
def test_the_quoted_tensor_parallel_accuracy_is_the_committed_check(alone):
    rows = json.loads((RESULTS / "tp_plan_cpu.json").read_text())["rows"]
    ratios = [r["ratio"] for r in rows if (r["tp"] == r["ranks"]) == alone]
    n = len(ratios)
    text = f"within {min(ratios):.4f}-{max(ratios):.4f} of the measured peak on {n} of {n}"
    assert text in " ".join((ROOT / "docs" / "patching.md").read_text().split()), text


def test_the_docs_tensor_parallel_fits_table_is_the_committed_plan():
    """results/tp_fits.md (docs/patching.md's table) is printed from results/tp_fits.json, whose plans are
    tensor parallel ones on 2, 4 and 8 GPUs; patch() never fits a shorter sequence than eager."""
    result = json.loads((RESULTS / "tp_fits.json").read_text())
    assert (RESULTS / "tp_fits.md").read_text() == _module("fsdp_fits").table(result) + "\n"
    assert result["benchmark"] == "tp_fits" and [p["gpus"] for p in result["plans"]] == [2, 4, 8] * 2
    for plan in result["plans"]:
        seqs = {(r["patched"], r["checkpointing"]): r["seq"] for r in plan["rows"]}
        assert all(seqs[True, c] >= seqs[False, c] for c in (False, True)), plan
    assert '--8<-- "benchmarks/results/tp_fits.md"' in (ROOT / "docs" / "patching.md").read_text()
