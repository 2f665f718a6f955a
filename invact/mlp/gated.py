"""Gated MLPs at two saved tensors: down(act(g) * u) keeps y = act(g) (+ bits) and u, not h = y * u.

In a gated MLP the product h = act(g) * u is what the down projection saves for its backward, while
the multiply itself saves y and u, from which h is one multiply away. `invact.mlp.recompute_products(module)`
hooks a module (patch() hooks the module that holds each InvAct activation: the MLP, or the MoE
experts module whose down projection is a functional call) so that, while it runs, every saved
tensor that is h (or a view of h) is stored as a recompute handle instead: in backward, h is
recomputed as the multiply's own saved operands, y * u, bitwise the same tensor (one deterministic
elementwise op on the same inputs). Where g and u are the two halves of one fused gate_up output
(Phi-3, MoE experts), u alone would keep g's half too (InvAct saves y, not g): when the module
returns, y and u move into that output, densely, and y's own storage is freed, or, where that is not
safe (see _move_into), u is copied out of it. Every other saved tensor is stored as it is.

What is recognised, by structure and not by class name: a tensor whose autograd node (or its view
base's) is a multiply of which one operand is an InvAct output (any activation, either mode, either
operand order, any u: nn.Linear's output, a chunk of a fused gate_up projection). Left alone: the
product after dropout (T5's gated MLP in training: the next layer saves the dropped-out tensor), under
torch.compile (there invact.mlp's custom ops serve the MLPs it recognises, invact.mlp.experts' ops a
MoE's experts, and invact.mlp.Recomputed's selective checkpoint any other gated module), and under
outer saved-tensor hooks (activation checkpointing, CPU offload): inner hooks would replace theirs for
the tensors saved inside the module, and checkpointing drops h anyway. The exception is an observer,
whose pack returns the tensor itself and only records it (invact.memory's counter marks its pack
`_invact_observer`): under it the product is recomputed and every other tensor is handed to it, so it
counts what is really saved.
"""

from __future__ import annotations

import operator

import torch

from invact.activation.modules import _CALLS
from invact.activation.ops import _Eager, _EagerPlain
from invact.memory import storage_id

# The autograd nodes of the eager InvAct functions (outside and inside torch.func transforms), and
# the multiply's. Their Python classes are compared first: a type costs less to read than name(),
# which builds a string (C++ nodes' classes are in torch._C._functions).
_INVACT_NODES = frozenset(f"{function.__name__}Backward" for function in (_Eager, _EagerPlain))
_INVACT_NODE_TYPES = (_Eager._backward_cls, _EagerPlain._backward_cls)
_MUL_NODE = "MulBackward0"
_MUL_TYPE = getattr(torch._C._functions, _MUL_NODE, None)


def _is_mul(node) -> bool:
    return type(node) is _MUL_TYPE or (_MUL_TYPE is None and node.name() == _MUL_NODE)


def multiply(t: torch.Tensor):
    """(node, operand nodes) of the multiply that produced t or t's view base, where both operands
    need grad (so the multiply saved both); None otherwise."""
    base = t._base
    node = (t if base is None else base).grad_fn
    if node is None or not _is_mul(node):
        return None
    operands = [n for n, _ in node.next_functions]
    if None in operands:  # an operand without grad: the multiply saved only one
        return None
    return node, operands


def _product_node(t: torch.Tensor):
    """The multiply node of y * u (y an InvAct output, both operands saved by it) that produced t or
    t's view base; None otherwise."""
    found = multiply(t)
    if found is None:
        return None
    node, operands = found
    return node if _any_invact(operands) else None


def _any_invact(nodes) -> bool:
    """Some of these autograd nodes is an InvAct function's."""
    return any(type(n) in _INVACT_NODE_TYPES or n.name() in _INVACT_NODES for n in nodes)


# The autograd nodes between a gated product and the DTensor a tensor parallel down projection saves
# (transformers' RowwiseParallel: DTensor.from_local, a redistribution to the placement it has, the
# matmul's view), none of which changes the values
_DTENSOR_PASSES = frozenset(("_FromTorchTensorBackward", "RedistributeBackward", "ViewBackward0",
                             "UnsafeViewBackward0", "AliasBackward0"))  # fmt: skip


def _dtensor_product_node(t: torch.Tensor):
    """The multiply node of y * u (as _product_node) whose product a DTensor `t` holds as its local
    tensor, unchanged: t's autograd node reaches it through _DTENSOR_PASSES alone (one input each),
    and t's local tensor is dense with the product's elements (then its values are the product's in
    the product's order, a view of it or a copy); None otherwise."""
    node = t.grad_fn
    for _ in range(len(_DTENSOR_PASSES) + 1):
        if node is None or _is_mul(node):
            break
        inputs = [n for n, _ in node.next_functions if n is not None]
        if node.name() not in _DTENSOR_PASSES or len(inputs) != 1:
            return None
        node = inputs[0]
    if node is None or not _is_mul(node):
        return None
    operands = [n for n, _ in node.next_functions]
    if None in operands or not _any_invact(operands):
        return None
    y, u = node._saved_self, node._saved_other
    local = t._local_tensor
    shape = torch.broadcast_shapes(y.shape, u.shape)
    if local.numel() != shape.numel() or local.dtype != torch.result_type(y, u) or not local.is_contiguous():
        return None
    return node


class _RecomputeLocal:
    """A saved DTensor whose local tensor is a gated product (_dtensor_product_node): the product
    recomputed from the multiply's saved operands, as a DTensor of the saved one's placement, shape and
    strides."""

    __slots__ = ("node", "local_shape", "mesh", "placements", "shape", "stride")

    def __init__(self, node, t: torch.Tensor) -> None:
        self.node, self.local_shape = node, t._local_tensor.shape
        self.mesh, self.placements, self.shape, self.stride = t.device_mesh, t.placements, t.shape, t.stride()

    def tensor(self) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        h = (self.node._saved_self * self.node._saved_other).contiguous().view(self.local_shape)
        return DTensor.from_local(h, self.mesh, self.placements, run_check=False, shape=self.shape,
                                  stride=self.stride)  # fmt: skip

    def __getitem__(self, _):  # the unpack hook's item getter (see _Saved)
        return self.tensor()


class _Recompute:
    """A saved tensor that is (a view of) y * u: recomputed from the multiply's saved operands."""

    __slots__ = ("node", "size", "stride", "offset", "base_stride", "whole")

    def __init__(self, node, t: torch.Tensor) -> None:
        base = t._base
        self.node, self.whole = node, base is None  # whole: h itself, not a view of it
        if base is None:
            self.base_stride = t.stride()
            return
        self.size, self.stride, self.base_stride = t.size(), t.stride(), base.stride()
        self.offset = t.storage_offset() - base.storage_offset()

    def tensor(self) -> torch.Tensor:
        h = self.node._saved_self * self.node._saved_other
        if h.stride() != self.base_stride:  # the same op on the same operands lays out the same
            raise RuntimeError("invact: the recomputed gated product has another layout than the saved one")
        if self.whole:  # the saved tensor was h itself: the view below would be h as it is
            return h
        return h.as_strided(self.size, self.stride, h.storage_offset() + self.offset)

    def __getitem__(self, _):  # the unpack hook's item getter (see _Saved)
        return self.tensor()


# A tensor some op inside the hooked module saved, as a one-item list [t]: the tensor itself until the
# module returns, then (see _Scope.close) possibly the same values elsewhere. A list, and _unpack its
# item getter, because a list is built without a Python call and operator.itemgetter runs in C: the
# hooks run for every tensor saved inside the module, and the unpack hook needs no Python frame but
# for a _Recompute (its __getitem__).
_Saved = list
_unpack = operator.itemgetter(0)


def _tensors(output) -> list[torch.Tensor]:
    """The tensors a module returned: itself, or the items of a tuple, list or dict (ModelOutput)."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, dict):
        return [t for t in output.values() if isinstance(t, torch.Tensor)]
    items = output if isinstance(output, (tuple, list)) else ()
    return [t for t in items if isinstance(t, torch.Tensor)]


_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)


def _wrapper_count() -> int | None:
    """What one Python storage object adds to its StorageImpl's use count, measured on a tensor of
    our own: 1 in torch 2.11 and 2.13 (a storage's Python object is kept and holds a reference); a
    build where it held none would read 0. None where torch cannot say."""
    if _USE_COUNT is None:
        return None
    t = torch.empty(1)
    storage = t.untyped_storage()
    return _USE_COUNT(storage._cdata) - 1  # less t's own reference


_WRAPPER = _wrapper_count()


def _holders(storage) -> int | None:
    """How many references hold `storage`'s StorageImpl besides the Python object `storage`: one per
    tensor on it (every view, `_base` or not, is a TensorImpl of its own that shares it) and one per
    other Python storage object; None where torch cannot say. Several references to one tensor count
    once: see _move_into, which drops its own references to the tensors it asks about.

    torch._C._storage_Use_Count is private (the StorageImpl's intrusive_ptr use count, which torch's
    CUDA graph trees read too); it is in torch 2.11's and 2.13's CPU builds (checked); some builds
    have registered it with CUDA only (pytorch#131881). Where it is missing, None: nothing moves
    (u is copied out, as where something else holds the storage). What `storage` itself adds is
    measured once (_WRAPPER), not assumed."""
    if _USE_COUNT is None or _WRAPPER is None:
        return None
    return _USE_COUNT(storage._cdata) - _WRAPPER


def _halves(g: torch.Tensor, u: torch.Tensor) -> int | None:
    """Where g and u are the two halves of every row of one storage and fill it (chunk(2, -1) of a
    fused gate_up output): u's offset in a row, 0 or the row's half; None otherwise."""
    cols = g.shape[-1]
    if g.shape != u.shape or g.dtype != u.dtype or g.stride(-1) != 1 or u.stride(-1) != 1 or cols == 0:
        return None
    try:
        rows_g, rows_u = g.view(-1, cols), u.view(-1, cols)
    except RuntimeError:  # the leading dimensions do not merge
        return None
    count = rows_g.shape[0]
    if count > 1 and not rows_g.stride(0) == rows_u.stride(0) == 2 * cols:
        return None
    if g.untyped_storage().nbytes() != count * 2 * cols * g.element_size():
        return None
    offsets = (g.storage_offset(), u.storage_offset())
    return offsets[1] if offsets in ((0, cols), (cols, 0)) else None


def _move_into(call: list, parts: list[_Saved], saved_y: list[_Saved]) -> bool:
    """With g and u (the saved parts) the two halves of each row of one storage S and nothing but
    these references holding S or y (call: [g, y], y = act(g)): move u to S's first half and y to its
    second, both dense, and point the saved references there. y's own storage is then freed, and S,
    its pages already touched, holds what the module saves: no fresh memory, where a copy of u would
    take as many bytes of fresh pages (on CPU a page fault costs microseconds: 8k faults for a 32 MB
    copy). False, with nothing changed, where the layout does not allow it; True where u was handled:
    moved, or copied out of S where something else holds S.

    Whether something else holds S is not read from view bookkeeping: a hook may hold g, u or the
    gate_up output itself, which is g's `_base` where the projection had no bias (mm, then
    _unsafe_view: not a view) and a view of it where it had one (addmm, then view), and holding one
    of these tensors adds no tensor on S. Instead a tensor of our own is put on S, every reference
    this call holds to g and u is dropped (call[0], the saved parts; their view base goes with
    them), and S's use count must then be that tensor's alone: anything else on S, a tensor or a
    view of it held by anyone (Python or C++), keeps it higher, and then u is copied out of our
    tensor instead. Left over garbage that still holds S counts as a holder too: a copy, not a move."""
    g, y = call
    u = parts[0][0]
    if any(p[0] is not u for p in parts) or any(s[0] is not y for s in saved_y):
        return False
    if y.shape != g.shape or y.dtype != g.dtype or not y.is_contiguous() or y.device != g.device:
        return False
    offset = _halves(g, u)
    if offset is None or _holders(y.untyped_storage()) != 1:  # y would keep its storage (a view of it)
        return False
    storage = g.untyped_storage()
    n, cols = g.numel(), g.shape[-1]
    shape, stride, u_offset = u.shape, u.stride(), u.storage_offset()
    dense = torch.empty(0, dtype=g.dtype, device=g.device).set_(storage, 0, (2 * n,), (1,))
    call[0] = None  # from here on nothing of ours holds g, u or their base: dense and storage hold S
    for p in parts:
        p[0] = None
    del g, u
    if _holders(storage) != 1:  # something else holds S (or torch cannot say): copy u out
        u_copy = dense.as_strided(shape, stride, u_offset).clone(memory_format=torch.contiguous_format)
        for p in parts:
            p[0] = u_copy
        return True
    with torch.no_grad():
        rows = dense.view(-1, 2 * cols)[:, offset : offset + cols]  # u, row by row
        # Compacting in place: row r goes to [r, r + 1) cols, over what was row r // 2's half (read
        # already). Rows in [a, 2a) land in [a, 2a) * cols and come from [2a, 4a) * cols: one copy per
        # doubling, each of two disjoint ranges.
        start = 1 if offset == 0 else 0  # row 0 is in place where u leads
        while start < rows.shape[0]:
            stop = min(max(2 * start, 1), rows.shape[0])
            dense[start * cols : stop * cols].view(-1, cols).copy_(rows[start:stop])
            start = stop
        dense[n:].copy_(y.view(-1))
    u_moved, y_moved = dense[:n].view(shape), dense[n:].view(y.shape)
    for p in parts:
        p[0] = u_moved
    for s in saved_y:
        s[0] = y_moved
    return True


class _Scope:
    """One call of a hooked module in progress: its saved-tensor hooks and what they have seen.

    Pack a gated product as a _Recompute and every other tensor as a _Saved, handed at the module's
    return to `observer` (its pack records and returns the tensor) if given. InvAct modules inside
    record their input and output (InvAct.forward, where recompute_products set _invact_notes_calls)."""

    __slots__ = ("observer", "calls", "saved", "products")

    def __init__(self, observer=None) -> None:
        self.observer = observer
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []  # (x, y) of each InvAct module inside
        self.saved: list[_Saved] = []
        self.products = 0  # gated products packed as _Recompute

    def pack(self, t: torch.Tensor):
        # Most saved tensors are no product: a leaf (the module's input, a weight: no grad_fn) or
        # another op's output. Only a multiply's goes on to _product_node.
        base = t._base
        node = (t if base is None else base).grad_fn
        if node is not None and _is_mul(node):
            node = _product_node(t)
            if node is not None:
                self.products += 1
                return _Recompute(node, t)
        elif node is not None and hasattr(t, "_local_tensor"):  # a DTensor: tensor parallel's down projection
            node = _dtensor_product_node(t)
            if node is not None:
                self.products += 1
                return _RecomputeLocal(node, t)
        saved = [t]
        self.saved.append(saved)
        return saved

    def close(self, arguments: tuple, output) -> bool:
        """At the module's return, stop keeping g where it is half of a fused gate_up output: InvAct
        saves y, not g, so u alone would keep the whole output. Either y and u move into that
        storage (_move_into) or u is copied out of it. Neither where some op in the call saved that
        storage whole, or the module was given it or returns it (its caller holds it): there the
        storage stays, and a copy would add u's bytes.

        Returns whether the call showed the hooks to be of no use in this module: an InvAct module
        ran inside and tensors were saved, yet none was a gated product or shared an InvAct input's
        storage (a plain MLP: act's output goes to a Linear, not to a multiply)."""
        saved, self.saved = self.saved, []  # from now on the saved-tensor slots alone hold them
        calls, self.calls = self.calls, []
        ran = bool(calls and saved)
        # Only a view (a chunk of a fused output) or a meta tensor can share its storage with a saved
        # tensor here: an op's own output owns its storage. The cheap test first (host time).
        shared = ran and any((x._base is not None or x.is_meta) and _may_share(x, saved) for x, _ in calls)
        if shared:
            _free_gate_halves(calls, saved, arguments, output)  # empties calls
        if self.observer is not None:
            for s in saved:
                s[0] = self.observer(s[0])
        return ran and not shared and not self.products


def _may_share(x: torch.Tensor, saved: list[_Saved]) -> bool:
    """Some saved tensor may share x's storage: one starts inside it (which every tensor sharing it
    does), or on the meta device (no addresses) one is in the same storage. Where none does on the meta
    device, the hooks remove themselves as on a device (invact plan's step after the first)."""
    if x.is_meta:
        return any(storage_id(t) == storage_id(x) for (t,) in saved)
    storage = x.untyped_storage()
    start = storage.data_ptr()
    end = start + storage.nbytes()
    return any(start <= t.data_ptr() <= end for (t,) in saved)


def _free_gate_halves(calls: list, saved: list[_Saved], arguments: tuple, output) -> None:
    """_Scope.close's work, where some saved tensor shares the storage of an InvAct module's input.
    Empties `calls`, taking each (x, y) out before its turn: _move_into must hold the only
    reference this module keeps to x."""
    by_storage: dict[int, list[_Saved]] = {}
    for s in saved:
        by_storage.setdefault(storage_id(s[0]), []).append(s)
    given = [t for a in arguments for t in _tensors(a)]
    kept = {storage_id(t) for (t,) in saved if t.numel() * t.element_size() == t.untyped_storage().nbytes()}
    kept |= {storage_id(t) for t in (*given, *_tensors(output))}
    calls.reverse()
    while calls:
        call = [*calls.pop()]  # [x, y], in the order the calls ran
        ptr = storage_id(call[0])
        parts = [] if ptr in kept else by_storage.pop(ptr, [])
        if parts and not _move_into(call, parts, by_storage.get(storage_id(call[1]), [])):
            for part in parts:
                part[0] = part[0].detach().clone(memory_format=torch.contiguous_format)


def _note_call(module, args, output) -> None:
    """The forward hook earlier versions registered on each InvAct module inside a hooked one. It
    does nothing now (InvAct.forward records its calls); kept so that a model pickled with such a hook
    still loads."""


_STAND_ASIDE = object()
_TOP_HOOKS = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
_HOOKS_ENABLED = getattr(torch._C._autograd, "_saved_tensors_hooks_is_enabled", None)
# What torch.autograd.graph.saved_tensors_hooks' __enter__ and __exit__ call
_push_hooks = torch._C._autograd._push_saved_tensors_default_hooks
_pop_hooks = torch._C._autograd._pop_saved_tensors_default_hooks


def _outer_pack():
    """None where no saved-tensor hooks are in force; an observer's pack; else _STAND_ASIDE (hooks
    that store something else: checkpointing, offloading; hooks disabled, as torch.func's grad and
    vjp do, which refuse any; also where torch cannot say)."""
    if _TOP_HOOKS is None or _HOOKS_ENABLED is None or not _HOOKS_ENABLED():
        return _STAND_ASIDE
    current = _TOP_HOOKS(False)
    if current is None:
        return None
    return current[0] if getattr(current[0], "_invact_observer", False) else _STAND_ASIDE


class _Hooks:
    """The forward pre-/post-hooks of one module: enter the recompute hooks, leave them after (also
    when forward raises). After a call that shows them to be of no use there (_Scope.close: a plain
    MLP), they remove themselves: each costs Python calls per forward and per saved tensor (a 16-64-16
    MLP on a 2-core Intel Xeon, benchmarks/host_time.py: 1.54x torch's host time hooked, 1.28x after)."""

    def __init__(self) -> None:
        self.stack: list[_Scope | None] = []
        self.handles: list = []

    def pre(self, module, args, kwargs):
        if torch.compiler.is_compiling():  # traced: no state touched (dynamo's checkpoint forbids it)
            return
        scope = None
        if torch.is_grad_enabled():
            outer = _outer_pack()
            if outer is not _STAND_ASIDE:
                scope = _Scope(outer)
                _push_hooks(scope.pack, _unpack)
                _CALLS.scopes.append(scope)
        self.stack.append(scope)

    def post(self, module, args, kwargs, output):
        if torch.compiler.is_compiling():
            return
        scope = self.stack.pop() if self.stack else None
        if scope is not None:
            _pop_hooks()
            _CALLS.scopes.remove(scope)
            useless = scope.close((*args, kwargs), output)
            # Not on an observed call (a measurement) nor one that raised (output None), nor while
            # another call of this module is in progress (recursion).
            if useless and self.handles and scope.observer is None and output is not None and not self.stack:
                for handle in self.handles:
                    handle.remove()
                module._invact_recompute_products = "removed: no gated product"
