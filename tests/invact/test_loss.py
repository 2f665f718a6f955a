"""invact.loss: a causal LM's loss from hidden states, against float64 and eager, and inside Hugging Face
models (the model's own semantics: shift, ignore_index, num_items_in_batch, logits_to_keep, tied and
biased heads, softcapping, logit scales, the Trainer)."""

from __future__ import annotations

import copy
import inspect
import math
import pickle

import pytest
import torch
import torch.nn.functional as F
import torch.utils._python_dispatch

import invact
import invact.loss as L
from invact.loss import op as loss_op
from invact.loss import source as loss_source

# Unit roundoff of fp32 (2^-24).
U32 = 2.0**-24


def _gamma(n: int) -> float:
    """Higham's gamma_n = n u / (1 - n u): the relative error bound of a sum or dot product of n
    terms in fp32 (Accuracy and Stability of Numerical Algorithms, 2nd ed., section 3.1)."""
    return n * U32 / (1 - n * U32)


def _fp32_bound(rows: int, hidden: int, vocab: int) -> float:
    """Relative error (in norm) allowed against float64 for fp32 inputs: every loss and gradient term
    goes through at most one dot product over the hidden size (the logits), one sum over the vocabulary
    (the log-sum-exp) and one over the rows (the weight's and bias's gradients, the mean), so gamma of
    their total length bounds each term's relative error (the softmax and tanh add a few u, within)."""
    return _gamma(hidden + vocab + rows)


# The transforms models apply between head and loss: none (Llama), a scale (Cohere's logit_scale,
# Granite's 1 / logits_scaling), Gemma 2's final softcapping c * tanh(z / c) with c = 30.
TRANSFORMS = {
    "none": (),
    "scale": (("mul", 0.0625),),
    "softcap": (("div", 30.0), ("tanh",), ("mul", 30.0)),
}
ROWS, HIDDEN, VOCAB = 96, 32, 1500


def _eager(h, w, b, t, ops, smoothing, reduction, upcast=True, logits=None):
    z = F.linear(h, w, b) if logits is None else logits
    for op in ops:
        z = z * op[1] if op[0] == "mul" else z / op[1] if op[0] == "div" else torch.tanh(z)
    return F.cross_entropy(z.float() if upcast else z, t, label_smoothing=smoothing, reduction=reduction)


def _case(seed: int, ignored: int = 17, scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(ROWS, HIDDEN, generator=g, dtype=torch.float64) * scale
    w = torch.randn(VOCAB, HIDDEN, generator=g, dtype=torch.float64) * 0.5
    b = torch.randn(VOCAB, generator=g, dtype=torch.float64)
    t = torch.randint(0, VOCAB, (ROWS,), generator=g)
    t[:ignored] = -100
    return h, w, b, t


def _run(fn, tensors, dtype):
    leaves = [x.detach().to(dtype).clone().requires_grad_() if x is not None else None for x in tensors]
    loss = fn(*leaves)
    loss.backward()
    return loss.detach().double(), [x.grad.double() for x in leaves if x is not None]


def _errors(got, want):
    (gl, gg), (wl, wg) = got, want
    return [abs(gl - wl).item() / max(abs(wl).item(), 1e-30)] + [
        ((a - b).norm() / b.norm()).item() for a, b in zip(gg, wg, strict=True)
    ]


def _many_chunks(monkeypatch) -> None:
    """Chunks of 7 rows of fp32 logits (14 of 16-bit): 14 (7) chunks of the 96 rows, the last partial."""
    monkeypatch.setattr(loss_op, "BLOCK_BYTES", {"cpu": 7 * 4 * VOCAB, "cuda": 7 * 4 * VOCAB})
    monkeypatch.setattr(loss_op, "MIN_ROWS", 1)


@pytest.fixture(params=["one chunk", "many chunks"])
def blocks(request, monkeypatch):
    if request.param == "many chunks":
        _many_chunks(monkeypatch)
    return request.param


@pytest.mark.parametrize("bias", [False, True], ids=["no bias", "bias"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("transform", sorted(TRANSFORMS))
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_fp32_within_the_derived_bound_of_float64(blocks, transform, smoothing, bias, reduction):
    h, w, b, t = _case(0)
    ops = TRANSFORMS[transform]
    tensors = (h, w, b if bias else None)
    want = _run(lambda h, w, b: _eager(h, w, b, t, ops, smoothing, reduction), tensors, torch.float64)
    got = _run(
        lambda h, w, b: L.linear_cross_entropy(
            h, w, t, linear_bias=b, ops=ops, label_smoothing=smoothing, reduction=reduction
        ),
        tensors,
        torch.float32,
    )
    bound = _fp32_bound(ROWS, HIDDEN, VOCAB)
    errors = _errors(got, want)
    assert max(errors) <= bound, (errors, bound)


# Unit roundoff of the 16-bit formats (8 and 11 bits of precision).
U16 = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def _chunk_slack(h, w, b, t, ops, dtype) -> float:
    """The weight gradient's extra relative error where it is summed over several chunks off CUDA
    (invact.loss.op._accumulate): each chunk's 16-bit product P_c = d_c^T h_c is rounded once, which
    adds at most u/2 |P_c| elementwise, so at most u/2 sum_c ||P_c|| / ||d W|| in norm (P_c from the
    float64 reference's logit gradient d); 0 where the rows are one chunk."""
    rows = loss_op.chunk_rows(ROWS, VOCAB, dtype.itemsize, "cpu", 4 * VOCAB * HIDDEN, True)
    if rows >= ROWS:
        return 0.0
    z = F.linear(h, w, b).requires_grad_()
    _eager(None, None, None, t, ops, 0.0, "mean", logits=z).backward()
    d = z.grad
    parts = sum((d[i : i + rows].t() @ h[i : i + rows]).norm() for i in range(0, ROWS, rows))
    return (U16[dtype] / 2 * parts / (d.t() @ h).norm()).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("transform", sorted(TRANSFORMS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_16bit_no_farther_from_float64_than_eager(blocks, transform, dtype, seed):
    # Eager upcasts the 16-bit logits to fp32 before the loss (Hugging Face's ForCausalLMLoss): the same
    # 16-bit matmul, then fp32. Both then round in fp32 in different orders, so ours may differ from
    # eager's distance by the fp32 bound (relative to the reference), and the weight's gradient by
    # its chunks' roundings (_chunk_slack), no more.
    h, w, b, t = _case(seed)
    ops = TRANSFORMS[transform]
    tensors = (h, w, b)
    want = _run(lambda h, w, b: _eager(h, w, b, t, ops, 0.0, "mean"), tensors, torch.float64)
    eager = _errors(_run(lambda h, w, b: _eager(h, w, b, t, ops, 0.0, "mean"), tensors, dtype), want)
    ours = _errors(
        _run(lambda h, w, b: L.linear_cross_entropy(h, w, t, linear_bias=b, ops=ops), tensors, dtype), want
    )
    slack = [_fp32_bound(ROWS, HIDDEN, VOCAB)] * 4
    slack[2] += _chunk_slack(h, w, b, t, ops, dtype)  # the weight's (loss, hidden, weight, bias)
    assert all(o <= e + s for o, e, s in zip(ours, eager, slack, strict=True)), (ours, eager, slack)


@pytest.mark.parametrize("bias", [False, True], ids=["no bias", "bias"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_one_block_without_smoothing_is_eagers_loss_bit_for_bit(bias, reduction):
    # one chunk of fp32 logits: F.cross_entropy's own forward and backward ops on the same logits
    h, w, b, t = _case(0)
    assert loss_op.chunk_rows(ROWS, VOCAB, 4, h.device, 4 * VOCAB * HIDDEN, True) >= ROWS
    tensors = (h, w, b if bias else None)
    want = _run(lambda h, w, b: _eager(h, w, b, t, (), 0.0, reduction), tensors, torch.float32)
    got = _run(
        lambda h, w, b: L.linear_cross_entropy(h, w, t, linear_bias=b, reduction=reduction),
        tensors,
        torch.float32,
    )
    assert torch.equal(got[0], want[0])
    assert all(torch.equal(a, e) for a, e in zip(got[1], want[1], strict=True))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_all_targets_ignored_behaves_as_eager(blocks, reduction):
    h, w, b, t = _case(0, ignored=ROWS)
    want = _run(lambda h, w, b: _eager(h, w, b, t, (), 0.0, reduction), (h, w, b), torch.float32)
    got = _run(
        lambda h, w, b: L.linear_cross_entropy(h, w, t, linear_bias=b, reduction=reduction),
        (h, w, b),
        torch.float32,
    )
    # mean: 0 / 0 = nan, as eager; sum: 0; gradients zero (nan times zero where eager's mean is nan)
    assert torch.equal(got[0].isnan(), want[0].isnan()) and (got[0].isnan() or got[0] == want[0] == 0)
    for a, e in zip(got[1], want[1], strict=True):
        assert torch.equal(a.isnan(), e.isnan()) and torch.equal(a.nan_to_num(), e.nan_to_num())


@pytest.mark.parametrize("transform", sorted(TRANSFORMS))
def test_large_finite_inputs_give_finite_loss_and_gradients(blocks, transform):
    # Logits up to about 1e4 (hidden 300 times the usual scale): exp overflows fp32 beyond 88.7, so a
    # naive softmax would not be finite; the log-sum-exp is.
    h, w, b, t = _case(0, scale=300.0)
    ops = TRANSFORMS[transform]
    loss, grads = _run(lambda h, w, b: L.linear_cross_entropy(h, w, t, linear_bias=b, ops=ops),
                       (h, w, b), torch.float32)  # fmt: skip
    assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads)


def test_bad_arguments_are_one_line_errors():
    h, w, _, t = _case(0)
    with pytest.raises(ValueError, match="reduction"):
        L.linear_cross_entropy(h, w, t, reduction="mode")
    with pytest.raises(ValueError, match="targets for"):
        L.linear_cross_entropy(h, w, t[:-1])
    with pytest.raises(ValueError, match="label_smoothing"):
        L.linear_cross_entropy(h, w, t, label_smoothing=1.5)


@pytest.mark.parametrize("frozen", [False, True], ids=["trained head", "frozen head"])
def test_saves_its_gradients_alone(frozen):
    """What the loss keeps for the backward is its gradients, computed in the forward: the hidden
    states' and (unless the head is frozen) the weight's, each its input's size, neither of them
    rows x vocab; not the inputs."""
    h, w, _, t = _case(0)
    h, w = h.float().requires_grad_(), w.float().requires_grad_(not frozen)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x) or x, lambda x: x):
        L.linear_cross_entropy(h, w, t)
    assert [tuple(x.shape) for x in saved] == [tuple(h.shape)] + ([] if frozen else [tuple(w.shape)])
    assert not {x.untyped_storage().data_ptr() for x in saved} & {h.data_ptr(), w.data_ptr()}


# -- Inside Hugging Face models --------------------------------------------------------------------------

transformers = pytest.importorskip("transformers")

SIZES = dict(vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, max_position_embeddings=64)  # fmt: skip


def _models():
    """label -> a tiny causal LM of each head/loss arrangement Hugging Face models use."""
    T = transformers
    kv = dict(num_key_value_heads=2)
    return {
        "llama": lambda: T.LlamaForCausalLM(T.LlamaConfig(**SIZES, **kv)),
        "llama tied": lambda: T.LlamaForCausalLM(T.LlamaConfig(**SIZES, **kv, tie_word_embeddings=True)),
        "gemma2 softcap": lambda: T.Gemma2ForCausalLM(
            T.Gemma2Config(**SIZES, **kv, head_dim=8, final_logit_softcapping=30.0)
        ),
        "cohere logit_scale": lambda: T.CohereForCausalLM(T.CohereConfig(**SIZES, **kv, logit_scale=0.0625)),
        "granite logits_scaling": lambda: T.GraniteForCausalLM(
            T.GraniteConfig(**SIZES, **kv, logits_scaling=8.0)
        ),
        "phi head bias": lambda: T.PhiForCausalLM(T.PhiConfig(**SIZES)),
    }


def _pair(label):
    torch.manual_seed(0)
    plain = _models()[label]().float().train()
    patched = copy.deepcopy(plain)
    invact.patch(patched, norms=False, exclude="*")  # activations and norms: their own tests; the loss alone
    return plain, patched


def _inputs():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, SIZES["vocab_size"], (3, 16), generator=g)
    labels = ids.clone()
    labels[0, :5] = -100  # a prompt
    labels[2] = -100  # a row whose labels are all ignored
    return ids, labels


def _step(model, **kwargs):
    model.zero_grad()
    out = model(**kwargs)
    out.loss.backward()
    return (
        out,
        out.loss.detach().double(),
        [p.grad.double() for p in model.parameters() if p.grad is not None],
    )


def _on_demand(out, want_out, bound: float | None = 0.0) -> None:
    """The patched output's logits are PendingLogits (nothing computed or kept until used) of eager's
    shape and dtype, and used, within `bound` of eager's logits relative to their norm (0: bit for bit,
    the same head on the same hidden states; None: not compared)."""
    logits, want = out.logits, want_out.logits
    assert isinstance(logits, L.PendingLogits) and out["logits"] is logits
    assert logits.shape == want.shape and logits.dtype == want.dtype
    if bound == 0.0:
        assert torch.equal(logits.detach(), want.detach())
    elif bound is not None:
        assert (logits.detach() - want.detach()).norm() <= bound * want.detach().norm()


# The tiny models' fp32 bound: the head's dot products over hidden 32, the loss's sums over the vocabulary
# (1000) and the 48 rows; the layers below add their own fp32 rounding, the same in both models.
HF_BOUND = _fp32_bound(48, 32, 1000)


@pytest.mark.parametrize("label", sorted(_models()))
@pytest.mark.parametrize("items", [None, 29], ids=["mean", "num_items_in_batch"])
def test_patched_model_loss_and_gradients_match_eager(label, items):
    plain, patched = _pair(label)
    assert any(d.kind == "loss" and d.replace for d in invact.plan(patched))
    assert isinstance(patched.get_output_embeddings(), torch.nn.Linear)  # still an nn.Linear, in place
    ids, labels = _inputs()
    extra = {} if items is None else {"num_items_in_batch": torch.tensor(items)}
    want_out, want_loss, want_grads = _step(plain, input_ids=ids, labels=labels, **extra)
    out, loss, grads = _step(patched, input_ids=ids, labels=labels, **extra)
    _on_demand(out, want_out)  # the contract: no logits kept, computed where they are used
    assert abs(loss - want_loss) <= HF_BOUND * abs(want_loss)
    assert len(grads) == len(want_grads)
    for g, w in zip(grads, want_grads, strict=True):
        assert (g - w).norm() <= HF_BOUND * w.norm() + 1e-30


def test_shift_labels_and_logits_to_keep_are_the_models_own():
    plain, patched = _pair("llama")
    ids, labels = _inputs()
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()
    for kwargs in ({"shift_labels": shifted}, {"logits_to_keep": 16}):
        _, want, _ = _step(plain, input_ids=ids, labels=labels, **kwargs)
        _, got, _ = _step(patched, input_ids=ids, labels=labels, **kwargs)
        assert abs(got - want) <= HF_BOUND * abs(want)


@pytest.mark.parametrize("label", sorted(_models()))
def test_inference_eval_and_calls_without_labels_are_unchanged(label):
    plain, patched = _pair(label)
    ids, labels = _inputs()
    assert torch.equal(patched(input_ids=ids).logits, plain(input_ids=ids).logits)  # training, no labels
    with torch.no_grad():  # no gradients: the logits, as eager
        assert torch.equal(
            patched(input_ids=ids, labels=labels).logits, plain(input_ids=ids, labels=labels).logits
        )
    plain.eval(), patched.eval()
    a, b = patched(input_ids=ids, labels=labels), plain(input_ids=ids, labels=labels)
    assert torch.equal(a.logits, b.logits) and torch.equal(a.loss, b.loss)


def test_the_step_saves_no_fp32_logits():
    plain, patched = _pair("llama")
    ids, labels = _inputs()
    eager = invact.memory.saved_tensors(plain, input_ids=ids, labels=labels)
    ours = invact.memory.saved_tensors(patched, input_ids=ids, labels=labels)
    fp32_logits = ids.numel() * SIZES["vocab_size"] * 4
    # ours keeps the loss's gradients in their place: the hidden states' (where eager's head keeps the
    # hidden states) and the head weight's, which a step's backward holds from its first op anyway (not
    # counted: invact.memory.EARLY_GRADIENT)
    assert eager.saved_bytes - ours.saved_bytes >= fp32_logits


def test_logits_used_otherwise_are_computed_as_the_model_would():
    _, patched = _pair("gemma2 softcap")
    head = patched.get_output_embeddings()
    head._invact_straight = False  # as for a model whose forward does more between head and loss
    h = torch.randn(2, 5, SIZES["hidden_size"])
    head._invact_armed = 1
    try:
        pending = torch.tanh(head(h) / 30.0) * 30.0
    finally:
        head._invact_armed = 0
    assert isinstance(pending, L.PendingLogits) and pending.shape == (2, 5, SIZES["vocab_size"])
    want = torch.tanh(F.linear(h, head.weight) / 30.0) * 30.0
    assert torch.equal(pending.argmax(-1), want.argmax(-1))  # a tensor method: on the computed logits
    assert torch.equal(pending[0], want[0])
    computed = []
    pending.logits = lambda: computed.append(1) or want  # counts the calls that compute them
    # code that walks an output probes for a mapping's or a sparse tensor's attributes: not computed
    assert not any(hasattr(pending, name) for name in ("keys", "items", "values", "indices", "to_dict"))
    assert not computed and pending.sum() == want.sum() and computed == [1]


def test_eager_takes_the_stand_in_where_the_head_feeds_the_loss_straight(monkeypatch):
    # no PendingLogits is made where the head's output goes straight to the loss (its Python is host
    # time); a model with another step between them (the clamp) still takes it
    made = []
    monkeypatch.setattr(L.PendingLogits, "__init__", lambda self, *a, **k: made.append(a) or None)
    _, patched = _pair("gemma2 softcap")
    ids, labels = _inputs()
    out, _, _ = _step(patched, input_ids=ids, labels=labels)
    assert len(made) == 1 and isinstance(out.logits, L.PendingLogits)  # the output's, not the loss's
    torch.manual_seed(0)
    clamped = ClampedLlamaForCausalLM(transformers.LlamaConfig(**SIZES, num_key_value_heads=2)).train()
    invact.patch(clamped, norms=False, exclude="*")
    with pytest.raises(AttributeError):  # the stub's PendingLogits has no fields: it was made and used
        clamped(input_ids=ids, labels=labels)
    assert made


def test_a_forward_hook_on_the_head_sees_the_logits_it_asks_for():
    plain, patched = _pair("gemma2 softcap")
    seen = []
    for model in (plain, patched):
        model.get_output_embeddings().register_forward_hook(lambda m, a, out: seen.append(out.argmax(-1)))
    ids, labels = _inputs()
    _, want, _ = _step(plain, input_ids=ids, labels=labels)
    _, got, _ = _step(patched, input_ids=ids, labels=labels)
    assert torch.equal(seen[0], seen[1])  # the hook's tensor method ran on the computed logits
    assert abs(got - want) <= HF_BOUND * abs(want)


def test_plan_names_the_head_and_loss_false_leaves_it():
    plain, _ = _pair("llama")
    decisions = [d for d in invact.plan(plain) if d.kind == "loss"]
    assert [(d.name, d.replace) for d in decisions] == [("lm_head", True)]
    assert not [d for d in invact.plan(plain, loss=False) if d.kind == "loss"]
    names = invact.patch(plain, norms=False, loss=False)
    assert "lm_head" not in names and type(plain.lm_head) is torch.nn.Linear
    base = transformers.LlamaModel(transformers.LlamaConfig(**SIZES, num_key_value_heads=2))
    assert not [d for d in invact.plan(base) if d.kind == "loss"]  # no head


def test_a_model_with_a_custom_loss_function_is_left_alone_with_the_reason():
    plain, _ = _pair("llama")
    plain.loss_function = lambda logits, labels, vocab_size, **kwargs: logits.float().mean()
    (d,) = [d for d in invact.plan(plain) if d.kind == "loss"]
    assert not d.replace and "causal-LM loss" in d.reason


def test_copies_and_pickles_keep_the_loss_path():
    _, patched = _pair("llama")
    ids, labels = _inputs()
    _, want, _ = _step(patched, input_ids=ids, labels=labels)
    for other in (copy.deepcopy(patched), pickle.loads(pickle.dumps(patched))):
        out, got, _ = _step(other, input_ids=ids, labels=labels)
        assert isinstance(out.logits, L.PendingLogits) and got == want
        assert vars(other)["_loss_function"].owner is other  # its steps read the copy's settings


def test_the_patched_forward_keeps_its_signature_and_a_raising_call_disarms():
    """Trainer reads inspect.signature(model.forward) to pick a dataset's columns; a forward that raises
    leaves nothing armed, so the next call is a plain one."""
    plain, patched = _pair("llama")
    assert inspect.signature(patched.forward) == inspect.signature(plain.forward)
    ids, labels = _inputs()
    with pytest.raises(ValueError):  # the embedding's own error, raised inside the forward
        patched(input_ids=ids, labels=labels, inputs_embeds=torch.zeros(3, 16, SIZES["hidden_size"]))
    head = patched.get_output_embeddings()
    assert head._invact_armed == 0 and not vars(patched).get("_invact_arms")
    _, got, _ = _step(patched, input_ids=ids, labels=labels)
    _, want, _ = _step(plain, input_ids=ids, labels=labels)
    assert abs(got - want) <= HF_BOUND * abs(want)


@pytest.mark.slow
def test_hf_trainer_step_matches_eager(tmp_path):
    from transformers import Trainer, TrainingArguments

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return 6

        def __getitem__(self, i):
            ids, labels = _inputs()
            return {"input_ids": ids[i % 3], "labels": labels[i % 3]}

    losses = {}
    for name, model in zip(("eager", "patched"), _pair("llama"), strict=True):
        seen = []
        model.register_forward_hook(lambda m, i, o, seen=seen: seen.append(o.loss.detach().double()))
        args = TrainingArguments(output_dir=str(tmp_path / name), use_cpu=True, report_to=[],
                                 save_strategy="no", max_steps=1, per_device_train_batch_size=6,
                                 learning_rate=0.1, optim="sgd", disable_tqdm=True, seed=0)  # fmt: skip
        Trainer(model=model, args=args, train_dataset=Rows()).train()
        losses[name] = seen[0]
    assert math.isfinite(losses["patched"]) and abs(losses["patched"] - losses["eager"]) <= HF_BOUND * abs(
        losses["eager"]
    )


def _compiled_step(patched, **kwargs):
    """_step through torch.compile(fullgraph=True) with aot_eager (the eager ops, so bitwise comparable),
    and the names of the ops its graphs call."""
    from tests.invact._stack_workers import _recording

    ops: set[str] = set()
    traced: set[str] = set()
    torch._dynamo.reset()
    try:
        compiled = torch.compile(patched, backend=_recording(ops, traced), fullgraph=True)
        return (*_step(compiled, **kwargs), ops, traced)
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("label", sorted(_models()))
@pytest.mark.parametrize("items", [None, 29], ids=["mean", "num_items_in_batch"])
def test_under_torch_compile_the_loss_is_the_op_where_the_head_feeds_the_loss(label, items):
    plain, patched = _pair(label)
    ids, labels = _inputs()
    extra = {} if items is None else {"num_items_in_batch": torch.tensor(items)}
    _, want_loss, want_grads = _step(patched, input_ids=ids, labels=labels, **extra)  # eager patch()
    out, loss, grads, ops, traced = _compiled_step(patched, input_ids=ids, labels=labels, use_cache=False,
                                                   **extra)  # fmt: skip
    # every model here hands its head's output to its loss function straight or through the steps the
    # loss reads from its source (a soft-cap, a scale): Dynamo traces the loss as the op, which the
    # compiled graph calls as eager does (the same chunks and kernels), its gradients from its forward
    assert patched.get_output_embeddings()._invact_straight
    assert "invact.linear_cross_entropy.default" in ops, sorted(ops)
    assert not [op for op in ops if "log_softmax" in op], sorted(ops)
    assert out.logits is None and "logits" not in out.keys()  # compiled: no logits (a graph returns tensors)
    # each within HF_BOUND of float64 (the masked rows' sum rounds in another order than eager's)
    assert abs(loss - want_loss) <= 2 * HF_BOUND * abs(want_loss)
    # AOTAutograd sums a tensor's gradient contributions in its own order (1-ulp differences in the
    # layers below the loss, compiled or not patched): the same bound as eager patch() against torch
    assert len(grads) == len(want_grads)
    for g, w in zip(grads, want_grads, strict=True):
        assert (g - w).norm() <= HF_BOUND * w.norm() + 1e-30
    assert getattr(patched.get_output_embeddings(), "_invact_hidden", None) is None  # nothing left held


@pytest.mark.parametrize("label", ["llama", "gemma2 softcap"])
def test_under_torch_compile_the_step_saves_no_fp32_logits(label):
    plain, patched = _pair(label)
    ids, labels = _inputs()
    saved = {}
    for name, model in (("plain", plain), ("patched", patched)):
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=invact.memory.inductor_partition, fullgraph=True)
        invact.memory.saved_tensors(compiled, input_ids=ids, labels=labels, use_cache=False)  # compiles
        saved[name] = invact.memory.saved_tensors(compiled, input_ids=ids, labels=labels, use_cache=False)
    torch._dynamo.reset()
    fp32_logits = ids.numel() * SIZES["vocab_size"] * 4
    # the op keeps its gradients: the hidden states' in place of the head's input, and the head weight's,
    # which the backward's first op holds anyway (not counted: invact.memory.EARLY_GRADIENT); no logits
    assert saved["plain"].saved_bytes - saved["patched"].saved_bytes >= fp32_logits


@pytest.mark.parametrize("label", sorted(_models()))
def test_under_torch_compile_no_tensor_of_the_logits_size_is_computed(label):
    """What the model's code does to the head's stand-in (a soft-cap, a scale) runs on no columns: the
    traced graph computes no tensor of rows x vocab elements (a full-shaped stand-in soft-capped came
    out as one, returned as the logits, at the forward's peak)."""
    _, patched = _pair(label)
    ids, labels = _inputs()
    sizes = []

    def backend(gm, example_inputs):
        for node in gm.graph.nodes:
            value = node.meta.get("example_value")
            if node.op.startswith("call") and isinstance(value, torch.Tensor):
                sizes.append((value.numel(), str(node.target)))
        return gm

    torch._dynamo.reset()
    try:
        torch.compile(patched, backend=backend, fullgraph=True)(input_ids=ids, labels=labels, use_cache=False)
    finally:
        torch._dynamo.reset()
    logits = ids.numel() * SIZES["vocab_size"]
    assert sizes and not [s for s in sizes if s[0] >= logits]


def test_under_torch_compile_a_tuple_output_holds_no_stand_in():
    from tests.invact._stack_workers import _recording

    _, patched = _pair("llama")
    ids, labels = _inputs()
    torch._dynamo.reset()
    compiled = torch.compile(patched, backend=_recording(set()), fullgraph=True)
    out = compiled(input_ids=ids, labels=labels, use_cache=False, return_dict=False)
    torch._dynamo.reset()
    assert isinstance(out, tuple) and out[0].dim() == 0 and out[1] is None  # (loss, logits=None, ...)
    head = patched.get_output_embeddings()
    assert getattr(head, "_invact_standin", None) is None and getattr(head, "_invact_hidden", None) is None


# What a forward may do between its head and its loss for the loss to be the op under torch.compile: the
# steps invact.loss reads from the source (forms Hugging Face's models use), and forms it refuses.
class _Base(torch.nn.Module):
    cap, scale = 30.0, 0.5

    def loss_function(self, logits, labels, vocab_size, **kwargs):
        return logits.sum()


class _Straight(_Base):
    def forward(self, h, labels=None):
        logits = self.lm_head(h)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=8)
        return loss, logits


class _Softcapped(_Base):
    def forward(self, h, labels=None):
        logits = self.lm_head(h)
        if self.cap is not None:
            logits = logits / self.cap
            logits = torch.tanh(logits)
            logits = logits * self.cap
        logits = 2 * logits
        loss = self.loss_function(logits, labels, 8)
        return loss, logits


class _Clamped(_Base):
    def forward(self, h, labels=None):
        logits = self.lm_head(h)
        logits = logits.clamp(-30, 30)
        loss = self.loss_function(logits, labels, 8)
        return loss, logits


class _Shifted(_Base):
    def forward(self, h, labels=None):
        logits = self.lm_head(h)
        logits = logits + self.scale
        loss = self.loss_function(logits, labels, 8)
        return loss, logits


class _Branched(_Base):
    def forward(self, h, labels=None):
        logits = self.lm_head(h)
        if self.cap is not None:
            logits = logits / self.cap
        else:
            logits = logits * self.scale
        loss = self.loss_function(logits, labels, 8)
        return loss, logits


class _Upcast(_Base):
    def forward(self, h, labels=None):
        logits = self.lm_head(h)
        loss = self.loss_function(logits.float(), labels, 8)
        return loss, logits


class _Reassigned(_Base):
    def forward(self, h, labels=None):
        logits = self.lm_head(h)
        loss = self.loss_function(logits, labels, 8)
        logits = logits * self.scale
        return loss, logits


_CAP = ("cap",)


@pytest.mark.parametrize(
    "cls, steps",
    [
        (_Straight, ()),
        (_Softcapped, (("div", _CAP, _CAP), ("tanh", None, _CAP), ("mul", _CAP, _CAP), ("mul", 2.0, None))),
        (_Clamped, None),
        (_Shifted, None),
        (_Branched, None),
        (_Upcast, None),
        (_Reassigned, None),
    ],
)
def test_the_steps_between_head_and_loss_are_read_or_refused(cls, steps):
    assert loss_source._steps(cls, "lm_head") == steps


def test_the_steps_are_read_from_the_models_settings_when_it_runs():
    model = _Softcapped()
    steps = loss_source._steps(_Softcapped, "lm_head")
    assert loss_source._ops(model, steps) == (("div", 30.0), ("tanh",), ("mul", 30.0), ("mul", 2.0))
    model.cap = None  # the guard: the soft-cap's steps drop out
    assert loss_source._ops(model, steps) == (("mul", 2.0),)
    model.cap = torch.tensor(30.0)  # not a number: no op can take it
    assert loss_source._ops(model, steps) is None


class ClampedLlamaForCausalLM(transformers.LlamaForCausalLM):
    """A causal LM that clamps its logits before the loss: a step invact.loss does not read (named
    ...ForCausalLM: transformers gives such a class its causal-LM loss)."""

    def forward(self, input_ids=None, labels=None, **kwargs):
        hidden = self.model(input_ids=input_ids, use_cache=False).last_hidden_state
        logits = self.lm_head(hidden)
        logits = logits.clamp(-30, 30)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, self.vocab_size)
        return transformers.modeling_outputs.CausalLMOutputWithPast(loss=loss, logits=logits)


def test_under_torch_compile_other_steps_keep_the_models_logits():
    torch.manual_seed(0)
    plain = ClampedLlamaForCausalLM(transformers.LlamaConfig(**SIZES, num_key_value_heads=2)).train()
    patched = copy.deepcopy(plain)
    invact.patch(patched, norms=False, exclude="*")
    assert any(d.kind == "loss" and d.replace for d in invact.plan(patched))  # eager: PendingLogits
    ids, labels = _inputs()
    _, want_loss, _ = _step(plain, input_ids=ids, labels=labels)
    out, loss, _, _, traced = _compiled_step(patched, input_ids=ids, labels=labels)
    assert not patched.get_output_embeddings()._invact_straight
    assert out.logits is not None and not [op for op in traced if "linear_cross_entropy" in op]
    assert abs(loss - want_loss) <= HF_BOUND * abs(want_loss)


def test_the_cross_entropy_override_takes_f_cross_entropys_parameters():
    """PendingLogits hands F.cross_entropy's call to _cross_entropy as it was made (Python binds it):
    the same parameters, in the same order, with the same defaults."""
    import inspect

    ours, torchs = inspect.signature(L._cross_entropy), inspect.signature(F.cross_entropy)
    assert [(p.name, p.default) for p in ours.parameters.values()] == [
        (p.name, p.default) for p in torchs.parameters.values()
    ]


# -- The families beyond transformers' causal LMs: GPT-2-style heads, encoder-decoders, wrappers ----------


def _families():
    """label -> (a tiny model of a family whose loss is not named "ForCausalLM", its training inputs)."""
    T = transformers
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, SIZES["vocab_size"], (2, 12), generator=g)
    labels = ids.clone()
    labels[0, :4] = -100
    text = {"input_ids": ids, "labels": labels}
    enc_dec = dict(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                   decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, dropout=0.0,
                   attention_dropout=0.0, activation_dropout=0.0, vocab_size=SIZES["vocab_size"],
                   pad_token_id=1, decoder_start_token_id=2)  # fmt: skip
    return {
        "gpt2": (
            lambda: T.GPT2LMHeadModel(
                T.GPT2Config(
                    n_embd=32,
                    n_layer=2,
                    n_head=4,
                    n_positions=64,
                    vocab_size=SIZES["vocab_size"],
                    resid_pdrop=0.0,
                    embd_pdrop=0.0,
                    attn_pdrop=0.0,
                )
            ),
            text,
        ),  # fmt: skip
        "bert lm head": (
            lambda: T.BertLMHeadModel(
                T.BertConfig(
                    hidden_size=32,
                    num_hidden_layers=2,
                    num_attention_heads=4,
                    intermediate_size=64,
                    vocab_size=SIZES["vocab_size"],
                    is_decoder=True,
                    hidden_dropout_prob=0.0,
                    attention_probs_dropout_prob=0.0,
                )
            ),
            text,
        ),  # fmt: skip
        "t5": (
            lambda: T.T5ForConditionalGeneration(
                T.T5Config(
                    d_model=32,
                    d_ff=64,
                    num_layers=1,
                    num_heads=4,
                    d_kv=8,
                    vocab_size=SIZES["vocab_size"],
                    decoder_start_token_id=0,
                    pad_token_id=0,
                    dropout_rate=0.0,
                )
            ),
            text,
        ),  # fmt: skip
        "bart final_logits_bias": (lambda: T.BartForConditionalGeneration(T.BartConfig(**enc_dec)), text),
        "whisper": (
            lambda: T.WhisperForConditionalGeneration(
                T.WhisperConfig(**enc_dec, num_mel_bins=8, max_source_positions=8, max_target_positions=32)
            ),
            {"input_features": torch.randn(2, 8, 16, generator=g), "labels": labels},
        ),  # fmt: skip
    }


@pytest.mark.parametrize("label", sorted(_families()))
def test_families_beyond_causal_lms_take_the_loss_and_match_eager(label):
    make, inputs = _families()[label]
    torch.manual_seed(0)
    plain = make().float().train()
    patched = copy.deepcopy(plain)
    invact.patch(patched, norms=False, exclude="*")  # the loss alone
    (d,) = [d for d in invact.plan(patched) if d.kind == "loss"]
    assert d.replace, d.reason
    if label.startswith("bart"):
        with torch.no_grad():  # a bias of its own, so that folding it into the head's matters
            plain.final_logits_bias.normal_()
            patched.final_logits_bias.copy_(plain.final_logits_bias)
    want_out, want_loss, want_grads = _step(plain, **inputs)
    out, loss, grads = _step(patched, **inputs)
    # the fp32 bound of these tiny models: the head's dot products over hidden 32, the sums over the
    # vocabulary and the 24 rows (the models' own layers round alike on both sides)
    bound = _fp32_bound(24, 32, SIZES["vocab_size"])
    _on_demand(out, want_out, bound)  # BART's bias is folded into the head's: rounded once, not twice
    assert abs(loss - want_loss) <= bound * abs(want_loss)
    assert len(grads) == len(want_grads)
    for g, w in zip(grads, want_grads, strict=True):
        assert (g - w).norm() <= bound * w.norm() + 1e-30


def test_gpt2_at_its_vocabulary_keeps_no_fp32_logits():
    T = transformers
    torch.manual_seed(0)
    vocab = 50257  # GPT-2's
    plain = T.GPT2LMHeadModel(T.GPT2Config(n_embd=32, n_layer=1, n_head=4, n_positions=64, vocab_size=vocab))
    plain.train()
    patched = copy.deepcopy(plain)
    invact.patch(patched, norms=False, exclude="*")
    ids = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(1))
    eager = invact.memory.saved_tensors(plain, input_ids=ids, labels=ids)
    ours = invact.memory.saved_tensors(patched, input_ids=ids, labels=ids)
    shapes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: shapes.append(x.shape) or x, lambda x: x):
        patched(input_ids=ids, labels=ids)
    assert not [s for s in shapes if vocab in s and s.numel() >= ids.numel() * vocab]
    fp32_logits = ids.numel() * vocab * 4
    # eager's loss keeps the fp32 log-softmax; ours the hidden states' gradient where eager's head keeps
    # the hidden states (the head weight's gradient, tied to the embedding, is not counted)
    assert eager.saved_bytes - ours.saved_bytes >= fp32_logits


@pytest.mark.parametrize("order", ["wrap, then patch", "patch, then wrap"])
def test_a_peft_model_of_no_task_type_takes_the_loss_in_either_order(order):
    peft = pytest.importorskip("peft")
    plain, patched = _pair("llama")
    config = peft.LoraConfig(target_modules=["q_proj", "v_proj"], r=4)
    if order == "wrap, then patch":
        patched = copy.deepcopy(plain)
        wrapped = peft.get_peft_model(patched, config)
        invact.patch(wrapped, norms=False, exclude="*")
    else:
        wrapped = peft.get_peft_model(patched, config)
    assert type(wrapped) is peft.PeftModel
    (d,) = [d for d in invact.plan(wrapped) if d.kind == "loss"]
    assert d.replace and d.name == "base_model.model.lm_head", d.reason
    ids, labels = _inputs()
    torch.manual_seed(0)
    want = peft.get_peft_model(copy.deepcopy(plain), config)(input_ids=ids, labels=labels)
    out = wrapped(input_ids=ids, labels=labels)
    _on_demand(out, want)
    assert abs(out.loss - want.loss) <= HF_BOUND * abs(want.loss)


@pytest.mark.parametrize("needs", ["hidden and weight", "weight alone"])
def test_on_cpu_no_fp32_chunk_is_alive_at_a_16bit_matmul(monkeypatch, needs):
    """The chunked forward in bf16 on CPU frees each chunk's fp32 softmax before its 16-bit matmuls (the
    hidden's gradient, the next chunk's logits): a 16-bit matmul on CPU allocates scratch memory inside
    itself (oneDNN's), which would otherwise add to the fp32 chunk at the peak."""
    from torch.utils._python_dispatch import TorchDispatchMode

    _many_chunks(monkeypatch)
    rows = loss_op.chunk_rows(
        ROWS, VOCAB, 2, "cpu", 4 * VOCAB * HIDDEN if needs == "hidden and weight" else 0
    )
    h, w, _, t = _case(0)
    h = h.to(torch.bfloat16).requires_grad_(needs == "hidden and weight")
    w = w.to(torch.bfloat16).requires_grad_()

    class Watch(TorchDispatchMode):
        """Weak references to every fp32 tensor of a chunk's shape (its rows x the vocabulary); at each
        16-bit matmul, how many of them are alive."""

        chunks: list = []
        alive_at_16bit_mm: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.mm.default, torch.ops.aten.mm.out, torch.ops.aten.addmm.default):
                if any(isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 for a in args):
                    self.alive_at_16bit_mm.append(
                        sum(not torch.UntypedStorage._expired(r) for r in self.chunks)
                    )
            out = func(*args, **(kwargs or {}))
            chunk = isinstance(out, torch.Tensor) and out.shape in ((rows, VOCAB), (VOCAB, rows))
            if chunk and out.dtype == torch.float32:
                self.chunks.append(out.untyped_storage()._weak_ref())
            return out

    watch = Watch()
    with watch:
        L.linear_cross_entropy(h, w, t)
    chunks = len(watch.chunks)
    for ref in watch.chunks:
        torch.UntypedStorage._free_weak_ref(ref)
    # each chunk's logits, and where the hidden's gradient is wanted its product, are 16-bit matmuls
    assert chunks and len(watch.alive_at_16bit_mm) >= (2 if h.requires_grad else 1) * (ROWS // rows)
    assert not any(watch.alive_at_16bit_mm)


class _MatmulFlops(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts 2 m k n for every matrix product the dispatcher runs, out= and in-place forms too
    (torch's FlopCounterMode skips addmm_)."""

    PRODUCTS = ("mm", "addmm", "addmm_", "bmm", "baddbmm", "matmul", "linear")

    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in self.PRODUCTS:
            a, b = (args[1], args[2]) if name.startswith(("addmm", "baddbmm")) else (args[0], args[1])
            if name == "linear":
                b = b.t()
            self.flops += 2 * a.shape[-2] * a.shape[-1] * b.shape[-1] * (a.shape[0] if a.dim() == 3 else 1)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head", ["trained", "frozen"])
def test_three_matmuls_with_gradients_one_without(blocks, dtype, head):
    """Forward + backward does eager's three (rows x hidden x vocab) products (the logits, d h, d W;
    two for a frozen head), the gradients computed in the forward; a forward under no_grad one."""
    h, w, _, t = _case(0)
    h = h.to(dtype).requires_grad_()
    w = w.to(dtype).requires_grad_(head == "trained")
    one = 2 * ROWS * HIDDEN * VOCAB
    with _MatmulFlops() as counter:
        L.linear_cross_entropy(h, w, t).backward()
    assert counter.flops == (3 if head == "trained" else 2) * one
    with torch.no_grad(), _MatmulFlops() as counter:
        L.linear_cross_entropy(h, w, t)
    assert counter.flops == one


def test_a_second_backward_through_the_same_graph_raises():
    """The gradients computed in the forward are scaled in place by the first backward: a second one
    (retain_graph=True) raises torch's error on saved tensors changed in place, not wrong gradients."""
    h, w, _, t = _case(0)
    h, w = h.float().requires_grad_(), w.float().requires_grad_()
    loss = L.linear_cross_entropy(h, w, t)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


class _LogitsProducts(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the matrix products whose result has `columns` columns (a chunk's logits)."""

    def __init__(self, columns: int):
        super().__init__()
        self.columns, self.calls = columns, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in ("mm", "addmm") and out.shape[-1] == self.columns:
            self.calls += 1
        return out


@pytest.mark.parametrize("head", ["trained", "frozen"])
def test_rows_whose_logits_fit_the_weight_gradients_fp32_sum_are_one_chunk(monkeypatch, head):
    """Where the rows' logits take no more bytes than the fp32 sum of the weight gradient that several
    chunks would need and a chunk, they are one chunk (no sum, the same peak): one logits matmul for all
    rows. A frozen head needs no such sum, and keeps BLOCK_BYTES's chunks."""
    _many_chunks(monkeypatch)
    # 30 x 1500 x 4 bytes of logits; 4 x 1500 x 160 of the weight's fp32 sum and 7 x 1500 x 4 a chunk
    rows, hidden = 30, 160
    h = torch.randn(rows, hidden, requires_grad=True)
    w = torch.randn(VOCAB, hidden, requires_grad=head == "trained")
    t = torch.randint(0, VOCAB, (rows,))
    with _LogitsProducts(VOCAB) as counter:
        L.linear_cross_entropy(h, w, t)
    several = -(-rows // loss_op.chunk_rows(rows, VOCAB, 4, "cpu", 4 * VOCAB * hidden))
    assert several > 1 and counter.calls == (1 if head == "trained" else several)
