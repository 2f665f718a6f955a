"""The loss over a vocabulary-sharded head (tensor parallel): each rank computes its shard's chunks of
logits, the log-sum-exp is reduced across the ranks, and the gathered (tokens x vocab) logits are never
formed.

Under tensor parallelism the head's weight is a DTensor sharded over the vocabulary (rows, `Shard(0)`) on
a 1-D mesh: transformers' `tp_plan` ("colwise_gather_output" for `lm_head`), torchtitan's
`ColwiseParallel` on `output`. Eager TP computes each rank's shard of the logits, gathers them (every rank
then holds the whole tokens x vocab tensor, fp32 for the loss) and runs F.cross_entropy on that copy;
torchtitan's `loss_parallel` keeps them sharded but still saves the shard's log-softmax. Here, per chunk of
rows (invact.loss.op._forward's chunks; every rank the same count of the same rows):

- the shard's logits z (rows x shard) = h W_shard^T (+ b_shard), then the transform, in fp32;
- on each rank its rows' max m, log-sum-exp l = m + log sum exp(z - m) over its shard, the target's
  logit where the target falls in its shard (0 elsewhere) and, for label smoothing, its logits' sum;
  one all-gather of those three (3 x rows, fp32) gives every rank the rows' whole log-sum-exp
  L = logsumexp over ranks of l (a sum of exps each <= 1 after the max: no overflow), the target's
  logit and the sum: each row's loss, the same on every rank;
- the gradient over the shard, softmax - one-hot: exp(z - m) exp(m - L) minus 1 at the target where it
  falls in the shard, times each row's factor; then d h's part h_d = d W_shard (a partial sum) and the
  shard's d W = d^T h (its rows of the whole weight's gradient, nothing to reduce).

d h is all-reduced over the mesh once, after the last chunk (each rank's part is its shard's; the hidden
states are the same on every rank, so each needs the sum, as eager TP's all-reduce of the head's input
gradient gives). Collectives: one small all-gather per chunk and one all-reduce of the hidden states'
gradient, in the forward: every rank calls the loss at the same point, as any TP step does.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
import torch.distributed as dist

from invact.loss.transform import gradient_into, row_losses, transformed


class VocabShard(NamedTuple):
    """Where one rank's rows of the head lie in the whole vocabulary."""

    start: int  # the first vocabulary row this rank holds
    vocab: int  # the whole vocabulary
    widest: int  # the most rows any rank holds: the chunks are sized from it, alike on every rank
    group: object  # the mesh's process group (torch.distributed.ProcessGroup); None: planned (below)


# The ranks a meta head stands for one of, while invact.planner plans a tensor parallel rank (`planning`;
# a list as invact._meta's, which torch.compile reads where it cannot read a ContextVar)
_PLANNED: list[int] = []


@contextlib.contextmanager
def planning(ranks: int):
    """Inside: a head weight on the meta device is the widest rank's shard of a vocabulary-parallel head
    over `ranks` ranks (invact.planner.tensor_parallel's rank), and its loss runs this module's path with no
    process group: each collective's output allocated (meta), nothing sent."""
    _PLANNED.append(ranks)
    try:
        yield
    finally:
        _PLANNED.pop()


def planned(weight) -> VocabShard | None:
    """The shard a meta head's weight stands for inside `planning` (the first rank's: the widest), else
    None."""
    if not _PLANNED or weight is None or not weight.is_meta or is_dtensor(weight):
        return None
    return VocabShard(0, weight.shape[0] * _PLANNED[-1], weight.shape[0], None)


def is_dtensor(t) -> bool:
    """t is a DTensor (its local tensor is `_local_tensor`), without importing torch.distributed.tensor."""
    return t is not None and hasattr(t, "_local_tensor")


def _whole(t):
    """A DTensor's whole value on every rank (a collective where it is sharded); anything else as it is."""
    return t.full_tensor() if is_dtensor(t) else t


def local(hidden, weight, bias, target, cw):
    """(hidden, weight, bias, target, class weights, VocabShard or None) as this rank computes with them,
    for a head whose weight is a DTensor: hidden states, targets and class weights whole on every rank
    (a DTensor of them gathered: a sequence-parallel norm's output); the weight and bias this rank's
    shard of the vocabulary, with the shard's place (None where the weight is replicated: then the plain
    loss on the local copy). ValueError where the weight is sharded otherwise. A meta weight inside
    `planning`: itself, with the shard it stands for."""
    shard = planned(weight)
    if shard is not None:
        return hidden, weight, bias, target, cw, shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh = weight.device_mesh
    hidden, target, cw = _whole(hidden), _whole(target), _whole(cw)
    if mesh.ndim != 1:
        raise ValueError(f"invact: the head's weight is a DTensor on a {mesh.ndim}-D mesh "
                         f"{tuple(weight.placements)}; the loss takes one sharded over the vocabulary "
                         "(Shard(0)) or replicated on a 1-D (tensor parallel) mesh")  # fmt: skip
    (placement,) = weight.placements
    if placement == Replicate():
        return hidden, weight.to_local(), _whole(bias), target, cw, None
    if not (isinstance(placement, Shard) and placement.dim in (0, -2)):
        raise ValueError(f"invact: the head's weight is sharded as {placement} (in_features): the loss "
                         "takes one sharded over the vocabulary (Shard(0)) or replicated")  # fmt: skip
    if bias is not None and not (is_dtensor(bias) and bias.placements[0].is_shard()):
        raise ValueError("invact: the head's weight is sharded over the vocabulary but its bias is not: "
                         "shard both (ColwiseParallel shards both)")  # fmt: skip
    local_weight = weight.to_local()
    if local_weight.shape[0] == 0:
        raise ValueError(f"invact: a vocabulary of {weight.shape[0]} rows leaves a rank of {mesh.size()} "
                         "none: the loss needs every rank to hold some")  # fmt: skip
    start = compute_local_shape_and_global_offset(weight.shape, mesh, weight.placements)[1][0]
    widest = -(-weight.shape[0] // mesh.size())  # DTensor's Shard: torch.chunk's sizes
    shard = VocabShard(start, weight.shape[0], widest, mesh.get_group())
    return hidden, local_weight, None if bias is None else bias.to_local(), target, cw, shard


def rows(z, t, scale, ops: tuple, smoothing: float, grad: bool, cw, shard: VocabShard) -> torch.Tensor:
    """invact.loss.op's _rows_pass for a shard of the vocabulary: z (rows, shard) the chunk's logits over
    this rank's shard, t the targets in the whole vocabulary, cw the whole vocabulary's class weights
    (fp32) or None. Each row's loss, fp32 (rows,), the same on every rank (one all-gather); with `grad`
    the shard's columns of each row's gradient times `scale`, written over z in its dtype."""
    zt, factor, tanhs = transformed(z, ops, keep=grad)
    stop = shard.start + z.shape[1]
    mine = (t >= shard.start) & (t < stop)
    at = torch.where(mine, t - shard.start, 0).unsqueeze(1)
    cws = None if cw is None else cw[shard.start : stop]
    parts = zt.new_zeros(3, z.shape[0])  # this rank's log-sum-exp, target logit and smoothing sum
    parts[1] = torch.where(mine, zt.gather(1, at).squeeze(1), 0.0)
    if smoothing:
        torch.sum(zt, dim=1, out=parts[2]) if cws is None else torch.mv(zt, cws, out=parts[2])
    top = zt.amax(dim=1, keepdim=True)
    sums = zt.sub_(top).exp_().sum(dim=1, keepdim=True)  # exp(z - max) in place, as _rows_pass
    parts[0] = (top + sums.log()).squeeze(1)
    if shard.group is None:  # planned on meta: the all-gather's outputs
        every = [torch.empty_like(parts) for _ in range(-(-shard.vocab // shard.widest))]
    else:
        every = [torch.empty_like(parts) for _ in range(dist.get_world_size(shard.group))]
        dist.all_gather(every, parts, group=shard.group)
    every = torch.stack(every)
    lse = torch.logsumexp(every[:, 0], dim=0)
    picked, total = every[:, 1].sum(0), every[:, 2].sum(0)
    losses, picked_w, whole = row_losses(lse, picked, total, t, cw, smoothing, shard.vocab)
    if grad:  # the softmax: exp(z - max) exp(max - L)
        p = zt.mul_((top.squeeze(1) - lse).exp_().unsqueeze(1))
        gradient_into(z, p, at, mine, cws, picked_w, whole, smoothing, shard.vocab, tanhs, factor, scale)
    return losses


def reduce_hidden_gradient(dh: torch.Tensor, shard: VocabShard) -> None:
    """d h summed over the ranks' shards, in place (each rank's part is its shard's); planned: nothing."""
    if shard.group is not None:
        dist.all_reduce(dh, group=shard.group)


def logits(hidden, weight, bias) -> torch.Tensor:
    """The logits eager tensor parallel computes from a vocabulary-sharded head, gathered (every rank the
    whole tensor; a collective): transformers' and torchtitan's colwise head, the same ops."""
    from torch.distributed.tensor import DTensor, Replicate

    mesh = weight.device_mesh
    x = hidden if is_dtensor(hidden) else DTensor.from_local(hidden, mesh, [Replicate()], run_check=False)
    x = x.redistribute(placements=[Replicate()]) if x.placements != (Replicate(),) else x
    z = torch.nn.functional.linear(x, weight, bias)
    return z.redistribute(placements=[Replicate()]).to_local()
