"""InvAct with a coefficient family other than the runtime's default, for the training comparison
(benchmarks/training.py): the `paper` family (the paper's formulas, refitted) in place of `floor`.

The runtime reads only invact/_generated/, printed from the default families (coeffs/defaults.json).
This module renders another family's torch functions with codegen, exactly as `python -m codegen`
would print them, imports them from a temporary file, and runs InvAct's scheme with them: the forward
is torch's activation and saves y plus the packed branch bits (x < T), the backward is the runtime's
portable torch backward (invact.activation._portable.backward) with this family's q. Gradients differ from the
runtime's by the difference between the two families' q (paper: linf_fp32 about 1e-3 per branch)."""

from __future__ import annotations

import functools
import importlib.util
import tempfile
from pathlib import Path
from types import ModuleType

import torch
from swap import replace_activations
from torch import nn

from codegen import coeffs_json, spec
from codegen.common import COEFFS
from codegen.torch_view import render_torch
from invact._layout import flat
from invact.activation import _bits, _portable
from invact.activation.activations import ACTIVATIONS, Activation


@functools.cache
def generated(activation: str, family: str) -> ModuleType:
    """The torch module codegen prints from coeffs/<activation>/<family>.json, imported."""
    path = COEFFS / activation / f"{family}.json"
    if not path.exists():
        raise ValueError(f"no coefficient file {path.relative_to(COEFFS.parent)}: fit it with "
                         f"`invact-fit {activation} --family {family}`")  # fmt: skip
    source = [(str(path.relative_to(COEFFS.parent)), "not hashed")]
    text = render_torch(coeffs_json.load(path), source, spec.load()[activation])
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / f"{activation}_{family}.py"
        file.write_text(text)
        module_spec = importlib.util.spec_from_file_location(f"_invact_family_{activation}_{family}", file)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    return module


class _Family(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, activation, family):
        gen = generated(activation, family)
        y = ACTIVATIONS[activation].torch_forward(x)
        bits = _bits.pack(_bits.is_left(flat(x.contiguous()), gen.THRESHOLD))
        ctx.save_for_backward(y, bits)
        ctx.act = Activation(activation, emitted=gen)  # its torch view is the family's module
        return y

    @staticmethod
    def backward(ctx, dy):
        y, bits = ctx.saved_tensors
        y = y.contiguous()
        dx = _portable.backward(ctx.act, flat(y), bits, flat(dy.contiguous()), precision_bit=False)
        return dx.view(y.shape), None, None


class FamilyActivation(nn.Module):
    """InvAct (bits mode) for `activation` with the q of coefficient family `family`."""

    def __init__(self, activation: str, family: str) -> None:
        super().__init__()
        generated(activation, family)  # a missing coefficient file fails here, not mid-training
        self.activation, self.family = activation, family

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (torch.is_grad_enabled() and x.requires_grad):
            return ACTIVATIONS[self.activation].torch_forward(x)
        return _Family.apply(x, self.activation, self.family)

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}, family={self.family!r}"


def patch_family(model: nn.Module, family: str) -> list[str]:
    """Replace, in place, every activation module invact.patch would replace by FamilyActivation."""
    return replace_activations(model, lambda old, act: FamilyActivation(act, family))
