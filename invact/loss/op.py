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

Where the vocabulary is one block and there is no label smoothing (a small head, whose cost is its host
time), eager runs F.cross_entropy's own ops on the block (_nll_loss, _nll_grads): in fp32 the loss and
gradients are eager's, bit for bit, with one matmul and one log-softmax more in backward.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from invact._meta import stands_for
from invact._traced import trace_as
from invact.activation.ops import backend_for, direct_backward

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
    kind = device if type(device) is str else device.type
    if kind == "meta":  # a planned step: as on the device type it is planned for
        kind = stands_for()
    budget = BLOCK_BYTES.get(kind, BLOCK_BYTES["cuda"])
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
    # g, logp and p are each an fp32 (rows x vocab) tensor, and p alone goes on: kept to the return, the
    # three and p's 16-bit copy made the step's peak (invact plan --step, a 2-layer Llama of width 128,
    # vocabulary 8000, 2 x 256 tokens, bf16, one block: 77.5 MiB, 63.6 freeing them, eager 66.8).
    del g, logp
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
    last = None  # in a compiled graph's body: the previous block's weight gradient (see below)
    for start in range(0, vocab, step):
        stop = min(start + step, vocab)
        w = weight if one else weight[start:stop]
        # In a compiled graph's body each block after the previous one's results (_after): its hidden
        # gradient, and its weight gradient, whose matmul inductor otherwise put off, several blocks at a
        # time, keeping their fp32 softmax blocks and 16-bit copies alive (bf16, 512 x 128 x 50257, CPU:
        # the backward peaked at 57 MiB, against 19 eager)
        hb = h
        if not kernels and dh is not None:
            hb = _after(h, dh[:, 0] if last is None else dh[:, 0] + last[0, 0].float())
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
        if need_b:
            db[start:stop] = p.sum(dim=0).to(db.dtype)
        # Where the hidden gradient multiplies p itself (a 16-bit block off CUDA: _accumulate), it comes
        # first, and the fp32 block is freed before the weight gradient's 16-bit matmul: that matmul's
        # own scratch memory on CPU (oneDNN's, allocated inside the op: 1.3 MiB for a 1024 x 1024 block
        # by 128 hidden, bf16, on an Intel Xeon) then never meets p's 4 MiB.
        early = need_h and p.dtype != pre_dtype and not p.is_cuda
        if early:
            _accumulate(dh, p, p, w)  # p in fp32 both ways: _accumulate's product off CUDA
        d = p.to(pre_dtype)  # p itself where the logits are fp32
        del p
        if need_w:
            dw[start:stop] = (d.t() @ h.to(d.dtype)).to(dw.dtype)
            last = None if kernels else dw[start:stop]
        if need_h and not early:
            _accumulate(dh, None, d, w)  # d in fp32, or in 16 bits on CUDA (out_dtype): p unused
        del d
    return dh, dw, db


@direct_backward
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
    hidden, target = _as_rows(hidden, target)
    return _loss(hidden, weight, bias, target, tuple(ops), ignore_index, float(label_smoothing),
                 reduction == "mean", torch.compiler.is_compiling())  # fmt: skip


def _as_rows(hidden: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden as rows (rows, in), target as (rows,)); ValueError where their counts differ."""
    hidden, target = hidden.reshape(-1, hidden.shape[-1]), target.reshape(-1)
    if target.shape[0] != hidden.shape[0]:
        raise ValueError(f"{target.shape[0]} targets for {hidden.shape[0]} rows of hidden states")
    return hidden, target


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
