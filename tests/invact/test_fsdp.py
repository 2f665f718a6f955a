"""invact.patch() on a tiny Llama trained by two gloo processes under FSDP2's fully_shard, in the
wrappings people use (tests/invact/_fsdp_workers.py: CASES), under DDP, and under DeepSpeed ZeRO-3
where deepspeed is installed: each case trains, patched, as it does unpatched in the same wrapping.

Per case, on both ranks and for both runs (unpatched, patched): no error; the parameters really
sharded (FSDP2: DTensors whose shard is at most half of the parameter; ZeRO-3: its partition);
step 1's loss the unpatched run's within the loss's rounding (LOSS_BOUND); step 2's within what step 1's
different update can change it by (test_second_step_loss); step 1's gradients the gradients of the
patched model in this process on the global batch, within the rounding of another summation order
(GRAD_BOUND); and, where a step's live bytes can be followed, a lower peak patched.

All cases run in one pair of worker processes (importing transformers, 3 s a process, paid once);
fsdp_results reads what each saved.
"""

from __future__ import annotations

import importlib.util
import math
import sys
import time
from pathlib import Path

import pytest
import torch

import invact
from invact.activation.ops import CPU_BODY_MAX_ELEMENTS
from tests.gloo import launch, log_tails
from tests.invact._fsdp_workers import (
    CASES,
    FSDP_CASES,
    HEADS,
    HIDDEN,
    INTERMEDIATE,
    LAYERS,
    ROWS_PER_RANK,
    SEQ,
    VOCAB,
    WORLD,
    global_batch,
    make_model,
    plain_name,
    rank_batch,
)
from tests.invact.test_loss import _fp32_bound as _loss_fp32_bound

REPO = Path(__file__).resolve().parents[2]
_WORKER_TIMEOUT_S = 300  # the workers' own collectives time out after 60 s; deepspeed's first use builds
# its CPU communication op (a C++ compile, 40 s on two cores)

U32 = 2.0**-24  # unit roundoff of fp32
U16 = 2.0**-8  # bf16's: a value rounded to bf16 is within 2^-8 of it, relatively


def _gamma(n: int) -> float:
    """Higham's gamma_n = n u / (1 - n u): the relative error of an fp32 sum or dot product of n terms
    (relative to the sum of the terms' magnitudes)."""
    return n * U32 / (1 - n * U32)


# Step 1's loss, patched against unpatched in the same wrapping: the forward up to the last hidden state
# runs the same ops on the same values (the norms' and activations' outputs are torch's bitwise:
# tests/invact/test_norm_patch.py, test_functional.py), so the two differ only in the loss itself, which
# the patched model computes a chunk of rows at a time. Each is within test_loss's fp32 bound (gamma of
# the head's dot products over HIDDEN, the log-sum-exp over VOCAB and the mean over the rank's SEQ - 1
# tokens) of the exact loss of those logits: their difference within twice that, relative to the loss.
LOSS_BOUND = 2 * _loss_fp32_bound(ROWS_PER_RANK * (SEQ - 1), HIDDEN, VOCAB)

# The summed lengths a gradient goes through, forward then backward. Per decoder layer the forward sums
# over HIDDEN five times (the input norm's mean square, the q/k/v projections, o_proj, the
# post-attention norm, the gate and up projections), over the head dimension once (the scores), over
# SEQ twice (softmax's sum and the probabilities times v) and over INTERMEDIATE once (down_proj); then
# the final norm and the head over HIDDEN, the log-sum-exp over VOCAB. The backward runs the transposed
# sums of the same lengths, and each weight's gradient a sum over the global batch's tokens.
_FORWARD_PATH = LAYERS * (5 * HIDDEN + HIDDEN // HEADS + 2 * SEQ + INTERMEDIATE) + 2 * HIDDEN + VOCAB
_PATH = 2 * _FORWARD_PATH + WORLD * ROWS_PER_RANK * SEQ
# Step 1's gradients under a wrapping against the same patched model in one process on the global batch:
# the same per-element products of the same fp32 values, summed in other orders (each rank's half, then
# averaged; other matmul blocks). To first order the relative roundings along a gradient's path add up:
# each run is within gamma(_PATH) of the exact gradient, relative to its terms' magnitudes; the two
# within twice that. Compared in norm per parameter, taking the terms' magnitudes as the gradient's
# (no cancellation amplifying it: measured 5.1e-8 at most, the embeddings' scatter-add in another order;
# every other gradient bitwise), 6.8e-4 for these sizes: a factor 2, a rank's half missing or a wrong
# shard are errors of order 1.
GRAD_BOUND = 2 * _gamma(_PATH)
# Step 2's loss: step 1 updated patched and unpatched parameters differently (their gradients differ by
# the approximations), and each forward rounds at other values: twice the first-order change (as
# test_training_stacks.test_hf_trainer_trains_a_patched_model), plus each forward's rounding, gamma of the
# forward's path relative to the loss.
STEP2_ROUNDING = 2 * _gamma(_FORWARD_PATH)

# The cases whose step 1 is followed by invact.planner.live_bytes.LiveBytes: not under torch.compile (Dynamo
# refuses to trace under a dispatch mode), nor under checkpointing, where what the forward saves is a
# layer's input and the peak is in the backward of a recomputed layer: there the workers' CPU backward
# (the generated torch functions, as in _stack_workers: numba would compile in each process) takes
# temporaries for q(y) that numba's kernel does not (measured, one process at these shapes: patched
# 3.35 MB against 2.75 MB unpatched with those functions, 2.50 MB with numba).
PEAK_CASES = tuple(c for c in CASES if c not in ("compiled", "checkpointed"))
ACTIVATION_OPS = {"invact.forward.default", "invact.backward.default"}


@pytest.fixture(scope="module")
def fsdp_results(tmp_path_factory):
    """{case: [rank 0's result, rank 1's]} of tests/invact/_fsdp_workers.py (None where a rank saved none:
    it crashed or was killed) and "log": the workers' exit codes and the ends of their logs."""
    out = tmp_path_factory.mktemp("fsdp")
    start = time.monotonic()
    # deepspeed (where installed) on its CPU accelerator, over gloo
    command = [sys.executable, "-m", "tests.invact._fsdp_workers", str(out)]
    codes = launch(command, WORLD, out, _WORKER_TIMEOUT_S, env={"DS_ACCELERATOR": "cpu"})
    # A rank that crashed (a segfault) or was killed (-9, at the deadline) loses the cases from there on:
    # each of those fails with the logs, the cases before keep their results.
    tails = log_tails(out, WORLD)
    results = {"log": f"workers exited with {codes} after {time.monotonic() - start:.0f} s:\n{tails}"}
    for case in CASES:
        files = [out / f"{case}_rank{r}.pt" for r in range(WORLD)]
        results[case] = [torch.load(f) if f.exists() else None for f in files]
    return results


def _runs(results, case) -> list[dict]:
    """Both ranks' result of `case`, checked to be there and to have trained (or skipped for a
    deepspeed that is not installed)."""
    if case == "deepspeed_zero3" and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed")  # importorskip's answer, without importing it here
    ranks = results[case]
    if any(r is None for r in ranks):
        pytest.fail(f"{case}: a rank saved no result\n{results['log']}")
    for r in ranks:
        assert "error" not in r, r.get("error")
        if "skipped" in r:
            pytest.skip(r["skipped"])
        for variant in ("unpatched", "patched"):
            assert "error" not in r[variant], f"{variant}:\n{r[variant]['error']}"
    return ranks


@pytest.fixture(scope="module")
def references():
    """The patched model's step-1 gradients in this process (the workers' CPU kernels: no numba):
    {False: untied, True: tied} on the global batch in fp32, "bf16": the mean of the two halves' bf16
    gradients (the mixed-precision case's, see test_step1_gradients), and "names": what patch() replaced."""
    from invact.activation import _numba

    refs = {}
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_numba, "available", lambda: False)
        torch.set_num_threads(1)  # the workers' one thread a rank: the same kernels for bf16
        try:
            for tied in (False, True):
                model = make_model(tied)
                refs["names"] = invact.patch(model)
                refs[tied] = _grads(model, global_batch())
            halves = []
            for rank in range(WORLD):
                model = make_model()
                invact.patch(model)
                for p in model.parameters():  # FSDP2's param_dtype casts parameters, not buffers
                    p.data = p.data.bfloat16()
                halves.append({k: g.float() for k, g in _grads(model, rank_batch(rank)).items()})
            refs["bf16 halves"] = halves
        finally:
            torch.set_num_threads(threads)
    return refs


def _grads(model, ids) -> dict[str, torch.Tensor]:
    model.train()
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    return {plain_name(n): p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("case", CASES)
def test_trains_sharded(fsdp_results, references, case):
    ranks = _runs(fsdp_results, case)
    for r in ranks:
        assert r["unpatched"]["patched"] == []
        assert r["patched"]["patched"] == references["names"]  # the same modules, patched before or after
        for run in (r["unpatched"], r["patched"]):
            assert all(math.isfinite(x) for x in run["losses"])
            if case in FSDP_CASES:
                assert run["param_types"] == ["DTensor"]
            # each rank holds at most its share of every parameter (DDP: all of it)
            for name, (held, whole) in run["shards"].items():
                share = whole if case == "ddp" else -(-whole // WORLD)
                assert held <= share and (case == "ddp" or held < whole), (name, held, whole)
            # checkpointing ran each layer again in backward (before its backward); elsewhere once
            if case != "compiled":
                assert run["layer_calls"] == LAYERS * (2 if case == "checkpointed" else 1)
    if case == "compiled":  # the layers compiled: invact traced as its ops, run as their bodies
        for variant in ("unpatched", "patched"):
            run = ranks[0][variant]
            traced = {op.removesuffix(".default") for op in run["traced"]}
            assert run["ops"] and traced, variant
            mine = {op for op in traced if op.startswith("invact.")}
            if variant == "patched":
                assert {"invact.norm_forward", "invact.gated_linear"} <= mine, sorted(traced)
            else:
                assert not mine, sorted(mine)
            # the bodies run, but for the activation's own ops on CPU from CPU_BODY_MAX_ELEMENTS elements
            # on (invact.activation.ops._body_here: the op's numba kernel, or its torch functions, there)
            called = ACTIVATION_OPS if ROWS_PER_RANK * SEQ * INTERMEDIATE >= CPU_BODY_MAX_ELEMENTS else set()
            assert {op for op in run["ops"] if op.startswith("invact.")} <= called, run["ops"]


@pytest.mark.parametrize("case", CASES)
def test_first_step_loss(fsdp_results, case):
    for r in _runs(fsdp_results, case):
        got, want = r["patched"]["losses"][0], r["unpatched"]["losses"][0]
        bound = LOSS_BOUND * abs(want)
        if case == "mixed_bf16":
            # The logits are a bf16 matmul of bf16 values: each run's, accumulated in its own blocks, is
            # within 2^-8 |z| of the other's, and the log-sum-exp and the target's logit move by at most
            # the largest change of a logit each.
            bound += 2 * 2 * U16 * r["unpatched"]["max_logit"][0]
        assert abs(got - want) <= bound, (got, want, bound)


# The cases whose head is an FSDP2 unit of its own or with the final norm: a patched model's logits
# are read by gathering its weight again (invact.loss._gathered) while its shards are as the loss found
# them. In the others the root holds the head, or DDP its whole weight.
HEAD_UNITS = ("head_unit", "norm_head_unit")


@pytest.mark.parametrize("case", [c for c in CASES if c != "deepspeed_zero3"])
def test_logits_are_right_or_refused(fsdp_results, case):
    """outputs.logits of a patched model under the wrapping (computed when read): eager's logits (equal
    sums and maxima: the same F.linear of the same hidden states) or a one-line refusal, never other
    values. Before backward: eager's. After it: eager's where the head's weight can be had as it was (DDP
    keeps it; a head unit gathers it again), refused where FSDP2's root freed it. After the parameters
    change in place (an optimizer's step): refused."""
    for r in _runs(fsdp_results, case):
        got, want = r["patched"]["probe"], r["unpatched"]["probe"]
        assert "error" not in want["before"] and want["after"] == want["updated"] == want["before"]
        assert got["before"] == want["before"]
        freed = "invact: outputs.logits was read after FSDP2 freed the head's gathered weight"
        if case in HEAD_UNITS or case == "ddp":
            assert got["after"] == want["before"]
        else:
            assert got["after"].get("error", "").startswith(freed), got["after"]
        updated = got["updated"].get("error", "")
        # DDP's weight, and the [norm, head] unit's (left gathered after a read: the norm's backward
        # needs it), changed in place; the head unit's shards changed (FSDP2 freed it after the read)
        if case in ("ddp", "norm_head_unit"):
            assert updated.startswith(
                "invact: outputs.logits was read after the head's weight changed in place"
            )
        elif case == "head_unit":
            assert updated.startswith("invact: outputs.logits was read after an optimizer's step changed"), (
                updated
            )
        else:
            assert updated.startswith(freed), updated
        assert "\n" not in updated


@pytest.mark.parametrize("case", CASES)
def test_second_step_loss(fsdp_results, case):
    """Both runs train (the global loss falls), and step 2's global loss (the mean over the ranks, whose
    gradient is the averaged one) moved from the unpatched run's by no more than step 1's different
    update explains: theta' - theta'_u is measured (the parameters after step 1), so to first order
    |L'_patched - L'_unpatched| <= sum |grad L'| |theta' - theta'_u| (grad L' of step 2, unpatched), twice
    that for the higher orders, plus each forward's rounding (STEP2_ROUNDING)."""
    ranks = _runs(fsdp_results, case)
    mean = lambda variant, step: sum(r[variant]["losses"][step] for r in ranks) / WORLD  # noqa: E731
    for variant in ("unpatched", "patched"):
        assert mean(variant, 1) < mean(variant, 0), variant
    if case == "mixed_bf16":
        return  # bf16 forwards at two parameter sets round differently: step 1's loss and gradients only
    run, patched = ranks[0]["unpatched"], ranks[0]["patched"]
    drift = sum(
        (run["grads"][1][n].double().abs() * (patched["params"][n] - run["params"][n]).double().abs()).sum()
        for n in run["params"]
    ).item()
    want = mean("unpatched", 1)
    bound = 2 * drift + STEP2_ROUNDING * abs(want)
    assert abs(mean("patched", 1) - want) <= bound, (mean("patched", 1), want, drift, bound)


@pytest.mark.parametrize("case", CASES)
def test_first_step_gradients(fsdp_results, references, case):
    ranks = _runs(fsdp_results, case)
    got = ranks[0]["patched"]["grads"][0]
    for other in ranks[1:]:  # after the reduction both ranks hold one gradient
        theirs = other["patched"]["grads"][0]
        assert got.keys() == theirs.keys() and all(torch.equal(got[k], theirs[k]) for k in got)
    if case == "mixed_bf16":
        # Under MixedPrecisionPolicy(bf16 parameters, fp32 reduction) each rank computes its half's bf16
        # gradients from the bf16 parameters, with the kernels this process runs at one thread on the
        # same shapes: its gradients are the reference half's bitwise, as fp32. The reduce-scatter adds
        # the two halves in fp32 and halves the sum (exact): within one rounding, u |a + b| / 2 <= u (|a|
        # + |b|) / 2, of the reference's mean, itself rounded once: twice that.
        halves = references["bf16 halves"]
        want = {k: (halves[0][k] + halves[1][k]) / 2 for k in halves[0]}
        assert got.keys() == want.keys()
        for k in want:
            bound = 2 * U32 * (halves[0][k].abs() + halves[1][k].abs()) / 2
            worst = ((got[k] - want[k]).abs() - bound).max().item()
            assert worst <= 0, f"{k}: exceeds its bound by {worst:.3g}"
        return
    want = references[case == "tied"]
    assert got.keys() == want.keys()
    for k in want:
        err, norm = (got[k] - want[k]).double().norm().item(), want[k].double().norm().item()
        assert err <= GRAD_BOUND * norm, f"{k}: relative error {err / norm:.3g} > {GRAD_BOUND:.3g}"


@pytest.mark.parametrize("case", PEAK_CASES)
def test_patched_peak_is_lower(fsdp_results, case):
    """Each rank's peak live bytes of step 1's forward and backward (invact.planner.live_bytes.LiveBytes: the
    shards, buffers and inputs from the start, then every storage an op allocates until it is freed)."""
    for r in _runs(fsdp_results, case):
        patched, unpatched = r["patched"]["peak"], r["unpatched"]["peak"]
        assert 0 < patched < unpatched, (patched, unpatched)
