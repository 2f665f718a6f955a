"""The loss's home: patch() and plan()'s decision for a model's head and loss (invact.loss.source reads
it from the model's source), the replacement (LossHead, HeadLoss, PendingLogits, the forward that arms
them), and the op (invact.loss.op: linear_cross_entropy; its CUDA kernels in invact.loss._triton).

How a model uses it (patch(model, loss=True), invact.patch): its head (an nn.Linear that
`get_output_embeddings()` returns) is patched in place (invact.identity). While the model runs a
training-mode forward with labels and gradients enabled:

- where the model's forward hands the head's output to its loss function straight or through scalings
  and tanh (Gemma 2/3's soft-cap, Cohere's logit_scale, Granite's logits_scaling), read from its
  source (`source._steps`), the head keeps its input and returns an empty stand-in (the logits' leading
  dimensions, no columns), and the model's loss function (HeadLoss, transformers' causal-LM loss)
  computes the loss from that input, the transform read from the model's settings at the call. The
  model's own scalings run on the empty stand-in, for nothing. Eager does so unless a forward hook
  could see the stand-in; torch.compile always (Dynamo traces tensors), with the custom op
  invact::linear_cross_entropy: the same chunks and kernels, its gradients computed in its forward;
- elsewhere, eager's head returns a `PendingLogits`: an object that is not a tensor, takes the
  model's scalings, tanh, `.float()` and `.view`, and computes the loss when the model's loss function
  hands it to F.cross_entropy (class indices, ignore_index, reduction "mean" or "sum", label
  smoothing), so the model's own code keeps its semantics: the label shift, ignore_index -100,
  num_items_in_batch, logits_to_keep. Anything else done to it computes the logits as the model would
  have (eager's tensor, on the autograd graph) and goes on with them. Under compile such a model
  computes its logits as eager does.

Such a call returns its logits on demand: eager's output holds a PendingLogits (the logits' shape and
dtype, the head's input and weight, which the loss keeps anyway), which computes the logits where they
are read (`.argmax`, any tensor op, torch function or Python operator, torch.save) as the model would
have, bit for bit; read after the head's weight changed in place (optimizer.step()) it raises, since the
logits it would compute are no longer the call's. Under torch.compile `logits` is None (a compiled
graph returns tensors). Eval mode and calls without labels are unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_map_only

from invact import kinds
from invact.identity import swap
from invact.kinds import Decision, Found, Kind, Options
from invact.loss import parallel
from invact.loss.op import _as_rows, _device_type, _loss, linear_cross_entropy
from invact.loss.source import (
    _host,
    _labels_at,
    _not_causal,
    _ops,
    _returns_child,
    _steps,
    class_decision,
    class_route,
    output_head,
)

__all__ = ["KIND", "HeadLoss", "LossHead", "PendingLogits", "class_decision", "head_of",
           "linear_cross_entropy", "output_head", "take"]  # fmt: skip

log = logging.getLogger("invact")


# PendingLogits' own fields, and tensor attributes that code walking an output probes for (a sparse
# tensor's values, indices): never forwarded to the computed logits
_NOT_FORWARDED = frozenset({"hidden", "weight", "bias", "added", "ops", "module", "values", "indices",
                            "crow_indices", "col_indices", "row_indices", "ccol_indices"})  # fmt: skip

# Tensor methods that hook the graph the logits are on, which the loss does not go through: on logits
# computed on demand they would never see its gradient
_OFF_GRAPH = frozenset({"retain_grad", "register_hook", "register_post_accumulate_grad_hook"})

# What _version_counters' entries are, in the words of PendingLogits' errors
_SOURCES = ("head's weight", "head's bias", "bias added to the head's output", "head's input")

_FIX = "patch(model, loss=False) to get real logits"


def _version_counters(weight, bias, added, hidden) -> tuple:
    """The version counters of what the logits are computed from (None for an absent bias): every
    in-place op on a tensor or a view of it bumps its counter, an optimizer's step included."""
    return (weight._version, None if bias is None else bias._version,
            None if added is None else added._version, hidden._version)  # fmt: skip


def _call(hidden, weight, bias) -> tuple:
    """What a PendingLogits checks and replays when read: the version counters of the head's input,
    weight and bias (_version_counters), and the autocast the head ran under: (device type, its dtype,
    None where autocast was off)."""
    kind = _device_type(hidden)
    try:
        cast = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None
    except RuntimeError:  # a device type autocast does not know (meta, outside invact.planner.autocast)
        cast = None
    return _version_counters(weight, bias, None, hidden), (kind, cast)


def _autocast_as(kind: str, cast):
    """The autocast state `cast` (a dtype, None: off) on device type `kind`, whatever it is now."""
    try:
        return torch.autocast(kind, dtype=cast) if cast is not None else torch.autocast(kind, enabled=False)
    except RuntimeError:  # a device type torch.autocast does not take (meta): as it is
        return contextlib.nullcontext()


def _freed(weight: torch.Tensor) -> bool:
    """Whether `weight` has elements but no storage: FSDP2 resharded its module (freed the all-gathered
    parameter it registered in the module's forward and registered the shard again). False under
    torch.compile (Dynamo does not trace storages), where FSDP2 wraps compiled layers, not the head."""
    if torch.compiler.is_compiling():
        return False
    return weight.numel() > 0 and weight.untyped_storage().nbytes() == 0


def _alone(module) -> bool:
    """Whether `module` is the only module of its FSDP2 unit (`fully_shard(model.lm_head)`), not one of a
    group (`fully_shard([model.model.norm, model.lm_head])`). FSDP2 gathers a unit again for its
    backward when a gradient reaches the outputs of its modules, which the loss does not use: a group's
    other modules (the norm) need their weights gathered in their backward, so the loss leaves them
    gathered, for FSDP2's post-backward to free. Read from FSDP2's state (private; False, the safe
    answer, where it is not as torch 2.11-2.15 have it)."""
    try:
        state = module._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None)
        groups = groups if groups is not None else [state._fsdp_param_group]
        return all(len(group.modules) == 1 for group in groups if group is not None)
    except (AttributeError, TypeError):
        return False


def _shards(module) -> tuple:
    """The version counters of the shards `module`'s parameters are now (FSDP2's DTensors, between its
    forwards), () where none is: what an optimizer's step changes under FSDP2."""
    # the DTensor's own counter: an in-place op on it (AdamW's foreach ops) bumps it, not its local tensor's
    return tuple(p._version for p in module._parameters.values() if hasattr(p, "_local_tensor"))


@contextlib.contextmanager
def _gathered(module, weight: torch.Tensor, found: dict | None = None):
    """`weight` (the head's, as its forward saw it) with its values while the block runs: where FSDP2
    shards the head as a unit of its own (`fully_shard(model.lm_head)`, as torchtitan does), its forward
    hook freed the all-gathered weight when the head returned, before the loss (or a read of the logits)
    uses it; this all-gathers it again into the same parameter (`module.unshard()`, a collective: every
    rank computes its loss, as in any training step) and frees it after (`module.reshard()`) where the
    head is a unit alone (_alone). The gradient the loss computes reaches that parameter, which FSDP2's
    post-backward reduce-scatters. A no-op elsewhere (a weight with its storage: unsharded, in a root
    unit, DDP, one device). `found` (a PendingLogits' `_fsdp`): where it gathers, the versions of the
    shards it gathers from are kept there under "shards", once (_unavailable compares later reads)."""
    if module is None or not _freed(weight) or not hasattr(module, "unshard"):
        yield
        return
    if found is not None:
        found.setdefault("shards", _shards(module))
    module.unshard()
    try:
        yield
    finally:
        if _alone(module):
            module.reshard()


def _refuse(what: str, *args, **kwargs):
    """Raise for a use of PendingLogits that would act on a computed copy of the logits (an in-place
    op: the output's logits would stay as they were) or on a graph the loss does not go through."""
    if what in _OFF_GRAPH:
        raise RuntimeError(f"invact: outputs.logits is computed on demand, off the loss's graph, so "
                           f".{what}() would never see the loss's gradient: {_FIX}")  # fmt: skip
    how = "item assignment" if what == "__setitem__" else f".{what}()"
    raise RuntimeError(f"invact: outputs.logits is computed on demand, so {how} would change a copy, not "
                       f"the output's logits: use an out-of-place op on it, or {_FIX}")  # fmt: skip


class PendingLogits:
    """The logits a patched head would return, not computed: the head's input, weight and bias, the
    transform the model applies to them, and the shape and dtype the logits would have. F.cross_entropy
    on it computes the loss with linear_cross_entropy; the model's scalings, tanh, a bias added over the
    vocabulary (BART's), `.float()` and views are recorded; anything else reads the logits: it computes
    them (`logits()`, again at each read: nothing is kept) and goes on with them as eager's tensor
    would. Reads are tensor methods and attributes, torch functions (lists of tensors included:
    torch.cat, torch.stack), every Python operator a tensor has, len() and iteration, torch.save and
    pickle (they write the computed tensor, which torch.load reads with weights_only), torch.tensor and
    torch.as_tensor (through `__dlpack__`: a tensor off the autograd graph, torch.tensor's copy as
    eager's; as_tensor's does not require grad where eager's does).

    The logits are computed under the call's autocast (not the read's) from the head's input, weight and
    bias as they are when read, so a read after one of them changed in place (optimizer.step()) raises
    instead of returning other logits than the call's (their version counters, recorded when the call's
    loss read them). So does what would
    act on a computed copy or on a graph the loss does not go through: in-place methods (`.add_()`),
    item assignment, `.retain_grad()`, `.register_hook()`."""

    # numpy defers its binary operators with an array to ours, as with a tensor (torch.Tensor's value)
    __array_priority__ = 1000

    def __init__(self, hidden, weight, bias, ops=(), call=None, module=None):
        self.hidden, self.weight, self.bias, self.ops, self.added = hidden, weight, bias, ops, None
        # the head (LossHead), for FSDP2's all-gather of a weight it sharded again (_gathered), and, shared
        # by the copies the model's steps make, the versions of its shards when the loss gathered it: an
        # optimizer's step under FSDP2 changes the shards, not the gathered weight (_unavailable)
        self.module, self._fsdp = module, {}
        # the version counters and autocast when the call's loss read the head (HeadLoss's `call`),
        # else now: at the head's call, before the model's loss
        self._versions, self._autocast = call if call is not None else _call(hidden, weight, bias)
        # the dtype F.linear computes the logits in: autocast's where it was on (bf16 logits of fp32
        # weights, as eager's head), else the inputs' promoted dtype
        self._head_dtype = self._autocast[1] or torch.promote_types(hidden.dtype, weight.dtype)
        self.dtype = self._head_dtype
        self.shape = torch.Size((*hidden.shape[:-1], weight.shape[0]))

    device = property(lambda self: self.hidden.device)
    ndim = property(lambda self: len(self.shape))
    requires_grad = property(lambda self: True)

    def size(self, dim=None):
        return self.shape if dim is None else self.shape[dim]

    def dim(self):
        return len(self.shape)

    def _with(self, **changes):
        """A copy with `changes` to its fields (a recorded step): the same call, as it was."""
        pending = object.__new__(PendingLogits)
        vars(pending).update(vars(self), **changes)
        return pending

    def _changed(self) -> str | None:
        """What the logits are computed from that changed in place since the call's loss read it (in
        _SOURCES' words), or None."""
        now = _version_counters(self.weight, self.bias, self.added, self.hidden)
        if now == self._versions:
            return None
        return next(what for what, a, b in zip(_SOURCES, now, self._versions, strict=True) if a != b)

    def _unavailable(self) -> str | None:
        """Where FSDP2 has freed the head's gathered weight since the call (its post-backward, or the
        head's own unit after its forward): what keeps the logits from being computed from it, or None.
        They are computed where the head is a unit of its own (it gathers again: _gathered) whose shards
        are as the loss found them; after backward the root's (which holds the head in most wrappings)
        cannot be gathered alone, and after an optimizer's step the shards are not the call's."""
        if self.module is None or not _freed(self.weight):
            return None
        shards = self._fsdp.get("shards")
        if shards is None or not hasattr(self.module, "unshard"):
            return "FSDP2 freed the head's gathered weight (its post-backward)"
        if _shards(self.module) != shards:
            return "an optimizer's step changed the head's shards (FSDP2)"
        return None

    def _records(self) -> bool:
        """Whether an elementwise step is recorded: before a cast only (`.float()` of 16-bit logits).
        logits() applies the steps in the head's dtype and casts last, as the models do; after a cast
        eager computes a step in the new dtype (other roundings), so the logits are computed for it."""
        return self.dtype == self._head_dtype

    def logits(self) -> torch.Tensor:
        """The logits as the model would have computed them (on the autograd graph): the same ops on the
        same tensors in the same order, so bit for bit eager's."""
        unavailable = self._unavailable()
        if unavailable is not None:
            raise RuntimeError(f"invact: outputs.logits was read after {unavailable}: it is computed "
                               f"from the head when read, so read it before loss.backward(), or use "
                               f"{_FIX}")  # fmt: skip
        changed = self._changed()
        if changed is not None:
            raise RuntimeError(f"invact: outputs.logits was read after the {changed} changed in place "
                               "(optimizer.step()?): it is computed from the head when read, so read it "
                               f"before the step, or use {_FIX}")  # fmt: skip
        log.info("invact: a patched head's logits were used by something other than the loss: computed")
        # under the call's autocast, not the read's: eager's head and steps ran under it (bf16 logits of
        # fp32 weights where it was on; fp32 where it was off, even when read in an autocast region)
        with _autocast_as(*self._autocast), _gathered(self.module, self.weight):
            if parallel.is_dtensor(self.weight):  # tensor parallel: the logits as its TP forward gathers them
                z = parallel.logits(self.hidden, self.weight, self.bias)
            else:
                z = F.linear(self.hidden, self.weight, self.bias)
            # BART's `+ final_logits_bias` after the head's own bias, as eager adds it: folded into the
            # head's bias (the loss's way) the sums would round differently
            if self.added is not None:
                z = z + self.added
            for op in self.ops:
                z = z * op[1] if op[0] == "mul" else z / op[1] if op[0] == "div" else torch.tanh(z)
            return z.to(self.dtype).reshape(self.shape)

    # What the models do between the head and the loss.
    def __truediv__(self, other):
        if isinstance(other, (int, float)) and not isinstance(other, bool) and other != 0 and self._records():
            return self._with(ops=(*self.ops, ("div", float(other))))
        return self.logits() / other

    def __mul__(self, other):
        if isinstance(other, (int, float)) and not isinstance(other, bool) and self._records():
            return self._with(ops=(*self.ops, ("mul", float(other))))
        return self.logits() * other

    __rmul__ = __mul__

    def __add__(self, other):
        # a bias over the vocabulary added to the head's output (BART's final_logits_bias), where no
        # scaling or cast came before it and it broadcasts to the logits' shape: logits() adds it as
        # eager does, the loss folds it into the head's bias
        if (
            isinstance(other, torch.Tensor)
            and not self.ops
            and self.added is None
            and 1 <= other.dim() <= len(self.shape)
            and other.shape[-1] == self.shape[-1]
            and other.numel() == self.shape[-1]
            and self._records()
        ):
            dtype = torch.promote_types(self.dtype, other.dtype)
            versions = (*self._versions[:2], other._version, self._versions[3])
            return self._with(added=other, dtype=dtype, _versions=versions)
        return self.logits() + other

    __radd__ = __add__

    def float(self):
        return self._with(dtype=torch.float32)

    def to(self, *args, **kwargs):
        dtype = kwargs.get("dtype", args[0] if args and isinstance(args[0], torch.dtype) else None)
        if dtype == torch.float32 and len(args) + len(kwargs) == 1:
            return self.float()
        return self.logits().to(*args, **kwargs)

    def contiguous(self):
        return self

    def view(self, *shape):
        shape = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)) else shape
        shape = list(shape)
        if shape and shape[-1] in (-1, self.shape[-1]) and shape.count(-1) <= 1:
            rows = math.prod(self.shape[:-1])
            known = math.prod(s for s in shape[:-1] if s != -1)
            if -1 in shape[:-1]:
                shape[shape.index(-1)] = rows // max(known, 1)
            shape[-1] = self.shape[-1]
            if math.prod(shape) == math.prod(self.shape):
                return self._with(shape=torch.Size(shape))
        return self.logits().view(*shape)

    reshape = view

    def __getattr__(self, name):  # any other tensor attribute: on the computed logits
        # Code that walks a model's output probes its values for mapping or sparse-tensor attributes
        # (`hasattr(v, "keys")`, `hasattr(v, "values")`): those do not compute the logits.
        if name.startswith("__") or name in _NOT_FORWARDED or not hasattr(torch.Tensor, name):
            raise AttributeError(name)
        if (name.endswith("_") and name != "requires_grad_") or name in _OFF_GRAPH:
            return functools.partial(_refuse, name)  # raises when called: hasattr finds it, as on a tensor
        return getattr(self.logits(), name)

    def __getitem__(self, index):
        return self.logits()[index]

    def __setitem__(self, index, value):
        _refuse("__setitem__")

    def __len__(self):  # the shape's, without computing the logits
        if not self.shape:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]

    def __dlpack__(self, *args, **kwargs):
        # torch.tensor and torch.as_tensor read a non-tensor through it (not __torch_function__ nor
        # __array__); DLPack exports no autograd graph, so the computed logits are detached
        return self.logits().detach().__dlpack__(*args, **kwargs)

    def __dlpack_device__(self):
        return self.hidden.__dlpack_device__()

    def __reduce_ex__(self, protocol):  # pickle, torch.save: the computed tensor's reduction
        return self.logits().__reduce_ex__(protocol)

    def __deepcopy__(self, memo):
        return self.logits().__deepcopy__(memo)

    def __repr__(self) -> str:
        return f"PendingLogits(shape={tuple(self.shape)}, dtype={self.dtype}, ops={self.ops})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        pending = args[0] if args and isinstance(args[0], cls) else None
        if (
            func is torch.tanh
            and pending is not None
            and len(args) == 1
            and not kwargs
            and pending._records()
        ):
            return pending._with(ops=(*pending.ops, ("tanh",)))
        if func is F.cross_entropy and pending is not None:
            loss = _cross_entropy(*args, **kwargs)
            if loss is not None:
                return loss
        # every PendingLogits among the arguments computed, inside lists and tuples too (torch.cat's and
        # torch.stack's): one left in a list sent func's dispatch back here without end
        args, kwargs = tree_map_only(cls, lambda v: v.logits(), (args, kwargs))
        return func(*args, **kwargs)


def _read(name: str):
    """PendingLogits' `name` (a Python operator or protocol of torch.Tensor): the computed logits'."""

    def read(self, *args, **kwargs):
        return getattr(self.logits(), name)(*args, **kwargs)

    read.__name__ = read.__qualname__ = name
    return read


# Python's operators and protocols on the logits that PendingLogits does not record: eager's, on the
# computed logits. Set after the class: an __eq__ in its body would make it unhashable (__hash__ None),
# and code that walks an output keys its values by identity, as a tensor's hash is.
for _name in ("__sub__", "__rsub__", "__rtruediv__", "__floordiv__", "__rfloordiv__", "__mod__", "__rmod__",
              "__pow__", "__rpow__", "__matmul__", "__rmatmul__", "__and__", "__rand__", "__or__", "__ror__",
              "__xor__", "__rxor__", "__lshift__", "__rlshift__", "__rshift__", "__rrshift__", "__eq__",
              "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__neg__", "__pos__", "__abs__", "__invert__",
              "__bool__", "__float__", "__int__", "__complex__", "__iter__", "__reversed__", "__contains__",
              "__array__"):  # fmt: skip
    setattr(PendingLogits, _name, _read(_name))


def _cross_entropy(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,  # noqa: A002
                   reduction="mean", label_smoothing=0.0):  # fmt: skip
    """F.cross_entropy(pending, target, ...) by linear_cross_entropy, or None where it does not apply
    (class weights, probabilities as targets, reduction "none", logits not (rows, vocab)). Its
    parameters are F.cross_entropy's (tests/invact/test_loss.py checks the two signatures): Python binds
    the call's arguments, not inspect.Signature.bind, which took 9 us a call."""
    if (
        weight is not None
        or size_average is not None
        or reduce is not None
        or reduction not in ("mean", "sum")
        or len(input.shape) != 2
        or not isinstance(target, torch.Tensor)
        or target.dtype != torch.long
        or target.shape != input.shape[:1]
    ):
        return None
    changed = input._changed()
    if changed is not None:  # eager's loss would be of the logits the head returned, before the change
        raise RuntimeError(f"invact: the {changed} changed in place between the head and the loss, which "
                           f"is computed from it: {_FIX}")  # fmt: skip
    hidden = input.hidden.reshape(-1, input.hidden.shape[-1])
    bias = input.bias
    if input.added is not None:  # BART's final_logits_bias, folded into the head's
        added = input.added.reshape(-1).to(hidden.dtype)
        bias = added if bias is None else bias + added
    with _gathered(input.module, input.weight, input._fsdp):
        return linear_cross_entropy(hidden, input.weight, target, linear_bias=bias, ops=input.ops,
                                    ignore_index=ignore_index, reduction=reduction,
                                    label_smoothing=label_smoothing)  # fmt: skip


_GLOBAL_FORWARD_HOOKS = torch.nn.modules.module._global_forward_hooks


def _own_class(module: nn.Module) -> type:
    """The module's class, seen through FSDP2's per-class subclass: `fully_shard` (transformers'
    fsdp_plan applies it when it loads a model) makes a module's class FSDP<cls>(FSDPModule, cls), and a
    head sharded so is still the nn.Linear it was."""
    cls = type(module)
    bases = cls.__bases__
    return bases[1] if len(bases) == 2 and bases[0].__name__ == "FSDPModule" else cls


class LossHead(nn.Module):
    """The mixin of a patched head (invact.identity): while `_invact_armed` (a training forward of its
    model with labels), where its owner's forward hands the head's output to its loss function through
    steps read from its source (`_invact_straight`, set by take()), it keeps its input for that loss
    function (HeadLoss) and returns an empty stand-in (under torch.compile always: Dynamo traces
    tensors, not PendingLogits' Python; eager where no forward hook could see the stand-in). Otherwise
    eager returns PendingLogits instead of the logits, and compile computes its logits as eager does."""

    _invact_armed = 0
    _invact_straight = False

    def forward(self, input):  # noqa: A002 - nn.Linear's argument name
        if self._invact_armed and torch.is_grad_enabled():
            compiling = torch.compiler.is_compiling()
            # Eager takes the stand-in too where nothing but the owner's steps can see the head's output
            # (no forward hook on it): HeadLoss then computes the loss without PendingLogits' Python
            # (its recorded steps and F.cross_entropy's __torch_function__ dispatch: 65 us of a tiny
            # Llama's 2.25 ms step on an Intel Xeon, benchmarks/host_time.py).
            if self._invact_straight and (compiling or not (self._forward_hooks or _GLOBAL_FORWARD_HOOKS)):
                dtype = torch.promote_types(input.dtype, self.weight.dtype)
                # The logits' leading dimensions and no columns: the model's steps (_steps) run on it
                # for nothing, and what the compiled graph returns as the logits (which _disarm drops,
                # outside the graph) holds no memory. A stand-in of the logits' full shape (one element,
                # expanded) came out of a soft-cap as a logits-sized tensor at the forward's peak.
                standin = input.new_empty((*input.shape[:-1], 0), dtype=dtype)
                _keep(self, "_invact_hidden", input, compiling)
                _keep(self, "_invact_standin", standin, compiling)  # _disarm takes it out of the output
                return standin
            if not compiling:
                return PendingLogits(input, self.weight, self.bias, module=self)
        return super().forward(input)

    def invact_repr(self) -> str:
        return "loss from hidden states"


class HeadLoss:
    """The loss function take() gives a patched model whose head feeds it straight (its `loss_function`):
    transformers' causal-LM loss (ForCausalLMLoss: labels shifted by one with ignore_index padding,
    mean over the tokens that count, or sum over num_items_in_batch) from the hidden state LossHead
    kept, by linear_cross_entropy (the custom op invact::linear_cross_entropy there), with the transform
    `steps` (_steps) make on `owner`, the module whose forward calls the head. Where LossHead kept none
    (PendingLogits, eval, no labels), the model's own loss function as it was."""

    def __init__(self, head: nn.Module, original, owner: nn.Module, steps: tuple = ()) -> None:
        self.head, self.original, self.owner, self.steps = head, original, owner, steps

    def __call__(self, logits, labels, vocab_size: int, num_items_in_batch=None, ignore_index: int = -100,
                 shift_labels=None, **kwargs):  # fmt: skip
        head, compiling = self.head, torch.compiler.is_compiling()
        hidden = _take(head, "_invact_hidden", compiling)
        if hidden is None:
            return self.original(logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
                                 ignore_index=ignore_index, shift_labels=shift_labels, **kwargs)  # fmt: skip
        # the stand-in as the owner's steps left it: _disarm drops it
        _keep(head, "_invact_standin", logits, compiling)
        if shift_labels is None:
            labels = F.pad(labels, (0, 1), value=ignore_index)
            shift_labels = labels[..., 1:].contiguous()
        ops = _ops(self.owner, self.steps) if self.steps else ()
        if ops is None:  # a number patch() read became something else since
            raise TypeError(f"invact: {type(self.owner).__name__}'s scaling of its logits is no longer a "
                            "number; patch it again, or with loss=False")  # fmt: skip
        if not (shift_labels.is_cpu and hidden.is_cpu):
            shift_labels = shift_labels.to(hidden.device)
        parameters = head._parameters  # nn.Module's __getattr__ finds them there, a Python call each
        if not compiling:  # what _disarm returns as the logits, on demand (PendingLogits), read from these
            call = _call(hidden, parameters["weight"], parameters.get("bias"))
            _keep(head, "_invact_output", (hidden, ops, call), compiling)
        hidden, target = _as_rows(hidden, shift_labels)
        with _gathered(head, parameters["weight"]):
            loss = _loss(hidden, parameters["weight"], parameters.get("bias"), target, ops, ignore_index, 0.0,
                         num_items_in_batch is None, compiling)  # fmt: skip
        if num_items_in_batch is not None:  # reduction "sum", over the batch's count
            if torch.is_tensor(num_items_in_batch):
                num_items_in_batch = num_items_in_batch.to(loss.device)
            loss = loss / num_items_in_batch
        return loss


def _labels(model: nn.Module, args: tuple, kwargs: dict):
    if "labels" in kwargs:
        return kwargs["labels"]
    at = _labels_at(type(model))
    return args[at] if at is not None and at < len(args) else None


def _head(model: nn.Module):
    """The module at the path where take() found the model's output embeddings (the module there now:
    what get_output_embeddings() returns, without its Python, 5 us a call on an Intel Xeon, on every
    training forward); get_output_embeddings() for a model patched before the path was kept."""
    path = model.__dict__.get("_invact_head_path")
    if path is None:
        return model.get_output_embeddings()
    head = model
    for part in path:
        head = head._modules.get(part)
        if head is None:
            return None
    return head


def _keep(module: nn.Module, name: str, value, compiling: bool) -> None:
    """module.name = value for a value nn.Module keeps in its instance dict (not a parameter, buffer or
    module): eager writes the dict itself, without nn.Module.__setattr__'s Python (a few us a call,
    several a step); `compiling` (torch.compiler.is_compiling()): the attribute as Dynamo traces it."""
    if compiling:
        setattr(module, name, value)
    else:
        module.__dict__[name] = value


def _take(module: nn.Module, name: str, compiling: bool):
    """module.name, removed from the module (None where it has none): _keep's counterpart. Under
    compile set to None, not deleted: Dynamo before torch 2.13 breaks the graph at a getattr of an
    attribute deleted in the same trace (_disarm takes what HeadLoss took), so fullgraph=True raised."""
    if compiling:
        value = getattr(module, name, None)
        if value is not None:
            setattr(module, name, None)
        return value
    state = module.__dict__
    value = state.get(name)
    if value is not None:
        state[name] = None
    return value


def _arm(model, args, kwargs):
    armed = model.training and torch.is_grad_enabled() and _labels(model, args, kwargs) is not None
    head = _head(model) if armed else None
    armed = isinstance(head, LossHead)
    compiling = torch.compiler.is_compiling()
    if armed:
        _keep(head, "_invact_armed", head._invact_armed + 1, compiling)
    _keep(model, "_invact_arms", [*getattr(model, "_invact_arms", ()), (head, armed)], compiling)


def _disarm(model, args, kwargs, output):
    head, armed = model._invact_arms.pop()
    if not armed:
        return output
    compiling = torch.compiler.is_compiling()
    _keep(head, "_invact_armed", head._invact_armed - 1, compiling)
    _take(head, "_invact_hidden", compiling)  # kept under compile, no loss took it
    standin = _take(head, "_invact_standin", compiling)  # the logits' stand-in (LossHead)
    if standin is None:  # eager's PendingLogits, where the model returned them: its logits on demand
        return output
    # eager: the logits on demand (HeadLoss kept the head's input and the transform); under compile
    # None (a compiled graph returns tensors)
    kept = _take(head, "_invact_output", compiling)
    logits = None if kept is None else PendingLogits(kept[0], head.weight, head.bias, kept[1], kept[2], head)
    if isinstance(output, tuple):
        return tuple(logits if v is standin else v for v in output)
    if getattr(output, "logits", None) is standin:
        if logits is not None:
            output["logits"] = logits
            return output
        if isinstance(output, dict) and "logits" in output:  # a ModelOutput: as if built with logits=None
            (OrderedDict if isinstance(output, OrderedDict) else dict).__delitem__(output, "logits")
        object.__setattr__(output, "logits", None)
    return output


class _Armed:
    """The forward take() sets on the module that takes the labels (an instance attribute, as
    invact.mlp's Forward): _arm, the forward it had (its class's, or one set on the instance before),
    then _disarm, also where the forward raises. In place of a forward pre-hook and hook: nn.Module
    runs a module with hooks through _call_impl's slow path (a closure and loops over the hooks, about
    20 us of a tiny Llama's eager step on an Intel Xeon). `__wrapped__`: the forward it wraps, so that
    inspect.signature (transformers' Trainer reads it to pick the dataset's columns) sees its
    arguments."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        inner = module.__dict__.get("forward")
        self.__wrapped__ = inner if inner is not None else type(module).forward.__get__(module)

    def __call__(self, *args, **kwargs):
        module = self.module
        _arm(module, args, kwargs)
        output = None
        try:
            output = self.__wrapped__(*args, **kwargs)
        finally:
            output = _disarm(module, args, kwargs, output)
        return output


def head_of(model: nn.Module) -> tuple[str | None, bool, str]:
    """(the qualified name of the model's head, whether patch() computes its loss from hidden states,
    why or why not); (None, False, why) for a model without a head. Decided by what the model computes,
    read from its source: a model whose output embeddings are an nn.Linear and whose training forward
    (`host`: the model, or in a wrapper whose forward takes no labels, such as PEFT's PeftModel, the
    module it wraps that does) hands the head's output to transformers' causal-LM loss (its
    `loss_function`, whatever its `loss_type`: GPT-2's None and the "ForConditionalGeneration" of
    vision- and audio-language models fall back or map to it) or to a cross-entropy
    (nn.CrossEntropyLoss or F.cross_entropy: T5, BART, Whisper and the other encoder-decoders)."""
    head = output_head(model)
    name = next((n for n, m in model.named_modules() if m is head), None)
    if name is None:
        return None, False, "the model has no output embeddings (get_output_embeddings)"
    if _own_class(head) is not nn.Linear and not isinstance(head, LossHead):
        kind = type(head)
        return name, False, f"its head is a {kind.__module__}.{kind.__qualname__}, not an nn.Linear"
    wrapped = _wrapped(head)
    if wrapped:
        return name, False, wrapped
    host, inner = _host(model, name)
    if host is None:
        return name, False, "its forward takes no labels"
    path = tuple(inner.split("."))
    route, why = class_route(type(host), path[0])
    if route is None:
        return name, False, why
    owner = host._modules[path[0]]
    for part in path[1:]:  # each module between the host and the head hands the head's output back as is
        if not _returns_child(type(owner), part):
            cls = type(owner).__name__
            return name, False, f"its {cls}.forward does more with {part}'s output than return it"
        owner = owner._modules[part]
    if route == "loss_function":
        own = vars(host).get("_loss_function")
        if own is not None and not isinstance(own, HeadLoss):
            return name, False, "its loss function is one of its own, not transformers' causal-LM loss"
        why = _not_causal(type(host), getattr(host, "loss_type", None))
        if why:
            return name, False, why
        what = "transformers' causal-LM loss"
    else:
        what = "its cross-entropy on the head's output"
    if _tensor_parallel_forward(head) is not None:
        return name, True, (f"{what} is computed from the hidden state over the vocabulary's shards of its "
                            "tensor parallel head (each rank its shard's chunks, the log-sum-exp reduced "
                            "across ranks): no (tokens x vocab) logits formed; eager only (under "
                            "torch.compile the head gathers its logits as unpatched)")  # fmt: skip
    return name, True, (f"{what} is computed from the hidden state and the head's weight a chunk of rows "
                        "at a time, with its gradients: no (tokens x vocab) logits kept")  # fmt: skip


def _tensor_parallel_forward(head: nn.Module):
    """The forward transformers' tensor parallelism (its `tp_plan`, transformers 5) set on `head`, where it
    gathers the logits of a head sharded over the vocabulary (the "colwise_gather_output" and
    "colwise_rep" styles: ColwiseParallel with a replicated output) and the loss can run over the shards
    instead (invact.loss.parallel); None for any other head. Read from the forward's closure (its style
    object and the forward it wraps): a forward of another shape is not recognised, and left alone."""
    forward = vars(head).get("forward")
    if isinstance(forward, _ParallelForward):
        return forward.__wrapped__
    code, cells = getattr(forward, "__code__", None), getattr(forward, "__closure__", None)
    if code is None or cells is None or not getattr(forward, "__module__", "").startswith("transformers."):
        return None
    free = dict(zip(code.co_freevars, (c.cell_contents for c in cells), strict=False))
    style, inner = free.get("self"), free.get("original_forward")
    weight = head._parameters.get("weight")
    # a 1-D mesh, or under FSDP2 x TP (transformers' fsdp_plan on a (data, tensor) mesh: the head in a unit,
    # or tied to the embeddings in theirs, kept gathered) a 2-D one, whose forward sees the weight gathered
    # over the first: a DTensor of the second
    mesh = weight.device_mesh.ndim if parallel.is_dtensor(weight) else 0
    if (type(style).__name__ != "ColwiseParallel" or getattr(inner, "__func__", None) is not nn.Linear.forward
            or mesh not in (1, 2)):  # fmt: skip
        return None
    output, placement = getattr(style, "output_layouts", None), weight.placements[-1]
    if not (
        output is not None and output.is_replicate() and placement.is_shard() and placement.dim in (0, -2)
    ):
        return None
    return forward


def _wrapped(head: nn.Module) -> str:
    """Why the loss cannot be computed from `head`'s input where something wraps the head's forward that
    invact does not take ("" where nothing does, or transformers' tensor parallel forward, which it
    takes: _tensor_parallel_forward)."""
    if _tensor_parallel_forward(head) is not None:
        return ""
    forward = vars(head).get("forward")
    if forward is not None:
        what = getattr(forward, "__qualname__", forward)
        return (f"its head's forward is replaced on the instance ({what}), "
                "a wrapping invact does not take: its logits and loss are left as they are")  # fmt: skip
    weight = head._parameters.get("weight")
    # FSDP2's DTensors (1-D, the head in a unit, its hooks only where the head is a unit: `unshard`) are
    # its shards, gathered for the forward; tensor parallel's are the forward's, on a 2-D mesh under
    # FSDP2 x TP, sharded through hooks on the head (parallelize_module)
    hooked = (head._forward_pre_hooks or head._forward_hooks) and not hasattr(head, "unshard")
    if parallel.is_dtensor(weight) and (weight.device_mesh.ndim > 1 or hooked):
        return ("its head's weight is a DTensor sharded by forward hooks (parallelize_module), whose loss "
                "invact does not take from the model: compute it with invact.functional.linear_cross_entropy "
                "from the hidden states and the DTensor weight (over the vocabulary's shards)")  # fmt: skip
    return ""


class _ParallelForward:
    """The forward take() sets on a head that transformers made tensor parallel (_tensor_parallel_forward),
    in place of that forward: in an armed eager training call, LossHead's forward on the head's input,
    whole on every rank (the loss then runs over the vocabulary's shards: invact.loss.parallel); the
    tensor parallel forward it wraps (`__wrapped__`: the logits gathered) in any other call."""

    def __init__(self, head: nn.Module, forward) -> None:
        self.head, self.__wrapped__ = head, forward

    def __call__(self, input):  # noqa: A002 - nn.Linear's argument name
        head = self.head
        if head._invact_armed and torch.is_grad_enabled() and not torch.compiler.is_compiling():
            return LossHead.forward(head, parallel._whole(input))
        return self.__wrapped__(input)


def take(model: nn.Module, name: str) -> None:
    """Patch the head `name` of `model` (head_of's) in place, and wrap the forward of the module that
    takes the labels (_host: the model, or the one a wrapper wraps; _Armed) so that a training forward
    with labels computes its loss from hidden states (eager: PendingLogits; under
    torch.compile: HeadLoss, where the head's owner hands its output to its loss function through
    steps _steps reads).
    Idempotent."""
    head = model.get_submodule(name)
    model, name = _host(model, name)  # the module whose forward takes the labels: its forward is wrapped
    if isinstance(head, LossHead) and getattr(model, "_invact_loss_hooked", False):
        return
    swap(head, LossHead)
    forward = _tensor_parallel_forward(head)
    if forward is not None and not isinstance(vars(head).get("forward"), _ParallelForward):
        head.forward = _ParallelForward(head, forward)
    owner, attr = kinds.parent(model, name)
    steps = _steps(type(owner), attr) if owner is model else None
    if steps is not None and _ops(owner, steps) is not None:
        head._invact_straight = True
        taken = vars(owner).get("_loss_function")
        if isinstance(taken, HeadLoss):  # taken again (a new head after patch(): the loss follows it)
            taken.head = head
        else:
            owner._loss_function = HeadLoss(head, owner.loss_function, owner, steps)
    model._invact_head_path = tuple(name.split("."))
    if not isinstance(vars(model).get("forward"), _Armed):  # one wrapper, however often it is taken
        model.forward = _Armed(model)
    model._invact_loss_hooked = True
    # The per-call state, set before the first call (and left None, not deleted, by _take): under compile
    # a first call that created an attribute recompiled at the second (Dynamo guards on whether it
    # exists: a second graph of the whole model).
    vars(model).setdefault("_invact_arms", [])
    for name in ("_invact_hidden", "_invact_standin", "_invact_output"):
        vars(head).setdefault(name, None)
    vars(head).setdefault("_invact_armed", 0)


def decide(model: nn.Module, options: Options, plan: list[Decision]) -> Found:
    """With options.loss, the loss's Decision (kind "loss", named for the head: head_of) for a model
    with a head; the plan as it is otherwise. include/exclude do not apply to it."""
    name, taken, why = head_of(model) if options.loss else (None, False, "")
    if name is None:
        return Found(plan, [])
    return Found(
        [*plan, Decision(name, kinds.qualname(model.get_submodule(name)), taken, why, kind="loss")], []
    )


def apply(model: nn.Module, plan: list[Decision], options: Options) -> list[str]:
    """take() the head the plan replaces; its name."""
    mine = [d for d in plan if d.kind == KIND.name and d.replace]
    for d in mine:
        take(model, d.name)
    return [d.name for d in mine]


KIND = Kind("loss", decide, apply)
