"""The device a meta tensor stands for. invact's planner runs a model's training step on the meta
device (shapes, no values: invact.planner); where invact's ops choose by device type
what they allocate (the loss's chunk of rows, invact.loss.op.BLOCK_BYTES; the CPU activation
backward's fp32 blocks, invact.activation._numba.fp32_blocks), an op on meta tensors chooses as on the
device type the plan is for: "cuda", unless a plan for another holds `standing_for` around its step."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

_STANDING = ["cuda"]  # a stack: the innermost standing_for's device type last


def stands_for() -> str:
    """The device type ("cuda", "cpu") a meta tensor stands for now."""
    return _STANDING[-1]


@contextlib.contextmanager
def standing_for(device: str) -> Iterator[None]:
    """Meta tensors stand for `device` (a device type) inside."""
    _STANDING.append(device)
    try:
        yield
    finally:
        _STANDING.pop()
