"""The head + loss's passes over a block of logits on CUDA (invact.loss): one kernel per pass.

Measured on an H200 (bf16, 4096 tokens x hidden 2048 x vocabulary 128256, blocks of 4096 columns):
torch's elementwise ops over each block (the fp32 copy, the log-sum-exp, the exp, the one-hot
subtraction, the scaling, the cast back) took 12.6 ms of a 34.5 ms step, the four matrix products
11.1 ms. Here each block is read once and, in backward, written once:

- forward: per row, the block's transformed logits folded into the running log-sum-exp (online:
  max, then the sum of exp rescaled), the logit at the row's target where it falls in the block, and
  with label smoothing their sum;
- backward: per row, d = (softmax - (1 - eps) onehot - eps / vocab) * dtransform * scale, written
  over the block's logits in their dtype (the matrix products that follow read d in that dtype, as
  invact.loss's torch path casts it).

The transform is the model's scalar steps around at most one tanh (Gemma's soft-cap c tanh(z / c),
Cohere's and Granite's scales): pre-op, tanh, post-op, each a multiply or a divide (a divide, not a
multiply by the reciprocal: the model's own rounding). tanh is 1 - 2 / (exp(2x) + 1) (libdevice's
is not available under TRITON_INTERPRET=1, how CI runs these kernels on CPU tensors). Other
transforms, and heads with a bias (whose gradient needs the block's column sums), take the torch
path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

NONE, MUL, DIV = 0, 1, 2
COLUMNS = 1024  # columns a program reads at a time


def plan(ops: tuple) -> tuple[int, float, bool, int, float] | None:
    """ops (invact.loss's transform) as (pre-op, its value, tanh, post-op, its value), or None where
    they are not one scalar step, a tanh and one scalar step (each optional)."""
    pre, tanh, post = (NONE, 1.0), False, (NONE, 1.0)
    for op in ops:
        if op[0] == "tanh":
            if tanh or post[0] != NONE:
                return None
            tanh = True
        else:
            kind = MUL if op[0] == "mul" else DIV
            if not tanh and pre[0] == NONE:
                pre = (kind, float(op[1]))
            elif tanh and post[0] == NONE:
                post = (kind, float(op[1]))
            else:
                return None
    return pre[0], pre[1], tanh, post[0], post[1]


@triton.jit
def _step(v, KIND: tl.constexpr, value):
    if KIND == 1:
        v = v * value
    elif KIND == 2:
        v = v / value
    return v


@triton.jit
def _tanh(x):
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _transformed(base, cols, inside, PRE: tl.constexpr, pre_value, TANH: tl.constexpr, POST: tl.constexpr,
                 post_value):  # fmt: skip
    """A chunk of a row's logits in fp32, transformed, and the tanh's slope 1 - tanh^2 (1 without)."""
    v = _step(tl.load(base + cols, mask=inside, other=0.0).to(tl.float32), PRE, pre_value)
    slope = tl.full(v.shape, 1.0, tl.float32)
    if TANH:
        v = _tanh(v)
        slope = 1.0 - v * v
    return _step(v, POST, post_value), slope


@triton.jit
def _forward_kernel(z_ptr, t_ptr, lse_ptr, picked_ptr, total_ptr, columns, stride, start,
                    PRE: tl.constexpr, pre_value, TANH: tl.constexpr, POST: tl.constexpr, post_value,
                    SMOOTH: tl.constexpr, FIRST: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0)
    base = z_ptr + row.to(tl.int64) * stride
    target = tl.load(t_ptr + row) - start
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.zeros([], tl.float32)
    picked = tl.zeros([], tl.float32)
    total = tl.zeros([], tl.float32)
    for c0 in range(0, columns, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        inside = cols < columns
        v, _ = _transformed(base, cols, inside, PRE, pre_value, TANH, POST, post_value)
        picked += tl.sum(tl.where(cols == target, v, 0.0), axis=0)
        if SMOOTH:
            total += tl.sum(tl.where(inside, v, 0.0), axis=0)
        v = tl.where(inside, v, float("-inf"))
        m_new = tl.maximum(m, tl.max(v, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(v - m_new), axis=0)
        m = m_new
    lse = m + tl.log(s)
    if FIRST:
        tl.store(lse_ptr + row, lse)
        tl.store(picked_ptr + row, picked)
        if SMOOTH:
            tl.store(total_ptr + row, total)
    else:
        old = tl.load(lse_ptr + row)
        top = tl.maximum(old, lse)
        tl.store(lse_ptr + row, top + tl.log(tl.exp(old - top) + tl.exp(lse - top)))
        tl.store(picked_ptr + row, tl.load(picked_ptr + row) + picked)
        if SMOOTH:
            tl.store(total_ptr + row, tl.load(total_ptr + row) + total)


@triton.jit
def _backward_kernel(z_ptr, t_ptr, lse_ptr, scale_ptr, columns, stride, start, smoothing, spread, factor,
                     PRE: tl.constexpr, pre_value, TANH: tl.constexpr, POST: tl.constexpr, post_value,
                     BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0)
    base = z_ptr + row.to(tl.int64) * stride
    target = tl.load(t_ptr + row) - start
    lse = tl.load(lse_ptr + row)
    scale = tl.load(scale_ptr + row) * factor
    for c0 in range(0, columns, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        inside = cols < columns
        v, slope = _transformed(base, cols, inside, PRE, pre_value, TANH, POST, post_value)
        p = tl.exp(v - lse) - tl.where(cols == target, 1.0 - smoothing, 0.0) - spread
        if TANH:
            p = p * slope
        tl.store(base + cols, (p * scale).to(z_ptr.dtype.element_ty), mask=inside)


def forward_block(z, t, lse, picked, total, start: int, ops: tuple, first: bool) -> None:
    """Fold the block z (rows, columns: the logits of vocabulary columns start...) into the running
    per-row lse, picked and (label smoothing) total, fp32 (rows,); `first`: they are written, not
    read."""
    pre, pre_value, tanh, post, post_value = plan(ops)
    rows, columns = z.shape
    _forward_kernel[(rows,)](
        z, t, lse, picked, total if total is not None else lse, columns, z.stride(0), start,
        PRE=pre, pre_value=pre_value, TANH=tanh, POST=post, post_value=post_value,
        SMOOTH=total is not None, FIRST=first, BLOCK=min(COLUMNS, triton.next_power_of_2(columns)),
    )  # fmt: skip


def backward_block(z, t, lse, scale, start: int, vocab: int, smoothing: float, ops: tuple) -> torch.Tensor:
    """The block's gradient d (the loss's, with respect to its logits), written over z and returned:
    scale (rows,) fp32 each row's factor (0 for a row that does not count)."""
    pre, pre_value, tanh, post, post_value = plan(ops)
    factor = (pre_value if pre == MUL else 1.0 / pre_value if pre == DIV else 1.0) * (
        post_value if post == MUL else 1.0 / post_value if post == DIV else 1.0
    )
    rows, columns = z.shape
    _backward_kernel[(rows,)](
        z, t, lse, scale, columns, z.stride(0), start, float(smoothing), float(smoothing) / vocab, factor,
        PRE=pre, pre_value=pre_value, TANH=tanh, POST=post, post_value=post_value,
        BLOCK=min(COLUMNS, triton.next_power_of_2(columns)),
    )  # fmt: skip
    return z
