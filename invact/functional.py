"""Functional InvAct: `invact(x, activation, mode)` for any generated activation, and one function per
torch-compatible module class (named after torch's function, printed from the activation spec
into invact/_generated/functional.py) taking torch's arguments. Same values as torch's; saves y and one bit
per element (none for a monotone activation).

`linear_cross_entropy` is torch's F.linear_cross_entropy (its signature, on every torch invact supports)
without the logits: the loss's chunks and kernels (invact.loss.op), for training loops that compute their
own loss from the head's input.

`rms_norm` and `layer_norm` are torch's F.rms_norm and F.layer_norm (their signatures and values) saving
their output and per-row rstd instead of their input (invact.norm.functional), for forwards that call norms
as functions.

`mode="bits"` (default) saves ceil(n/8) extra bytes; `mode="precision_bit"` stores the bit in the
lowest mantissa bit of y itself (y within 1 ulp of torch's, no extra bytes).
"""

from invact._generated import functional as _generated_functional
from invact._generated.functional import *  # noqa: F403 - the generated functional forms
from invact.activation.ops import invact
from invact.loss.op import linear_cross_entropy
from invact.norm.functional import layer_norm, rms_norm

__all__ = ["invact", "layer_norm", "linear_cross_entropy", "rms_norm", *_generated_functional.__all__]
