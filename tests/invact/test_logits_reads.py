"""A patched training call's `outputs.logits` (invact.loss.PendingLogits) read every way a tensor is read
gives what eager's logits give, bit for bit: Python's operators, torch functions (lists of tensors
included), tensor methods, len and iteration, torch.tensor / torch.as_tensor, torch.save and pickle. A
read after the head's weight changed in place (optimizer.step()) raises, as do uses that would act on a
computed copy (in-place ops) or on a graph the loss does not go through."""

from __future__ import annotations

import copy
import io
import operator
import pickle
import re
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers

import invact
import invact.loss as L

VOCAB = 128
CONFIG = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=VOCAB)  # fmt: skip


def _llama():
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(model_type="llama", **CONFIG)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float().train()


def _pair(route: str):
    """(eager, patched) twins with the same weights. The loss alone is patched (norms=False, exclude="*":
    the activations and norms have their own tests), so both heads see the same hidden states bit for
    bit. `route`: "straight", the head's input goes to transformers' loss (HeadLoss) and the output's
    PendingLogits is made after the forward; "hooked", a forward hook on the head makes the head return
    a PendingLogits that the model's own loss code runs on."""
    eager = _llama()
    patched = copy.deepcopy(eager)
    invact.patch(patched, norms=False, exclude="*")
    assert patched.get_output_embeddings()._invact_straight  # Llama hands its head's output to its loss
    if route == "hooked":
        for model in (eager, patched):
            model.get_output_embeddings().register_forward_hook(lambda module, args, output: None)
    return eager, patched


def _inputs():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 8), generator=g)
    return ids, ids.clone()


@pytest.fixture(scope="module", params=["straight", "hooked"])
def outputs(request):
    """Eager's and the patched model's outputs of one training call with labels."""
    eager, patched = _pair(request.param)
    ids, labels = _inputs()
    want, got = eager(input_ids=ids, labels=labels), patched(input_ids=ids, labels=labels)
    assert isinstance(got.logits, L.PendingLogits) and isinstance(want.logits, torch.Tensor)
    return got, want


def _same(got, want, grad: bool = True) -> None:
    """got is what eager's read gave: a tensor of the same dtype and shape, equal element for element
    (rtol = atol = 0: the same ops on the same operands round alike; NaN where eager has NaN), on the
    autograd graph where eager's is (`grad`); lists, tuples and other values equal."""
    if isinstance(want, torch.Tensor):
        assert type(got) is torch.Tensor and got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
        if grad:
            assert got.requires_grad == want.requires_grad
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            _same(a, b, grad)
    elif isinstance(want, np.ndarray):
        np.testing.assert_array_equal(got, want, strict=True)
    else:
        assert type(got) is type(want) and got == want


def _saved(logits):
    buffer = io.BytesIO()
    torch.save(logits, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


# A fixed operand of the logits' shape, and a matrix for products over the vocabulary.
OTHER = torch.randn(2, 8, VOCAB, generator=torch.Generator().manual_seed(2))
RIGHT = torch.randn(VOCAB, 3, generator=torch.Generator().manual_seed(3))

# (id, read): each is applied to the patched output's logits and to eager's.
READS = [
    # Python's operators, the logits on either side
    ("neg", lambda z: -z),
    ("pos", lambda z: +z),
    ("abs", lambda z: abs(z)),
    ("add", lambda z: z + 1.5),
    ("radd", lambda z: 1.5 + z),
    ("add tensor", lambda z: z + OTHER),
    ("tensor add", lambda z: OTHER + z),
    ("sub", lambda z: z - 1.5),
    ("rsub", lambda z: 1 - z),
    ("sub tensor", lambda z: z - OTHER),
    ("tensor sub", lambda z: OTHER - z),
    ("mul", lambda z: z * 3),
    ("rmul", lambda z: 3 * z),
    ("mul tensor", lambda z: z * OTHER),
    ("truediv", lambda z: z / 7),
    ("rtruediv", lambda z: 1 / z),
    ("truediv tensor", lambda z: z / OTHER),
    ("floordiv", lambda z: z // 0.25),
    ("rfloordiv", lambda z: 3 // z),
    ("mod", lambda z: z % 0.5),
    ("rmod", lambda z: 1.0 % z),
    ("pow", lambda z: z**2),
    ("rpow", lambda z: 2**z),
    ("pow tensor", lambda z: z ** OTHER.abs()),
    ("matmul", lambda z: z @ RIGHT),
    ("tensor matmul", lambda z: torch.ones(3, 8) @ z),
    ("gt", lambda z: z > 0),
    ("ge", lambda z: z >= 0),
    ("lt", lambda z: z < 0),
    ("le", lambda z: z <= 0),
    ("eq", lambda z: z == OTHER),
    ("ne", lambda z: z != OTHER),
    ("gt tensor", lambda z: z > OTHER),
    ("reflected lt", lambda z: 0 < z),
    ("tensor ge", lambda z: OTHER >= z),
    ("contains", lambda z: 0.5 in z),
    # len, iteration, indexing
    ("len", lambda z: len(z)),
    ("iter", lambda z: list(z)),
    ("reversed", lambda z: reversed(z)),
    ("getitem", lambda z: z[0]),
    ("getitem last token", lambda z: z[:, -1]),
    ("getitem mask", lambda z: z[OTHER > 1]),
    # torch functions, a list of tensors included
    ("cat", lambda z: torch.cat([z, OTHER])),
    ("cat tuple dim", lambda z: torch.cat((OTHER, z, z), dim=-1)),
    ("stack", lambda z: torch.stack([z, OTHER])),
    ("where", lambda z: torch.where(z > 0, z, OTHER)),
    ("softmax", lambda z: torch.softmax(z, -1)),
    ("log_softmax", lambda z: F.log_softmax(z, dim=-1)),
    (
        "cross_entropy none",
        lambda z: F.cross_entropy(z.view(-1, VOCAB), _inputs()[1].view(-1), reduction="none"),
    ),
    ("as_tensor", lambda z: torch.as_tensor(z)),
    ("tensor", lambda z: torch.tensor(z)),
    ("from_dlpack", lambda z: torch.from_dlpack(z.detach())),
    # tensor methods and attributes
    ("argmax", lambda z: z.argmax(-1)),
    ("softmax method", lambda z: z.softmax(-1)),
    ("sum", lambda z: z.sum()),
    ("mean", lambda z: z.mean(-1)),
    ("max", lambda z: z.max(-1)),
    ("topk", lambda z: z.topk(5)),
    ("float", lambda z: z.float()),
    ("float times", lambda z: z.float() * 3),
    ("double", lambda z: z.double()),
    ("half", lambda z: z.half()),
    ("to float32", lambda z: z.to(torch.float32)),
    ("to float64", lambda z: z.to(torch.float64)),
    ("to cpu", lambda z: z.to("cpu")),
    ("view", lambda z: z.view(-1, VOCAB)),
    ("reshape", lambda z: z.reshape(16, VOCAB)),
    ("view 3d", lambda z: z.view(2, -1, VOCAB)),
    ("contiguous", lambda z: z.contiguous()),
    ("transpose", lambda z: z.mT),
    ("detach", lambda z: z.detach()),
    ("clone", lambda z: z.clone()),
    ("numpy", lambda z: z.detach().numpy()),
    ("tolist", lambda z: z.tolist()),
    ("shape", lambda z: z.shape),
    ("size", lambda z: z.size(-1)),
    ("dtype", lambda z: z.dtype),
    ("ndim", lambda z: z.ndim),
    ("dim", lambda z: z.dim()),
    ("device", lambda z: z.device),
    ("requires_grad", lambda z: z.requires_grad),
    ("is_leaf", lambda z: z.is_leaf),
    ("numel", lambda z: z.numel()),
    # serialization: the computed tensor is what is written
    ("torch.save", _saved),
    ("pickle", lambda z: pickle.loads(pickle.dumps(z))),
    ("copy", lambda z: copy.copy(z)),
]

# Reads that PendingLogits records (what models do between the head and the loss): still pending.
RECORDED = {"mul", "rmul", "truediv", "float", "float times", "to float32", "view", "reshape", "view 3d",
            "contiguous"}  # fmt: skip

# Reads whose result is off the autograd graph where eager's is on it: torch.as_tensor reads a
# non-tensor through DLPack, which carries no graph (torch.tensor's copy is detached on both sides).
DETACHED = {"as_tensor"}


@pytest.mark.parametrize(("name", "read"), READS, ids=[r[0] for r in READS])
def test_a_read_gives_eagers_result(outputs, name, read):
    got, want = outputs
    with warnings.catch_warnings():
        # eager's torch.tensor(logits) warns to clone().detach() instead; ours reads through DLPack
        warnings.filterwarnings("ignore", message="To copy construct from a tensor")
        expected = read(want.logits)
        result = read(got.logits)
    assert isinstance(got.logits, L.PendingLogits)  # the read did not replace the output's logits
    assert isinstance(result, L.PendingLogits) == (name in RECORDED)
    if name in RECORDED:  # a recorded step (a scaling, .float(), a view): pending still
        result = result.logits()
    _same(result, expected, grad=name not in DETACHED)


# (id, read) that raise on eager's logits too: ours raises the same error.
EAGER_ERRORS = [
    ("bool", lambda z: bool(z)),
    ("float()", lambda z: float(z)),
    ("int()", lambda z: int(z)),
    ("invert", lambda z: ~z),
    ("numpy asarray", lambda z: np.asarray(z)),
    ("deepcopy", lambda z: copy.deepcopy(z)),
]


@pytest.mark.parametrize(("name", "read"), EAGER_ERRORS, ids=[r[0] for r in EAGER_ERRORS])
def test_a_read_eager_refuses_raises_eagers_error(outputs, name, read):
    got, want = outputs
    with pytest.raises(Exception) as eager_error, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # float() of a tensor that requires grad warns first
        read(want.logits)
    with pytest.raises(eager_error.type, match="^" + re.escape(str(eager_error.value)) + "$"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            read(got.logits)


# (id, use) that would act on a computed copy, or hook a graph the loss does not go through: they raise
# with what to do instead of leaving the output's logits as they were.
REFUSED = [
    ("add_", lambda z: z.add_(1), "would change a copy"),
    ("masked_fill_", lambda z: z.masked_fill_(OTHER > 0, 0.0), "would change a copy"),
    ("setitem", lambda z: operator.setitem(z, 0, 0.0), "item assignment would change a copy"),
    ("retain_grad", lambda z: z.retain_grad(), "never see the loss's gradient"),
    ("register_hook", lambda z: z.register_hook(lambda g: g), "never see the loss's gradient"),
]


@pytest.mark.parametrize(("name", "use", "message"), REFUSED, ids=[r[0] for r in REFUSED])
def test_a_use_on_a_copy_raises_with_what_to_do(outputs, name, use, message):
    got, _ = outputs
    with pytest.raises(RuntimeError, match=rf"{message}.*patch\(model, loss=False\)"):
        use(got.logits)


def test_the_pending_logits_stay_hashable_by_identity(outputs):
    # `==` is the tensor's elementwise one, set after the class so that it keeps object's hash (a
    # tensor's is by identity too): code that walks an output may key its values
    got, _ = outputs
    logits = got.logits
    assert hash(logits) == object.__hash__(logits) and {logits: 1}[logits] == 1


def _trained(route: str):
    """The patched model's output of one training call, its backward and an AdamW step (lr 1e-3:
    the head's weight moves by about lr per element), and eager's output of the same call."""
    eager, patched = _pair(route)
    ids, labels = _inputs()
    want, got = eager(input_ids=ids, labels=labels), patched(input_ids=ids, labels=labels)
    got.loss.backward()
    return patched, want, got


AFTER_STEP = r"outputs\.logits was read after the head's weight changed in place \(optimizer\.step\(\)\?\)"


@pytest.mark.parametrize("route", ["straight", "hooked"])
def test_reading_the_logits_after_the_optimizer_step_raises(route):
    patched, _, got = _trained(route)
    torch.optim.AdamW(patched.parameters(), lr=1e-3).step()
    for read in (lambda z: z.argmax(-1), lambda z: -z, lambda z: torch.cat([z, z]), _saved):
        with pytest.raises(RuntimeError, match=AFTER_STEP + r".*read it before the step"):
            read(got.logits)
    assert len(got.logits) == 2 and got.logits.shape == (2, 8, VOCAB)  # the shape's: nothing computed


@pytest.mark.parametrize("route", ["straight", "hooked"])
def test_reading_the_logits_before_the_step_gives_eagers(route):
    patched, want, got = _trained(route)
    before = got.logits.argmax(-1), got.logits.detach().clone()
    torch.optim.AdamW(patched.parameters(), lr=1e-3).step()
    assert torch.equal(before[0], want.logits.argmax(-1))
    assert torch.equal(before[1], want.logits.detach())  # the step does not reach a computed read


@pytest.mark.parametrize("route", ["straight", "hooked"])
def test_the_logits_are_computed_under_the_calls_autocast_not_the_reads(route):
    """Under autocast eager's head computes bf16 logits of fp32 weights, and so do the pending ones read
    outside it; a call without autocast gives fp32 logits, also read inside an autocast region."""
    eager, patched = _pair(route)
    ids, labels = _inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, got = eager(input_ids=ids, labels=labels), patched(input_ids=ids, labels=labels)
    assert got.logits.dtype == want.logits.dtype == torch.bfloat16
    _same(got.logits.detach(), want.logits.detach())
    _same(torch.cat([got.logits, want.logits]), torch.cat([want.logits, want.logits]))
    want, got = eager(input_ids=ids, labels=labels), patched(input_ids=ids, labels=labels)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _same(got.logits.detach(), want.logits.detach())  # fp32, the call's
        _same(got.logits @ RIGHT, want.logits @ RIGHT)  # the read's product under the read's autocast


def test_a_change_between_the_head_and_the_loss_raises():
    """The loss is computed from the head's input and weight when the model's loss code calls
    F.cross_entropy: changed in place since the head's call, eager's loss would be of other logits."""
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(6, 16, generator=g, requires_grad=True)
    weight = torch.randn(VOCAB, 16, generator=g, requires_grad=True)
    pending = L.PendingLogits(hidden, weight, None)
    with torch.no_grad():
        weight.mul_(2)
    with pytest.raises(RuntimeError, match="head's weight changed in place between the head and the loss"):
        F.cross_entropy(pending, torch.zeros(6, dtype=torch.long))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_steps_after_a_cast_are_computed_in_the_new_dtype(dtype):
    """Steps recorded before `.float()` run in the head's dtype, as a model's do; after it eager runs
    them in fp32, which rounds otherwise: there the logits are computed and the step applied to them."""
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(4, 6, 32, generator=g).to(dtype).requires_grad_()
    weight = torch.randn(VOCAB, 32, generator=g).to(dtype).requires_grad_()
    pending, eager = L.PendingLogits(hidden, weight, None), F.linear(hidden, weight)
    cases = [
        (torch.tanh(pending / 30.0) * 30.0).float(),
        pending.float() / 30.0,
        torch.tanh(pending.float() / 7.0) * 7.0,
        pending.float() * 3,
    ]
    wants = [
        (torch.tanh(eager / 30.0) * 30.0).float(),
        eager.float() / 30.0,
        torch.tanh(eager.float() / 7.0) * 7.0,
        eager.float() * 3,
    ]
    for got, want in zip(cases, wants, strict=True):
        got = got.logits() if isinstance(got, L.PendingLogits) else got
        _same(got, want)


def test_a_bias_added_over_the_vocabulary_is_added_as_eager_adds_it():
    """BART's `head(h) + final_logits_bias`: the loss folds it into the head's bias; the logits add it
    after the head's own, as eager (folded, the sum rounds otherwise), and a change to it since raises."""
    g = torch.Generator().manual_seed(6)
    hidden = torch.randn(2, 5, 16, generator=g, requires_grad=True)
    weight = torch.randn(VOCAB, 16, generator=g, requires_grad=True)
    bias = torch.randn(VOCAB, generator=g, requires_grad=True)
    added = torch.randn(1, VOCAB, generator=g) * 100  # large against the head's bias: folding would round
    pending = L.PendingLogits(hidden, weight, bias) + added
    assert isinstance(pending, L.PendingLogits)
    want = F.linear(hidden, weight, bias) + added
    _same(pending.logits(), want)
    _same(pending.view(-1, VOCAB).argmax(-1), want.view(-1, VOCAB).argmax(-1))
    added.add_(1)
    with pytest.raises(RuntimeError, match="bias added to the head's output changed in place"):
        pending.logits()
