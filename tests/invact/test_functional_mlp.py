"""MLPs that call their activation as a function (`w2(F.silu(w1(x)) * w3(x))`, torchtitan's FeedForward;
`c_proj(F.relu(c_fc(x)).square())`, nanochat's): patch() finds them by what the calls compute
(invact.mlp.functional) and runs them as the same Function as an MLP with an InvAct module, for every
activation of the spec."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import invact
from invact.activation.activations import ACTIVATIONS
from invact.activation.modules import InvAct
from invact.mlp import Forward, match_functional
from invact.mlp.functional import ULPS

HIDDEN, INTERMEDIATE = 12, 24


class _Gated(nn.Module):
    def __init__(self, bias: bool = False):
        super().__init__()
        self.w1 = nn.Linear(HIDDEN, INTERMEDIATE, bias=bias)
        self.w2 = nn.Linear(INTERMEDIATE, HIDDEN, bias=bias)
        self.w3 = nn.Linear(HIDDEN, INTERMEDIATE, bias=bias)


class _Plain(nn.Module):
    def __init__(self, bias: bool = True):
        super().__init__()
        self.c_fc = nn.Linear(HIDDEN, INTERMEDIATE, bias=bias)
        self.c_proj = nn.Linear(INTERMEDIATE, HIDDEN, bias=bias)


def GatedCalls(f) -> nn.Module:  # noqa: N802 - a class per function
    """torchtitan's FeedForward, w2(f(w1(x)) * w3(x)), f called in the forward's code (no attribute)."""

    class GatedCalls(_Gated):
        def forward(self, x):
            return self.w2(f(self.w1(x)) * self.w3(x))

    return GatedCalls()


def PlainCalls(f) -> nn.Module:  # noqa: N802
    """nanoGPT's and nanochat's MLP, c_proj(f(c_fc(x))), f called in the forward's code."""

    class PlainCalls(_Plain):
        def forward(self, x):
            return self.c_proj(f(self.c_fc(x)))

    return PlainCalls()


class GatedModule(nn.Module):
    """The same MLP with the activation an InvAct module (invact.mlp's module form)."""

    def __init__(self, activation: str):
        super().__init__()
        self.w1 = nn.Linear(HIDDEN, INTERMEDIATE, bias=False)
        self.w2 = nn.Linear(INTERMEDIATE, HIDDEN, bias=False)
        self.w3 = nn.Linear(HIDDEN, INTERMEDIATE, bias=False)
        self.act = InvAct(activation)

    def forward(self, x):
        return self.w2(self.act(self.w1(x)) * self.w3(x))


class PlainModule(nn.Module):
    def __init__(self, activation: str):
        super().__init__()
        self.c_fc = nn.Linear(HIDDEN, INTERMEDIATE)
        self.act = InvAct(activation)
        self.c_proj = nn.Linear(INTERMEDIATE, HIDDEN)

    def forward(self, x):
        return self.c_proj(self.act(self.c_fc(x)))


def _spec_call(activation: str):
    """The spec's own torch forward of `activation`, called as a function."""
    return lambda g: ACTIVATIONS[activation].torch_forward(g)


def _grads(model: nn.Module, x: torch.Tensor):
    x = x.clone().requires_grad_()
    out = model(x)
    out.backward(torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape))
    return out, [x.grad, *(p.grad for p in model.parameters())]


def _same_weights(functional_form: nn.Module, module_form: nn.Module) -> nn.Module:
    module_form.load_state_dict(functional_form.state_dict(), strict=False)
    return module_form


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("form", ["gated", "plain"])
@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
def test_every_activation_called_as_a_function_runs_the_module_forms_function(activation, form, dtype):
    # The spec's torch forward called in forward code is found as that activation, and the MLP then runs
    # the very Function the InvAct-module form runs: outputs and gradients bitwise.
    torch.manual_seed(0)
    calls = GatedCalls(_spec_call(activation)) if form == "gated" else PlainCalls(_spec_call(activation))
    module = GatedModule(activation) if form == "gated" else PlainModule(activation)
    calls, module = calls.to(dtype), _same_weights(calls, module).to(dtype)
    eager = copy.deepcopy(calls)
    taken = invact.patch(calls)
    invact.patch(module)
    assert taken == [f"forward:{activation}"]
    assert isinstance(calls.__dict__.get("forward"), Forward)
    x = torch.randn(2, 5, HIDDEN, dtype=dtype)
    (got_out, got), (want_out, want) = _grads(calls, x), _grads(module, x)
    assert torch.equal(got_out, want_out)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert torch.equal(got_out, eager(x))  # the spec's op is the forward's own: the output is eager's


# How people write them (the calls, not the spec's forwards): the activation each computes.
WRITTEN = {
    "F.silu": (F.silu, "silu"),
    "x * torch.sigmoid(x)": (lambda g: g * torch.sigmoid(g), "silu"),
    "torch.sigmoid(x) * x": (lambda g: torch.sigmoid(g) * g, "silu"),
    "F.gelu": (F.gelu, "gelu"),
    "F.gelu tanh": (lambda g: F.gelu(g, approximate="tanh"), "gelu_tanh"),
    "F.relu(x).square()": (lambda g: F.relu(g).square(), "relu2"),
    "torch.relu(x) ** 2": (lambda g: torch.relu(g) ** 2, "relu2"),
    "F.mish": (F.mish, "mish"),
    "F.elu": (F.elu, "elu"),
    "x * torch.sigmoid(1.702 * x)": (lambda g: g * torch.sigmoid(1.702 * g), "quick_gelu"),
}


@pytest.mark.parametrize("form", ["gated", "plain"])
@pytest.mark.parametrize("written", sorted(WRITTEN))
def test_the_calls_people_write_are_found(written, form):
    f, activation = WRITTEN[written]
    model = GatedCalls(f) if form == "gated" else PlainCalls(f)
    found = match_functional(model)
    assert found is not None and found[0].function == activation
    assert found[1] <= ULPS
    (decision,) = [d for d in invact.plan(model) if d.kind == "mlp"]
    assert decision.replace and decision.name == f"forward:{activation}"
    assert ("exactly" in decision.reason) == (found[1] == 0)


# Forwards that compute something else where the activation stands: none is an MLP invact takes.
OTHERS = {
    "dropout after": lambda g: F.dropout(F.silu(g), 0.1),
    "scaled": lambda g: 2.0 * F.silu(g),
    "clamped": lambda g: F.silu(g).clamp(max=3.0),
    "leaky relu 0.2": lambda g: F.leaky_relu(g, 0.2),
    "no activation": lambda g: g * 1.0,
}


@pytest.mark.parametrize("other", sorted(OTHERS))
def test_other_calls_are_no_activation(other):
    for model in (GatedCalls(OTHERS[other]), PlainCalls(OTHERS[other])):
        assert match_functional(model) is None
        assert not [d for d in invact.plan(model) if d.kind == "mlp"]
        assert invact.patch(model) == [] and "forward" not in model.__dict__


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w2 = nn.Linear(HIDDEN, INTERMEDIATE), nn.Linear(INTERMEDIATE, HIDDEN)

    def forward(self, x, scale):
        return self.w2(F.silu(self.w1(x)) * scale)


class SharedGate(nn.Module):
    """The gate's output used twice: the activation is not the only consumer."""

    def __init__(self):
        super().__init__()
        self.w1, self.w2 = nn.Linear(HIDDEN, INTERMEDIATE), nn.Linear(INTERMEDIATE, HIDDEN)
        self.w3 = nn.Linear(HIDDEN, INTERMEDIATE)

    def forward(self, x):
        g = self.w1(x)
        return self.w2(F.silu(g) * self.w3(x) + g)


@pytest.mark.parametrize("cls", [TwoInputs, SharedGate])
def test_other_forwards_are_not_recognised(cls):
    assert match_functional(cls()) is None


def _saved_bytes(model: nn.Module, x: torch.Tensor) -> int:
    with invact.memory.count_saved(model) as counted:
        model(x)
    return counted.report.saved_bytes


@pytest.mark.parametrize("form", ["gated", "plain"])
def test_it_saves_what_the_module_form_saves(form):
    # x, y and its bits, u (gated): the module form's Function's tensors, where eager saves the
    # pre-activation, the activation's output, u and the product besides x.
    torch.manual_seed(0)
    calls = GatedCalls(F.silu) if form == "gated" else PlainCalls(F.silu)
    module = _same_weights(calls, GatedModule("silu") if form == "gated" else PlainModule("silu"))
    eager = copy.deepcopy(calls)
    invact.patch(calls), invact.patch(module)
    x = torch.randn(4, 8, HIDDEN, requires_grad=True)
    assert _saved_bytes(calls, x) == _saved_bytes(module, x) < _saved_bytes(eager, x)


def test_include_exclude_gated_false_and_a_mode_switch():
    model = nn.Sequential(GatedCalls(F.silu), PlainCalls(F.gelu))
    assert invact.patch(model, exclude="0.*") == ["1.forward:gelu"]
    assert invact.patch(copy.deepcopy(nn.Sequential(GatedCalls(F.silu))), gated=False) == []
    (left,) = invact.plan(nn.Sequential(GatedCalls(F.silu)), gated=False)
    assert not left.replace and left.reason.startswith("gated=False")
    assert invact.patch(model) == ["0.forward:silu"]
    assert invact.patch(model) == []  # idempotent
    assert invact.patch(model, mode="precision_bit") == ["0.forward:silu", "1.forward:gelu"]
    assert {m.__dict__["forward"].mode for m in model} == {"precision_bit"}


def _gamma(n: int) -> float:
    """Higham's gamma_n = n u / (1 - n u) for fp32 (u = 2^-24): the relative error bound of a sum of n
    products in any order."""
    return n * 2.0**-24 / (1 - n * 2.0**-24)


def _intermediate_grads(calls: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """d loss / d w1(x) and d loss / d w3(x) of _grads' step, from the unfused module form (its
    activation an InvAct module, its product saved: patch(gated=False)) with the same weights."""
    module = _same_weights(calls, GatedModule("silu"))
    invact.patch(module, gated=False)
    grads = {}

    def keep(name: str):
        def hook(module, args, out) -> None:  # returns None: the output stays as it is
            out.register_hook(lambda g: grads.__setitem__(name, g))

        return hook

    for name in ("w1", "w3"):
        getattr(module, name).register_forward_hook(keep(name))
    _grads(module, x)
    return grads["w1"], grads["w3"]


def test_under_torch_compile_the_gated_form_is_the_custom_op():
    # fullgraph, invact's ops in Dynamo's graph, and aot_eager's gradients bitwise eager's (it runs the
    # ops' bodies: the same computation)
    from tests.invact._stack_workers import _recording

    torch.manual_seed(0)
    model = GatedCalls(F.silu)
    invact.patch(model)
    x = torch.randn(2, 5, HIDDEN)
    want = _grads(model, x)
    ops: set[str] = set()
    traced: set[str] = set()
    torch._dynamo.reset()
    got = _grads(torch.compile(model, backend=_recording(ops, traced), fullgraph=True), x)
    torch._dynamo.reset()
    assert torch.equal(got[0], want[0])
    assert all(torch.equal(a, b) for a, b in zip(got[1][1:], want[1][1:], strict=True))  # the weights'
    # x's gradient, dg W1 + du W3, summed in another order: within gamma_2K of the terms' magnitudes
    # (Higham, Accuracy and Stability, 3.1), dg and du as the unfused module form computes them (the
    # same q, bitwise: tests/invact/test_mlp.py)
    dg, du = _intermediate_grads(model, x)
    terms = dg.abs() @ model.w1.weight.abs() + du.abs() @ model.w3.weight.abs()
    assert ((got[1][0] - want[1][0]).abs() <= _gamma(2 * INTERMEDIATE) * terms).all()
    traced = {op.removesuffix(".default") for op in traced}
    assert {"invact.forward", "invact.gated_linear"} <= traced, sorted(traced)
