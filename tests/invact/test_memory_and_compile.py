"""The memory contract (what autograd holds) and torch.compile(fullgraph=True)."""

import pytest
import torch
from torch import nn

import invact


def saved_storages(model: nn.Module, x: torch.Tensor) -> dict[int, int]:
    """Storage pointer -> bytes of every tensor autograd saves in model(x), parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x).sum().backward()
    return saved


class ActThenLinear(nn.Module):
    def __init__(self, act: nn.Module, width: int = 96):
        super().__init__()
        self.act, self.linear = act, nn.Linear(width, 8)

    def forward(self, h):
        self.y = self.act(h)
        return self.linear(self.y)


@pytest.mark.parametrize(
    "act", [invact.InvActGELU(), invact.InvActGELU("tanh"), invact.InvActSiLU(), invact.InvActQuickGELU()]
)
def test_only_the_output_and_the_bits_are_held(act):
    h = torch.randn(33, 96, requires_grad=True)  # 3168 elements: 396 bytes of bits
    n = h.numel()
    model = ActThenLinear(act)
    saved = saved_storages(model, h)
    y_ptr = model.y.untyped_storage().data_ptr()
    assert h.untyped_storage().data_ptr() not in saved  # the input is no longer held
    assert saved.pop(y_ptr) == 4 * n  # y: the same storage the Linear saves, counted once
    assert list(saved.values()) == [(n + 7) // 8]  # and ceil(n/8) bytes of bits: nothing else


def test_a_monotone_activation_holds_the_output_alone():
    h = torch.randn(33, 96, requires_grad=True)
    model = ActThenLinear(invact.InvActSoftplus())
    saved = saved_storages(model, h)
    assert list(saved) == [model.y.untyped_storage().data_ptr()]  # y, shared with the Linear: no bits
    torch_saved = saved_storages(ActThenLinear(nn.Softplus()), h)
    assert len(torch_saved) == 2  # torch: the input and the output


def test_precision_bit_adds_nothing_and_torch_holds_both():
    h = torch.randn(33, 96, requires_grad=True)
    n = h.numel()
    model = ActThenLinear(invact.InvActSiLU(mode="precision_bit"))
    assert list(saved_storages(model, h).values()) == [4 * n]
    torch_saved = saved_storages(ActThenLinear(nn.SiLU()), h)
    assert sorted(torch_saved.values()) == [4 * n, 4 * n]  # torch: the input and the output


class MLP(nn.Module):
    def __init__(self, act: nn.Module):
        super().__init__()
        self.up, self.act, self.down = nn.Linear(64, 256), act, nn.Linear(256, 64)

    def forward(self, x):
        return self.down(self.act(self.up(x)))


def _grads(model, x):
    x = x.detach().requires_grad_()
    out = model(x)
    out.square().sum().backward()
    return out.detach(), x.grad, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
@pytest.mark.parametrize("mode", ["bits", "precision_bit"])
@pytest.mark.parametrize("act", [invact.InvActGELU, invact.InvActSoftplus])  # two branches; monotone
def test_compiled_mlp_matches_eager(backend, mode, act):
    torch.manual_seed(0)
    eager = MLP(act(mode=mode))
    compiled_model = MLP(act(mode=mode))
    compiled_model.load_state_dict(eager.state_dict())
    compiled = torch.compile(compiled_model, fullgraph=True, backend=backend)
    x = torch.randn(16, 64)
    torch._dynamo.reset()
    want, got = _grads(eager, x), _grads(compiled, x)
    # Same ops in the same order for aot_eager; inductor may fuse the Linear epilogues (fp32 rounding).
    tol = 0 if backend == "aot_eager" else 1e-5
    for a, b in zip([want[0], want[1], *want[2]], [got[0], got[1], *got[2]], strict=True):
        assert torch.allclose(a, b, atol=tol, rtol=tol)


@pytest.mark.parametrize(("act", "bit_bytes"), [(invact.InvActGELU, lambda n: [(n + 7) // 8]),
                                               (invact.InvActSoftplus, lambda n: [])])  # fmt: skip
def test_compiled_graph_still_saves_only_y_and_bits(act, bit_bytes):
    model = ActThenLinear(act(), width=96)
    h = torch.randn(33, 96, requires_grad=True)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    n = h.numel()
    # The compiled graph may hand the empty bits tensor of a monotone activation to its backward: a
    # storage of 0 bytes, so nothing held.
    saved = [b for b in saved_storages(compiled, h).values() if b]
    assert sorted(saved) == [*bit_bytes(n), 4 * n]
