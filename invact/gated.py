"""Gated MLPs at two saved tensors: down(act(g) * u) keeps y = act(g) (+ bits) and u, not h = y * u.

In a gated MLP the product h = act(g) * u is what the down projection saves for its backward, while
the multiply itself saves y and u, from which h is one multiply away. `recompute_products(module)`
hooks a module (patch() hooks the module that holds each InvAct activation: the MLP, or the MoE
experts module whose down projection is a functional call) so that, while it runs, every saved
tensor that is h (or a view of h) is stored as a recompute handle instead: in backward, h is
recomputed as the multiply's own saved operands, y * u, bitwise the same tensor (one deterministic
elementwise op on the same inputs). Where g and u are the two halves of one fused gate_up output
(Phi-3, MoE experts), u is copied out of it when the module returns, so that the half holding g is
freed (InvAct saves y, not g). Every other saved tensor is stored as it is.

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

import threading

import torch
from torch import nn

from invact.modules import InvAct
from invact.ops import _Eager, _EagerPlain

# The autograd nodes of the eager InvAct functions (outside and inside torch.func transforms)
_INVACT_NODES = frozenset(f"{function.__name__}Backward" for function in (_Eager, _EagerPlain))
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
    return node if any(n.name() in _INVACT_NODES for n in operands) else None


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


class _Part:
    """A saved tensor that is part, not all, of its storage: the view itself until the hooked module
    returns, then (see _Scope.close) possibly a compact copy of it."""

    __slots__ = ("t",)

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


def _tensors(output) -> list[torch.Tensor]:
    """The tensors a module returned: itself, or the items of a tuple, list or dict (ModelOutput)."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, dict):
        return [t for t in output.values() if isinstance(t, torch.Tensor)]
    items = output if isinstance(output, (tuple, list)) else ()
    return [t for t in items if isinstance(t, torch.Tensor)]


class _Scope:
    """One call of a hooked module in progress: its saved-tensor hooks and what they have seen.

    Pack a gated product as a _Recompute and a part of a storage as a _Part; hand every other tensor
    to `observer` (its pack records and returns the tensor) if given. InvAct modules inside record
    the storages of their inputs (see _note_input)."""

    def __init__(self, observer=None) -> None:
        self.observe = observer or (lambda t: t)
        self.inputs: set[int] = set()  # storages of the inputs of InvAct modules called inside
        self.whole: set[int] = set()  # storages some op saved whole
        self.parts: list[_Part] = []
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, t: torch.Tensor):
        node = _product_node(t)
        if node is not None:
            return _Recompute(node, t)
        storage = t.untyped_storage()
        if t.numel() * t.element_size() < storage.nbytes():
            self.parts.append(_Part(t))
            return self.parts[-1]
        self.whole.add(storage.data_ptr())
        return self.observe(t)

    @staticmethod
    def unpack(saved):
        if isinstance(saved, _Recompute):
            return saved.tensor()
        return saved.t if isinstance(saved, _Part) else saved

    def close(self, arguments: tuple, output) -> None:
        """At the module's return, copy each saved part of an InvAct input's storage out of it: u,
        when g and u are the halves of one fused gate_up output. InvAct saves y, not g, so u alone
        would keep the whole output; with u copied out, nothing does, and g's half is freed. Not
        where some op in the call saved that storage whole, or the module was given it or returns
        it (its caller holds it): there the copy would add u's bytes."""
        given = [t for a in arguments for t in _tensors(a)]
        kept = self.whole | {t.untyped_storage().data_ptr() for t in (*given, *_tensors(output))}
        for part in self.parts:
            ptr = part.t.untyped_storage().data_ptr()
            if ptr in self.inputs and ptr not in kept:
                part.t = part.t.detach().clone(memory_format=torch.contiguous_format)
            part.t = self.observe(part.t)


class _Calls(threading.local):
    """The hooked module calls in progress in this thread (as saved-tensor hooks are: nn.DataParallel
    runs its replicas' forwards in threads), innermost last."""

    def __init__(self) -> None:
        self.scopes: list[_Scope] = []


_CALLS = _Calls()


def _note_input(module, args) -> None:
    """Forward pre-hook of an InvAct module inside a hooked one: record its input's storage."""
    scopes = _CALLS.scopes
    if scopes and not torch.compiler.is_compiling() and isinstance(args[0], torch.Tensor):
        scopes[-1].inputs.add(args[0].untyped_storage().data_ptr())


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
        self.stack: list[_Scope | None] = []

    def pre(self, module, args, kwargs):
        if torch.compiler.is_compiling():  # traced: no state touched (dynamo's checkpoint forbids it)
            return
        scope = None
        if torch.is_grad_enabled():
            outer = _outer_pack()
            if outer is not _STAND_ASIDE:
                scope = _Scope(outer)
                scope.hooks.__enter__()
                _CALLS.scopes.append(scope)
        self.stack.append(scope)

    def post(self, module, args, kwargs, output):
        if torch.compiler.is_compiling():
            return
        scope = self.stack.pop() if self.stack else None
        if scope is not None:
            scope.hooks.__exit__(None, None, None)
            _CALLS.scopes.remove(scope)
            scope.close((*args, kwargs), output)


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
    for act in module.modules():
        if isinstance(act, InvAct) and not getattr(act, "_invact_notes_input", False):
            act.register_forward_pre_hook(_note_input)
            act._invact_notes_input = True
    return True
