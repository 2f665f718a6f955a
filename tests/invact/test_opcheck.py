"""torch.library.opcheck on the registered ops invact::forward and invact::backward, for every
activation and mode: schema (no hidden mutation or aliasing), autograd registration, fake kernels
(what torch.compile traces) and AOT dispatch with dynamic shapes."""

import pytest
import torch

import invact  # noqa: F401 - registers the ops
from invact.activations import ACTIVATIONS

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
