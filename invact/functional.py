"""Functional InvAct: `invact(x, activation, mode)` for any generated activation, and one function per
torch-compatible module class (named after torch's function, printed from the activation spec
into invact/_generated/functional.py) taking torch's arguments. Same values as torch's; saves y and one bit
per element (none for a monotone activation).

`linear_cross_entropy` is torch's F.linear_cross_entropy (its signature, on every torch invact supports)
without the logits: the loss's chunks and kernels (invact.loss.op), for training loops that compute their
own loss from the head's input.

`mode="bits"` (default) saves ceil(n/8) extra bytes; `mode="precision_bit"` stores the bit in the
lowest mantissa bit of y itself (y within 1 ulp of torch's, no extra bytes).
"""

from invact._generated import functional as _generated_functional
from invact._generated.functional import *  # noqa: F403 - the generated functional forms
from invact.activation.ops import invact
from invact.loss.op import linear_cross_entropy

__all__ = ["invact", "linear_cross_entropy", *_generated_functional.__all__]
