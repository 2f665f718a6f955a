"""invact.planner.step's predicted peaks against real CPU steps: LiveBytes' bookkeeping on plain CPU ops, the
profiler measurement the comparison rests on, and each predicted peak (the meta device) against the
profiler's peak of one real step of the same model, for the architectures of benchmarks/step_plan.py
(the five it was fitted on and four more), every recipe, eager and patched, without and with
checkpointing, at one sequence length. The measuring helpers are benchmarks/step_plan.py's (the
benchmark runs three sequence lengths and writes benchmarks/results/step_plan_cpu.{json,md}, and
step_plan_cpu_llama_tied-phi3-olmo2-granite.{json,md} for the four)."""

from __future__ import annotations

import functools
import gc
import json
import sys
from pathlib import Path

import pytest
import torch

from invact.planner import live_bytes
from invact.planner.live_bytes import CPU_PACKED_N, LiveBytes, cpu_matmul_workspace
from invact.planner.recipes import RECIPES

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import step_plan  # noqa: E402

sys.path.pop(0)

# The acceptance for invact.planner.step's predicted peak: within 5% of the measured one, and never more
# than 2% below it (a plan that promises less than the step takes is the costly error). Measured by
# benchmarks/step_plan.py on a 2-core Intel Xeon (AVX512), torch 2.13, transformers 5.24, 180 rows
# (5 architectures x seq 128/256/512 x 3 recipes x eager/patched x checkpointing off/on): all 180
# within it, worst ratio above 1 1.0073 (GPT-2, mixed, seq 256, patch()), worst below 1 0.9930 (Gemma 2,
# LoRA, seq 512, patch() with checkpointing); every eager row within 0.9998-1.0001. The four it was not
# fitted on (llama_tied, phi3, olmo2, granite; 144 rows): all within it, eager 0.9998-1.0000, patched
# 0.9854-1.0000 (llama_tied's patched rows 0.80-0.94 without cpu_matmul_workspace).
ABOVE = 1.05
BELOW = 0.98
BATCH, SEQ = step_plan.BATCH, 256

CASES = [
    (name, recipe, patched, checkpointing)
    for name in step_plan.ARCHITECTURES
    for recipe in RECIPES
    for patched in (False, True)
    for checkpointing in (False, True)
]


# The rows every run checks: each architecture with each recipe once, its (patched, checkpointing) variant
# turning with the architecture and the recipe, so that each recipe meets each of the four variants on at
# least two architectures and each architecture three of them (27 of the 108). The other rows are marked
# "full" (`make test-full`, `pytest -m full`): at about 8 s a row on two cores they took 14 of CI's 50
# minutes; benchmarks/step_plan.py measures all of them, at three sequence lengths, for its committed
# results (checked against the acceptance below).
_VARIANTS = [(patched, checkpointing) for patched in (False, True) for checkpointing in (False, True)]
COVERING = {
    (name, recipe, *_VARIANTS[(i + j) % len(_VARIANTS)])
    for i, name in enumerate(step_plan.ARCHITECTURES)
    for j, recipe in enumerate(RECIPES)
}


def _param(case: tuple):
    label = f"{case[0]}-{case[1]}-{'patched' if case[2] else 'eager'}-{'ckpt' if case[3] else 'nockpt'}"
    return pytest.param(*case, id=label, marks=() if case in COVERING else pytest.mark.full)


@functools.lru_cache(maxsize=1)  # the cases run in CASES' order: each pair serves both checkpointing cases
def _steps(name: str, recipe: str, patched: bool):
    meta, real = step_plan.steps(step_plan.ARCHITECTURES[name], recipe)
    if patched:
        meta.patch()
        real.patch()
    return meta, real


@pytest.fixture(scope="module", autouse=True)
def _release_steps():
    yield
    _steps.cache_clear()


def test_live_bytes_follows_plain_cpu_ops():
    w = torch.ones(100)  # 400 bytes, alive before
    with LiveBytes({"weights": [w]}) as live:
        live.phase = "forward"
        a = torch.ones(1000)  # 4000 bytes: 4400 live
        b = a * 2  # 4000: 8400 live, the peak
        view = b.view(10, 100)  # b's storage: nothing new
        del a  # 4400 live (noticed at the next sweep)
        live.phase = "backward"
        c = torch.empty(500)  # 2000: 6400 live, below the peak, though 10400 counting a
    live.close()
    assert live.peak == 400 + 4000 + 4000
    assert live.peak_phase == "forward" and live.peak_op is torch.ops.aten.mul.Tensor
    assert live.at_peak == {"weights": 400, "forward": 8000}
    assert live.peaks == {"forward": 8400, "backward": 6400}
    assert view.untyped_storage()._cdata == b.untyped_storage()._cdata and c.numel() == 500


def test_live_bytes_peak_after_a_free_counts_only_what_is_alive():
    with LiveBytes() as live:
        live.phase = "forward"
        a = torch.ones(1000)  # 4000
        b = a * 2  # 8000
        del a  # 4000
        c = torch.empty(1500)  # 6000: 10000 live, the peak (not 14000: a is gone)
    live.close()
    assert live.peak == 4000 + 6000 and live.peak_op is torch.ops.aten.empty.memory_format
    assert live.at_peak == {"forward": 10000}
    assert b.numel() + c.numel() == 2500


# Bytes the profiler and LiveBytes may differ by on plain CPU ops: scalar tensors (a 0-dim loss, its
# gradient, wrapped numbers: 4 to 8 bytes each) that they meet at different moments; measured 20 bytes
# apart on the sum below (1 MiB).
SCALARS = 64


def _two_gradients_of_one_tensor():
    x = torch.ones(256, 256, requires_grad=True)  # 256 KiB
    h = x * 1.5
    ((h * 2).sum() + (h * 3).sum()).backward()  # h's two gradients meet in autograd's input buffer
    return x


def test_live_bytes_sums_two_gradients_in_place_as_autograd_does():
    # A plain step adds the second gradient into the first; under a dispatch mode autograd adds them out
    # of place, and LiveBytes would count one 256 KiB tensor more (5 x 256 KiB) were it not taken in place.
    measured = step_plan.profiled_peak(_two_gradients_of_one_tensor)["peak"]
    with LiveBytes() as live:
        live.phase = "backward"
        _two_gradients_of_one_tensor()
    live.close()
    assert abs(live.peak - measured) <= SCALARS and abs(measured - 4 * 2**18) <= SCALARS, (
        live.peak,
        measured,
    )


def test_profiled_peak_of_plain_cpu_ops():
    # the measuring helper: the largest running sum of the allocator's allocations and frees (a + a, not
    # a * 2: the allocator also sees the scalar wrapped as a tensor, 8 + 4 bytes inside aten::mul)
    def run():
        a = torch.ones(1000)  # 4000
        b = a + a  # 8000, the peak
        del a  # 4000
        c = torch.empty(500)  # 6000
        del b, c  # 0

    measured = step_plan.profiled_peak(run)
    assert measured["peak"] == 8000 and measured["end"] == 0
    assert measured["at"][-1] == "aten::add"


def test_live_bytes_counts_a_workspace_while_its_op_runs():
    # 1000 bytes inside each mm (a kernel's scratch memory): alive with the mm's output, gone after it
    def scratch(func, args):
        return 1000 if func is torch.ops.aten.mm.default else 0

    a = torch.ones(10, 10)  # 400 bytes, alive before
    with LiveBytes({"inputs": [a]}, workspace=scratch) as live:
        live.phase = "forward"
        b = a.mm(a)  # 400 + 400 + 1000 while it runs: the peak
        c = b + 1  # 1200 live, below it
    live.close()
    assert live.peak == 400 + 400 + 1000 and live.peak_op is torch.ops.aten.mm.default
    assert live.at_peak == {"inputs": 400, "forward": 1400}
    assert live.peaks == {"forward": 1800} and c.numel() == 100


# What oneDNN's scratchpad holds beyond the copies of B that cpu_matmul_workspace plans (its batch
# descriptors): 5.6 to 11.6 KiB measured at 1 and 2 threads (torch 2.13, oneDNN 3.12, Intel Xeon with
# AMX) for M 2-1024, K 64-128256, N 2-32.
SCRATCH_REST = 12 * 2**10


def _amx() -> bool:
    try:
        return "amx_bf16" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


# (M, K, N): a loss's d hidden = d logits x W of a head of hidden 32 (K the vocabulary), a rank-8 and a
# 2-column one, K not a multiple of 32
_NARROW = [(64, 32000, 32), (256, 16001, 8), (7, 1000, 2)]


@pytest.mark.skipif(not _amx(), reason="the workspace was measured with oneDNN's AMX kernels")
@pytest.mark.parametrize("m, k, n", _NARROW)
def test_the_planned_workspace_is_onednns_copy_of_a_narrow_b(m, k, n):
    a, b = torch.randn(m, k, dtype=torch.bfloat16), torch.randn(k, n, dtype=torch.bfloat16)
    c = torch.zeros(m, n, dtype=torch.bfloat16)
    for func, args in ((torch.ops.aten.mm.default, (a, b)), (torch.ops.aten.addmm.default, (c, a, b))):
        planned = cpu_matmul_workspace(func, args)
        assert planned >= torch.get_num_threads() * k * n * 2  # at least a copy of B per thread
        output = m * n * 2
        measured = step_plan.profiled_peak(functools.partial(func, *args))["peak"] - output
        assert 0 <= measured - planned <= SCRATCH_REST, (func, measured, planned)


@pytest.mark.skipif(live_bytes._onednn_bf16(), reason="this CPU's bf16 matmuls run oneDNN's kernels")
@pytest.mark.parametrize("m, k, n", _NARROW)
def test_where_torch_runs_its_own_bf16_kernel_no_workspace_is_planned_or_made(m, k, n):
    # an AVX2 CPU: torch's own bf16 matmul allocates its output alone
    a, b = torch.randn(m, k, dtype=torch.bfloat16), torch.randn(k, n, dtype=torch.bfloat16)
    assert cpu_matmul_workspace(torch.ops.aten.mm.default, (a, b)) == 0
    measured = step_plan.profiled_peak(functools.partial(torch.ops.aten.mm.default, a, b))["peak"]
    assert measured == m * n * 2


def test_no_workspace_is_planned_but_a_narrow_bf16_bs(monkeypatch):
    monkeypatch.setattr(live_bytes, "_onednn_bf16", lambda: True)  # the plan on a CPU that runs oneDNN's
    aten = torch.ops.aten
    a, b = torch.empty(64, 4096, dtype=torch.bfloat16), torch.empty(4096, CPU_PACKED_N, dtype=torch.bfloat16)
    assert cpu_matmul_workspace(aten.mm.default, (a, b), threads=4) == 4 * 4096 * CPU_PACKED_N * 2
    assert cpu_matmul_workspace(aten.mm.out, (a, b), threads=1) == 4096 * CPU_PACKED_N * 2
    wide = torch.empty(4096, CPU_PACKED_N + 1, dtype=torch.bfloat16)
    for func, args in [
        (aten.mm.default, (a, wide)),  # N past CPU_PACKED_N: copied in blocks, not planned
        (aten.mm.default, (a.float(), b.float())),  # fp32: MKL's sgemm, no scratchpad of torch's
        (aten.mm.default, (a[:1], b)),  # M = 1, a GEMV
        (aten.mm.default, (a.t().contiguous().t(), b)),  # A stored transposed
        (aten.mm.default, (a, b.t().contiguous().t())),  # B stored transposed (x W^T)
        (aten.mm.default, (a[:2, :16], b[:16, :8])),  # 2 x 16 x 8: torch's own kernel, not oneDNN
        (aten.add.Tensor, (a, a)),
    ]:  # fmt: skip
        assert cpu_matmul_workspace(func, args) == 0, (func, [t.shape for t in args])


# The committed results for the architectures the predictor was not fitted on (benchmarks/step_plan.py
# --only llama_tied phi3 olmo2 granite), whose figures docs/patching.md quotes
UNFITTED = ROOT / "benchmarks" / "results" / "step_plan_cpu_llama_tied-phi3-olmo2-granite.json"


def test_the_unfitted_architectures_results_are_within_the_acceptance_and_quoted():
    result = json.loads(UNFITTED.read_text())
    assert UNFITTED.with_suffix(".md").read_text() == step_plan.table(result) + "\n"
    rows = result["rows"]
    assert sorted(result["architectures"]) == sorted(["llama_tied", "phi3", "olmo2", "granite"])
    assert all(r["ratio"] is not None for r in rows) and all(r["end_bytes"] == 0 for r in rows)
    outside = [r for r in rows if not BELOW <= r["ratio"] <= ABOVE]
    assert not outside, [(r["architecture"], r["recipe"], r["seq"], r["ratio"]) for r in outside]
    eager = [r["ratio"] for r in rows if not r["patched"]]
    patched = [r["ratio"] for r in rows if r["patched"]]
    quoted = [f"{len(rows)} of {len(rows)} within 0.98-1.05", f"eager rows {min(eager):.4f}-{max(eager):.4f}",
              f"patched ones {min(patched):.4f}-{max(patched):.4f}"]  # fmt: skip
    docs = " ".join((ROOT / "docs" / "patching.md").read_text().split())
    assert not [q for q in quoted if q not in docs], quoted


@pytest.mark.slow
@pytest.mark.parametrize("name, recipe, patched, checkpointing", [_param(case) for case in CASES])
def test_predicted_peak_is_a_real_steps(name, recipe, patched, checkpointing):
    if RECIPES[recipe].lora:
        pytest.importorskip("peft")
    if RECIPES[recipe].quantized:
        pytest.importorskip("bitsandbytes")
    meta, real = _steps(name, recipe, patched)
    gc.collect()
    predicted = meta.peak(BATCH, SEQ, checkpointing=checkpointing)
    measured = step_plan.measure(real, BATCH, SEQ, checkpointing, dispatch=False)
    ratio = predicted["peak_bytes"] / measured["measured_bytes"]
    mib = {key: round(value / 2**20, 3) for key, value in predicted["terms"].items()}
    assert BELOW <= ratio <= ABOVE, (
        f"predicted {predicted['peak_bytes']} bytes, measured {measured['measured_bytes']} (ratio "
        f"{ratio:.4f}); predicted peak in {predicted['phase']} at {predicted['op']}, terms (MiB) {mib}; "
        f"measured peak in {measured['measured_at'][-3:]}"
    )
    assert measured["end_bytes"] == 0  # the real step leaves nothing allocated
