"""What a model applies between its head and its loss, on a chunk of logits: scalar multiplications and
divisions (Cohere's logit_scale, Granite's logits_scaling) and tanh (Gemma 2/3's final softcapping),
in fp32, with the factors of its derivative. Shared by the loss's rows on one device (invact.loss.op)
and over a vocabulary's shards (invact.loss.parallel)."""

from __future__ import annotations

import torch


def transformed(pre: torch.Tensor, ops: tuple, keep: bool):
    """z = ops applied to pre, in fp32 (pre itself where it is fp32: a chunk's fresh logits, which the
    callers change in place), and the derivative's factors: the product of the scalars and, when
    keep, each tanh's output (each contributes 1 - t^2)."""
    z = pre.float() if pre.dtype != torch.float32 else pre
    scale, tanhs = 1.0, []
    for op in ops:
        if op[0] == "mul":
            z.mul_(op[1])
            scale *= op[1]
        elif op[0] == "div":  # divided, not multiplied by the reciprocal: the model's own rounding
            z.div_(op[1])
            scale /= op[1]
        else:  # "tanh"
            z.tanh_()
            if keep:
                tanhs.append(z.clone())
    return z, scale, tanhs
