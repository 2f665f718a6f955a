"""A causal LM's loss from its last hidden state and its head's weight, a block of the vocabulary at a
time: no (tokens x vocab) logits kept for backward, none materialized whole in forward or backward.

Eager, a Hugging Face causal LM computes logits = lm_head(h) (tokens x vocab, in the model's dtype),
upcasts them (an fp32 copy) and runs F.cross_entropy, whose log-softmax saves an fp32 (tokens x vocab)
tensor: 4 bytes x vocab per token, the largest single tensor of a small model's training step. The
head already keeps h, so the logits are one matmul away. Here:

- forward, per vocabulary block (`block_columns`): z = transform(h @ W_b^T + b_b) in fp32; the
  log-sum-exp of each row accumulates across blocks (torch.logaddexp), and so do the target's logit
  and, with label smoothing, the row's sum of logits. Saved: h (the head's input, which the head
  saves in eager too), the target, one fp32 log-sum-exp per row that counts (target not ignore_index)
  and, where some rows do not count, the int64 indices of those that do.
- backward, per block again: z recomputed, p = exp(z - lse) (the softmax), minus (1 - eps) at the
  target and eps / vocab everywhere, times the transform's derivative, gives d(h W_b^T + b_b); the
  block's weight gradient is one matmul over all rows (rounded once, as eager's), the hidden's gradient
  accumulates in fp32 across blocks.
  One matmul more than eager's three; the elementwise passes over (tokens x vocab) are as many, on a
  block at a time.

`transform` is what the model applies between the head and the loss, recorded as it runs: scalar
multiplications and divisions (Cohere's logit_scale, Granite's logits_scaling) and tanh (Gemma 2/3's
final softcapping, c * tanh(z / c)), computed in fp32 (eager runs them in the model's dtype).

How a model uses it (patch(model, loss=True), invact.patch): its head (an nn.Linear that
`get_output_embeddings()` returns) is patched in place (invact.identity). While the model runs a
training-mode forward with labels and gradients enabled:

- where the model's forward hands the head's output to its loss function straight or through scalings
  and tanh (Gemma 2/3's soft-cap, Cohere's logit_scale, Granite's logits_scaling), read from its
  source (`_steps`), the head keeps its input and returns an empty stand-in (the logits' leading
  dimensions, no columns), and the model's loss function (HeadLoss, transformers' causal-LM loss)
  computes the loss from that input, the transform read from the model's settings at the call. The
  model's own scalings run on the empty stand-in, for nothing. Eager does so unless a forward hook
  could see the stand-in; torch.compile always (Dynamo traces tensors), with the custom op
  invact::linear_cross_entropy: the same vocabulary blocks, saving the hidden state and the
  log-sum-exp;
- elsewhere, eager's head returns a `PendingLogits`: an object that is not a tensor, takes the
  model's scalings, tanh, `.float()` and `.view`, and computes the loss when the model's loss function
  hands it to F.cross_entropy (class indices, ignore_index, reduction "mean" or "sum", label
  smoothing), so the model's own code keeps its semantics: the label shift, ignore_index -100,
  num_items_in_batch, logits_to_keep. Anything else done to it computes the logits as the model would
  have (eager's tensor, on the autograd graph) and goes on with them. Under compile such a model
  computes its logits as eager does.

Such a call returns `logits=None`: the logits of a training step with labels are not kept (ask for
them with patch(loss=False), or in eval mode or without labels, where nothing changes).

Where the vocabulary is one block and there is no label smoothing (a small head, whose cost is its host
time), eager runs F.cross_entropy's own ops on the block (_nll_loss, _nll_grads): in fp32 the loss and
gradients are eager's, bit for bit, with one matmul and one log-softmax more in backward.
"""

from __future__ import annotations

import ast
import functools
import inspect
import logging
import math
import re
import sys
import textwrap
from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn

from invact import kinds
from invact._traced import trace_as
from invact.activation.ops import backend_for
from invact.callers import forward_tree
from invact.identity import swap
from invact.kinds import Decision, Found, Kind, Options

log = logging.getLogger("invact")

# Bytes of one block's fp32 (rows x columns) logits, per device type. The forward holds about two such
# buffers at a time (the matmul's output and its fp32 copy), the backward about three (one more per
# tanh of a softcapped head). On CPU, small blocks stay in cache: forward + backward of 512 rows,
# hidden 128, vocab 128256 on 2 cores of an AMD EPYC Zen 4 took 0.70, 0.61, 0.59, 0.60, 0.87 and
# 0.91 s (fp32) with 1, 2, 4, 8, 32 and 128 MiB blocks, against 0.61 s eager; bf16 0.28-0.32 s up to 8
# MiB, 0.60 s at 128 MiB, against 0.52 s eager. On CUDA (an H200, bf16, 4096 x 2048 x 128256, torch's
# ops per block: benchmarks/results/gpu_quick_h200.json) 16, 64, 256 and 1024 MiB blocks took 85.5,
# 32.6, 24.2 and 23.1 ms: launches per block dominate small blocks; 256 MiB is 16384 columns at 4096
# rows, whose logits in bf16 (the one-pass kernels' only block buffer, invact.loss._triton) are an
# eighth of eager's fp32 logits for a 128256-word vocabulary.
BLOCK_BYTES = {"cpu": 4 * 2**20, "cuda": 256 * 2**20}
# The narrowest block: below it the matmuls get thin (rows x hidden x columns) and the per-block Python
# overhead grows.
MIN_COLUMNS = 256


def block_columns(rows: int, vocab: int, device: torch.device | str) -> int:
    """Vocabulary columns per block for `rows` rows on `device` (or a device type): BLOCK_BYTES of fp32
    logits (CUDA's figure on other accelerators), at least MIN_COLUMNS, at most the vocabulary."""
    budget = BLOCK_BYTES.get(device if type(device) is str else device.type, BLOCK_BYTES["cuda"])
    return min(vocab, max(MIN_COLUMNS, budget // (4 * max(rows, 1))))


def _device_type(t: torch.Tensor) -> str:
    """t.device.type without building a torch.device for the common CPU and CUDA tensors (t.device
    makes one per call: a small head's forward asks for it on every step)."""
    return "cpu" if t.is_cpu else "cuda" if t.is_cuda else t.device.type


def _transformed(pre: torch.Tensor, ops: tuple, keep: bool):
    """z = ops applied to pre, in fp32 (pre itself where it is fp32: a block's fresh logits, which the
    callers may change in place), and the derivative's factors: the product of the scalars and, when
    keep, each tanh's output (each contributes 1 - t^2)."""
    z = pre.float() if pre.dtype != torch.float32 else pre
    scale, tanhs = 1.0, []
    for op in ops:
        if op[0] == "mul":
            z.mul_(op[1])
            scale *= op[1]
        elif op[0] == "div":  # divided, not multiplied by the reciprocal: the model's own rounding
            z.div_(op[1])
            scale /= op[1]
        else:  # "tanh"
            z.tanh_()
            if keep:
                tanhs.append(z.clone())
    return z, scale, tanhs


def _kernels(h: torch.Tensor, bias, ops: tuple) -> bool:
    """invact.loss._triton's one-pass kernels serve this call (CUDA, no bias, a transform they take)."""
    if bias is not None or backend_for(h) != "triton":
        return False
    from invact.loss import _triton as _loss_triton

    return _loss_triton.plan(ops) is not None


def _masked(target: torch.Tensor, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(whether each row counts: target != ignore_index; the targets with those that do not count
    replaced by class 0, a valid index whose row is masked out). Every row is computed, as eager's
    F.cross_entropy computes every row's logits: no data-dependent shape, nothing read back."""
    valid = target != ignore_index
    return valid, torch.where(valid, target, 0)


def _row_losses(h, t, weight, bias, ops: tuple, smoothing: float, kernels: bool = True):
    """(each row's loss, fp32 (rows,): cross-entropy of its transformed logits against t, with label
    smoothing F.cross_entropy's (1 - eps) nll + eps * mean over classes of -log p; each row's
    log-sum-exp), a vocabulary block at a time."""
    lse, picked, total = _row_sums(h, t, weight, bias, ops, smoothing, kernels)
    rows = lse - picked
    if smoothing:
        rows = (1 - smoothing) * rows + smoothing * (lse - total.div(weight.shape[0]))
    return rows, lse


def _row_sums(h, t, weight, bias, ops: tuple, smoothing: float, kernels: bool = True):
    """Per row of h, in fp32, a vocabulary block at a time: (the log-sum-exp of its transformed logits,
    the logit at its target, with label smoothing the sum of its logits (else None)). `kernels`:
    invact.loss._triton's passes where they serve the call (False: torch ops only, a compiled graph's
    body)."""
    vocab = weight.shape[0]
    step = block_columns(h.shape[0], vocab, h.device)
    if kernels and _kernels(h, bias, ops):
        from invact.loss import _triton as _loss_triton

        n = h.shape[0]
        lse, picked = (torch.empty(n, dtype=torch.float32, device=h.device) for _ in range(2))
        total = torch.empty(n, dtype=torch.float32, device=h.device) if smoothing else None
        for start in range(0, vocab, step):
            z = F.linear(h, weight[start : start + step])
            _loss_triton.forward_block(z, t, lse, picked, total, start, ops, first=start == 0)
        return lse, picked, total
    if step >= vocab:  # one block: no running sums
        z, _, _ = _transformed(F.linear(h, weight, bias), ops, keep=False)
        total = z.sum(dim=1) if smoothing else None
        return torch.logsumexp(z, dim=1), z.gather(1, t.unsqueeze(1)).squeeze(1), total
    lse = total = None
    for start in range(0, vocab, step):
        stop = min(start + step, vocab)
        pre = F.linear(h, weight[start:stop], None if bias is None else bias[start:stop])
        z, _, _ = _transformed(pre, ops, keep=False)
        del pre
        block = torch.logsumexp(z, dim=1)
        lse = block if lse is None else torch.logaddexp(lse, block)
        if smoothing:
            total = z.sum(dim=1) if total is None else total + z.sum(dim=1)
    return lse, _target_logits(h, t, weight, bias, ops), total


def _after(h: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """h, bitwise (h + 0 * x is h for finite x; a -0.0 becomes +0.0, which multiplies alike), made to
    depend on `previous` (rows,), the previous vocabulary block's result: in a compiled graph's backward
    body this orders the blocks, where inductor otherwise computed every block's logits again
    (independent matmuls) ahead and fused their elementwise passes, keeping them all alive: the loss
    alone (512 x 128 hidden states, vocabulary 50257, CPU) peaked at 133 MiB in bf16 and 66 MiB in
    fp32 compiled, against 57 and 48 MiB ordered (19 and 29 eager)."""
    return h + (previous.unsqueeze(1) * 0.0).to(h.dtype)


def _target_logits(h, t, weight, bias, ops: tuple) -> torch.Tensor:
    """Each row's transformed logit at its target (rows,), fp32, from its target's weight row: the dot
    product the block's matmul forms, in fp32 and rounded to the matmul's dtype (its last place may
    differ from the matmul's: another summation order). Read from no block of logits, so none outlives
    its own log-sum-exp: under inductor a gather from every block fused into one kernel that kept them
    all, one fp32 (rows x vocab) tensor at the forward's peak (512 x 128 x 50257: 98 MiB, against 29
    MiB eager)."""
    pre = torch.linalg.vecdot(h.float(), weight.index_select(0, t).float())
    if bias is not None:
        pre = pre + bias.index_select(0, t).float()
    dtype = torch.result_type(h, weight)
    pre = pre if dtype == torch.float32 else pre.to(dtype)
    return _transformed(pre.unsqueeze(1), ops, keep=False)[0].squeeze(1)


# aten's reduction codes for nll_loss_forward / nll_loss_backward (torch's Reduction enum)
_MEAN, _SUM = 1, 2


def _nll_loss(h, target, weight, bias, ops: tuple, ignore_index: int, mean: bool):
    """(the loss, the count of rows that count as fp32) where the vocabulary is one block and there is no
    label smoothing: the ops F.cross_entropy runs (log-softmax, then nll_loss_forward, whose mean
    divides by that count: nan where none counts, as eager's), computed without autograd (nothing kept).
    A small head's cost is its host time, its ops and Python."""
    z = F.linear(h, weight, bias)
    if ops or z.dtype is not torch.float32:
        z = _transformed(z, ops, keep=False)[0]
    return torch.ops.aten.nll_loss_forward(torch.log_softmax(z, 1), target, None, _MEAN if mean else _SUM,
                                           ignore_index)  # fmt: skip


def _nll_grads(grad, h, target, weight, bias, ops: tuple, ignore_index: int, mean: bool, total, needs,
               pre_dtype):  # fmt: skip
    """_nll_loss's (d h in fp32, d weight, d bias; None where not in `needs`) for the loss's gradient
    `grad`: the logits and their log-softmax recomputed, then the two backward ops F.cross_entropy's
    autograd runs (nll_loss_backward, _log_softmax_backward_data: so in fp32 d logits is eager's, bit
    for bit), times the transform's derivative, and the head's products (_head_grads)."""
    z, factor, tanhs = F.linear(h, weight, bias), 1.0, ()
    if ops or z.dtype is not torch.float32:
        z, factor, tanhs = _transformed(z, ops, keep=True)
    logp = torch.log_softmax(z, 1)
    del z
    g = torch.ops.aten.nll_loss_backward(grad, logp, target, None, _MEAN if mean else _SUM, ignore_index,
                                         total)  # fmt: skip
    p = torch.ops.aten._log_softmax_backward_data(g, logp, 1, torch.float32)
    for th in tanhs:  # d tanh(u) / du = 1 - tanh(u)^2
        p.mul_(th.square_().neg_().add_(1))
    if factor != 1.0:
        p.mul_(factor)
    return _head_grads(p, h, weight, bias, needs, pre_dtype)


def _head_grads(p, h, weight, bias, needs, pre_dtype):
    """(d h in fp32, d weight, d bias; None where not in `needs`) of a one-block head from p, the fp32
    gradient of its logits: each product rounded once, as eager's."""
    d = p if p.dtype is pre_dtype else p.to(pre_dtype)
    dw = d.t().mm(h if h.dtype is d.dtype else h.to(d.dtype)) if needs[1] else None
    if dw is not None and dw.dtype is not weight.dtype:
        dw = dw.to(weight.dtype)
    db = p.sum(dim=0).to(bias.dtype) if needs[2] else None
    if not needs[0]:
        return None, dw, db
    if d.dtype == torch.float32:
        return d.mm(weight if weight.dtype is d.dtype else weight.to(d.dtype)), dw, db
    dh = torch.zeros(h.shape, dtype=torch.float32, device=h.device)
    _accumulate(dh, p, d, weight)
    return dh, dw, db


def _block_logits(h, w, b):
    """A block's logits h w^T + b, as the forward computes them."""
    return F.linear(h, w, b)


def _kernel_grad_blocks(grad, h, t, lse, weight, ops: tuple, smoothing: float, needs, logits, step: int):
    """_grad_blocks by invact.loss._triton's backward pass: per block the logits (in the matmul dtype),
    d written over them in one pass, then the two products."""
    from invact.loss import _triton as _loss_triton

    vocab = weight.shape[0]
    dw = torch.empty_like(weight) if needs[1] else None
    dh = torch.zeros(h.shape, dtype=torch.float32, device=h.device) if needs[0] else None
    scale = grad.reshape(-1).float().contiguous()
    for start in range(0, vocab, step):
        w = weight[start : start + step]
        d = _loss_triton.backward_block(logits(h, w, None), t, lse, scale, start, vocab, smoothing, ops)
        if dw is not None:
            dw[start : start + step] = (d.t() @ h.to(d.dtype)).to(dw.dtype)
        if dh is not None:  # on CPU tensors (the interpreter) a 16-bit d multiplies in fp32 (_accumulate)
            _accumulate(dh, d.float() if d.dtype != torch.float32 and not d.is_cuda else None, d, w)
    return dh, dw, None


def _grad_blocks(grad, h, t, lse, weight, bias, ops: tuple, smoothing: float, needs, pre_dtype,
                 logits=_block_logits, kernels: bool = True):  # fmt: skip
    """(d h in fp32, d weight, d bias; None where not in `needs`) of the sum over rows of grad times
    _row_losses' row loss, a vocabulary block at a time, the logits recomputed per block (by
    `logits`). grad: one factor per row (rows, 1), 0 for a row that does not count."""
    vocab = weight.shape[0]
    need_h, need_w, need_b = needs
    step = block_columns(h.shape[0], vocab, h.device)
    if kernels and _kernels(h, bias, ops):
        return _kernel_grad_blocks(grad, h, t, lse, weight, ops, smoothing, needs, logits, step)
    one = step >= vocab
    dw = torch.empty_like(weight) if need_w and not one else None
    db = torch.empty_like(bias) if need_b and not one else None
    # fp32 accumulator across blocks: each block's product is rounded once, the sum is not
    dh = torch.zeros(h.shape, dtype=torch.float32, device=h.device) if need_h and not one else None
    lse = lse.unsqueeze(1)
    for start in range(0, vocab, step):
        stop = min(start + step, vocab)
        w = weight if one else weight[start:stop]
        hb = h if kernels or dh is None else _after(h, dh[:, 0])
        pre = logits(hb, w, None if bias is None else (bias if one else bias[start:stop]))
        p, scale, tanhs = _transformed(pre, ops, keep=True)
        del pre
        p = p.sub_(lse).exp_()  # the softmax of the transformed logits
        if one:
            p.scatter_add_(1, t.unsqueeze(1), p.new_full((p.shape[0], 1), -(1 - smoothing)))
        else:
            inside = ((t >= start) & (t < stop)).to(p.dtype)
            at = (t - start).clamp(0, stop - start - 1).unsqueeze(1)
            p.scatter_add_(1, at, inside.mul_(-(1 - smoothing)).unsqueeze(1))
        if smoothing:
            p.sub_(smoothing / vocab)
        for th in tanhs:  # d tanh(u) / du = 1 - tanh(u)^2
            p.mul_(th.square_().neg_().add_(1))
        del tanhs
        p.mul_(grad * scale if scale != 1.0 else grad)
        if one:
            return _head_grads(p, h, weight, bias, needs, pre_dtype)
        d = p.to(pre_dtype)
        if need_w:
            dw[start:stop] = (d.t() @ h.to(d.dtype)).to(dw.dtype)
        if need_b:
            db[start:stop] = p.sum(dim=0).to(db.dtype)
        if need_h:
            _accumulate(dh, p, d, w)
        del p, d
    return dh, dw, db


class _LinearCrossEntropy(torch.autograd.Function):
    """sum over rows r with target[r] != ignore_index of cross_entropy(transform(hidden W^T + bias)),
    fp32, computed a vocabulary block at a time (the module docstring). Eager's path; under
    torch.compile the custom op invact::linear_cross_entropy (below), whose body is the same blocks."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, ops, ignore_index, smoothing, mean):
        # mean: divided by the count of rows that count here, not by an autograd node of its own.
        # One block without label smoothing (a small head, whose cost is host time): F.cross_entropy's
        # own ops (_nll_loss); the kernels' one pass beats them where they serve.
        vocab = weight.shape[0]
        nll = not smoothing and block_columns(hidden.shape[0], vocab, _device_type(hidden)) >= vocab
        ctx.nll = nll = nll and not _kernels(hidden, bias, ops)
        ctx.ops, ctx.ignore_index, ctx.mean = ops, ignore_index, mean
        ctx.pre_dtype = hidden.dtype if hidden.dtype is weight.dtype else torch.result_type(hidden, weight)
        if nll:
            loss, total = _nll_loss(hidden, target, weight, bias, ops, ignore_index, mean)
            ctx.save_for_backward(hidden, weight, bias, target, total)
            return loss
        valid, t = _masked(target, ignore_index)
        rows, lse = _row_losses(hidden, t, weight, bias, ops, smoothing)
        loss = torch.where(valid, rows, 0.0).sum()
        count = valid.sum() if mean else None
        ctx.save_for_backward(hidden, weight, bias, target, lse, count)
        ctx.smoothing = smoothing
        return loss if count is None else loss / count

    @staticmethod
    def backward(ctx, grad):
        needs = ctx.needs_input_grad[:3]
        if ctx.nll:
            hidden, weight, bias, target, total = ctx.saved_tensors
            dh, dw, db = _nll_grads(grad, hidden, target, weight, bias, ctx.ops, ctx.ignore_index, ctx.mean,
                                    total, needs, ctx.pre_dtype)  # fmt: skip
            if dh is not None and dh.dtype is not hidden.dtype:
                dh = dh.to(hidden.dtype)
            return dh, dw, db, None, None, None, None, None
        hidden, weight, bias, target, lse, count = ctx.saved_tensors
        if count is not None:
            grad = grad / count
        ignored = target == ctx.ignore_index
        scale, t = torch.where(ignored, 0.0, grad).unsqueeze(1), torch.where(ignored, 0, target)
        dh, dw, db = _grad_blocks(scale, hidden, t, lse, weight, bias, ctx.ops, ctx.smoothing, needs,
                                  ctx.pre_dtype)  # fmt: skip
        return None if dh is None else dh.to(hidden.dtype), dw, db, None, None, None, None, None


# torch.compile traces the loss as two custom ops: the forward returns the loss and the log-sum-exp of
# every row, the backward takes what the forward saved: hidden, the head's weight and bias, the targets
# and that log-sum-exp. The transform is passed as a list of (code, value) floats (OPS: a schema takes
# no tuples of strings). Their bodies (invact._traced) are what a compiled graph runs.
OPS = ("mul", "div", "tanh")


def _encode_ops(ops: tuple) -> list[float]:
    return [float(v) for op in ops for v in (OPS.index(op[0]), op[1] if len(op) > 1 else 0.0)]


def _decode_ops(codes: list[float]) -> tuple:
    pairs = zip(codes[0::2], codes[1::2], strict=True)
    return tuple((OPS[int(c)], v) if OPS[int(c)] != "tanh" else ("tanh",) for c, v in pairs)


def _op_forward_impl(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     target: torch.Tensor, ops: list[float], ignore_index: int,
                     smoothing: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    return _op_forward_body(hidden, weight, bias, target, ops, ignore_index, smoothing)


def _op_forward_body(hidden, weight, bias, target, ops, ignore_index, smoothing, kernels: bool = True):
    """invact::linear_cross_entropy's body; `kernels` False in a compiled graph (torch ops only)."""
    valid, t = _masked(target, ignore_index)
    rows, lse = _row_losses(hidden, t, weight, bias, _decode_ops(ops), smoothing, kernels)
    return torch.where(valid, rows, 0.0).sum(), lse


_op_forward = torch.library.custom_op("invact::linear_cross_entropy", _op_forward_impl, mutates_args=())


@_op_forward.register_fake
def _(hidden, weight, bias, target, ops, ignore_index, smoothing):
    return hidden.new_empty((), dtype=torch.float32), hidden.new_empty(hidden.shape[:1], dtype=torch.float32)


def _op_backward_impl(
    grad: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    lse: torch.Tensor,
    ops: list[float],
    ignore_index: int,
    smoothing: float,
    needs: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _op_backward_body(grad, hidden, weight, bias, target, lse, ops, ignore_index, smoothing, needs,
                             _block_logits, kernels=True)  # fmt: skip


def _op_backward_body(grad, hidden, weight, bias, target, lse, ops, ignore_index, smoothing, needs, logits,
                      kernels: bool = False):  # fmt: skip
    """invact::linear_cross_entropy_backward's body, each block's logits computed by `logits`;
    `kernels`: invact.loss._triton's passes where they serve (not in a compiled graph)."""
    # == where the forward has !=: in a compiled graph, not merged with the forward's mask, which the
    # partitioner would keep (a bool per row, from the int64 targets it keeps anyway)
    ignored = target == ignore_index
    scale = torch.where(ignored, 0.0, grad).unsqueeze(1)
    needs = (needs[0], needs[1], needs[2] and bias is not None)
    dh, dw, db = _grad_blocks(scale, hidden, torch.where(ignored, 0, target), lse, weight, bias,
                              _decode_ops(ops), smoothing, needs, torch.result_type(hidden, weight),
                              logits=logits, kernels=kernels)  # fmt: skip
    # an output is a tensor: a fresh empty one where no gradient is wanted (the autograd formula drops it)
    dhidden = hidden.new_empty(0) if dh is None else dh.to(hidden.dtype)
    return dhidden, weight.new_empty(0) if dw is None else dw, weight.new_empty(0) if db is None else db


_op_backward = torch.library.custom_op("invact::linear_cross_entropy_backward", _op_backward_impl,
                                       mutates_args=())  # fmt: skip


@_op_backward.register_fake
def _(grad, hidden, weight, bias, target, lse, ops, ignore_index, smoothing, needs):
    db = torch.empty_like(bias) if needs[2] and bias is not None else weight.new_empty(0)
    return (torch.empty_like(hidden) if needs[0] else hidden.new_empty(0),
            torch.empty_like(weight) if needs[1] else weight.new_empty(0), db)  # fmt: skip


def _transposed_logits(h, w, b):
    """A block's logits as (w h^T)^T: the same products as h w^T in another form, which the joint graph's
    common-subexpression pass does not merge with the forward's (merged, each block's logits would be a
    forward tensor the backward reads, and the partitioner would save them all: the (tokens x vocab)
    tensor this op exists not to keep)."""
    z = torch.mm(w, h.t()).t()
    return z if b is None else z + b


# The two ops' bodies in a compiled graph (invact._traced): the forward's as it is, the backward's
# recomputing the logits in the other form.
trace_as("invact::linear_cross_entropy", functools.partial(_op_forward_body, kernels=False))
trace_as(
    "invact::linear_cross_entropy_backward",
    functools.partial(_op_backward_body, logits=_transposed_logits),
)


def _op_setup_context(ctx, inputs, output):
    hidden, weight, bias, target, ops, ignore_index, smoothing = inputs
    ctx.save_for_backward(hidden, weight, bias, target, output[1])
    ctx.ops, ctx.ignore_index, ctx.smoothing = ops, ignore_index, smoothing
    ctx.mark_non_differentiable(output[1])


def _op_autograd_backward(ctx, grad, _dlse):
    hidden, weight, bias, target, lse = ctx.saved_tensors
    needs = [bool(n) for n in ctx.needs_input_grad[:3]]
    dh, dw, db = torch.ops.invact.linear_cross_entropy_backward(
        grad, hidden, weight, bias, target, lse, ctx.ops, ctx.ignore_index, ctx.smoothing, needs
    )
    return (dh if needs[0] else None, dw if needs[1] else None, db if needs[2] and bias is not None else None,
            None, None, None, None)  # fmt: skip


_op_forward.register_autograd(_op_autograd_backward, setup_context=_op_setup_context)


def _accumulate(dh: torch.Tensor, p: torch.Tensor, d: torch.Tensor, w: torch.Tensor) -> None:
    """dh += d @ w with an fp32 result, d the block's gradient in the matmul dtype (p in fp32). A 16-bit
    product rounded to 16 bits per block before the sum would add one rounding per block (measured:
    215 blocks of a bf16 (96 x 32) hidden gradient drifted 3% farther from float64 than eager's): CUDA
    multiplies in 16 bits into fp32 (torch.mm's out_dtype); other devices have no such kernel (CPU:
    NotImplementedError in torch 2.13) and multiply p by w in fp32."""
    if d.dtype == torch.float32:
        dh.addmm_(d, w.to(d.dtype))
    elif dh.is_cuda:
        dh += torch.mm(d, w.to(d.dtype), out_dtype=torch.float32)
    else:
        dh.addmm_(p, w.float())


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ops: tuple = (),
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """F.cross_entropy(transform(F.linear(hidden, weight, bias)).float(), target, ...) without the
    logits: hidden (rows, in) or (..., in), weight (vocab, in), bias (vocab,) or None, target class
    indices (rows,) or (...); `ops` the transform, a tuple of ("mul", float), ("div", float) and
    ("tanh",) applied in order. reduction "mean" (over rows whose target is not ignore_index, as
    F.cross_entropy: nan if there are none) or "sum". Returns an fp32 scalar. Gradients reach hidden,
    weight and bias."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing!r}")
    hidden = hidden.reshape(-1, hidden.shape[-1])
    target = target.reshape(-1)
    if target.shape[0] != hidden.shape[0]:
        raise ValueError(f"{target.shape[0]} targets for {hidden.shape[0]} rows of hidden states")
    return _loss(hidden, weight, bias, target, tuple(ops), ignore_index, float(label_smoothing),
                 reduction == "mean", torch.compiler.is_compiling())  # fmt: skip


def _loss(hidden, weight, bias, target, ops: tuple, ignore_index: int, label_smoothing: float, mean: bool,
          compiling: bool):  # fmt: skip
    """linear_cross_entropy on arguments it has checked: hidden (rows, in), target (rows,), reduction
    "mean" where `mean`, else "sum"; `compiling`: torch.compiler.is_compiling()."""
    if compiling:
        loss = torch.ops.invact.linear_cross_entropy(hidden, weight, bias, target, _encode_ops(ops),
                                                     ignore_index, label_smoothing)[0]  # fmt: skip
        if mean:
            loss = loss / (target != ignore_index).sum()
        return loss
    if _is_wrapped(hidden):  # a dead torch.func wrapper: autograd.Function.apply unwraps it
        args = hidden, weight, bias, target, ops, ignore_index, label_smoothing, mean
        return _LinearCrossEntropy.apply(*args)
    return _apply(hidden, weight, bias, target, ops, ignore_index, label_smoothing, mean)


# _LinearCrossEntropy's apply without autograd.Function.apply's Python layer (see
# invact.activation.ops._apply_plain)
_apply = super(torch.autograd.Function, _LinearCrossEntropy).apply
_is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


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
        if name.startswith("__") or name in ("hidden", "weight", "bias", "ops"):
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
        parameters = head._parameters  # nn.Module's __getattr__ finds them there, a Python call each
        hidden, target = hidden.reshape(-1, hidden.shape[-1]), shift_labels.reshape(-1)
        if target.shape[0] != hidden.shape[0]:
            raise ValueError(f"{target.shape[0]} labels for {hidden.shape[0]} rows of hidden states")
        loss = _loss(hidden, parameters["weight"], parameters.get("bias"), target, ops, ignore_index, 0.0,
                     num_items_in_batch is None, compiling)  # fmt: skip
        if num_items_in_batch is not None:  # reduction "sum", over the batch's count
            if torch.is_tensor(num_items_in_batch):
                num_items_in_batch = num_items_in_batch.to(loss.device)
            loss = loss / num_items_in_batch
        return loss


def _steps(owner: type, attr: str) -> tuple | None:
    """What `owner`'s forward does to the head's output before handing it to `self.loss_function`, read
    from its source: () where it hands it straight; a tuple of steps where it only scales it and takes
    its tanh (Gemma 2/3's soft-cap, Cohere's logit_scale, Granite's logits_scaling); None where the
    code between does anything else, or the source cannot be read.

    A step is (kind, value, guard): kind "mul", "div" or "tanh"; value a number or the path of an
    attribute of self (a tuple of names: `self.config.final_logit_softcapping` is ("config",
    "final_logit_softcapping")), None for tanh; guard such a path where the step sits under `if <path>
    is not None:`, else None. Recognized, in the block that assigns `name = self.<attr>(...)` (once in
    the whole forward): `name = name / v`, `name = name * v`, `name = v * name`, `name = torch.tanh(name)`,
    bare or under one such `if` with no else; statements that do not read `name`; then the statement
    that calls `self.loss_function` with `name` as its logits, and reads `name` nowhere else."""
    tree = forward_tree(owner)
    if tree is None:
        return None
    found = _head_block(tree, attr)
    if found is None:
        return None
    name, rest = found
    steps: list[tuple] = []
    for stmt in rest:
        reads = [n for n in ast.walk(stmt) if isinstance(n, ast.Name) and n.id == name]
        if not reads:
            continue
        if (step := _step(stmt, name)) is not None:
            steps.append((*step, None))
        elif (guarded := _guarded(stmt, name)) is not None:
            steps.extend(guarded)
        elif _loss_takes(stmt, name) and len(reads) == 1:
            assigned = [t for n in ast.walk(tree) for t in _targets(n) if t == name]
            return tuple(steps) if len(assigned) == 1 + len(steps) else None
        else:
            return None
    return None


def _targets(node: ast.AST) -> list[str]:
    """The plain names node assigns (an =, an augmented or an annotated assignment)."""
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
        node, (ast.AugAssign, ast.AnnAssign)) else []  # fmt: skip
    return [t.id for t in targets if isinstance(t, ast.Name)]


def _head_block(tree: ast.AST, attr: str, chained: bool = False) -> tuple[str, list[ast.stmt]] | None:
    """(name, the statements after it in its block) for the statement `name = self.<attr>(...)`, or with
    `chained` also `name = self.<attr>(...).float()`, `... + bias` and the like (_from_call)."""
    for node in ast.walk(tree):
        for field in ("body", "orelse", "finalbody"):
            block = getattr(node, field, None)
            if not isinstance(block, list):
                continue
            for i, stmt in enumerate(block):
                if not isinstance(stmt, ast.Assign):
                    continue
                if _calls_self(stmt.value, attr) or (chained and _from_call(stmt.value, attr)):
                    names = _targets(stmt)
                    if len(stmt.targets) == 1 and names:
                        return names[0], block[i + 1 :]
    return None


def _from_call(node: ast.AST, attr: str) -> bool:
    """node is `self.<attr>(...)` under method calls and arithmetic (`.float()`, `.contiguous()`,
    `+ self.final_logits_bias`): what PendingLogits records or computes the logits for."""
    return any(_calls_self(n, attr) for n in _chain(node))


def _chain(node: ast.AST):
    """node, then each receiver of its method calls and left operand of its arithmetic, inward."""
    while True:
        yield node
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            node = node.func.value
        elif isinstance(node, ast.BinOp):
            node = node.left
        else:
            return


def _attribute_path(node: ast.AST) -> tuple[str, ...] | None:
    """node is `self.a.b...`: ("a", "b", ...)."""
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    return tuple(reversed(names)) if names and isinstance(node, ast.Name) and node.id == "self" else None


def _operand(node: ast.AST):
    """A number, or the path of an attribute of self; None for anything else."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return float(node.value)
    return _attribute_path(node)


def _step(stmt: ast.stmt, name: str) -> tuple | None:
    """(kind, value) where stmt is `name = name / v`, `name * v`, `v * name` or `torch.tanh(name)`."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and _targets(stmt) == [name]):
        return None
    value = stmt.value
    is_name = lambda n: isinstance(n, ast.Name) and n.id == name  # noqa: E731
    if isinstance(value, ast.BinOp) and isinstance(value.op, (ast.Div, ast.Mult)):
        kind = "div" if isinstance(value.op, ast.Div) else "mul"
        if is_name(value.left) and (v := _operand(value.right)) is not None:
            return kind, v
        if kind == "mul" and is_name(value.right) and (v := _operand(value.left)) is not None:
            return kind, v
    if (
        isinstance(value, ast.Call)
        and isinstance(value.func, ast.Attribute)
        and value.func.attr == "tanh"
        and isinstance(value.func.value, ast.Name)
        and value.func.value.id == "torch"
        and len(value.args) == 1
        and not value.keywords
        and is_name(value.args[0])
    ):
        return "tanh", None
    return None


def _guarded(stmt: ast.stmt, name: str) -> list[tuple] | None:
    """The steps of `if <path> is not None: <steps>` (no else), each guarded by the path."""
    if not (isinstance(stmt, ast.If) and not stmt.orelse and isinstance(stmt.test, ast.Compare)):
        return None
    test = stmt.test
    guard = _attribute_path(test.left)
    if guard is None or not (
        len(test.ops) == 1
        and isinstance(test.ops[0], ast.IsNot)
        and isinstance(test.comparators[0], ast.Constant)
        and test.comparators[0].value is None
    ):
        return None
    steps = [_step(s, name) for s in stmt.body]
    return None if None in steps else [(*step, guard) for step in steps]


def _loss_takes(stmt: ast.stmt, name: str) -> bool:
    """stmt calls `self.loss_function` with `name` as its logits (first argument or keyword)."""
    for node in ast.walk(stmt):
        if isinstance(node, ast.Call) and _calls_self(node, "loss_function", call=False):
            given = [k.value for k in node.keywords if k.arg == "logits"] + node.args[:1]
            return bool(given) and isinstance(given[0], ast.Name) and given[0].id == name
    return False


def _resolve(owner: nn.Module, path: tuple[str, ...]):
    """The attribute at `path` from owner; None where one is missing."""
    value = owner
    for part in path:
        value = getattr(value, part, None)
    return value


def _ops(owner: nn.Module, steps: tuple) -> tuple:
    """The transform (linear_cross_entropy's `ops`) the steps make on `owner` as it is configured now:
    guarded steps whose guard is None dropped, paths read; None where a value is not a number (a
    tensor, a missing setting)."""
    ops = []
    for kind, value, guard in steps:
        if guard is not None and _resolve(owner, guard) is None:
            continue
        if kind == "tanh":
            ops.append(("tanh",))
            continue
        number = value if isinstance(value, float) else _resolve(owner, value)
        if type(number) not in (int, float):
            return None
        ops.append((kind, float(number)))
    return tuple(ops)


def _calls_self(node, attr: str, call: bool = True) -> bool:
    """node is `self.<attr>(...)` (call=False: node is a Call of `self.<attr>`)."""
    if call and not isinstance(node, ast.Call):
        return False
    f = node.func
    return (
        isinstance(f, ast.Attribute)
        and f.attr == attr
        and isinstance(f.value, ast.Name)
        and f.value.id == "self"
    )


def output_head(model: nn.Module) -> nn.Module | None:
    """The model's output embeddings (Hugging Face's get_output_embeddings()); None where it has none."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return head if isinstance(head, nn.Module) else None


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
    return name, True, (f"{what} is computed from the hidden state and the head's weight a vocabulary "
                        "block at a time: no (tokens x vocab) logits kept")  # fmt: skip


def class_decision(cls: type) -> tuple[bool, str]:
    """head_of's decision for a class, from its source alone (no instance: what tests and
    benchmarks/loss_classes.py enumerate over transformers' classes): its head's path (what its
    get_output_embeddings returns: transformers' default, `self.lm_head`, or the `return self.<path>`
    of its own), whether its forward takes labels, what its forward does with the head's output
    (class_route), and for transformers' causal-LM loss its loss type, named for the class as
    transformers' PreTrainedModel names it. What only an instance shows (the head an nn.Linear, a loss
    function set on it, the modules between it and its head) head_of checks besides."""
    path = _output_embeddings_path(cls)
    if isinstance(path, str):
        return False, path
    if _labels_at(cls) is None:
        return False, "its forward takes no labels"
    route, why = class_route(cls, path[0])
    if route is None:
        return False, why
    if route == "loss_function":
        utils = sys.modules.get("transformers.loss.loss_utils")
        loss_type = None if utils is None else _class_loss_type(cls, utils.LOSS_MAPPING)
        why = _not_causal(cls, loss_type)
        return (False, why) if why else (True, "transformers' causal-LM loss")
    return True, "its cross-entropy on the head's output"


def _class_loss_type(cls: type, mapping: dict) -> str | None:
    """The loss_type transformers' PreTrainedModel.__init__ gives an instance of cls: its class name
    where LOSS_MAPPING has it, else the first key of LOSS_MAPPING found in the name, else None (a test
    compares it with instances' loss_type)."""
    name = cls.__name__
    if name in mapping:
        return name
    found = re.findall(f"({'|'.join(mapping)})", name)
    return found[0] if found else None


def _output_embeddings_path(cls: type) -> tuple[str, ...] | str:
    """The attribute path cls.get_output_embeddings returns: ("lm_head",) for transformers' default,
    the path of its `return self.<path>` where it defines its own; else why there is none to read."""
    method = getattr(cls, "get_output_embeddings", None)
    modeling = sys.modules.get("transformers.modeling_utils")
    if method is None:
        return "it has no get_output_embeddings (no head to take)"
    if modeling is not None and method is modeling.PreTrainedModel.get_output_embeddings:
        return ("lm_head",)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(method)))
    except (OSError, TypeError, SyntaxError):
        return "its get_output_embeddings' source cannot be read"
    values = [n.value for n in ast.walk(tree) if isinstance(n, ast.Return) and n.value is not None]
    paths = {_attribute_path(v) for v in values}
    if len(paths) == 1 and None not in paths:
        return paths.pop()
    if (
        len(values) == 1
        and isinstance(values[0], ast.Call)
        and (isinstance(values[0].func, ast.Attribute) and values[0].func.attr == "get_output_embeddings")
    ):
        inner = _attribute_path(values[0].func.value)
        where = "self." + ".".join(inner) if inner else "another module"
        return f"its get_output_embeddings is {where}'s: decided on an instance, by that module's forward"
    return "its get_output_embeddings returns no attribute of its own (no head to take)"


def _host(model: nn.Module, name: str) -> tuple[nn.Module | None, str]:
    """(the module whose training forward takes the labels and computes the loss on the head's output,
    the head's name within it), found from the model down the modules that hold the head: the first
    whose forward takes labels and hands the head's output to a loss (class_route); past a module that
    takes no labels (a wrapper's forward(*args, **kwargs): PEFT's PeftModel) or hands them on to the
    next by name or **kwargs (PeftModelForCausalLM); (None, name) where none does. A module that takes
    labels and keeps them (Llama 4's multimodal model, computing its loss on its language model's
    output) is where the search stops: its class_route gives the reason."""
    parts = name.split(".")
    module, last = model, (None, name)
    for depth, part in enumerate(parts[:-1] or parts):
        if _labels_at(type(module)) is not None:
            last = module, ".".join(parts[depth:])
            if class_route(type(module), part)[0] is not None or not _passes_labels(type(module), part):
                return last
        module = module._modules.get(part)
        if module is None:
            break
    if module is not None and len(parts) > 1 and _labels_at(type(module)) is not None:
        return module, parts[-1]
    return last


@functools.cache
def _passes_labels(cls: type, attr: str) -> bool:
    """cls.forward calls self.<attr>(...) with labels=... or **kwargs (the labels handed on)."""
    tree = forward_tree(cls)
    if tree is None:
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _calls_self(node, attr, call=False):
            if any(k.arg in ("labels", None) for k in node.keywords):
                return True
    return False


def _not_causal(cls: type, loss_type: str | None) -> str | None:
    """None where an instance of cls with this loss_type computes transformers' causal-LM loss
    (ForCausalLMLoss) as its loss_function: transformers' PreTrainedModel property, which gives
    LOSS_MAPPING[loss_type] and falls back to the causal-LM loss for a type it does not know (None:
    GPT-2's, CTRL's, BERT's LM head); else why not."""
    utils = sys.modules.get("transformers.loss.loss_utils")
    modeling = sys.modules.get("transformers.modeling_utils")
    if utils is None or modeling is None or not issubclass(cls, modeling.PreTrainedModel):
        return "its loss_function is not transformers' (not a PreTrainedModel)"
    if (
        inspect.getattr_static(cls, "loss_function", None)
        is not modeling.PreTrainedModel.__dict__["loss_function"]
    ):
        return "it defines a loss_function of its own"
    mapping = utils.LOSS_MAPPING
    if mapping.get(loss_type if loss_type in mapping else "ForCausalLM") is not mapping["ForCausalLM"]:
        return f"its loss type {loss_type!r} is not transformers' causal-LM loss"
    return None


@functools.cache
def class_route(cls: type, attr: str) -> tuple[str | None, str]:
    """What cls.forward does with the output of `self.<attr>(...)` (the child holding the head), read
    from its source: ("loss_function", why) where it hands it to self.loss_function, ("cross_entropy",
    why) where to nn.CrossEntropyLoss or F.cross_entropy (as it is, or through `.view`, `.reshape`, a
    scaling or `.float()`: PendingLogits records those), else (None, what it does instead)."""
    tree = forward_tree(cls)
    if tree is None:
        return None, "its forward's source cannot be read"
    found = _head_block(tree, attr, chained=True)
    if found is None:
        calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and _calls_self(n, attr)]
        if not calls:
            return None, f"its forward does not call self.{attr}"
        return None, f"its forward does not keep the head's output under a name: {_quote(calls[0], tree)}"
    name, rest = found
    losses = _cross_entropy_modules(tree)
    first = None  # the first simple statement that does something else with it
    for stmt in rest:
        if first is None:
            simple = (n for n in ast.walk(stmt) if isinstance(n, ast.stmt) and not isinstance(n, _COMPOUND))
            first = next((n for n in simple if any(isinstance(r, ast.Name) and r.id == name
                                                   for r in ast.walk(n))), None)  # fmt: skip
        for node in ast.walk(stmt):
            if not isinstance(node, ast.Call):
                continue
            if _calls_self(node, "loss_function", call=False):
                given = [k.value for k in node.keywords if k.arg == "logits"] + node.args[:1]
                if given and _reads(given[0], name):
                    return "loss_function", "its forward hands the head's output to self.loss_function"
            elif _is_cross_entropy(node.func, losses) and node.args and _reads(node.args[0], name):
                return "cross_entropy", "its forward computes a cross-entropy on the head's output"
    if first is None:
        return None, "its forward hands the head's output to no loss"
    return None, f"its forward hands the head's output to no cross-entropy; it does {_quote(first, tree)}"


_COMPOUND = (ast.If, ast.For, ast.While, ast.With, ast.Try)


def _quote(node: ast.AST, tree: ast.AST) -> str:
    """node's source line, shortened: `line N: code`, the line numbered in the model's file."""
    code = ast.unparse(node).splitlines()[0]
    code = code if len(code) <= 60 else code[:57] + "..."
    return f"`{code}` (line {getattr(node, 'lineno', '?')})"


def _reads(node: ast.AST, name: str) -> bool:
    """node is `name` or a method call chain or arithmetic on it (`name.view(-1, v)`, `name.float()`,
    `name / t`): what PendingLogits records or the loss takes."""
    return any(isinstance(n, ast.Name) and n.id == name for n in _chain(node))


def _cross_entropy_modules(tree: ast.AST) -> set[str]:
    """The names the forward binds to a CrossEntropyLoss(...) (`loss_fct = CrossEntropyLoss()`)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            func = node.value.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if called == "CrossEntropyLoss":
                names.update(_targets(node))
    return names


def _is_cross_entropy(func: ast.AST, losses: set[str]) -> bool:
    """func is F.cross_entropy (under any module path), or a name bound to a CrossEntropyLoss."""
    if isinstance(func, ast.Attribute):
        return func.attr == "cross_entropy"
    return isinstance(func, ast.Name) and (func.id == "cross_entropy" or func.id in losses)


@functools.cache
def _returns_child(cls: type, attr: str) -> bool:
    """cls.forward returns `self.<attr>(...)`'s output as it is (BERT's LM head modules hand their
    decoder's output back): `return self.<attr>(...)`, or `x = self.<attr>(...)` then `return x`."""
    tree = forward_tree(cls)
    if tree is None:
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.Return) and _calls_self(node.value, attr):
            return True
    found = _head_block(tree, attr)
    if found is None:
        return False
    name, rest = found
    return (
        bool(rest)
        and isinstance(rest[0], ast.Return)
        and isinstance(rest[0].value, ast.Name)
        and (rest[0].value.id == name)
    )


@functools.cache
def _labels_at(cls: type) -> int | None:
    """The position of `labels` among the positional arguments of cls.forward (self excluded); None
    where it takes no labels. Once per class: _arm runs on every training forward."""
    forward = getattr(cls, "forward", None)
    if forward is None:
        return None
    names = list(inspect.signature(forward).parameters)[1:]
    return names.index("labels") if "labels" in names else None


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
    """module.name, removed from the module (None where it has none): _keep's counterpart."""
    if compiling:
        value = getattr(module, name, None)
        if value is not None:
            delattr(module, name)
        return value
    return module.__dict__.pop(name, None)


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
    standin = _take(head, "_invact_standin", compiling)  # under compile: the logits' stand-in (LossHead)
    pending = (lambda v: v is standin) if standin is not None else (lambda v: isinstance(v, PendingLogits))
    if isinstance(output, tuple):
        return tuple(None if pending(v) else v for v in output)
    if pending(getattr(output, "logits", None)):
        if isinstance(output, dict) and "logits" in output:  # a ModelOutput: as if built with logits=None
            (OrderedDict if isinstance(output, OrderedDict) else dict).__delitem__(output, "logits")
        object.__setattr__(output, "logits", None)
    return output


def take(model: nn.Module, name: str) -> None:
    """Patch the head `name` of `model` (head_of's) in place, and hook the module whose forward takes
    the labels (_host: the model, or the one a wrapper wraps) so that a training forward with labels
    computes its loss from hidden states (eager: PendingLogits; under
    torch.compile: HeadLoss, where the head's owner hands its output to its loss function through
    steps _steps reads).
    Idempotent."""
    head = model.get_submodule(name)
    model, name = _host(model, name)  # the module whose forward takes the labels: it is hooked
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
    model.register_forward_pre_hook(_arm, with_kwargs=True)
    model.register_forward_hook(_disarm, with_kwargs=True, always_call=True)
    model._invact_loss_hooked = True


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
