"""Norms called as functions (invact.norm.functional): invact.functional.rms_norm and layer_norm are torch's
values and invact's inverted norm op (the one the norm modules run, whose numerics tests/invact/test_norm.py
bounds per variant), and patch() rewrites a forward that calls torch's (nanochat's `norm(x)` helper, a
forward's own F.rms_norm / F.layer_norm / torch.rms_norm, with and without parameters) to call invact's:
outputs bitwise the unpatched model's, gradients bitwise those of the same forward calling invact's by hand,
fewer bytes saved. A forward that cannot be rewritten safely is left alone with the reason."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import invact
from invact.norm import InvNorm
from invact.norm import functional as norm_functional

D = 32


def _norm(x):  # nanochat's helper: a weightless RMSNorm over the last dimension
    return F.rms_norm(x, (x.size(-1),))


def _rms(m, x):
    return F.rms_norm(x, (D,))


def _rms_ours(m, x):
    return invact.functional.rms_norm(x, (D,))


def _rms_weight(m, x):
    return F.rms_norm(x, (D,), m.weight, 1e-6)


def _rms_weight_ours(m, x):
    return invact.functional.rms_norm(x, (D,), m.weight, 1e-6)


def _torch_rms(m, x):
    return torch.rms_norm(x, [D])


def _helper(m, x):
    return _norm(x)


def _helper_ours(m, x):
    return invact.functional.rms_norm(x, (x.size(-1),))


def _layer(m, x):
    return F.layer_norm(x, (D,))


def _layer_ours(m, x):
    return invact.functional.layer_norm(x, (D,))


def _layer_params(m, x):
    return F.layer_norm(x, (D,), m.weight, m.bias)


def _layer_params_ours(m, x):
    return invact.functional.layer_norm(x, (D,), m.weight, m.bias)


# Each form: (the norm as the forward calls torch's, the same by hand with invact's, with parameters?)
FORMS = {
    "F.rms_norm": (_rms, _rms_ours, False),
    "F.rms_norm weight eps": (_rms_weight, _rms_weight_ours, True),
    "torch.rms_norm": (_torch_rms, _rms_ours, False),
    "helper norm(x)": (_helper, _helper_ours, False),
    "F.layer_norm": (_layer, _layer_ours, False),
    "F.layer_norm weight bias": (_layer_params, _layer_params_ours, True),
}
NORM = _rms  # what Block's forward calls: set per test (a global name, as nanochat calls its helper)


class Block(nn.Module):
    """A block calling its norm as a function before each projection (nanochat's Block: the norm's
    output is what the projection saves)."""

    def __init__(self, params: bool) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)
        self.weight = nn.Parameter(torch.randn(D) * 0.1 + 1) if params else None
        self.bias = nn.Parameter(torch.randn(D) * 0.1) if params else None

    def forward(self, x):
        x = x + self.down(torch.relu(self.up(NORM(self, x))))
        return x + self.up(NORM(self, x)).sum(-1, keepdim=True)


def _block(form: str, dtype) -> Block:
    torch.manual_seed(0)
    return Block(FORMS[form][2]).to(dtype)


def _run(model, x):
    x = x.detach().clone().requires_grad_()
    with invact.memory.count_saved(model) as counted:
        out = model(x)
    out.float().square().mean().backward()
    grads = [x.grad, *(p.grad for p in model.parameters())]
    return out.detach(), grads, counted.report.saved_bytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("form", sorted(FORMS))
def test_a_rewritten_forward_is_the_same_forward_calling_invacts(form, dtype, monkeypatch):
    theirs, ours, _ = FORMS[form]
    monkeypatch.setitem(globals(), "NORM", theirs)
    model = _block(form, dtype)
    eager, by_hand = copy.deepcopy(model), copy.deepcopy(model)
    plan = {d.name: d for d in invact.plan(model)}
    name = "forward:layer_norm" if "layer" in form else "forward:rms_norm"
    assert plan[name].replace and plan[name].kind == "norm", plan[name]
    assert invact.patch(model) == [name]
    x = torch.randn(4, 16, D, generator=torch.Generator().manual_seed(1)).to(dtype) * 3
    out, grads, saved = _run(model, x)
    out_eager, _, saved_eager = _run(eager, x)
    monkeypatch.setitem(globals(), "NORM", ours)  # the unpatched forward now calls invact's by hand
    out_hand, grads_hand, saved_hand = _run(by_hand, x)
    assert torch.equal(out, out_eager)  # torch's values, bitwise
    assert torch.equal(out, out_hand)
    for g, h in zip(grads, grads_hand, strict=True):  # the op invact's functions run, bitwise
        assert (g is None and h is None) or torch.equal(g, h)  # None: a bias the form does not use
    assert saved == saved_hand < saved_eager  # each call saves its output (the projection's), not its input


@pytest.mark.parametrize("function", ["rms_norm", "layer_norm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_functions_run_the_norm_modules_op(function, dtype):
    """invact.functional.rms_norm / layer_norm: torch's values, and the gradients of an InvNorm of the
    variant torch's modules (nn.RMSNorm, nn.LayerNorm) are inverted with, bitwise."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(8, D, generator=g) * 3).to(dtype)
    w = nn.Parameter((torch.randn(D, generator=g) * 0.1 + 1).to(dtype))
    b = nn.Parameter((torch.randn(D, generator=g) * 0.1).to(dtype))
    if function == "rms_norm":
        ours = lambda x: invact.functional.rms_norm(x, (D,), w, 1e-5)  # noqa: E731
        theirs = lambda x: F.rms_norm(x, (D,), w, 1e-5)  # noqa: E731
        module = InvNorm("rms_torch", w, None, 1e-5)
    else:
        ours = lambda x: invact.functional.layer_norm(x, (D,), w, b)  # noqa: E731
        theirs = lambda x: F.layer_norm(x, (D,), w, b)  # noqa: E731
        module = InvNorm("layer", w, b, 1e-5)
    results = []
    for fn in (ours, module):
        xs = x.clone().requires_grad_()
        w.grad = b.grad = None
        y = fn(xs)
        y.backward(torch.ones_like(y))
        results.append((y.detach(), xs.grad, w.grad))
    assert torch.equal(results[0][0], theirs(x))
    for a, c in zip(results[0], results[1], strict=True):
        assert torch.equal(a, c)


def test_calls_outside_the_last_dimension_or_without_gradient_are_torchs():
    x = torch.randn(4, 6, D)
    assert torch.equal(invact.functional.rms_norm(x, (6, D)), F.rms_norm(x, (6, D)))
    inverted = type(invact.functional.rms_norm(x.requires_grad_(), (D,)).grad_fn)
    assert type(invact.functional.rms_norm(x, (6, D)).grad_fn) is not inverted  # two dimensions: torch's
    with torch.no_grad():
        assert invact.functional.rms_norm(x, (D,)).grad_fn is None


class Branching(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(D, D)

    def forward(self, x, cache=None):
        if cache is not None:  # a trace would take one path for every call
            x = x + cache
        return self.proj(F.rms_norm(x, (D,)))


def _branching_helper(x, flag=False):
    return F.rms_norm(x, (D,)) if flag else F.layer_norm(x, (D,))


class HelperBranches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(D, D)

    def forward(self, x):
        return self.proj(_branching_helper(x))


@pytest.mark.parametrize(
    ("cls", "why"), [(Branching, "it has a If"), (HelperBranches, "_branching_helper(): it has a IfExp")]
)
def test_a_forward_that_cannot_be_rewritten_safely_is_left_alone(cls, why):
    model = cls()
    decision = next(d for d in invact.plan(model) if d.kind == "norm")
    assert not decision.replace and why in decision.reason, decision.reason
    assert invact.patch(model) == []
    assert "forward" not in vars(model)


def test_patch_again_and_include_exclude(monkeypatch):
    monkeypatch.setitem(globals(), "NORM", _helper)
    model = _block("helper norm(x)", torch.float32)
    assert invact.plan(model, exclude=["forward:*"])[0].reason == "excluded by include/exclude"
    assert invact.patch(model) == ["forward:rms_norm"]
    assert invact.patch(model) == []  # rewritten already: nothing to do
    assert model.__dict__["_invact_norm_calls"] == ("rms_norm", "rms_norm")
    assert norm_functional.calls(model) == ([], "")  # its forward is the instance's now
