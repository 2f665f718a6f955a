"""The memory contract (what autograd holds) and torch.compile(fullgraph=True)."""

import pytest
import torch
from torch import nn

import invact
from invact.activation.activations import ACTIVATIONS

NAMES = sorted(ACTIVATIONS)


def _bit_bytes(name: str, n: int) -> list[int]:
    """What InvAct saves besides y in bits mode: ceil(n/8) bytes, or nothing for a monotone f."""
    return [] if ACTIVATIONS[name].monotone else [(n + 7) // 8]


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


class TorchForward(nn.Module):
    """torch's own forward of an activation, as the library's module computes it."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def forward(self, x):
        return ACTIVATIONS[self.name].torch_forward(x)


@pytest.mark.parametrize("name", NAMES)
def test_only_the_output_and_the_bits_are_held(name):
    h = torch.randn(33, 96, requires_grad=True)  # 3168 elements: 396 bytes of bits
    n = h.numel()
    model = ActThenLinear(invact.InvAct(name))
    saved = saved_storages(model, h)
    y_ptr = model.y.untyped_storage().data_ptr()
    assert h.untyped_storage().data_ptr() not in saved  # the input is no longer held
    assert saved.pop(y_ptr) == 4 * n  # y: the same storage the Linear saves, counted once
    assert list(saved.values()) == _bit_bytes(name, n)  # and the bits (none if monotone): nothing else
    # torch holds the input (or an intermediate as large) besides the output
    torch_model = ActThenLinear(TorchForward(name))
    torch_saved = saved_storages(torch_model, h)
    torch_saved.pop(torch_model.y.untyped_storage().data_ptr())
    assert sum(torch_saved.values()) >= 4 * n


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


# Every activation through aot_eager (the op's tracing and its fake kernels); inductor's code
# generation (slow on CPU: seconds per graph) for the first two-branch and the first monotone one.
_INDUCTOR = [
    next(n for n in NAMES if not ACTIVATIONS[n].monotone),
    next(n for n in NAMES if ACTIVATIONS[n].monotone),
]
_COMPILED = [("aot_eager", n) for n in NAMES] + [
    pytest.param("inductor", n, marks=pytest.mark.slow) for n in _INDUCTOR
]


@pytest.mark.parametrize(("backend", "name"), _COMPILED)
@pytest.mark.parametrize("mode", ["bits", "precision_bit"])
def test_compiled_mlp_matches_eager(backend, mode, name, portable):
    torch.manual_seed(0)
    eager = MLP(invact.InvAct(name, mode=mode))
    compiled_model = MLP(invact.InvAct(name, mode=mode))
    compiled_model.load_state_dict(eager.state_dict())
    compiled = torch.compile(compiled_model, fullgraph=True, backend=backend)
    x = torch.randn(16, 64)
    torch._dynamo.reset()
    want, got = _grads(eager, x), _grads(compiled, x)
    if backend == "aot_eager":  # the same ops in the same order: bitwise
        for a, b in zip([want[0], want[1], *want[2]], [got[0], got[1], *got[2]], strict=True):
            assert torch.equal(a, b)
        return
    # inductor fuses the Linear epilogues (fp32 rounding) and computes y and q with its own code
    assert torch.allclose(want[0], got[0], atol=1e-5, rtol=1e-5)
    for a, b in zip([want[1], *want[2]], [got[1], *got[2]], strict=True):
        assert (a - b).norm() <= INDUCTOR_GRAD_RTOL * a.norm()


# Norm-wise relative gradient difference, inductor against eager on the portable backend: measured at
# most 2.9e-6 over every activation (GELU: inductor's fp32 erf gives a y an ulp from aten's where q is
# steep, by the cusp; 2.5e-7 or less for the others); 1e-5 leaves 3x.
INDUCTOR_GRAD_RTOL = 1e-5


@pytest.mark.parametrize("name", NAMES)
def test_compiled_graph_still_saves_only_y_and_bits(name):
    model = ActThenLinear(invact.InvAct(name), width=96)
    h = torch.randn(33, 96, requires_grad=True)
    torch._dynamo.reset()  # one forward code object per activation: past dynamo's recompile limit otherwise
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    n = h.numel()
    # The compiled graph may hand the empty bits tensor of a monotone activation to its backward: a
    # storage of 0 bytes, so nothing held.
    saved = [b for b in saved_storages(compiled, h).values() if b]
    assert sorted(saved) == [*_bit_bytes(name, n), 4 * n]


def _hidden_sum(output) -> torch.Tensor:
    return output.last_hidden_state.sum()


@pytest.mark.slow  # inductor's C++ code generation: about 15 s on CPU
def test_inductor_partition_saves_what_inductor_saves():
    """invact.memory.inductor_partition decides what to save as inductor does: the same bytes as
    backend="inductor" on a model where torch's aot_eager_decomp_partition (no joint-graph passes)
    saves more: Gemma 2's eager attention, whose dropout (p=0) is a clone of the probabilities."""
    transformers = pytest.importorskip("transformers")
    from invact.memory import inductor_partition, saved_tensors

    torch.manual_seed(0)
    cfg = transformers.Gemma2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, vocab_size=100, attn_implementation="eager",
    )  # fmt: skip
    model = transformers.Gemma2Model(cfg).train()
    ids = torch.randint(0, 100, (1, 64))

    def saved(backend) -> int:
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=backend)
        saved_tensors(compiled, input_ids=ids, loss=_hidden_sum)  # compile outside the measurement
        return saved_tensors(compiled, input_ids=ids, loss=_hidden_sum).saved_bytes

    ours = saved(inductor_partition)
    assert ours == saved("inductor")
    scores = 2 * 64 * 64 * 4  # one layer's (heads, seq, seq) fp32 probabilities
    assert saved("aot_eager_decomp_partition") >= ours + scores
