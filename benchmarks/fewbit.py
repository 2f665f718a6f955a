"""A baseline, not part of the runtime: FewBit-style k-bit gradient quantization (Novikov et al., ICML
2023) of an activation, for the training comparison (benchmarks/training.py).

Forward is torch's own activation; what it saves for backward is, per element, the index of the
interval of x it fell in (k bits of information, held in one uint8 here: the memory figure FewBit
would reach packs k bits per element). Backward is dy * levels[index]. The quantizer is the optimal
k-bit piecewise-constant approximation of f' for x ~ N(0, 1) (fitting.quantize.l2_optimal,
weight "normal"), so the baseline is as good as FewBit's own quantizers or better.
"""

from __future__ import annotations

import functools

import torch
from swap import replace_activations
from torch import nn

from fitting.activations import get_activation
from fitting.quantize import l2_optimal
from invact.activation.activations import ACTIVATIONS

# DP cells of the quantizer: fitting/quantize.py measures 1000 cells within 2.5% of the continuous
# optimum's L2 at k = 8 (within 0.3% at 4000), far below the k-bit error itself at k <= 4.
CELLS = 1000


@functools.cache
def quantizer(activation: str, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(borders (2^k - 1,), levels (2^k,)) as float32 tensors."""
    q = l2_optimal(get_activation(activation), max_bits=bits, cells=CELLS, weight="normal")[bits]
    return torch.tensor(q.borders, dtype=torch.float32), torch.tensor(q.levels, dtype=torch.float32)


class _FewBit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, activation, bits):
        borders, levels = quantizer(activation, bits)
        index = torch.bucketize(x.detach().float(), borders.to(x.device), right=True).to(torch.uint8)
        ctx.save_for_backward(index)
        ctx.levels = levels.to(x.device)
        return ACTIVATIONS[activation].torch_forward(x)

    @staticmethod
    def backward(ctx, dy):
        (index,) = ctx.saved_tensors
        return (dy.float() * ctx.levels[index.long()]).to(dy.dtype), None, None


class FewBitActivation(nn.Module):
    """torch's activation `activation` (a name in invact.activation.activations.ACTIVATIONS) with a k-bit
    gradient."""

    def __init__(self, activation: str, bits: int) -> None:
        super().__init__()
        if not 1 <= bits <= 8:
            raise ValueError(f"bits must be in 1..8, got {bits}")
        self.activation, self.bits = activation, bits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (torch.is_grad_enabled() and x.requires_grad):
            return ACTIVATIONS[self.activation].torch_forward(x)
        return _FewBit.apply(x, self.activation, self.bits)

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}, bits={self.bits}"


def patch_fewbit(model: nn.Module, bits: int) -> list[str]:
    """Replace, in place, every activation module invact.patch would replace by its k-bit baseline."""
    return replace_activations(model, lambda old, act: FewBitActivation(act, bits))
