"""invact.loss._triton: the head + loss's one-pass kernels, run here under TRITON_INTERPRET=1 on CPU tensors
(INVACT_BACKEND=triton), held to test_loss.py's derived fp32 bound against float64, as the torch path
is. 16-bit accuracy is judged on a GPU (test_cuda.py): the interpreter truncates fp32 -> bf16 casts."""

from __future__ import annotations

import pytest
import torch

import invact.loss as L
from invact.loss import _triton as _loss_triton
from invact.loss import op as loss_op
from tests.invact.test_loss import (
    HIDDEN,
    ROWS,
    TRANSFORMS,
    VOCAB,
    _case,
    _eager,
    _errors,
    _fp32_bound,
    _run,
)

pytest.importorskip("triton")


@pytest.fixture(params=["one chunk", "many chunks"])
def kernels(request, monkeypatch):
    monkeypatch.setenv("INVACT_BACKEND", "triton")
    if request.param == "many chunks":  # 40 rows a chunk: 3 chunks of the 96 rows, the last partial
        monkeypatch.setattr(loss_op, "BLOCK_BYTES", {"cpu": 40 * 4 * VOCAB, "cuda": 40 * 4 * VOCAB})
        monkeypatch.setattr(loss_op, "MIN_ROWS", 1)
    return request.param


# Every transform with and without smoothing, each once: the reduction is applied outside the kernels
# (the Function divides their sum by the count), so "sum" is tested once, not crossed with the rest
# (the interpreter takes 3-7 s a case).
CASES = [(transform, smoothing, "mean") for transform in sorted(TRANSFORMS) for smoothing in (0.0, 0.1)]


@pytest.mark.parametrize(("transform", "smoothing", "reduction"), [*CASES, ("softcap", 0.1, "sum")])
def test_fp32_within_the_derived_bound_of_float64(kernels, transform, smoothing, reduction):
    h, w, _, t = _case(0)
    ops = TRANSFORMS[transform]
    assert loss_op._kernels(h.float(), ops)  # the kernels serve these calls
    want = _run(lambda h, w: _eager(h, w, None, t, ops, smoothing, reduction), (h, w), torch.float64)
    got = _run(
        lambda h, w: L.linear_cross_entropy(h, w, t, ops=ops, label_smoothing=smoothing, reduction=reduction),
        (h, w),
        torch.float32,
    )
    bound = _fp32_bound(ROWS, HIDDEN, VOCAB)
    errors = _errors(got, want)
    assert max(errors) <= bound, (errors, bound)


def test_all_targets_ignored_gives_nan_mean_and_zero_gradients(kernels):
    h, w, _, t = _case(0, ignored=ROWS)
    loss, grads = _run(lambda h, w: L.linear_cross_entropy(h, w, t), (h, w), torch.float32)
    assert loss.isnan() and all(torch.equal(g, torch.zeros_like(g)) for g in grads)


@pytest.mark.parametrize(
    ("ops", "taken"),
    [
        ((), True),
        ((("mul", 2.0),), True),
        ((("div", 30.0), ("tanh",), ("mul", 30.0)), True),
        ((("tanh",),), True),
        ((("mul", 2.0), ("mul", 3.0)), False),  # two scalar steps before the tanh
        ((("tanh",), ("tanh",)), False),
        ((("tanh",), ("mul", 2.0), ("div", 3.0)), False),
    ],
)
def test_plan_takes_one_step_a_tanh_and_one_step(ops, taken):
    assert (_loss_triton.plan(ops) is not None) == taken


def test_a_head_with_a_bias_takes_the_kernels_and_its_gradient(kernels):
    # the kernel sees the chunk's logits with the bias added; the bias's gradient is their column sums
    h, w, b, t = _case(0)
    assert loss_op._kernels(h.float(), ())
    want = _run(lambda h, w, b: _eager(h, w, b, t, (), 0.0, "mean"), (h, w, b), torch.float64)
    got = _run(lambda h, w, b: L.linear_cross_entropy(h, w, t, linear_bias=b), (h, w, b), torch.float32)
    bound = _fp32_bound(ROWS, HIDDEN, VOCAB)
    assert max(_errors(got, want)) <= bound
