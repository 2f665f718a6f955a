"""What FSDP2 (`torch.distributed.fsdp.fully_shard`) holds on one rank of N during a training step, for
invact.planner.step's plan of a step on the meta device: `Sharding(model, ranks)` stands in for
`fully_shard` on each decoder layer and then the root, as torchtitan, accelerate and TRL wrap a model,
without a process group and without FSDP2 itself (whose lazy init refuses meta parameters and whose
internals differ across torch 2.11-2.15). It gives each parameter its shard and follows, with module
hooks and autograd hooks (the ones FSDP2 registers), the bytes FSDP2 allocates and frees:

- sharded parameters, gradients and optimizer state: each parameter's dim 0 split over the ranks,
  every rank's shard `ceil(dim0 / ranks)` rows (FSDP2 pads the last ranks' shards to that: the per-rank
  bytes are the largest shard's);
- a unit's all-gather before its forward: the flat all-gather output (every rank's padded shard) and
  the unsharded parameters (padded) copied out of it; the output is freed after the next unit's
  copy-out (the root's post-forward frees the last), the unsharded parameters after a layer's forward
  (reshard_after_forward, FSDP2's default for all but the root). The root's stay gathered until its
  gradients are reduced at the end of backward;
- in backward, a layer gathered again when a gradient reaches its outputs, and the unit that ran before
  it in the forward prefetched (its all-gather output alive until that unit's own backward begins; the
  root's backward prefetches the last layer);
- a unit's gradients, when its backward ends (the gradient reaching its inputs; where none needs one,
  at the end of backward, as FSDP2's final callback): the unit resharded, the previous unit's
  reduce-scatter input freed, its own allocated and filled from the unsharded gradients, which are then
  freed, and the sharded gradients, one storage for the unit; the input kept until the next unit's
  post-backward.

Read from torch 2.13's torch/distributed/fsdp/_fully_shard/ (FSDP2 on a CPU over gloo: no streams).

The model's own (full, meta) parameters compute the forward and backward as on one device, with the
rank's micro-batch; their bytes are not counted (the gathered buffers stand for them). Imports no
torch.distributed.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten, tree_unflatten

# The label LiveBytes files FSDP2's buffers under (the all-gathered parameters, the all-gather output,
# the reduce-scatter input): a term of its own in a plan's --explain
LABEL = "sharding"


def shard_shape(shape: torch.Size, ranks: int) -> torch.Size:
    """The shape of one rank's shard of a parameter of `shape`: dim 0 split in `ranks`, rounded up (every
    rank's shard padded to the first's); a 0-d parameter is one element on every rank."""
    if not shape:
        return torch.Size((1,))
    return torch.Size((math.ceil(shape[0] / ranks), *shape[1:]))


def layer_classes(model: nn.Module) -> set[str]:
    """The class names of the modules wrapped one unit each: the model's `_no_split_modules` (its
    decoder and vision layers, what accelerate's and TRL's FSDP2 wrap policies read), from the model or
    any module it holds (a PEFT wrapper holds the model)."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    return names


class _Unit:
    """One `fully_shard` unit: its parameters (each once), the bytes of their gathered copy and of the
    flat all-gather buffer (every rank's padded shard), and the gathered copy while it is alive."""

    def __init__(self, module: nn.Module, params: list[nn.Parameter], ranks: int, root: bool) -> None:
        self.module, self.params, self.root = module, params, root
        self.padded = sum(ranks * shard_shape(p.shape, ranks).numel() * p.element_size() for p in params)
        self.gathered: torch.Tensor | None = None  # the unsharded parameters, while allocated
        self.flat: torch.Tensor | None = None  # a prefetched all-gather output, until copied out
        self.reduced = False


class _PostBackward(torch.autograd.Function):
    """The identity on a unit's inputs whose backward runs when their gradient is computed, after the
    unit's own backward (FSDP2's RegisterPostBackwardFunction): the unit's gradients are reduced then."""

    @staticmethod
    def forward(ctx, sharding, unit, *tensors):
        ctx.sharding, ctx.unit = sharding, unit
        return tensors

    @staticmethod
    def backward(ctx, *grads):
        ctx.sharding._reduce(ctx.unit)
        return (None, None, *grads)


class Sharding:
    """FSDP2's per-rank memory of `model` on `ranks` ranks (module docstring). `shards`: a meta tensor per
    parameter, its rank's shard (what the optimizer steps on: `trainable`); `attach(live)` installs the
    hooks for one step followed by `live` (invact.planner.live_bytes.LiveBytes), `finish()` reduces what the
    backward left (the root's gradients, and every unit's where its inputs needed none) and frees the
    gathered copies; `detach()` removes the hooks."""

    def __init__(self, model: nn.Module, ranks: int) -> None:
        if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
            raise ValueError(f"ranks must be a positive integer, got {ranks!r}")
        self.model, self.ranks = model, ranks
        classes = layer_classes(model)
        layers = [m for m in model.modules() if type(m).__name__ in classes and m is not model]
        # the innermost unit holding each parameter (a layer inside a layer is a unit of its own)
        owner: dict[int, nn.Module] = {}
        for module in [model, *layers]:
            for p in module.parameters():
                owner[id(p)] = module
        self.units: list[_Unit] = []
        for module in [*layers, model]:
            params = [p for p in dict.fromkeys(module.parameters()) if owner[id(p)] is module]
            if params:
                self.units.append(_Unit(module, params, ranks, root=module is model))
        self.shards: dict[nn.Parameter, nn.Parameter] = {}
        for p in dict.fromkeys(model.parameters()):
            shard = torch.empty(shard_shape(p.shape, ranks), dtype=p.dtype, device="meta")
            self.shards[p] = nn.Parameter(shard, requires_grad=p.requires_grad)
        self.trainable = [s for s in self.shards.values() if s.requires_grad]
        self.live, self.in_backward, self.order = None, False, []
        self.kept_flat = self.kept_input = None  # the last all-gather output, reduce-scatter input
        self._handles: list = []

    def _allocate(self, nbytes: int) -> torch.Tensor:
        """`nbytes` on the meta device, filed under LABEL by the LiveBytes that follows the step."""
        phase = self.live.phase
        self.live.phase = LABEL
        try:
            return torch.empty(nbytes, dtype=torch.uint8, device="meta")
        finally:
            self.live.phase = phase

    def _gather(self, unit: _Unit) -> None:
        """The unit's all-gather and copy-out, in the forward: the output stays until the next unit's
        copy-out has run (FSDP2 keeps it in its all-gather state; the root's post-forward frees the last)."""
        if unit.gathered is not None:
            return
        flat = self._allocate(unit.padded)  # the all-gather output: every rank's padded shard
        unit.gathered = self._allocate(unit.padded)  # the unsharded parameters (padded), copied out of it
        self.kept_flat = flat  # the previous unit's output freed, after this copy-out

    def _prefetch(self, unit: _Unit) -> None:
        """In the backward, the unit's all-gather issued before its backward (FSDP2's backward prefetch):
        its output alive until the unit's pre-backward copies it out."""
        if unit.gathered is None and unit.flat is None:
            unit.flat = self._allocate(unit.padded)

    def _pre_backward(self, unit: _Unit) -> None:
        if unit.gathered is None:
            if unit.flat is None:
                unit.flat = self._allocate(unit.padded)
            unit.gathered = self._allocate(unit.padded)  # copied out, then the output freed
            unit.flat = None
        # the unit that ran before it in the forward (the root's: the last layer), whose backward is next
        at = self.order.index(unit) if unit in self.order else len(self.order)
        if at > 0:
            self._prefetch(self.order[at - 1])

    def _reduce(self, unit: _Unit) -> None:
        """The unit's post-backward: resharded, the previous unit's reduce-scatter input freed, its own
        allocated (every rank's padded rows of each gradient) and filled, the unsharded gradients freed,
        and the output (one storage for the unit: the sharded gradients are views of it) allocated; the
        input kept until the next unit's post-backward."""
        if unit.reduced:
            return
        unit.reduced = True
        unit.gathered = unit.flat = None
        grads = [p for p in unit.params if p.grad is not None]
        self.kept_input = None
        if not grads:
            return
        numels = [self.shards[p].numel() for p in grads]
        dtype = grads[0].grad.dtype
        flat = self._allocate(self.ranks * sum(numels) * grads[0].grad.element_size())
        for p in grads:
            p.grad = None
        output = torch.empty(sum(numels), dtype=dtype, device="meta")  # the sharded gradients' storage
        at = 0
        for p, numel in zip(grads, numels, strict=True):
            shard = self.shards[p]
            grad = output[at : at + numel].view(shard.shape)
            shard.grad = grad if shard.grad is None else shard.grad + grad
            at += numel
        self.kept_input = flat

    def _pre_forward(self, module, args, kwargs, unit: _Unit):
        if self.in_backward:  # checkpointing's recompute: FSDP2 leaves the unit as its backward has it
            return None
        self._gather(unit)
        unit.reduced = False
        flat, spec = tree_flatten((args, kwargs))
        needing = [i for i, v in enumerate(flat) if isinstance(v, torch.Tensor) and v.requires_grad]
        if not needing or not torch.is_grad_enabled():
            return None
        passed = _PostBackward.apply(self, unit, *(flat[i] for i in needing))
        for i, t in zip(needing, passed, strict=True):
            flat[i] = t
        return tree_unflatten(flat, spec)

    def _post_forward(self, module, args, output, unit: _Unit):
        if self.in_backward:
            return output
        if unit.root:  # the root stays gathered until its gradients are reduced; the last output freed
            self.kept_flat = None
        else:
            unit.gathered = None  # reshard_after_forward
            self.order.append(unit)
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:
            register_multi_grad_hook(tensors, lambda grads: self._pre_backward(unit), mode="any")
        return output

    def attach(self, live) -> None:
        """Hooks on every unit for one step followed by `live` (a LiveBytes: what this allocates is
        filed under LABEL)."""
        self.live, self.in_backward, self.order = live, False, []
        self.kept_flat = self.kept_input = None
        for unit in self.units:
            pre = unit.module.register_forward_pre_hook(
                lambda m, a, k, unit=unit: self._pre_forward(m, a, k, unit), with_kwargs=True, prepend=True
            )
            post = unit.module.register_forward_hook(
                lambda m, a, o, unit=unit: self._post_forward(m, a, o, unit)
            )
            self._handles += [pre, post]

    def backward(self) -> None:
        """The backward begins: a unit's forward from now on is checkpointing's recompute."""
        self.in_backward = True

    def finish(self) -> None:
        """The end of backward (FSDP2's final callback): the root's gradients reduced, and every unit's
        whose inputs needed none; nothing gathered, no reduce-scatter input kept."""
        for unit in self.units:
            self._reduce(unit)
        self.kept_input = None

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for unit in self.units:
            unit.gathered = unit.flat = None
            unit.reduced = False
        self.live, self.order, self.kept_flat, self.kept_input = None, [], None, None

    def tensors(self) -> Iterator[torch.Tensor]:
        """The rank's shards of every parameter: its weights."""
        yield from self.shards.values()
