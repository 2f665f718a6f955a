"""What one rank of N holds during a training step under transformers' tensor parallelism (its `tp_plan`:
`from_pretrained(..., distributed_config=DistributedConfig(tp_plan="auto"))`), for invact.planner.step's
plan of a step on the meta device. `TensorParallel(model, ranks)` makes the meta model one rank's model,
without a process group and without DTensor (imports no torch.distributed):

- each module the model's plan names (`model.tp_plan`: the config's `base_model_tp_plan` under the base
  model's prefix, the class's `_tp_plan` for the head, and transformers' "embedding_rowwise" for the
  input embeddings) gets this rank's shard of its parameters, the widest rank's (torch's Shard:
  `torch.chunk`, the first ranks' shards `ceil(n / ranks)`; a parameter tied to another, one shard for
  both): "colwise" and "colwise_gather_output" split a Linear's output features (weight rows and bias),
  "rowwise" its input features (weight columns; the bias whole), "embedding_rowwise" an embedding's
  rows (the vocabulary), "replicated_with_grad_allreduce" keeps the parameters whole (their gradients
  all-reduced in place: no bytes). The attention then runs this rank's heads and the
  MLP its share of the intermediate features, as transformers' DTensor forward does (its local tensors);
  everything else (norms, a module the plan does not name) is whole on every rank. Weights, gradients and
  AdamW's state are the rank's.
- `attach()` adds, for one step, the bytes the collectives allocate, as DTensor's redistributions
  allocate them (torch 2.13's functional collectives: a new output, the input freed when unreferenced):
  a "rowwise" or "embedding_rowwise" output's all-reduce (the partial sums, the reduced copy and
  autograd's wrapper of it, a copy too); in backward a "colwise"
  input's gradient all-reduced (a copy of it, per module: q, k and v each reduce their own); the head's
  "colwise_gather_output" all-gather (every rank's logits gathered along the first dimension, then
  concatenated along the vocabulary: both buffers at once) and in backward this rank's columns of the
  gradient copied out; an untied "embedding_rowwise" weight's gradient is the whole vocabulary's
  (DTensor's embedding backward leaves each rank a Replicate gradient of every row, measured: transformers
  5.25, torch 2.13), its other rows allocated beside the shard's gradient until the gradients are set to
  None. `detach()` removes them.

A rank's plan is the widest rank's (rank 0's, where a dimension does not divide). A style not listed
above raises PlanError naming it, as does a plan that splits heads (heads not divisible by the ranks).
"""

from __future__ import annotations

import math
import re

import torch
from torch import nn

from invact.planner.options import PlanError, check_positive

# The tp_plan styles a rank's plan follows (module docstring)
STYLES = (
    "colwise",
    "rowwise",
    "colwise_gather_output",
    "embedding_rowwise",
    "replicated_with_grad_allreduce",
)


def tp_plan(model: nn.Module) -> dict[str, str]:
    """The tensor parallel plan transformers applies to `model`: {module name pattern (`*` for a layer's
    index) relative to `model`: style}: its `tp_plan` (transformers 5), else its config's
    `base_model_tp_plan` (under the base model's prefix) and the model classes' own `_tp_plan` (the head)."""
    plan = getattr(model, "tp_plan", None)
    if isinstance(plan, dict) and plan:
        return dict(plan)
    plan = {}
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    base = getattr(config, "base_model_tp_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "")
    has_prefix = bool(prefix) and isinstance(getattr(model, prefix, None), nn.Module)
    for name, style in base.items():
        plan[f"{prefix}.{name}" if has_prefix else name] = style
    plan.update(getattr(type(model), "_tp_plan", None) or {})
    return plan


def _matches(plan: dict[str, str], model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """(name, module, style) for each module of `model` a pattern of `plan` names."""
    patterns = [(re.compile(re.escape(k).replace(r"\*", r"\d+") + "$"), s) for k, s in plan.items()]
    found = []
    for name, module in model.named_modules():
        for pattern, style in patterns:
            if pattern.match(name):
                found.append((name, module, style))
                break
    return found


class _GradAllReduce(torch.autograd.Function):
    """The identity whose backward copies the gradient: a colwise input's (partial) gradient all-reduced,
    the functional collective's new output."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.clone()


class _Gather(torch.autograd.Function):
    """A head's local logits gathered over `ranks` ranks into the `whole` vocabulary: all_gather along
    dim 0 (ranks x the rows, each rank's shard padded to the widest), then the chunks concatenated
    along the vocabulary (both alive at once); in backward this rank's columns copied out."""

    @staticmethod
    def forward(ctx, local, ranks, whole):
        ctx.width = local.shape[-1]
        gathered = local.new_empty((ranks * local.shape[0], *local.shape[1:]))
        out = local.new_empty((*local.shape[:-1], whole))
        del gathered
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad.narrow(-1, 0, ctx.width).contiguous(), None, None


class TensorParallel:
    """One rank of `ranks` under transformers' tp_plan (module docstring): __init__ shards `model`'s
    planned parameters in place (a meta model built for the plan); attach()/detach() the collectives'
    bytes for one step."""

    def __init__(self, model: nn.Module, ranks: int) -> None:
        check_positive("the tensor parallel ranks", ranks)
        self.model, self.ranks = model, ranks
        plan = tp_plan(model)
        if not plan:
            raise PlanError(f"{type(model).__name__} has no tp_plan: transformers cannot shard it for tensor "
                            "parallelism")  # fmt: skip
        unknown = sorted({s for s in plan.values() if s not in STYLES})
        if unknown:
            raise PlanError(f"--tp plans the tp_plan styles {', '.join(STYLES)}; "
                            f"{type(model).__name__}'s has {', '.join(unknown)}")  # fmt: skip
        self._check_heads(model, ranks)
        self.modules = _matches(plan, model)
        self._shards: dict[int, nn.Parameter] = {}  # id of a whole parameter: its shard (tied: one)
        # each planned module's whole output width (a gathered head's logits)
        self.whole = {name: getattr(module, "out_features", None) for name, module, _ in self.modules}
        for _, module, style in self.modules:
            self._shard_module(module, style)
        self._shards.clear()
        self._handles: list = []
        self._rest: list[torch.Tensor] = []  # an untied embedding's gradient's other rows, this step

    @staticmethod
    def _check_heads(model: nn.Module, ranks: int) -> None:
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        for key in ("num_attention_heads", "num_key_value_heads"):
            heads = getattr(config, key, None)
            if isinstance(heads, int) and heads % ranks:
                raise PlanError(f"--tp {ranks} splits attention heads: {key} {heads} is not a multiple of it")

    def _shard(self, module: nn.Module, name: str, dim: int) -> None:
        """Replace parameter `name` of `module` by the widest rank's shard along `dim` (meta); a parameter
        already sharded (tied to one sharded before) by that same shard."""
        p = getattr(module, name)
        shard = self._shards.get(id(p))
        if shard is None:
            shape = list(p.shape)
            shape[dim] = math.ceil(shape[dim] / self.ranks)
            shard = torch.empty(shape, dtype=p.dtype, device="meta")
            shard = nn.Parameter(shard, requires_grad=p.requires_grad)
            self._shards[id(p)] = shard
        setattr(module, name, shard)

    def _shard_module(self, module: nn.Module, style: str) -> None:
        if style == "replicated_with_grad_allreduce" or not isinstance(getattr(module, "weight", None),
                                                                        torch.Tensor):  # fmt: skip
            return
        if style == "rowwise":
            self._shard(module, "weight", 1)
            if hasattr(module, "in_features"):
                module.in_features = module.weight.shape[1]
            return
        self._shard(module, "weight", 0)  # colwise, colwise_gather_output, embedding_rowwise
        if style == "embedding_rowwise":
            module.num_embeddings = module.weight.shape[0]
            return
        if getattr(module, "bias", None) is not None:
            self._shard(module, "bias", 0)
        if hasattr(module, "out_features"):
            module.out_features = module.weight.shape[0]

    def attach(self, patched: bool = False) -> None:
        """The collectives' bytes on the planned modules for one step (module docstring); the modules are
        looked up by name, so a module patch() put in a planned one's place is followed. `patched`: the
        model is patched, and its loss (invact.loss.parallel over the vocabulary's shards, which the
        sharded meta head stands for) never runs the head's forward nor gathers its logits: the head is
        left without hooks (a hook on it would turn patch()'s loss away)."""
        modules = dict(self.model.named_modules())
        for name, _, style in self.modules:
            module = modules.get(name)
            if module is None or (patched and style == "colwise_gather_output"):
                continue
            if style == "replicated_with_grad_allreduce":
                continue
            if style == "embedding_rowwise":
                self._whole_gradient(module)
            if style in ("rowwise", "embedding_rowwise"):
                # the all-reduce's output, then autograd's wrapper of it (_c10d_functional's
                # all_reduce and _wrap_tensor_autograd: a new tensor each), the partial sums alive till then
                self._handles.append(module.register_forward_hook(lambda m, a, out: out.clone().clone()))
                continue
            # colwise, colwise_gather_output: the replicated input's gradient all-reduced
            self._handles.append(module.register_forward_pre_hook(
                lambda m, args: (_GradAllReduce.apply(args[0]), *args[1:]) if args[0].requires_grad
                else None))  # fmt: skip
            if style == "colwise_gather_output":
                whole = self.whole[name]
                self._handles.append(module.register_forward_hook(
                    lambda m, a, out, whole=whole: _Gather.apply(out, self.ranks, whole)))  # fmt: skip

    def _whole_gradient(self, module: nn.Module) -> None:
        """An untied vocabulary-parallel embedding: its gradient the whole vocabulary's (module docstring)."""
        weight = module.weight
        if not weight.requires_grad or any(m is not module and getattr(m, "weight", None) is weight
                                           for _, m, _ in self.modules):  # fmt: skip
            return
        rows = (self.ranks - 1) * weight.shape[0]

        def rest(p: torch.Tensor) -> None:
            self._rest.append(p.new_empty((rows, *p.shape[1:])))

        self._handles.append(weight.register_post_accumulate_grad_hook(rest))

    def release(self) -> None:
        """The gradients are set to None: an embedding's whole gradient with them."""
        self._rest.clear()

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._rest.clear()
