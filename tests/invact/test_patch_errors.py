"""invact.patch() and invact.plan() (invact/patch.py) on arguments they cannot take: a TypeError or
ValueError of one line that names the function and the argument, raised before anything changes; on
a model patched already: a second patch() changes nothing and reports nothing; and on a model whose
head was replaced after patch() (resize_token_embeddings): one warning, plan() says the loss path is
off, and patch() again takes the new head."""

from __future__ import annotations

import collections
import copy
import re
import sys
import warnings

import pytest
import torch
from torch import nn

import invact
from invact.loss import LossHead, PendingLogits

transformers = pytest.importorskip("transformers")

TINY_LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=128)  # fmt: skip


class _Net(nn.Module):
    """A Linear, a GELU, a Linear; its forward takes `x` (a keyword for dict inputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.act, self.down = nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)

    def forward(self, x):
        return self.down(self.act(self.up(x)))


def _llama(**overrides) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**TINY_LLAMA | overrides)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").train()


def _ids(vocab: int = TINY_LLAMA["vocab_size"]) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(1))


# (case, the keyword arguments ("model": what stands for the model), the error, what its message says)
BAD = [
    ("model a str", {"model": "gpt2"}, TypeError, "model must be a torch.nn.Module, got str (a model's name"),
    ("model None", {"model": None}, TypeError, "model must be a torch.nn.Module, got None"),
    ("model an int", {"model": 42}, TypeError, "model must be a torch.nn.Module, got int"),
    ("model a state_dict", {"model": "state_dict"}, TypeError, "got OrderedDict (a state_dict?"),
    ("norms 'yes'", {"norms": "yes"}, TypeError, "norms must be True or False, got 'yes'"),
    ("gated 1", {"gated": 1}, TypeError, "gated must be True or False, got 1"),
    ("loss None", {"loss": None}, TypeError, "loss must be True or False, got None"),
    ("mode unknown", {"mode": "fast"}, ValueError, "mode must be 'bits' or 'precision_bit', got 'fast'"),
    ("mode an int", {"mode": 1}, TypeError, "mode must be 'bits' or 'precision_bit' (a str), got int"),
    ("include an int", {"include": 5}, TypeError, "include takes glob patterns"),
    ("exclude of ints", {"exclude": [3]}, TypeError, "exclude takes glob patterns"),
    ("example_inputs a list", {"example_inputs": [1, 2]}, TypeError, "example_inputs must be a tensor"),
    ("include matching nothing", {"include": "enc.*"}, ValueError, "include pattern 'enc.*' matches no"),
]


@pytest.mark.parametrize("function", [invact.patch, invact.plan], ids=["patch", "plan"])
@pytest.mark.parametrize("case, kwargs, error, says", BAD, ids=[case for case, *_ in BAD])
def test_bad_arguments_name_the_argument_and_change_nothing(function, case, kwargs, error, says):
    net = _Net()
    kwargs = dict(kwargs)
    model = kwargs.pop("model", net)
    model = net.state_dict() if model == "state_dict" else model
    with pytest.raises(error, match=re.escape(says)) as raised:
        function(model, **kwargs)
    message = str(raised.value)
    assert "\n" not in message
    if case != "include matching nothing":  # the plan's own ValueError names the pattern
        assert message.startswith(f"invact.{function.__name__}: "), message
    assert type(net.act) is nn.GELU  # nothing patched


def test_a_mapping_as_example_inputs_is_its_dict():
    """transformers' BatchEncoding is a Mapping, not a dict: taken as the dict of keyword arguments."""
    x = torch.randn(4, 8)
    as_dict = invact.plan(_Net(), example_inputs={"x": x})
    assert invact.plan(_Net(), example_inputs=collections.UserDict(x=x)) == as_dict
    assert [d.name for d in as_dict if d.replace] == ["act"]


def test_a_second_patch_changes_and_reports_nothing():
    model = _llama()
    plain = copy.deepcopy(model)
    first = invact.patch(model)
    assert "lm_head" in first and "model.layers.0.mlp.act_fn" in first and "model.norm" in first
    ids = _ids()
    once = model(input_ids=ids, labels=ids)
    once.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    assert invact.patch(model) == []
    assert invact.patch(model, norms=False, gated=False) == []  # it undoes nothing either
    forward = vars(model)["forward"]
    assert invact.patch(model) == [] and vars(model)["forward"] is forward  # not wrapped again
    (d,) = [d for d in invact.plan(model) if d.kind == "loss"]  # the head as it is: patched
    assert d.replace and not d.reason.startswith("not in effect")
    twice = model(input_ids=ids, labels=ids)
    twice.loss.backward()
    assert isinstance(twice.logits, PendingLogits)  # the loss path, as after the first call
    assert torch.equal(twice.loss, once.loss)
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, grads[name]), name
    want = plain(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(twice.loss, want, rtol=1e-5, atol=0)


def _invact_warnings(caught) -> list[warnings.WarningMessage]:
    return [w for w in caught if str(w.message).startswith("invact:")]


def _same_loss(model: nn.Module, ids: torch.Tensor, tied: bool) -> PendingLogits:
    """The patched model's training forward: its loss is the unpatched model's of the same weights."""
    out = model(input_ids=ids, labels=ids)
    plain = _llama(tie_word_embeddings=tied)
    plain.resize_token_embeddings(model.config.vocab_size)
    plain.load_state_dict(model.state_dict())
    torch.testing.assert_close(out.loss, plain(input_ids=ids, labels=ids).loss, rtol=1e-5, atol=0)
    return out.logits


def test_a_head_replaced_after_patch_warns_and_patch_takes_it_back():
    model = _llama()  # its own head (tie_word_embeddings False, Llama's default)
    invact.patch(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.resize_token_embeddings(128)  # the same size: the same head, nothing to say
        assert not _invact_warnings(caught)
        resized_at = sys._getframe().f_lineno + 1
        model.resize_token_embeddings(136)  # a new nn.Linear
    (warned,) = _invact_warnings(caught)
    said = str(warned.message)
    assert "lm_head of LlamaForCausalLM was replaced after invact.patch()" in said
    assert "call invact.patch(model) again" in said
    assert "\n" not in said
    # at the user's line (the resize above), not inside transformers' resize_token_embeddings
    assert (warned.filename, warned.lineno) == (__file__, resized_at)
    assert type(model.lm_head) is nn.Linear
    (d,) = [d for d in invact.plan(model) if d.kind == "loss"]
    assert d.replace and d.reason.startswith("not in effect: the head was replaced after invact.patch()")
    ids = _ids(136)
    out = model(input_ids=ids, labels=ids)
    assert type(out.logits) is torch.Tensor  # the model's own loss, on full logits: correct, no saving

    assert invact.patch(model) == ["lm_head"]  # takes the new head
    assert isinstance(model.lm_head, LossHead)
    (d,) = [d for d in invact.plan(model) if d.kind == "loss"]
    assert d.replace and not d.reason.startswith("not in effect")
    assert isinstance(_same_loss(model, ids, tied=False), PendingLogits)  # the loss from hidden states again
    # taken again, not twice over: one forward wrapper, and the loss function follows the new head
    assert not isinstance(vars(model)["forward"].__wrapped__, type(vars(model)["forward"]))
    assert model._loss_function.head is model.lm_head

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.resize_token_embeddings(144)  # after patch() took a head again: one more warning
        model.resize_token_embeddings(152)  # then no more until patch() runs again
    assert len(_invact_warnings(caught)) == 1


def test_a_tied_head_resized_stays_patched():
    """A head tied to the input embeddings keeps its module through resize_token_embeddings (it takes the
    new embedding's weight): the loss path stays, nothing to warn about."""
    model = _llama(tie_word_embeddings=True)
    invact.patch(model)
    head = model.lm_head
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.resize_token_embeddings(136)
    assert not _invact_warnings(caught)
    assert model.lm_head is head and model.lm_head.weight is model.model.embed_tokens.weight
    assert invact.patch(model) == []
    assert isinstance(_same_loss(model, _ids(136), tied=True), PendingLogits)


def test_copies_of_a_patched_model_watch_their_own_head():
    model = _llama()
    invact.patch(model)
    other = copy.deepcopy(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        other.resize_token_embeddings(136)
    assert len(_invact_warnings(caught)) == 1
    assert isinstance(model.lm_head, LossHead) and model.lm_head.out_features == 128  # the original
