"""The transform of a head's logits (invact.loss's `ops`: scalings, a tanh soft-cap) as the rows kernel
of invact.loss._triton takes it. Needs no triton: a meta step planned for CUDA asks it too (whether the
kernel, and so its bytes, would serve) on a machine without triton."""

from __future__ import annotations

# The scalar steps' codes in plan's answer
NONE, MUL, DIV = 0, 1, 2


def plan(ops: tuple) -> tuple[int, float, bool, int, float] | None:
    """ops (invact.loss's transform) as invact.loss._triton's kernel takes them: (pre-op, its value,
    tanh, post-op, its value), or None where they are not one scalar step, a tanh and one scalar step
    (each optional)."""
    pre, tanh, post = (NONE, 1.0), False, (NONE, 1.0)
    for op in ops:
        if op[0] == "tanh":
            if tanh or post[0] != NONE:
                return None
            tanh = True
        else:
            kind = MUL if op[0] == "mul" else DIV
            if not tanh and pre[0] == NONE:
                pre = (kind, float(op[1]))
            elif tanh and post[0] == NONE:
                post = (kind, float(op[1]))
            else:
                return None
    return pre[0], pre[1], tanh, post[0], post[1]
