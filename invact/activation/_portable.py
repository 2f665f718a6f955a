"""The portable backend: forward and backward in torch ops and the generated torch functions, on any
device and dtype. The backends share one signature (invact.activation.ops chooses among them):

- forward(act, x, precision_bit) -> (y, bits): y = torch's forward on x as given (same shape and
  strides), bits packed in x's storage order (uint8, ceil(n/8)), empty for a monotone activation or
  in precision-bit mode, where the bit is y's lowest mantissa bit instead;
- backward(act, y, bits, dy, precision_bit) -> dx: flat tensors in one element order, dx in dy's
  dtype.
"""

from __future__ import annotations

import torch

from invact._layout import flat, like, shaped_like
from invact.activation import _bits
from invact.activation.activations import SIXTEEN_BIT, Activation


def forward(
    act: Activation, x: torch.Tensor, precision_bit: bool, pack=_bits.pack
) -> tuple[torch.Tensor, torch.Tensor]:
    """`pack`: how the bits are packed (_bits.pack_indexed in a compiled graph's body)."""
    y = act.torch_forward(x)  # on x as given: torch's strided and contiguous paths round differently
    no_bits = x.new_empty(0, dtype=torch.uint8)
    if act.monotone:
        return y, no_bits
    left = _bits.is_left(flat(like(x, y)), act.threshold)
    if precision_bit and x.dtype != torch.float64:  # y is ours: its lowest mantissa bit becomes the bit
        return _bits.with_lsb(y, shaped_like(left, y)), no_bits
    return y, pack(left)


def backward(act: Activation, y, bits, dy, precision_bit: bool) -> torch.Tensor:
    """dx = dy * q(y, bit) in fp32, with the 16-bit q (Activation.q16) for y in bf16 or fp16: the
    functions the Triton kernels evaluate for those dtypes."""
    y32 = y.float()
    gen = act.generated
    q_left, q_right = act.q16 if y.dtype in SIXTEEN_BIT else (getattr(gen, "q_left", None), gen.q_right)
    if act.monotone:  # q itself at y = +-inf (x = +-inf, as torch); NaN stays NaN
        q = torch.where(torch.isnan(y32), torch.nan, q_right(y32))
    else:
        left = _bits.lsb(y) if precision_bit else _bits.unpack(bits, y.numel())
        q = torch.where(left, q_left(y32), q_right(y32))
        q = torch.where(torch.isfinite(y32), q, torch.nan)  # x = +-inf or NaN: NaN, as torch
    return (dy.float() * q).to(dy.dtype)
