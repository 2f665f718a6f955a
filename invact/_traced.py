"""An op's body in torch ops, traced into a compiled graph in place of the op.

torch.compile (Dynamo) sees invact's custom ops as single calls, so the graph it hands to AOTAutograd
stays small and its guards few. AOTAutograd then traces that graph under FunctionalTensorMode to build
the joint forward + backward graph, and a rule registered here runs there: instead of recording a call
to the op (which inductor would run as a fallback through the dispatcher into the op's Python body,
tens of microseconds a call: pytorch issue 139629), it runs the op's body written in torch ops, so
the forward and the backward formula (the op's registered autograd calls its backward op, decomposed
the same way) become aten ops that inductor fuses and launches from generated code. No invact Python
runs per call in the compiled step. torch.library.triton_op decomposes its ops at the same place.

What is saved for backward is then the partitioner's choice (AOTAutograd's min-cut over the joint
graph), no longer fixed by the op's outputs. The bodies are written so that its choice is what eager
patch() saves or less (checked by tests/invact/test_memory_and_compile.py with inductor's own
partitioner, invact.memory.inductor_partition): what the backward needs from the forward is the
output the next layer keeps anyway (banned from recomputation: a matmul reads it in backward) and
small tensors a reduction made (banned too: reductions are not recomputed), and where the backward
recomputes something the forward also computed (a gated product, a block of logits), it computes it
in another form, so the joint graph's common-subexpression pass cannot merge the two into one forward
tensor that the backward would then need saved.

Tensor subclasses other than fake and functional tensors (DTensor and the like) are left to the op's
own dispatch, as triton_op does.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
from collections.abc import Callable
from pathlib import Path

import torch
import torch.compiler.config as _compile_config
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode

_PLAIN = (torch.Tensor, FunctionalTensor)
_AS_OPS = [0]  # regions being traced now whose invact ops stay ops (as_ops)


@contextlib.contextmanager
def as_ops():
    """While entered, invact's ops are recorded as ops, not traced as their bodies: for a selective
    checkpoint's region (invact.mlp.Recomputed), whose policy decides per op (it marks invact's op to
    be saved, and the op keeps its y and bits; its body's aten ops would each get the policy's
    answer for aten ops)."""
    _AS_OPS[0] += 1
    try:
        yield
    finally:
        _AS_OPS[0] -= 1


def trace_as(op: str, body: Callable, when: Callable[..., bool] | None = None) -> None:
    """While AOTAutograd traces (FunctionalTensorMode), the custom op `op` ("invact::name") runs as
    body(*args, **kwargs), in torch ops, instead of being recorded as one call; where `when` is given
    and when(*args, **kwargs) is False (a body that reads values, such as float64's Newton inversion),
    the call is recorded as the op, as without this rule."""

    def rule(mode, func, types, args, kwargs):
        if any(not issubclass(t, _PLAIN) and not issubclass(t, torch._subclasses.FakeTensor) for t in types):
            return NotImplemented
        if _AS_OPS[0] or (when is not None and not when(*args, **kwargs)):
            return mode.__torch_dispatch__(func, types, args, kwargs)
        with mode:
            return body(*args, **kwargs)

    torch.library.register_torch_dispatch(op, FunctionalTensorMode, rule)


@functools.cache
def _source_digest() -> str:
    """A digest of invact's own sources (the bodies above and everything they call)."""
    digest = hashlib.sha256()
    root = Path(__file__).parent
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def tag_compile_cache() -> None:
    """Put invact's source digest into torch.compile's cache key (torch.compiler.config.cache_key_tag,
    which the on-disk caches of AOTAutograd and inductor hash): they key a graph by what Dynamo traced,
    in which invact's ops are single calls, so without it a graph compiled with other bodies (another
    invact version, an edited checkout) would be loaded and run. Called once, at `import invact` (not
    while Dynamo traces: inside a checkpointed region it would trace the call, not run it); graphs
    without invact's ops compiled in the same process get the tag too, which costs them one compile
    per invact version."""
    tag = f"invact-{_source_digest()}"
    if tag not in _compile_config.cache_key_tag.split():
        _compile_config.cache_key_tag = f"{_compile_config.cache_key_tag} {tag}".strip()
