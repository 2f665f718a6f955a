"""Gated MLPs at two saved tensors: down(act(g) * u) keeps y = act(g) (+ bits) and u, not h = y * u.

In a gated MLP the product h = act(g) * u is what the down projection saves for its backward, while
the multiply itself saves y and u, from which h is one multiply away. `recompute_products(module)`
hooks a module (patch() hooks the module that holds each InvAct activation: the MLP, or the MoE
experts module whose down projection is a functional call) so that, while it runs, every saved
tensor that is h (or a view of h) is stored as a recompute handle instead: in backward, h is
recomputed as the multiply's own saved operands, y * u, bitwise the same tensor (one deterministic
elementwise op on the same inputs). Every other saved tensor is stored as it is.

What is recognised, by structure and not by class name: a tensor whose autograd node (or its view
base's) is a multiply of which one operand is an InvAct output (any activation, either mode, either
operand order, any u: nn.Linear's output, a chunk of a fused gate_up projection). Left alone: the
product after dropout (T5's gated MLP in training: the next layer saves the dropped-out tensor),
under torch.compile (its partitioner recomputes cheap products itself), and under outer saved-tensor
hooks (activation checkpointing, CPU offload): inner hooks would replace theirs for the tensors saved
inside the module, and checkpointing drops h anyway. The exception is an observer, whose pack returns
the tensor itself and only records it (invact.memory's counter marks its pack `_invact_observer`):
under it the product is recomputed and every other tensor is handed to it, so it counts what is
really saved.
"""

from __future__ import annotations

import torch
from torch import nn

from invact.ops import _Eager

_INVACT_NODE = f"{_Eager.__name__}Backward"  # the autograd node of the eager InvAct function
_MUL_NODE = "MulBackward0"


def multiply(t: torch.Tensor):
    """(node, operand nodes) of the multiply that produced t or t's view base, where both operands
    need grad (so the multiply saved both); None otherwise."""
    base = t if t._base is None else t._base
    node = base.grad_fn
    if node is None or node.name() != _MUL_NODE:
        return None
    operands = [n for n, _ in node.next_functions]
    if any(n is None for n in operands):  # an operand without grad: the multiply saved only one
        return None
    return node, operands


def _product_node(t: torch.Tensor):
    """The multiply node of y * u (y an InvAct output, both operands saved by it) that produced t or
    t's view base; None otherwise."""
    found = multiply(t)
    if found is None:
        return None
    node, operands = found
    return node if any(n.name() == _INVACT_NODE for n in operands) else None


class _Recompute:
    """A saved tensor that is (a view of) y * u: recomputed from the multiply's saved operands."""

    __slots__ = ("node", "size", "stride", "offset", "base_stride")

    def __init__(self, node, t: torch.Tensor) -> None:
        base = t if t._base is None else t._base
        self.node, self.size, self.stride = node, t.size(), t.stride()
        self.offset = t.storage_offset() - base.storage_offset()
        self.base_stride = base.stride()

    def tensor(self) -> torch.Tensor:
        h = self.node._saved_self * self.node._saved_other
        if h.stride() != self.base_stride:  # the same op on the same operands lays out the same
            raise RuntimeError("invact: the recomputed gated product has another layout than the saved one")
        return h.as_strided(self.size, self.stride, h.storage_offset() + self.offset)


def _hooks(observer=None) -> torch.autograd.graph.saved_tensors_hooks:
    """Pack a gated product as a _Recompute; hand everything else to `observer` (its pack records and
    returns the tensor) if given."""
    observe = observer or (lambda t: t)

    def pack(t: torch.Tensor):
        node = _product_node(t)
        return observe(t) if node is None else _Recompute(node, t)

    def unpack(saved):
        return saved.tensor() if isinstance(saved, _Recompute) else saved

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


_STAND_ASIDE = object()


def _outer_pack():
    """None where no saved-tensor hooks are in force; an observer's pack; else _STAND_ASIDE (hooks
    that store something else: checkpointing, offloading; hooks disabled, as torch.func's grad and
    vjp do, which refuse any; also where torch cannot say)."""
    autograd = torch._C._autograd
    top = getattr(autograd, "_top_saved_tensors_default_hooks", None)
    enabled = getattr(autograd, "_saved_tensors_hooks_is_enabled", None)
    if top is None or enabled is None or not enabled():
        return _STAND_ASIDE
    current = top(False)
    if current is None:
        return None
    return current[0] if getattr(current[0], "_invact_observer", False) else _STAND_ASIDE


class _Hooks:
    """The forward pre-/post-hooks of one module: enter the recompute hooks, leave them after (also
    when forward raises)."""

    def __init__(self) -> None:
        self.stack: list[torch.autograd.graph.saved_tensors_hooks | None] = []

    def pre(self, module, args, kwargs):
        if torch.compiler.is_compiling():  # traced: no state touched (dynamo's checkpoint forbids it)
            return
        active = None
        if torch.is_grad_enabled():
            outer = _outer_pack()
            if outer is not _STAND_ASIDE:
                active = _hooks(outer)
                active.__enter__()
        self.stack.append(active)

    def post(self, module, args, kwargs, output):
        if torch.compiler.is_compiling():
            return
        active = self.stack.pop() if self.stack else None
        if active is not None:
            active.__exit__(None, None, None)


def recompute_products(module: nn.Module) -> bool:
    """Hook `module` so that nothing it runs saves a copy of a gated product act(g) * u (see the
    module docstring; nested hooked modules stand aside for the outermost). Idempotent; returns
    False if it was hooked already."""
    if getattr(module, "_invact_recompute_products", False):
        return False
    hooks = _Hooks()
    module.register_forward_pre_hook(hooks.pre, with_kwargs=True)
    module.register_forward_hook(hooks.post, with_kwargs=True, always_call=True)
    module._invact_recompute_products = True
    return True
