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
are used (`.argmax`, any tensor op) as the model would have; under torch.compile `logits` is None (a
compiled graph returns tensors). Eval mode and calls without labels are unchanged.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn

from invact import kinds
from invact.identity import swap
from invact.kinds import Decision, Found, Kind, Options
from invact.loss.op import _as_rows, _loss, linear_cross_entropy
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
_NOT_FORWARDED = frozenset({"hidden", "weight", "bias", "ops", "values", "indices", "crow_indices",
                            "col_indices", "row_indices", "ccol_indices"})  # fmt: skip


class PendingLogits:
    """The logits a patched head would return, not computed: the head's input, weight and bias, the
    transform the model applies to them, and the shape and dtype the logits would have. F.cross_entropy
    on it computes the loss with linear_cross_entropy; the model's scalings, tanh, `.float()` and
    views are recorded; anything else computes the logits (`logits()`) and goes on with them."""

    def __init__(self, hidden, weight, bias, ops=(), dtype=None, shape=None):
        self.hidden, self.weight, self.bias, self.ops = hidden, weight, bias, ops
        self.dtype = dtype or torch.promote_types(hidden.dtype, weight.dtype)
        self.shape = torch.Size(shape or (*hidden.shape[:-1], weight.shape[0]))

    device = property(lambda self: self.hidden.device)
    ndim = property(lambda self: len(self.shape))
    requires_grad = property(lambda self: True)

    def size(self, dim=None):
        return self.shape if dim is None else self.shape[dim]

    def dim(self):
        return len(self.shape)

    def _with(self, **changes):
        state = {"ops": self.ops, "dtype": self.dtype, "shape": self.shape} | changes
        return PendingLogits(self.hidden, self.weight, self.bias, **state)

    def logits(self) -> torch.Tensor:
        """The logits as the model would have computed them (on the autograd graph)."""
        log.info("invact: a patched head's logits were used by something other than the loss: computed")
        z = F.linear(self.hidden, self.weight, self.bias)
        for op in self.ops:
            z = z * op[1] if op[0] == "mul" else z / op[1] if op[0] == "div" else torch.tanh(z)
        return z.to(self.dtype).reshape(self.shape)

    # What the models do between the head and the loss.
    def __truediv__(self, other):
        if isinstance(other, (int, float)) and not isinstance(other, bool) and other != 0:
            return self._with(ops=(*self.ops, ("div", float(other))))
        return self.logits() / other

    def __mul__(self, other):
        if isinstance(other, (int, float)) and not isinstance(other, bool):
            return self._with(ops=(*self.ops, ("mul", float(other))))
        return self.logits() * other

    __rmul__ = __mul__

    def __add__(self, other):
        # a bias over the vocabulary added to the head's output (BART's final_logits_bias): the head's
        # bias, where no scaling came before it
        if (
            isinstance(other, torch.Tensor)
            and not self.ops
            and other.dim() >= 1
            and other.shape[-1] == self.shape[-1]
            and other.numel() == self.shape[-1]
        ):
            bias = other.reshape(-1).to(self.hidden.dtype)
            bias = bias if self.bias is None else self.bias + bias
            dtype = torch.promote_types(self.dtype, other.dtype)
            return PendingLogits(self.hidden, self.weight, bias, self.ops, dtype, self.shape)
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
                return self._with(shape=tuple(shape))
        return self.logits().view(*shape)

    reshape = view

    def __getattr__(self, name):  # any other tensor attribute: on the computed logits
        # Code that walks a model's output probes its values for mapping or sparse-tensor attributes
        # (`hasattr(v, "keys")`, `hasattr(v, "values")`): those do not compute the logits.
        if name.startswith("__") or name in _NOT_FORWARDED or not hasattr(torch.Tensor, name):
            raise AttributeError(name)
        return getattr(self.logits(), name)

    def __getitem__(self, index):
        return self.logits()[index]

    def __repr__(self) -> str:
        return f"PendingLogits(shape={tuple(self.shape)}, dtype={self.dtype}, ops={self.ops})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.tanh and len(args) == 1 and not kwargs and isinstance(args[0], cls):
            return args[0]._with(ops=(*args[0].ops, ("tanh",)))
        if func is F.cross_entropy and isinstance(args[0], cls):
            loss = _cross_entropy(*args, **kwargs)
            if loss is not None:
                return loss
        real = lambda v: v.logits() if isinstance(v, cls) else v  # noqa: E731
        return func(*[real(a) for a in args], **{k: real(v) for k, v in kwargs.items()})


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
    hidden = input.hidden.reshape(-1, input.hidden.shape[-1])
    return linear_cross_entropy(hidden, input.weight, target, input.bias, ops=input.ops,
                                ignore_index=ignore_index, reduction=reduction,
                                label_smoothing=label_smoothing)  # fmt: skip


_GLOBAL_FORWARD_HOOKS = torch.nn.modules.module._global_forward_hooks


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
                return PendingLogits(input, self.weight, self.bias)
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
        if not compiling:  # what _disarm returns as the logits, on demand (PendingLogits)
            _keep(head, "_invact_output", (hidden, ops), compiling)
        parameters = head._parameters  # nn.Module's __getattr__ finds them there, a Python call each
        hidden, target = _as_rows(hidden, shift_labels)
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
    logits = None if kept is None else PendingLogits(kept[0], head.weight, head.bias, kept[1])
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
    if type(head) is not nn.Linear and not isinstance(head, LossHead):
        return name, False, f"its head is a {type(head).__name__}, not an nn.Linear"
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
    return name, True, (f"{what} is computed from the hidden state and the head's weight a chunk of rows "
                        "at a time, with its gradients: no (tokens x vocab) logits kept")  # fmt: skip


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
    owner, attr = kinds.parent(model, name)
    steps = _steps(type(owner), attr) if owner is model else None
    if (
        steps is not None
        and _ops(owner, steps) is not None
        and not isinstance(vars(owner).get("_loss_function"), HeadLoss)
    ):
        head._invact_straight = True
        owner._loss_function = HeadLoss(head, owner.loss_function, owner, steps)
    model._invact_head_path = tuple(name.split("."))
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
