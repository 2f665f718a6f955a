"""The QLoRA recipe's planned base (invact.planner.quantized) against bitsandbytes itself: a 4-bit layer's
meta stand-ins hold the bytes bitsandbytes stores for the same weight, and gemm_4bit_workspace is what
bitsandbytes' gemm_4bit allocates inside itself on this CPU (the torch profiler sees it). The whole
step's peak against real QLoRA steps: tests/invact/test_step_peak.py (every recipe) and
benchmarks/step_plan.py --recipes qlora (results/step_plan_cpu_llama-gemma2-gpt2-phi3_qlora.json)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

bnb = pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")

from invact.planner import quantized  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import step_plan  # noqa: E402

sys.path.pop(0)

# Weight shapes (out, in): a block-multiple, one whose element count is not a multiple of 64 x 256 (the
# second level's last block partial), and one with an odd element count (the packed weight rounds up)
SHAPES = [(128, 64), (96, 200), (33, 65)]
# The workspace's: bitsandbytes' CPU kernel dequantizes an odd in_features (no model's) with a generic
# fallback of its own, whose temporaries are not planned
EVEN = [(o, i) for o, i in SHAPES if i % 2 == 0]


def _tensors(layer) -> dict[str, torch.Tensor]:
    state = layer.weight.quant_state
    return {"packed": layer.weight.data, "absmax": state.absmax, "code": state.code, "offset": state.offset,
            "absmax2": state.state2.absmax, "code2": state.state2.code}  # fmt: skip


@pytest.mark.parametrize("shape", SHAPES, ids=[f"{o}x{i}" for o, i in SHAPES])
def test_a_meta_layer_holds_what_bitsandbytes_stores(shape):
    out_features, in_features = shape
    real, meta = (nn.Linear(in_features, out_features, bias=False, dtype=torch.bfloat16, device=d)
                  for d in ("cpu", "meta"))  # fmt: skip
    dynamic = torch.empty(256, device="meta")
    got = {}
    for name, linear in (("real", real), ("meta", meta)):
        layer = quantized._as_4bit(bnb, linear, linear.weight, torch.bfloat16, dynamic)
        got[name] = {k: (t.shape, t.dtype, t.untyped_storage().nbytes()) for k, t in _tensors(layer).items()}
        got[name]["dtype"] = layer.weight.quant_state.dtype
    assert got["meta"] == got["real"]


@pytest.mark.parametrize("shape", EVEN, ids=[f"{o}x{i}" for o, i in EVEN])
def test_the_planned_workspace_is_what_gemm_4bit_allocates_inside(shape):
    """The profiler's peak of one forward of a real 4-bit layer (bitsandbytes' kernel on this CPU) is its
    output plus the planned workspace, to the byte."""
    from torch.profiler import ProfilerActivity, profile

    out_features, in_features = shape
    linear = nn.Linear(in_features, out_features, bias=False, dtype=torch.bfloat16)
    layer = quantized._as_4bit(bnb, linear, linear.weight, torch.bfloat16, None)
    x = torch.randn(8, in_features, dtype=torch.bfloat16)
    state = layer.weight.quant_state
    args = (x, layer.weight, list(state.shape), state.state2.absmax, state.blocksize, state.quant_type, None,
            state.absmax, state.state2.code, state.offset)  # fmt: skip
    workspace = quantized.gemm_4bit_workspace(torch.ops.bitsandbytes.gemm_4bit.default, args)
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        y = torch.ops.bitsandbytes.gemm_4bit.default(*args)
    events = sorted(
        (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
    )
    running = peak = 0
    for _, nbytes in events:
        running += nbytes
        peak = max(peak, running)
    assert peak == y.untyped_storage().nbytes() + workspace > y.untyped_storage().nbytes()


def test_other_ops_have_no_planned_workspace():
    a = torch.ones(4, 4)
    assert quantized.gemm_4bit_workspace(torch.ops.aten.mm.default, (a, a)) == 0


# The committed check of whole QLoRA steps (benchmarks/step_plan.py --only llama gemma2 gpt2 phi3 --recipes
# qlora), which the README and docs quote
QLORA = ROOT / "benchmarks" / "results" / "step_plan_cpu_llama-gemma2-gpt2-phi3_qlora.json"


def test_the_qlora_results_are_within_the_acceptance_and_quoted():
    result = json.loads(QLORA.read_text())
    assert QLORA.with_suffix(".md").read_text() == step_plan.table(result) + "\n"
    rows = result["rows"]
    assert {r["recipe"] for r in rows} == {"qlora"} and len(result["architectures"]) >= 3
    assert {r["patched"] for r in rows} == {False, True}
    assert all(r["ratio"] is not None for r in rows) and all(r["end_bytes"] == 0 for r in rows)
    outside = [r for r in rows if not step_plan.BELOW <= r["ratio"] <= step_plan.ABOVE]
    assert not outside, [(r["architecture"], r["seq"], r["ratio"]) for r in outside]
    ratios = [r["ratio"] for r in rows]
    quoted = f"QLoRA: {len(rows)} of {len(rows)} within 0.98-1.05 ({min(ratios):.4f}-{max(ratios):.4f})"
    assert quoted in " ".join((ROOT / "docs" / "patching.md").read_text().split())


@pytest.mark.parametrize("recipe", ["bf16", "qlora"])
def test_the_gated_hooks_settle_on_meta_as_on_a_cpu(recipe):
    """patch()'s gated-product hooks stay on an MLP whose call saves a product (bf16) and take themselves
    off one whose call saves none (a QLoRA MLP under autocast: the adapters save their bf16 cast), on the
    meta device as on a CPU: a planned step is a training run's steps after its first."""
    meta, real = step_plan.steps(step_plan.ARCHITECTURES["llama"], recipe)
    meta.patch()
    real.patch()
    meta._settle(meta.inputs(1, 16))
    real.run(step_plan.inputs(real, 1, 16))
    states = {
        name: [
            getattr(m, "_invact_recompute_products", None)
            for m in step.base.modules()
            if "MLP" in type(m).__name__
        ]
        for name, step in (("meta", meta), ("cpu", real))
    }
    assert states["meta"] == states["cpu"] and states["cpu"], states
    assert all(s == (True if recipe == "bf16" else "removed: no gated product") for s in states["cpu"]), (
        states
    )


# A Llama whose MLP is wide against its vocabulary: the 4-bit layers' transients and the MLP's
# activations, not the loss, make the peak (before the hooks settled on the meta device, patch()'s row
# without checkpointing at seq 64 was planned 1.054 times the measured peak)
WIDE = {"model_type": "llama", "hidden_size": 512, "intermediate_size": 4096, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
        "tie_word_embeddings": False}  # fmt: skip


@pytest.mark.parametrize("checkpointing", [False, True], ids=["nockpt", "ckpt"])
def test_a_wide_qlora_step_is_planned_as_measured(checkpointing):
    meta, real = step_plan.steps(WIDE, "qlora")
    meta.patch()
    real.patch()
    predicted = meta.peak(2, 64, checkpointing=checkpointing)["peak_bytes"]
    measured = step_plan.measure(real, 2, 64, checkpointing, dispatch=False)["measured_bytes"]
    assert step_plan.BELOW <= predicted / measured <= step_plan.ABOVE, (predicted, measured)
