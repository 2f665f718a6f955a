"""A causal LM's loss from its last hidden state and its head's weight, a chunk of rows at a time, with
its gradients computed in the forward: no (tokens x vocab) logits kept for backward, none materialized
whole, and three (tokens x hidden x vocab) matmuls in all, as eager's.

Eager, a Hugging Face causal LM computes logits = lm_head(h) (tokens x vocab, in the model's dtype),
upcasts them (an fp32 copy) and runs F.cross_entropy, whose log-softmax saves an fp32 (tokens x vocab)
tensor: 4 bytes x vocab per token, the largest single tensor of a small model's training step. Here,
per chunk of rows (`chunk_rows`: BLOCK_BYTES of logits):

- the chunk's logits over the whole vocabulary, z = transform(h_c W^T + b) (one matmul);
- each row's loss from them, and where a gradient is wanted, d loss / d z written over z (_rows: one
  Triton kernel on CUDA, invact.loss._triton; torch ops elsewhere);
- d h_c = d W (one matmul; each row's in one product, rounded once, as eager's) and the chunk's part of
  d W = d^T h_c (one matmul, summed across chunks in fp32, rounded once at the end: _accumulate), and
  of d b (the column sums).

The loss is a scalar, so the gradients for d loss = 1 are all a backward needs: it multiplies them by the
loss's gradient (autograd's; 1 for loss.backward(), else a scale such as num_items_in_batch's), with no
host synchronisation. Saved for backward: those gradients (the hidden states' size and, unless the head
is frozen, the weight's), which the step's backward holds from its first op anyway; where no gradient is
wanted (no_grad, eval with labels) only the loss is computed, one matmul. A second backward through the
same graph (retain_graph=True) finds the gradients scaled and raises torch's error on saved tensors
changed in place.

`transform` is what the model applies between the head and the loss, recorded as it runs: scalar
multiplications and divisions (Cohere's logit_scale, Granite's logits_scaling) and tanh (Gemma 2/3's
final softcapping, c * tanh(z / c)), computed in fp32 (eager runs them in the model's dtype).

Where the rows are one chunk of fp32 logits without transform or label smoothing (a small head, whose
cost is its host time), off CUDA, the ops are F.cross_entropy's own and F.linear's backward's (_nll):
the loss and gradients are eager's, bit for bit.
"""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.nn.functional as F

from invact._meta import stands_for
from invact.activation.ops import backend_for, direct_backward
from invact.loss import parallel
from invact.loss.kernel_plan import plan
from invact.loss.transform import gradient_into, row_losses
from invact.loss.transform import transformed as _transformed
from invact.memory import EARLY_GRADIENT

log = logging.getLogger("invact")

# Bytes of one chunk's logits (rows x the whole vocabulary, in the matmul's dtype), per device type: the
# forward's one buffer of that size. CUDA's 512 MiB: 2093 rows of a 128256-word vocabulary in bf16. On an
# H200 (bf16, torch 2.11; results/loss_floor_h200.json) the head + loss at 4096 x 2048 x 128256 took
# 15.71, 13.05 and 12.35 ms with 128, 256 and 512 MiB chunks, and 30.12, 25.09, 22.98 ms at 8192 tokens,
# each peaking 1520-1546 MiB above its inputs: the weight gradient's fp32 sum (1 GiB) and its bf16 copy
# (0.5 GiB) make the peak, not the chunk. CPU's 256 MiB: per chunk the weight gradient's product is
# written whole and added into its fp32 sum, which costs most where the CPU's memory is slow; 2048 x
# 512 x 49152 on 2 threads of an Intel Xeon (AMX), forward + backward, against torch.compile's own head +
# loss (0.527 s bf16, 1.483 s fp32): 64, 128 and 256 MiB chunks took 0.897, 0.657, 0.512 s in bf16 and
# 1.580, 1.507, 1.454 s in fp32 (eager's head + loss: 0.93 and 1.64 s). PASS_BYTES of 1, 2 or 4 MiB
# made no difference there beyond the noise.
CPU_BLOCK = 256 * 2**20
BLOCK_BYTES = {"cpu": CPU_BLOCK, "cuda": 512 * 2**20}
# Bytes of fp32 logits the CPU passes (_rows_torch) work on at a time: a few rows, in cache.
PASS_BYTES = 2 * 2**20
# The smallest chunk (bytes of logits) where the head is small.
MIN_BYTES = 4 * 2**20
# The fewest rows a chunk takes: the weight gradient's product sums over a chunk's rows, and a thinner
# one runs below the GEMM's speed and adds one more pass over the weight gradient per chunk.
MIN_ROWS = 64


def chunk_rows(rows: int, vocab: int, itemsize: int, device: torch.device | str, head: int = 0,
               summed: bool = False) -> int:  # fmt: skip
    """Rows per chunk for `rows` rows on `device` (or a device type), `head` the bytes of the head weight
    in fp32 (4 x vocab x hidden: the weight gradient's fp32 sum, which several chunks need where that
    gradient is wanted, `summed`): a chunk's logits (`itemsize` bytes an element) take at most that many
    bytes (MIN_BYTES at least) and at most BLOCK_BYTES (CUDA's figure on other accelerators), at least
    MIN_ROWS rows and at most `rows`; and where `summed`, all the rows are one chunk where their logits
    fit in the bytes of the sum and a chunk together (what several chunks hold at their peak: no sum
    needed, and no passes over it).

    The chunk no larger than the fp32 sum: the step's transient stays the head's size, not the tokens',
    and the sum's passes (one read and write of it a chunk) add at most one pass over the logits' bytes.
    On an H200 (bf16, 4096 x 2048 x 128256, results/loss_floor_h200_prototype.json) one chunk of the
    4096 rows took 11.17 ms and peaked 1519 MiB above its inputs, chunks of 1024 rows with the fp32 sum
    12.54 ms and 1519."""
    kind = device if type(device) is str else device.type
    if kind == "meta":  # a planned step: as on the device type it is planned for
        kind = stands_for()
    budget = min(BLOCK_BYTES.get(kind, BLOCK_BYTES["cuda"]), max(head, MIN_BYTES))
    if summed and rows * vocab * itemsize <= head + budget:
        return max(1, rows)
    return max(1, min(rows, max(MIN_ROWS, budget // (itemsize * max(vocab, 1)))))


def _device_type(t: torch.Tensor) -> str:
    """t.device.type without building a torch.device for the common CPU and CUDA tensors (t.device
    makes one per call: a small head's forward asks for it on every step)."""
    return "cpu" if t.is_cpu else "cuda" if t.is_cuda else t.device.type


def _compute_dtype(h: torch.Tensor, w: torch.Tensor, kind: str) -> torch.dtype:
    """The dtype F.linear(h, w) computes in here: autocast's where it is on (mixed precision: bf16
    logits from fp32 weights, as eager's head), else the inputs' promoted dtype."""
    try:
        if torch.is_autocast_enabled(kind):
            return torch.get_autocast_dtype(kind)
    except RuntimeError:  # a device type autocast does not know (meta, outside invact.planner.autocast)
        pass
    return h.dtype if h.dtype is w.dtype else torch.result_type(h, w)


def _kernels(t: torch.Tensor, ops: tuple) -> bool:
    """invact.loss._triton.rows serves chunks of logits on t's device (CUDA, or INVACT_BACKEND=triton; a
    meta tensor standing for CUDA, whether or not triton is installed here: the plan is the kernel's
    bytes) with this transform (one it takes)."""
    if plan(ops) is None:
        return False
    return backend_for(t) == "triton" or (t.is_meta and stands_for() == "cuda")


def _rows_torch(z, t, scale, ops: tuple, smoothing: float, grad: bool, cw=None) -> torch.Tensor:
    """invact.loss._triton.rows in torch ops (CPU, meta standing for a CPU, transforms the kernel does
    not take, class weights `cw`): each row's loss, fp32 (rows,); with `grad` the rows' gradient times
    `scale`, written over z in its dtype. A few rows at a time (PASS_BYTES of fp32), whose fp32 copy
    stays in cache through the passes over it."""
    step = max(1, PASS_BYTES // (4 * z.shape[1]))
    if step >= z.shape[0]:
        return _rows_pass(z, t, scale, ops, smoothing, grad, cw)
    parts = [_rows_pass(z[i : i + step], t[i : i + step], scale[i : i + step], ops, smoothing, grad, cw)
             for i in range(0, z.shape[0], step)]  # fmt: skip
    return torch.cat(parts)


def _rows_pass(z, t, scale, ops: tuple, smoothing: float, grad: bool, cw=None) -> torch.Tensor:
    """_rows_torch on rows whose fp32 copy is one buffer (z itself where fp32). `cw`: F.cross_entropy's
    class weights (vocab,), fp32, or None: row r's loss is then (1 - eps) w[t_r] nll_r + eps/C sum_c w_c
    (-log p_rc), and its gradient (1 - eps) w[t_r] (p_r - e_t) + eps/C (W p_r - w), W = sum_c w_c."""
    zt, factor, tanhs = _transformed(z, ops, keep=grad)
    at = t.unsqueeze(1)
    picked = zt.gather(1, at).squeeze(1)
    total = (zt.sum(dim=1) if cw is None else zt @ cw) if smoothing else None
    top = zt.amax(dim=1, keepdim=True)
    # exp(z - max) in place: its row sums give the log-sum-exp, and divided by them, the softmax
    sums = zt.sub_(top).exp_().sum(dim=1, keepdim=True)
    lse = (top + sums.log()).squeeze(1)
    classes = z.shape[1]
    losses, picked_w, whole = row_losses(lse, picked, total, t, cw, smoothing, classes)
    if grad:
        gradient_into(
            z, zt.div_(sums), at, None, cw, picked_w, whole, smoothing, classes, tanhs, factor, scale
        )
    return losses


def _rows(z, t, scale, ops: tuple, smoothing: float, grad: bool, cw=None) -> torch.Tensor:
    """Each row's loss from z (rows, vocab), the chunk's logits, fp32 (rows,); with `grad` each row's
    gradient d loss / d z times scale (rows,) written over z: the kernel on CUDA, torch ops elsewhere
    and with class weights `cw` (which the kernel does not take). On meta tensors standing for CUDA,
    what the kernel allocates (its output alone)."""
    if cw is None and _kernels(z, ops):
        if z.is_meta:
            return z.new_empty(z.shape[:1], dtype=torch.float32)
        from invact.loss import _triton as _loss_triton

        return _loss_triton.rows(z, t, scale, smoothing, ops, grad)
    return _rows_torch(z, t, scale, ops, smoothing, grad, cw)


def _accumulate(acc: torch.Tensor, d: torch.Tensor, h: torch.Tensor, first: bool) -> None:
    """acc (fp32, the weight's shape) = d^T h (+ acc unless `first`), d and h in the matmul dtype, the
    chunks' products summed in fp32. CUDA: one 16-bit GEMM accumulating into fp32 (addmm's out_dtype),
    so d W is rounded once, as eager's. Other devices have no such kernel (CPU: NotImplementedError in
    torch 2.13): a 16-bit product, rounded to 16 bits once per chunk, then summed in fp32. In fp32 its
    GEMM ran 3.0x slower than in bf16 (2048 x 512 x 49152 in chunks of 170 rows, 2 threads of an Intel
    Xeon with AMX: 373 against 114 ms a head), which put the head + loss above eager's time; the chunks'
    roundings add at most u/2 |P_c| each (u = 2^-8, P_c a chunk's product) to d W's error, measured 4-7%
    above eager's distance from float64 at 8 to 32 chunks (tests/invact/test_loss.py bounds it)."""
    if d.dtype == torch.float32:
        torch.mm(d.t(), h, out=acc) if first else acc.addmm_(d.t(), h)
    elif acc.is_cuda:
        torch.addmm(acc, d.t(), h, out_dtype=torch.float32, beta=0 if first else 1, out=acc)
    elif acc.is_meta and stands_for() != "cpu":
        # CUDA's bytes (no tensor beside acc); values do not exist on meta. addmm's out_dtype meta
        # decomposition fails before torch 2.13 (TypeError: a dtype times a Tensor); mm's does not.
        torch.mm(d.t(), h, out_dtype=torch.float32, out=acc)
    else:
        part = d.t().mm(h)
        if first:
            acc.copy_(part)
            return
        # In SUM_PIECES slices: a 16-bit tensor added into an fp32 one is converted to fp32 inside add_ (a
        # hidden copy of the weight's fp32 size, which put real CPU steps 8 MiB above their plan: invact
        # plan, step_plan.py at seq 512); a slice's copy is a sixteenth of it.
        size = -(-acc.shape[0] // SUM_PIECES)
        for start in range(0, acc.shape[0], size):
            acc[start : start + size].add_(part[start : start + size].float())


# Slices of the weight gradient's fp32 sum added at a time on CPU (_accumulate).
SUM_PIECES = 16


# aten's reduction codes for nll_loss_forward / nll_loss_backward (torch's Reduction enum)
_MEAN, _SUM = 1, 2


def _nll(h, target, weight, bias, ignore_index: int, mean: bool, needs, cw=None):
    """_forward where the rows are one chunk of fp32 logits without transform or label smoothing (a
    small head, whose cost is its host time): the ops F.cross_entropy runs forward and backward
    (log_softmax, nll_loss_forward; nll_loss_backward, _log_softmax_backward_data: so the loss and
    d logits are eager's, bit for bit), then the head's products as F.linear's backward runs them."""
    z = F.linear(h, weight, bias)
    logp = torch.log_softmax(z, 1)
    del z
    reduction = _MEAN if mean else _SUM
    loss, total = torch.ops.aten.nll_loss_forward(logp, target, cw, reduction, ignore_index)
    if not (needs[0] or needs[1] or needs[2]):
        return loss, None, None, None
    one = torch.ones((), dtype=loss.dtype, device=loss.device)
    g = torch.ops.aten.nll_loss_backward(one, logp, target, cw, reduction, ignore_index, total)
    d = torch.ops.aten._log_softmax_backward_data(g, logp, 1, torch.float32)
    del g, logp
    dh = d.mm(weight) if needs[0] else None
    dw = d.t().mm(h) if needs[1] else None
    db = d.sum(dim=0) if needs[2] else None
    return loss, dh, dw, db


def _forward(h, weight, bias, target, ops: tuple, ignore_index: int, smoothing: float, mean: bool | None,
             needs, cw=None, given=None, shard=None):  # fmt: skip
    """(the loss, fp32 scalar; its gradients for d loss = 1 with respect to h, weight and bias, each in
    its tensor's dtype, None where `needs` does not ask for it), a chunk of rows at a time: per chunk
    its logits over the whole vocabulary (one matmul), its rows' losses and, where a gradient is
    wanted, d loss / d logits written over them (_rows), then d h for its rows (one matmul, rows
    apart: rounded once, as eager's) and its part of d weight (one matmul, summed in fp32 across
    chunks: _accumulate). Three matmuls in all where every gradient is wanted; one where none is.

    `mean`: True for reduction "mean", False for "sum", None for "none" (the loss is then each row's,
    fp32 (rows,), 0 where ignored; no gradient). `cw`: class weights (vocab,) or None. `given`: each
    row's gradient factor (rows,) in place of the reduction's (the backward of reduction "none").
    `shard`: an invact.loss.parallel.VocabShard where weight and bias are this rank's shard of a
    vocabulary-parallel head (its rows' losses reduced across ranks, d h all-reduced; invact.loss.parallel),
    None for a whole head."""
    n = h.shape[0]
    vocab = weight.shape[0] if shard is None else shard.widest  # alike on every rank: the same chunks
    kind = _device_type(h)
    need_h, need_w, need_b = needs[0], needs[1], needs[2] and bias is not None
    grad = need_h or need_w or need_b
    dtype = _compute_dtype(h, weight, kind)
    step = chunk_rows(n, vocab, dtype.itemsize, kind, 4 * vocab * weight.shape[1], need_w)
    if (shard is None and step >= n and dtype == torch.float32 and not ops and not smoothing
            and not _kernels(h, ops)
            and mean is not None and given is None):  # fmt: skip
        return _nll(h, target, weight, bias, ignore_index, mean, (need_h, need_w, need_b),
                    None if cw is None else cw.float())  # fmt: skip
    with torch.autocast(kind, enabled=False) if kind in ("cpu", "cuda") else contextlib.nullcontext():
        hc = h if h.dtype is dtype else h.to(dtype)
        w = weight if weight.dtype is dtype else weight.to(dtype)
        b = bias if bias is None or bias.dtype is dtype else bias.to(dtype)
        cwf = None if cw is None else cw.float()
        valid = target != ignore_index
        t = torch.where(valid, target, 0)
        # what a mean divides by: the rows that count, or their targets' class weights summed (torch's)
        count = (valid.sum() if cwf is None else torch.where(valid, cwf[t], 0.0).sum()) if mean else None
        # each row's factor: 1 / count in a mean (0 for a row that does not count, also where none does)
        if given is not None:
            scale = torch.where(valid, given.float(), 0.0)
        else:
            scale = torch.where(valid, 1.0 / count, 0.0) if mean else valid.float()
        losses = torch.empty(n, dtype=torch.float32, device=h.device)
        dh = torch.empty(h.shape, dtype=dtype, device=h.device) if need_h else None
        one = step >= n
        acc = None if not need_w or one else torch.empty(weight.shape, dtype=torch.float32, device=h.device)
        dw = db = None
        for start in range(0, n, step):
            stop = min(start + step, n)
            hb = hc[start:stop]
            z = F.linear(hb, w, b)
            if shard is None:
                losses[start:stop] = _rows(z, t[start:stop], scale[start:stop], ops, smoothing, grad, cwf)
            else:
                losses[start:stop] = parallel.rows(z, t[start:stop], scale[start:stop], ops, smoothing, grad,
                                                   cwf, shard)  # fmt: skip
            if need_h:
                torch.mm(z, w, out=dh[start:stop])
            if need_w:
                if one:
                    dw = z.t().mm(hb)
                else:
                    _accumulate(acc, z, hb, start == 0)
            if need_b:
                part = z.sum(dim=0, dtype=torch.float32)
                db = part if db is None else db.add_(part)
            del z
        losses = torch.where(valid, losses, 0.0)
        loss = losses if mean is None else losses.sum()
        if mean:
            loss = loss / count
    if acc is not None:
        dw = acc.to(weight.dtype)
        del acc
    elif dw is not None and dw.dtype is not weight.dtype:
        dw = dw.to(weight.dtype)
    if dh is not None and shard is not None:
        parallel.reduce_hidden_gradient(dh, shard)
    if dh is not None and dh.dtype is not h.dtype:
        dh = dh.to(h.dtype)
    if db is not None:
        db = db.to(bias.dtype)
    return loss, dh, dw, db


def _scaled(grads: tuple, grad: torch.Tensor) -> tuple:
    """Each of `grads` (None or the forward's own gradient buffer) times the loss's gradient, in place:
    one foreach multiply by the 0-dim tensor (its value read on the device). A 16-bit tensor times an
    fp32 0-dim one as Tensor.mul_ takes the mixed-dtype, broadcast path of TensorIterator: the weight and
    hidden gradients of a 4096 x 2048 x 128256 head took 1.04 ms that way on an H200, a third of a
    matmul (results/gpu_quick_h200_steps.json's top kernels). A second backward through the same graph
    finds them scaled and raises torch's error on saved tensors changed in place."""
    present = [g for g in grads if g is not None]
    if present:
        torch._foreach_mul_(present, grad)
    return grads


@direct_backward
class _LinearCrossEntropy(torch.autograd.Function):
    """sum (or mean) over rows r with target[r] != ignore_index of cross_entropy(transform(hidden W^T +
    bias)), fp32, its gradients computed in the forward a chunk of rows at a time (_forward) and saved:
    the backward scales them by the loss's gradient. Eager's path; under torch.compile the custom op
    invact::linear_cross_entropy (below), which runs the same _forward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, ops, ignore_index, smoothing, mean, cw=None, shard=None):
        loss, dh, dw, db = _forward(hidden, weight, bias, target, ops, ignore_index, smoothing, mean,
                                    ctx.needs_input_grad[:3], cw, shard=shard)  # fmt: skip
        for g in (dw, db):  # the parameters' gradients: no activation memory (invact.memory.count_saved)
            if g is not None:
                setattr(g, EARLY_GRADIENT, True)
        ctx.save_for_backward(dh, dw, db)
        return loss

    @staticmethod
    def backward(ctx, grad):
        dh, dw, db = _scaled(ctx.saved_tensors, grad)
        return dh, dw, db, None, None, None, None, None, None, None


# torch.compile records the loss as one custom op: it returns the loss and its gradients (empty where
# none is wanted), which its autograd formula scales; inductor calls it as eager does (the same chunks,
# kernels and matmuls), and what the compiled step saves for the backward is the gradients alone. The
# transform is passed as a list of (code, value) floats (OPS: a schema takes no tuples of strings).
OPS = ("mul", "div", "tanh")


def _encode_ops(ops: tuple) -> list[float]:
    return [float(v) for op in ops for v in (OPS.index(op[0]), op[1] if len(op) > 1 else 0.0)]


def _decode_ops(codes: list[float]) -> tuple:
    pairs = zip(codes[0::2], codes[1::2], strict=True)
    return tuple((OPS[int(c)], v) if OPS[int(c)] != "tanh" else ("tanh",) for c, v in pairs)


def _op_impl(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
             ops: list[float], ignore_index: int, smoothing: float, mean: bool,
             needs: list[bool]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    loss, dh, dw, db = _forward(hidden, weight, bias, target, _decode_ops(ops), ignore_index, smoothing, mean,
                                needs)  # fmt: skip
    for g in (dw, db):  # the parameters' gradients, as the eager Function marks them
        if g is not None:
            setattr(g, EARLY_GRADIENT, True)
    # an output is a tensor: a fresh empty one where no gradient is wanted
    return (loss, hidden.new_empty(0) if dh is None else dh, weight.new_empty(0) if dw is None else dw,
            weight.new_empty(0) if db is None else db)  # fmt: skip


_op = torch.library.custom_op("invact::linear_cross_entropy", _op_impl, mutates_args=())


@_op.register_fake
def _(hidden, weight, bias, target, ops, ignore_index, smoothing, mean, needs):
    return (hidden.new_empty((), dtype=torch.float32),
            torch.empty_like(hidden) if needs[0] else hidden.new_empty(0),
            torch.empty_like(weight) if needs[1] else weight.new_empty(0),
            torch.empty_like(bias) if needs[2] and bias is not None else weight.new_empty(0))  # fmt: skip


def _op_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*output[1:])
    ctx.mark_non_differentiable(*output[1:])
    ctx.needs = inputs[-1]


def _op_backward(ctx, grad, _dh, _dw, _db):
    dh, dw, db = ctx.saved_tensors
    needs = ctx.needs
    return (dh * grad if needs[0] else None, dw * grad if needs[1] else None,
            db * grad if needs[2] and db.numel() else None, None, None, None, None, None, None)  # fmt: skip


_op.register_autograd(_op_backward, setup_context=_op_setup_context)


class _PerRow(torch.autograd.Function):
    """reduction "none": each row's loss (rows,), fp32, computed a chunk at a time without a gradient (one
    matmul); the backward computes the chunks again with each row's gradient as its factor (three). Saved:
    the references to hidden, weight, bias, target and class weights it is given, no logits."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, cw, ops, ignore_index, smoothing, shard=None):
        losses = _forward(hidden, weight, bias, target, ops, ignore_index, smoothing, None,
                          (False, False, False), cw, shard=shard)[0]  # fmt: skip
        ctx.save_for_backward(hidden, weight, bias, target, cw)
        ctx.args = ops, ignore_index, smoothing, shard
        return losses

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, bias, target, cw = ctx.saved_tensors
        ops, ignore_index, smoothing, shard = ctx.args
        _, dh, dw, db = _forward(hidden, weight, bias, target, ops, ignore_index, smoothing, False,
                                 ctx.needs_input_grad[:3], cw, given=grad, shard=shard)  # fmt: skip
        return dh, dw, db, None, None, None, None, None, None


REDUCTIONS = ("mean", "sum", "none")


def linear_cross_entropy(
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    target: torch.Tensor,
    *,
    linear_bias: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    reduction: str = "mean",
    ignore_index: int | None = None,
    label_smoothing: float = 0.0,
    ops: tuple = (),
) -> torch.Tensor:
    """F.cross_entropy(F.linear(input, linear_weight, linear_bias), target, ...) without the logits: the
    signature of torch's F.linear_cross_entropy (2.13; here on every torch invact supports), computed a
    chunk of rows at a time with its gradients in the forward (three matmuls in all, as eager's).

    input (rows, in), (in,) or (..., in); linear_weight (vocab, in); linear_bias (vocab,) or None; target
    class indices of input's leading shape; weight: class weights (vocab,) or None; reduction "mean"
    (over the rows whose target is not ignore_index, weighted by their classes' weights: nan where none
    counts), "sum" or "none" (each row's loss, target's shape: then the backward computes the chunks
    again, four matmuls in all); ignore_index None means -100; label_smoothing in [0, 1]. `ops`
    (invact's own) is a transform between the head and the loss, a tuple of ("mul", float), ("div",
    float) and ("tanh",) applied in order (Gemma 2's soft-cap: div, tanh, mul).

    Returns fp32 (torch's rounds the loss to input's dtype); gradients reach input, linear_weight and
    linear_bias. Tensor parallel: linear_weight (and linear_bias) a DTensor sharded over the vocabulary
    (Shard(0), a 1-D mesh: a ColwiseParallel head) computes over the shards, the log-sum-exp reduced
    across the ranks, no rank forming the gathered logits (invact.loss.parallel); a replicated one runs
    on its local copy; input, target and weight may be DTensors (gathered whole). Class probabilities as
    target run torch's own ops (logits materialized). Under torch.compile, "mean" and "sum" without
    class weights are the custom op invact::linear_cross_entropy
    (the same chunks and kernels); class weights and "none" run torch's ops for inductor to compile."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(REDUCTIONS)}; got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing!r}")
    ignore_index = -100 if ignore_index is None else ignore_index
    if input.dim() == 0:
        raise ValueError("input must have at least one dimension (in_features)")
    if parallel.is_dtensor(linear_weight) or parallel.planned(linear_weight) is not None:
        return _sharded(input, linear_weight, target, linear_bias, weight, reduction, ignore_index,
                        float(label_smoothing), tuple(ops))  # fmt: skip
    if target.is_floating_point() or (reduction == "none" or weight is not None) and _compiling():
        return _reference(input, linear_weight, target, linear_bias, weight, reduction, ignore_index,
                          label_smoothing, ops)  # fmt: skip
    shape = target.shape
    hidden, target = _as_rows(input, target)
    if reduction == "none":
        return _PerRow.apply(hidden, linear_weight, linear_bias, target, weight, tuple(ops), ignore_index,
                             float(label_smoothing)).reshape(shape)  # fmt: skip
    return _loss(hidden, linear_weight, linear_bias, target, tuple(ops), ignore_index, float(label_smoothing),
                 reduction == "mean", _compiling(), weight)  # fmt: skip


_compiling = torch.compiler.is_compiling


# collectives in the forward: run eagerly (a graph break under torch.compile). torch._disable_dynamo imports
# Dynamo (and sympy) at the first call, not at `import invact` as torch.compiler.disable would.
@torch._disable_dynamo
def _sharded(input, linear_weight, target, linear_bias, weight, reduction, ignore_index, smoothing, ops):
    """linear_cross_entropy with a DTensor head weight (tensor parallel): over the vocabulary's shards
    (invact.loss.parallel), or on the local copy of a replicated one."""
    if target.is_floating_point():
        raise ValueError("invact: class probabilities as target take a whole head, not a DTensor one")
    hidden, w, b, target, cw, shard = parallel.local(input, linear_weight, linear_bias, target, weight)
    shape = target.shape
    hidden, target = _as_rows(hidden, target)
    if reduction == "none":
        return _PerRow.apply(hidden, w, b, target, cw, ops, ignore_index, smoothing, shard).reshape(shape)
    mean = reduction == "mean"
    if not torch.is_grad_enabled():
        return _forward(
            hidden, w, b, target, ops, ignore_index, smoothing, mean, (False,) * 3, cw, shard=shard
        )[0]
    return _LinearCrossEntropy.apply(hidden, w, b, target, ops, ignore_index, smoothing, mean, cw, shard)


def _reference(input, linear_weight, target, linear_bias, weight, reduction, ignore_index, smoothing, ops):
    """The logits, then F.cross_entropy on them in fp32 (the transform `ops` between): what the chunked
    path computes, for the cases it leaves to torch's ops."""
    z = F.linear(input, linear_weight, linear_bias)
    for op in ops:
        z = z * op[1] if op[0] == "mul" else z / op[1] if op[0] == "div" else torch.tanh(z)
    z = z.float()
    if input.dim() > 2:
        z, target = z.reshape(-1, z.shape[-1]), target.reshape(-1, *target.shape[input.dim() - 1 :])
    loss = F.cross_entropy(z, target.float() if target.is_floating_point() else target,
                           weight=None if weight is None else weight.float(), ignore_index=ignore_index,
                           reduction=reduction, label_smoothing=smoothing)  # fmt: skip
    return loss.reshape(input.shape[:-1]) if reduction == "none" else loss


def _as_rows(hidden: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden as rows (rows, in), target as (rows,)); ValueError where their counts differ."""
    hidden, target = hidden.reshape(-1, hidden.shape[-1]), target.reshape(-1)
    if target.shape[0] != hidden.shape[0]:
        raise ValueError(f"{target.shape[0]} targets for {hidden.shape[0]} rows of hidden states")
    return hidden, target


def _loss(hidden, weight, bias, target, ops: tuple, ignore_index: int, label_smoothing: float, mean: bool,
          compiling: bool, cw: torch.Tensor | None = None):  # fmt: skip
    """linear_cross_entropy on arguments it has checked: hidden (rows, in), target (rows,), reduction
    "mean" where `mean`, else "sum"; `compiling`: torch.compiler.is_compiling() (then `cw`, the class
    weights, is None)."""
    if parallel.is_dtensor(weight) or parallel.planned(weight) is not None:  # a tensor parallel head
        reduction = "mean" if mean else "sum"
        return _sharded(hidden, weight, target, bias, cw, reduction, ignore_index, label_smoothing,
                        ops)  # fmt: skip
    grad = torch.is_grad_enabled()
    if not grad and not compiling:  # the loss alone (one matmul), on no autograd graph
        return _forward(hidden, weight, bias, target, ops, ignore_index, label_smoothing, mean,
                        (False, False, False), cw)[0]  # fmt: skip
    if compiling:  # the op, Dynamo's one call (its gradients where any is wanted)
        needs = [grad and t is not None and t.requires_grad for t in (hidden, weight, bias)]
        return torch.ops.invact.linear_cross_entropy(hidden, weight, bias, target, _encode_ops(ops),
                                                     ignore_index, label_smoothing, mean,
                                                     needs)[0]  # fmt: skip
    if _is_wrapped(hidden):  # a dead torch.func wrapper: autograd.Function.apply unwraps it
        args = hidden, weight, bias, target, ops, ignore_index, label_smoothing, mean, cw
        return _LinearCrossEntropy.apply(*args)
    return _apply(hidden, weight, bias, target, ops, ignore_index, label_smoothing, mean, cw)


# _LinearCrossEntropy's apply without autograd.Function.apply's Python layer (see
# invact.activation.ops._apply_plain)
_apply = super(torch.autograd.Function, _LinearCrossEntropy).apply
_is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
