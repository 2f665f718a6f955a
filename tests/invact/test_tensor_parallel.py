"""Tensor parallel (DTensor) training, patched and not, on 2 and 4 gloo ranks (tests/invact/_tp_workers.py):
the vocabulary-parallel loss against float64 for every argument, transformers' tp_plan and torchtitan's
parallelize_module plan (and FSDP2 x TP on a 2 x 2 mesh) with losses equal to eager TP's, gradients within
a derived bound of the same patched model in one process, no logits of the vocabulary (or a shard of it)
saved on any rank, and each rank's peak below eager TP's."""

from __future__ import annotations

import sys
import time

import pytest
import torch

from tests.gloo import launch, log_tails
from tests.invact._tp_workers import (
    BATCH,
    CASES,
    FN_HIDDEN,
    FN_VOCAB,
    HEADS,
    HIDDEN,
    INTERMEDIATE,
    LAYERS,
    REDUCTIONS,
    ROWS,
    SEQ,
    VOCAB,
)
from tests.invact.test_fsdp import _gamma
from tests.invact.test_loss import _fp32_bound

WORLDS = (2, 4)
_WORKER_TIMEOUT_S = 300  # 4 ranks ran all cases in 18 s on 2 cores (AMD EPYC); the collectives' own is 60 s
TRAINING = ("hf", "native", "native_sp", "fsdp_tp", "hf_fsdp_tp", "hf_fsdp_tp_tied")


def _functional_bound(world: int) -> float:
    """test_loss's fp32 bound (gamma of the hidden size, the vocabulary and the rows: the longest sums a
    term goes through) with the ranks' sums added to the length: the log-sum-exp over the ranks' parts and
    the all-reduce of the hidden states' gradient, world terms each."""
    return _fp32_bound(ROWS + 2 * world, FN_HIDDEN, FN_VOCAB)


def _loss_bound(world: int) -> float:
    """Step 1's loss, patched TP against eager TP: the same forward to the last hidden state (the norms'
    outputs are torch's bitwise, tests/invact/test_norm_patch.py; the activations' too,
    test_functional.py; the same TP collectives), then each loss within test_loss's fp32 bound of the exact
    loss of those logits (the rank's tokens, the vocabulary with the ranks' sums, the hidden size): the two
    within twice that, relative to the loss."""
    return 2 * _fp32_bound(BATCH * SEQ + 2 * world, HIDDEN, VOCAB)


def _grad_bound(world: int, tokens: int) -> float:
    """Step 1's gradients under TP against the same patched model in one process on the same tokens: the
    same per-element products summed in other orders (each rank's shard of a projection, then the
    all-reduce; world terms more per sum). To first order the relative roundings along a gradient's path
    add up, as tests/invact/test_fsdp.py derives: per decoder layer the forward sums over HIDDEN five times,
    the head dimension once, SEQ twice, INTERMEDIATE once, and two all-reduces over the ranks; then the
    final norm and head over HIDDEN and the log-sum-exp over VOCAB; the backward runs the transposed sums,
    each weight's gradient one over the tokens. Each run within gamma(path) of the exact gradient, the two
    within twice that."""
    forward = (
        LAYERS * (5 * HIDDEN + HIDDEN // HEADS + 2 * SEQ + INTERMEDIATE + 2 * world) + 2 * HIDDEN + VOCAB
    )
    return 2 * _gamma(2 * forward + tokens + world)


@pytest.fixture(scope="module", params=WORLDS, ids=[f"{w} ranks" for w in WORLDS])
def tp_results(request, tmp_path_factory):
    """(world, {case: [each rank's result], "log": ...}) of one launch of the workers on `world` ranks."""
    world = request.param
    out = tmp_path_factory.mktemp(f"tp{world}")
    start = time.monotonic()
    codes = launch(
        [sys.executable, "-m", "tests.invact._tp_workers", str(out)], world, out, _WORKER_TIMEOUT_S
    )
    results = {"log": f"workers exited with {codes} after {time.monotonic() - start:.0f} s:\n"
                      f"{log_tails(out, world)}"}  # fmt: skip
    for case in CASES:
        files = [out / f"{case}_rank{r}.pt" for r in range(world)]
        results[case] = [torch.load(f, weights_only=False) if f.exists() else None for f in files]
    return world, results


def _ranks(tp_results, case: str) -> list[dict]:
    world, results = tp_results
    ranks = results[case]
    if any(r is None for r in ranks):
        pytest.fail(f"{case}: a rank saved no result\n{results['log']}")
    for r in ranks:
        assert "error" not in r, r["error"]
        if "skipped" in r:
            pytest.skip(r["skipped"])
    return ranks


def test_linear_cross_entropy_over_vocabulary_shards_within_the_bound_of_float64(tp_results):
    world = tp_results[0]
    for rank, result in enumerate(_ranks(tp_results, "functional")):
        errors = result["errors"]
        assert (
            len(errors) == 2 * len(REDUCTIONS) * 2 * 2 * 2
        )  # chunks x reductions x smoothing x weights x bias
        over = {k: e for k, e in errors.items() if not e <= _functional_bound(world)}
        assert not over, (rank, over, _functional_bound(world))


@pytest.mark.parametrize("case", TRAINING)
def test_losses_equal_eager_tensor_parallel(tp_results, case):
    world = tp_results[0]
    for rank, r in enumerate(_ranks(tp_results, case)):
        eager, patched = r["eager"]["losses"][0], r["patched"]["losses"][0]
        assert abs(patched - eager) <= _loss_bound(world) * abs(eager), (rank, patched, eager)
        assert r["patched"]["losses"][1] < patched  # it trains: AdamW's step lowers the loss


@pytest.mark.parametrize("case", TRAINING)
def test_gradients_within_the_bound_of_one_process(tp_results, case):
    world = tp_results[0]
    tokens = BATCH * SEQ * (2 if "fsdp_tp" in case else 1)
    for rank, r in enumerate(_ranks(tp_results, case)):
        want, got = r["reference"]["grads"], r["patched"]["grads"]
        assert got.keys() == want.keys()
        for name, g in want.items():
            error = float((got[name] - g).norm() / g.norm())
            assert error <= _grad_bound(world, tokens), (rank, name, error)


@pytest.mark.parametrize("case", TRAINING)
def test_no_logits_saved_and_each_ranks_peak_below_eager(tp_results, case):
    for rank, r in enumerate(_ranks(tp_results, case)):
        eager, patched = r["eager"], r["patched"]
        assert eager["vocab_wide"], "eager TP saves its logits: the check sees them"
        assert patched["vocab_wide"] == [], (rank, patched["vocab_wide"])
        assert patched["saved"] < eager["saved"], (rank, patched["saved"], eager["saved"])
        assert patched["peak"] < eager["peak"], (rank, patched["peak"], eager["peak"])


def test_the_gated_products_behind_row_parallel_dtensors_are_not_saved(tp_results):
    """Under transformers' TP the down projection saves a DTensor made from the MLP's product act(g) * u
    (its rank's columns): patch() recomputes it in backward as on one device. Recognised, the forward
    saves exactly one product less per layer, each this rank's (BATCH, SEQ, INTERMEDIATE / world) fp32."""
    world = tp_results[0]
    product = BATCH * SEQ * (INTERMEDIATE // world) * 4
    for rank, r in enumerate(_ranks(tp_results, "hf")):
        saved = r["products"]
        assert saved["kept"] - saved["recomputed"] == LAYERS * product, (rank, saved)


def test_transformers_tp_head_is_taken_over_the_shards(tp_results):
    for r in _ranks(tp_results, "hf"):
        kind, replace, reason = r["patched"]["plan"]["lm_head"]
        assert (kind, replace) == ("loss", True) and "vocabulary's shards" in reason, reason
        assert "lm_head" in r["patched"]["taken"]
        # outputs.logits read after a patched forward: gathered over the ranks, eager TP's bit for bit
        assert r["patched"]["logits_type"] == "PendingLogits"
        assert torch.equal(r["patched"]["logits"], r["eager"]["logits"])


@pytest.mark.parametrize("case", ["hf_fsdp_tp", "hf_fsdp_tp_tied"])
def test_transformers_fsdp_and_tp_plans_loaded_first_are_patched(tp_results, case):
    """A model transformers loads already sharded (its fsdp_plan's units: FSDP2's FSDP<cls> classes, the
    final norm and the head one unit; its tp_plan inside) is patched after loading: the head's loss (its
    weight a DTensor of the 2-D mesh) and the norms are taken, and the norms' probe runs no unit's hooks
    (a unit's forward before the root's makes FSDP2 refuse the model's forward)."""
    for r in _ranks(tp_results, case):
        taken = r["patched"]["taken"]
        assert "lm_head" in taken and "model.norm" in taken, taken


def test_a_head_sharded_by_hooks_is_left_alone(tp_results):
    for r in _ranks(tp_results, "hf"):
        hooked = r["hooked"]
        kind, replace, reason = hooked["plan"]["lm_head"]
        assert (kind, replace) == ("loss", False) and "linear_cross_entropy" in reason, reason
        assert "lm_head" not in hooked["taken"]
        assert hooked["patched"] == hooked["eager"]  # the loss as it was: eager's, exactly
