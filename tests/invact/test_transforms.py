"""torch.func (grad, vmap, vjp), also under torch.compile, forward-mode AD's clear refusal, and
TorchScript around InvAct."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import grad, jvp, vmap

import invact
from invact.activation.activations import ACTIVATIONS
from invact.activation.ops import invact as invact_op
from tests.invact.test_functional import _fp32_bound

NAMES = sorted(ACTIVATIONS)


def _total(name):
    return lambda t: invact_op(t, name).sum()


@pytest.mark.parametrize("name", NAMES)
def test_func_grad_is_the_eager_gradient(name):
    x = torch.randn(257) * 3
    got = grad(_total(name))(x)
    xe = x.clone().requires_grad_()
    invact_op(xe, name).sum().backward()
    # torch.func runs the portable backward (torch ops) where eager runs numba: the same formula in fp32,
    # each within 1e-6 of it (tests/codegen/test_generated_precision.py), so 2e-6 apart.
    assert (got - xe.grad).abs().max() <= 2e-6
    want = grad(lambda t: ACTIVATIONS[name].torch_forward(t).sum())(x)
    assert (got - want).abs().max() <= _fp32_bound(name) + 1e-6  # torch's own grad within 1e-6 of f'


@pytest.mark.parametrize("name", ["gelu", "softplus"])  # two branches; monotone
def test_per_sample_gradients_with_vmap(name):
    xs = torch.randn(4, 33) * 3
    per_sample = vmap(grad(_total(name)))(xs)
    one_by_one = torch.stack([grad(_total(name))(x) for x in xs])
    # The same ops, batched: bitwise, except where torch's own forward is not (its vectorized loop
    # and its scalar tail round softplus differently: a row of 33 ends in the tail, the batch does not).
    forward = ACTIVATIONS[name].torch_forward
    same_y = forward(xs) == torch.stack([forward(x) for x in xs])
    assert torch.equal(per_sample[same_y], one_by_one[same_y])
    transposed = vmap(grad(_total(name)), in_dims=1)(xs.T.contiguous())
    same_y &= forward(xs.T.contiguous()).T == torch.stack([forward(x) for x in xs])
    assert torch.equal(transposed[same_y], one_by_one[same_y])


def test_vmap_saves_the_output_and_bits_not_the_input():
    x = torch.randn(4, 64, requires_grad=True)
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = (t.untyped_storage().nbytes(), t.dtype)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = vmap(invact.functional.silu)(x)
    assert x.untyped_storage().data_ptr() not in saved
    assert sorted(saved.values(), key=str) == sorted([(4 * 256, torch.float32), (32, torch.uint8)], key=str)
    y.sum().backward()
    want = torch.func.grad(lambda t: invact.functional.silu(t).sum())(x.detach())
    assert torch.equal(x.grad, want) or (x.grad - want).abs().max() <= 2e-6  # numba vs torch ops, as above


def test_func_grad_on_a_channels_last_tensor():
    x = (torch.randn(2, 3, 5, 7) * 3).to(memory_format=torch.channels_last)
    got = grad(_total("gelu"))(x)
    # Under torch.func the input is made contiguous first (storage order = logical order), and torch's
    # forward rounds its contiguous and strided paths differently: compare with the contiguous input.
    xe = x.contiguous().requires_grad_()
    invact_op(xe, "gelu").sum().backward()
    assert (got - xe.grad).abs().max() <= 2e-6  # as in test_func_grad_is_the_eager_gradient


def test_forward_mode_is_refused_with_a_clear_error():
    x = torch.randn(8)
    with pytest.raises(NotImplementedError, match="invact: forward-mode AD"):
        jvp(lambda t: invact.functional.gelu(t).sum(), (x.requires_grad_(),), (torch.ones(8),))


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")
def test_torchscript_calls_back_into_python():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), invact.InvActGELU(), nn.Linear(16, 4), invact.InvActSiLU())
    scripted = torch.jit.script(model)
    x = torch.randn(3, 8)
    xs, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
    scripted(xs).sum().backward()
    model(xe).sum().backward()
    assert torch.equal(xs.grad, xe.grad)
    assert torch.equal(scripted(x), F.silu(model[2](F.gelu(model[0](x)))))


# -- torch.func under torch.compile ---------------------------------------------------------------------
# torch 2.13 cannot differentiate a custom op's registered autograd, nor an autograd.Function, inside
# torch.func's transforms under torch.compile (pytorch/pytorch#170834, #174067): there invact runs
# torch's own ops (invact.activation.ops.invact, invact.mlp.Forward, InvNorm.forward), so the compiled
# transform gives torch's gradients, bitwise (aot_eager runs the same aten kernels), with no graph break
# (fullgraph=True raises on one), and no saving.


def _tiny_llama_loss():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_attention_heads=2,
                                      num_key_value_heads=2, num_hidden_layers=1, vocab_size=64)  # fmt: skip
    torch.manual_seed(0)
    model, ids = transformers.LlamaModel(config), torch.randint(0, 64, (2, 8))

    def loss(m):
        return grad(lambda p: torch.func.functional_call(m, p, (ids,)).last_hidden_state.square().sum())

    return model, loss


def _mlp_per_sample():
    torch.manual_seed(0)
    model, xs = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)), torch.randn(4, 3, 8)

    def loss(m):
        per_sample = grad(lambda p, x: torch.func.functional_call(m, p, (x,)).square().sum())
        return lambda p: vmap(per_sample, in_dims=(None, 0))(p, xs)

    return model, loss


@pytest.mark.parametrize("make", [_tiny_llama_loss, _mlp_per_sample], ids=["llama grad", "mlp vmap(grad)"])
def test_compiled_transforms_give_torchs_gradients(make):
    plain, loss = make()
    model = copy.deepcopy(plain)
    assert invact.patch(model)
    params = {k: v.detach() for k, v in model.named_parameters()}
    want = loss(plain)(params)
    torch._dynamo.reset()
    got = torch.compile(loss(model), backend="aot_eager", fullgraph=True)(params)
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
