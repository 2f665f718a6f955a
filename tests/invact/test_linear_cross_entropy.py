"""invact.functional.linear_cross_entropy: torch's F.linear_cross_entropy signature (input, linear_weight,
target, *, linear_bias, weight, reduction, ignore_index, label_smoothing) on the chunked loss, against
F.cross_entropy(F.linear(...)) in float64 for every argument, in one chunk and many."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F

import invact
from invact.loss import op as loss_op
from tests.invact.test_loss import _fp32_bound

ROWS, HIDDEN, VOCAB = 40, 16, 600
# The fp32 bound of tests/invact/test_loss.py (gamma of the longest sum a term goes through: the hidden
# size, the vocabulary, the rows) with class weights one product more per term, which the softmax's and
# tanh's few unit roundoffs it leaves room for already cover.
BOUND = _fp32_bound(ROWS, HIDDEN, VOCAB)


@pytest.fixture(params=["one chunk", "many chunks"])
def chunks(request, monkeypatch):
    if request.param == "many chunks":  # 6 rows of fp32 logits a chunk: 7 chunks of the 40, the last partial
        monkeypatch.setattr(loss_op, "BLOCK_BYTES", {"cpu": 6 * 4 * VOCAB, "cuda": 6 * 4 * VOCAB})
        monkeypatch.setattr(loss_op, "MIN_ROWS", 1)
    return request.param


def _case(seed: int, ignore_index: int | None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(ROWS, HIDDEN, generator=g, dtype=torch.float64)
    w = torch.randn(VOCAB, HIDDEN, generator=g, dtype=torch.float64) * 0.5
    b = torch.randn(VOCAB, generator=g, dtype=torch.float64)
    cw = torch.rand(VOCAB, generator=g, dtype=torch.float64) + 0.5
    t = torch.randint(0, VOCAB, (ROWS,), generator=g)
    t[:7] = -100 if ignore_index is None else ignore_index
    return x, w, b, cw, t


def _grads(fn, tensors, dtype, upstream):
    leaves = [None if x is None else x.detach().to(dtype).requires_grad_() for x in tensors]
    loss = fn(*leaves)
    loss.backward(upstream.to(loss.dtype))
    return loss.detach().double(), [x.grad.double() for x in leaves if x is not None]


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


@pytest.mark.parametrize("ignore_index", [None, -100, 3], ids=["ignore None", "ignore -100", "ignore 3"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("class_weight", [False, True], ids=["", "class weights"])
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_fp32_within_the_derived_bound_of_float64(
    chunks, reduction, bias, class_weight, smoothing, ignore_index
):
    x, w, b, cw, t = _case(0, ignore_index)
    kwargs = dict(weight=cw if class_weight else None, reduction=reduction, label_smoothing=smoothing)
    # a gradient from above that is not all ones: "none"'s rows each scaled, a scalar's by 1.7
    upstream = torch.linspace(-1, 2, ROWS, dtype=torch.float64) if reduction == "none" else torch.tensor(1.7)
    tensors = (x, w, b if bias else None)

    def reference(x, w, b):
        index = -100 if ignore_index is None else ignore_index
        return F.cross_entropy(F.linear(x, w, b), t, ignore_index=index, **kwargs)

    def ours(x, w, b):
        return invact.functional.linear_cross_entropy(
            x, w, t, linear_bias=b, ignore_index=ignore_index, **kwargs
        )

    want_loss, want = _grads(reference, tensors, torch.float64, upstream)
    # class weights in fp32 as the fp32 inputs are (F.cross_entropy takes them in the logits' dtype)
    kwargs["weight"] = None if not class_weight else cw.float()
    got_loss, got = _grads(ours, tensors, torch.float32, upstream)
    errors = [_relative(got_loss, want_loss)] + [_relative(a, b) for a, b in zip(got, want, strict=True)]
    assert max(errors) <= BOUND, (errors, BOUND)
    assert got_loss.shape == want_loss.shape


@pytest.mark.parametrize("shape", [(), (5,), (2, 5), (2, 3, 5)], ids=["unbatched", "rows", "2-d", "3-d"])
def test_inputs_of_any_leading_shape(shape):
    # torch's takes (in,) and (rows, in); invact's also (..., in), as F.linear does (target of that shape).
    g = torch.Generator().manual_seed(1)
    x = torch.randn(*shape, HIDDEN, generator=g)
    w = torch.randn(VOCAB, HIDDEN, generator=g)
    t = torch.randint(0, VOCAB, shape, generator=g)
    for reduction in ("mean", "none"):
        got = invact.functional.linear_cross_entropy(x, w, t, reduction=reduction)
        z = F.linear(x, w).reshape(-1, VOCAB)
        want = F.cross_entropy(z, t.reshape(-1), reduction=reduction).reshape(
            shape if reduction == "none" else ()
        )
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=BOUND, atol=0.0)


def test_class_probabilities_as_target_are_torchs():
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(ROWS, HIDDEN, generator=g), torch.randn(VOCAB, HIDDEN, generator=g)
    p = torch.softmax(torch.randn(ROWS, VOCAB, generator=g), dim=1)
    got = invact.functional.linear_cross_entropy(x, w, p, label_smoothing=0.1)
    assert torch.equal(got, F.cross_entropy(F.linear(x, w), p, label_smoothing=0.1))


def test_the_signature_is_torchs():
    ours = inspect.signature(invact.functional.linear_cross_entropy).parameters
    names = ["input", "linear_weight", "target", "linear_bias", "weight", "reduction", "ignore_index",
             "label_smoothing"]  # fmt: skip
    assert list(ours)[: len(names)] == names and list(ours)[len(names) :] == ["ops"]
    if hasattr(F, "linear_cross_entropy"):  # torch 2.13 and later: the same names, kinds and defaults
        torch_params = inspect.signature(F.linear_cross_entropy).parameters
        for name in names:
            a, b = ours[name], torch_params[name]
            assert (a.kind, a.default) == (b.kind, b.default), name


def test_bad_arguments_are_one_line_errors():
    x, w, _, _, t = _case(0, None)
    lce = invact.functional.linear_cross_entropy
    for call, words in [
        (lambda: lce(x, w, t, reduction="average"), "reduction must be one of"),
        (lambda: lce(x, w, t[:-1]), "targets for"),
        (lambda: lce(x, w, t, label_smoothing=-0.1), "label_smoothing"),
        (lambda: lce(x[0, 0], w, t), "at least one dimension"),
    ]:
        with pytest.raises(ValueError, match=words) as caught:
            call()
        assert "\n" not in str(caught.value)


def test_reduction_none_keeps_no_logits_for_backward():
    # What the graph saves: the inputs it was given (references) and nothing of the (rows x vocab) logits.
    x, w, _, _, t = _case(0, None)
    x, w = x.float().requires_grad_(), w.float().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda s: saved.append(s) or s, lambda s: s):
        loss = invact.functional.linear_cross_entropy(x, w, t, reduction="none")
    assert loss.shape == (ROWS,)
    assert all(s.numel() < ROWS * VOCAB for s in saved), [tuple(s.shape) for s in saved]
