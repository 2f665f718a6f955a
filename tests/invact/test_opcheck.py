"""torch.library.opcheck on every registered invact op: the activation's invact::forward and
invact::backward for every activation and mode, the gated MLP's invact::gated_linear and
invact::gate_up_linear (a fused gate_up) with their backwards, a MoE's invact::experts_linear and
invact::experts_gated_down with theirs,
the norm's invact::norm_forward and invact::norm_backward for every variant of the spec, the loss's
invact::linear_cross_entropy (its gradients from its forward): schema (no
hidden mutation or aliasing), autograd registration, fake kernels (what torch.compile traces) and AOT
dispatch with dynamic shapes."""

import pytest
import torch

import invact  # noqa: F401 - registers the ops
from invact.activation.activations import ACTIVATIONS
from invact.norm import VARIANTS, invertible

NAMES = sorted(ACTIVATIONS)


@pytest.mark.parametrize("precision_bit", [False, True])
@pytest.mark.parametrize("name", NAMES)
def test_forward_op(name, precision_bit):
    x = torch.randn(5, 13, requires_grad=True)  # 65 elements: a partial last byte of bits
    torch.library.opcheck(torch.ops.invact.forward.default, (x, name, precision_bit))


@pytest.mark.parametrize("precision_bit", [False, True])
@pytest.mark.parametrize("name", NAMES)
def test_backward_op(name, precision_bit):
    x = torch.randn(5, 13)
    y, bits = torch.ops.invact.forward(x, name, precision_bit)
    dy = torch.randn_like(y)
    # inputs that do not require grad: the backward op has no autograd formula (double backward raises)
    torch.library.opcheck(torch.ops.invact.backward.default, (dy, y, bits, name, precision_bit))


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no bias"])
@pytest.mark.parametrize("shape", [(5,), (2, 3)], ids=["rows", "batch x seq"])
def test_gated_linear_ops(shape, bias):
    torch.manual_seed(0)
    y, u = (torch.randn(*shape, 24, requires_grad=True) for _ in range(2))
    weight = torch.randn(12, 24, requires_grad=True)
    b = torch.randn(12, requires_grad=True) if bias else None
    torch.library.opcheck(torch.ops.invact.gated_linear.default, (y, u, weight, b))
    dout = torch.randn(*shape, 12)
    args = (dout, y.detach(), u.detach(), weight.detach(), bias)
    torch.library.opcheck(torch.ops.invact.gated_linear_backward.default, args)


def test_experts_ops():
    """A MoE's experts (invact.mlp.experts), routed rows (3, 0, 5, 2): one expert with none."""
    torch.manual_seed(0)
    rows, hidden, k = (3, 0, 5, 2), 6, 8
    x = torch.randn(sum(rows), hidden, requires_grad=True)
    w_gate_up = torch.randn(len(rows), 2 * k, hidden, requires_grad=True)
    w_down = torch.randn(len(rows), hidden, k, requires_grad=True)
    offsets = torch.cumsum(torch.tensor(rows), 0)
    torch.library.opcheck(torch.ops.invact.experts_linear.default, (x, w_gate_up, offsets))
    gate_up = torch.randn(sum(rows), 2 * k, requires_grad=True)
    torch.library.opcheck(torch.ops.invact.experts_gated_down.default, (gate_up, w_down, offsets, "silu"))
    dout = torch.randn(sum(rows), hidden)
    args = (dout, gate_up.detach(), w_down.detach(), offsets, "silu")
    torch.library.opcheck(torch.ops.invact.experts_gated_down_backward.default, args)
    args = (torch.randn(sum(rows), 2 * k), x.detach(), w_gate_up.detach(), offsets)
    torch.library.opcheck(torch.ops.invact.experts_linear_backward.default, args)


def _norm_inputs(variant: str, dtype: torch.dtype, weight_dtype: torch.dtype):
    torch.manual_seed(0)
    v = VARIANTS[variant]
    x = torch.randn(2, 3, 16, dtype=dtype, requires_grad=True)
    weight = (torch.rand(16) + 0.5).to(weight_dtype).requires_grad_()  # |w_eff| away from 0
    # |b| <= 0.25 < |w|: invertible (rho < 1), as a call traced keeping y has checked (invact.norm); with
    # rho > 1 the op sets x aside at run time, which a compiled graph's body cannot
    bias = ((torch.rand(16) - 0.5) / 2).to(weight_dtype).requires_grad_() if v.bias else None
    assert invertible(weight, bias, v, dtype)
    return x, weight, bias


@pytest.mark.parametrize("keep_x", [False, True], ids=["y kept", "x kept"])
@pytest.mark.parametrize("weights", ["x's dtype", "float32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_norm_ops(variant, dtype, weights, keep_x):
    x, weight, bias = _norm_inputs(variant, dtype, dtype if weights == "x's dtype" else torch.float32)
    args = (x, weight, bias, 1e-5, variant, keep_x, 0)  # key 0: no module (the op checks the weights)
    torch.library.opcheck(torch.ops.invact.norm_forward.default, args)
    y, rstd, residual, x_kept = torch.ops.invact.norm_forward(*args)
    assert x_kept.numel() == (x.numel() if keep_x else 0)
    # inputs that do not require grad: the backward op has no autograd formula
    saved = (t if t is None else t.detach() for t in (y, rstd, residual, x_kept, weight, bias))
    args = (torch.randn_like(y), *saved, variant, x.dtype, [True, True, True])
    torch.library.opcheck(torch.ops.invact.norm_backward.default, args)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no bias"])
def test_gate_up_linear_ops(bias):
    torch.manual_seed(0)
    gate_up = torch.randn(2, 3, 48, requires_grad=True)
    weight = torch.randn(12, 24, requires_grad=True)
    b = torch.randn(12, requires_grad=True) if bias else None
    torch.library.opcheck(torch.ops.invact.gate_up_linear.default, (gate_up, weight, b, "silu"))
    args = (torch.randn(2, 3, 12), gate_up.detach(), weight.detach(), bias, "silu")
    torch.library.opcheck(torch.ops.invact.gate_up_linear_backward.default, args)


@pytest.mark.parametrize("ops", [[], [1.0, 30.0, 2.0, 0.0, 0.0, 30.0]], ids=["plain", "soft-cap"])
@pytest.mark.parametrize("ignored", [False, True], ids=["every row", "rows ignored"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no bias"])
@pytest.mark.parametrize("needs", [[True, True, True], [True, False, False], [False, False, False]],
                         ids=["every gradient", "frozen head", "no gradient"])  # fmt: skip
def test_linear_cross_entropy_op(monkeypatch, bias, ignored, ops, needs):
    from invact.loss import op as loss_op

    monkeypatch.setattr(loss_op, "MIN_ROWS", 1)
    monkeypatch.setitem(loss_op.BLOCK_BYTES, "cpu", 4 * 4 * 300)  # 4 rows a chunk: two chunks of the 6
    torch.manual_seed(0)
    hidden = torch.randn(6, 8, requires_grad=needs[0])
    weight = torch.randn(300, 8, requires_grad=needs[1])
    b = torch.randn(300, requires_grad=needs[2]) if bias else None
    target = torch.randint(0, 300, (6,))
    if ignored:
        target[1] = target[4] = -100
    args = (hidden, weight, b, target, ops, -100, 0.1, True, [needs[0], needs[1], needs[2] and bias])
    torch.library.opcheck(torch.ops.invact.linear_cross_entropy.default, args)
