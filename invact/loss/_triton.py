"""The head + loss's pass over a chunk of logits on CUDA (invact.loss.op): one kernel, a program per row.

Each row holds the logits of its token over the whole vocabulary (in the matmul's dtype). Pass 1 reads
the row once: its transformed logits folded into a log-sum-exp online (a running max and a sum of exp
rescaled as the max grows), and with label smoothing their sum; the logit at the target is read alone.
The row's loss is stored (fp32). Pass 2, where a gradient is wanted, reads the row again and writes
d = (softmax - (1 - eps) onehot - eps / vocab) * dtransform * scale over it in its dtype, the input of
the two matmuls that follow (d h = d W, d W += d^T h). Two reads and one write of each element: on an
H200 (bf16, 4096 x 128256 logits; benchmarks/results/loss_floor_h200_prototype.json) the first version,
which reduced every block of a row as it went, ran at 2209 GB/s counting those bytes.

The transform is the model's scalar steps around at most one tanh (Gemma's soft-cap c tanh(z / c),
Cohere's and Granite's scales): pre-op, tanh, post-op, each a multiply or a divide (a divide, not a
multiply by the reciprocal: the model's own rounding). tanh is 1 - 2 / (exp(2x) + 1) (libdevice's
is not available under TRITON_INTERPRET=1, how CI runs these kernels on CPU tensors). Other
transforms take the torch path (invact.loss.op._rows_torch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from invact._triton_build import build
from invact.loss.kernel_plan import DIV, MUL, NONE, plan  # noqa: F401 - plan: read here by tests


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
def _rows_kernel(z_ptr, t_ptr, scale_ptr, loss_ptr, columns, stride, smoothing, spread, factor,
                 PRE: tl.constexpr, pre_value, TANH: tl.constexpr, POST: tl.constexpr, post_value,
                 SMOOTH: tl.constexpr, GRAD: tl.constexpr, LANES: tl.constexpr,
                 BLOCK: tl.constexpr):  # fmt: skip
    """One row of whole-vocabulary logits: its loss, then (GRAD) its gradient written over it."""
    row = tl.program_id(0)
    base = z_ptr + row.to(tl.int64) * stride
    target = tl.load(t_ptr + row)
    # the logit at the target, read once (the same fp32 steps as the passes take)
    at = target + tl.arange(0, 1)
    at_target, at_slope = _transformed(base, at, at >= 0, PRE, pre_value, TANH, POST, post_value)
    picked = tl.sum(at_target, axis=0)
    # pass 1, the log-sum-exp online: LANES keeps a running max and sum per lane, reduced across lanes
    # once at the end (2 exp per element, no reduction per step); else each step reduces its block
    if LANES:
        m = tl.full([BLOCK], -3.0e38, tl.float32)
        s = tl.zeros([BLOCK], tl.float32)
    else:
        m = tl.full([], -3.0e38, tl.float32)
        s = tl.zeros([], tl.float32)
    total = tl.zeros([BLOCK], tl.float32)
    for c0 in range(0, columns, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        inside = cols < columns
        v, v_slope = _transformed(base, cols, inside, PRE, pre_value, TANH, POST, post_value)
        if SMOOTH:
            total += tl.where(inside, v, 0.0)
        # masked lanes hold a finite floor, not -inf: exp(floor - floor) = 1 is harmless where it is
        # scaled by exp(floor - max) = 0 at the end, where exp(-inf - -inf) would be nan
        v = tl.where(inside, v, -3.0e38)
        if LANES:
            m_new = tl.maximum(m, v)
            s = s * tl.exp(m - m_new) + tl.exp(v - m_new)
        else:
            m_new = tl.maximum(m, tl.max(v, axis=0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(v - m_new), axis=0)
        m = m_new
    if LANES:
        top = tl.max(m, axis=0)
        lse = top + tl.log(tl.sum(s * tl.exp(m - top), axis=0))
    else:
        lse = m + tl.log(s)
    loss = lse - picked
    if SMOOTH:  # F.cross_entropy's (1 - eps) nll + eps * mean over classes of -log p
        loss = (1.0 - smoothing) * loss + smoothing * (lse - tl.sum(total, axis=0) / columns)
    tl.store(loss_ptr + row, loss)
    if GRAD:  # pass 2: d = (softmax - (1 - eps) onehot - eps / vocab) * dtransform * scale
        scale = tl.load(scale_ptr + row) * factor
        for c0 in range(0, columns, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            inside = cols < columns
            u, slope = _transformed(base, cols, inside, PRE, pre_value, TANH, POST, post_value)
            p = tl.exp(u - lse) - tl.where(cols == target, 1.0 - smoothing, 0.0) - spread
            if TANH:
                p = p * slope
            tl.store(base + cols, (p * scale).to(z_ptr.dtype.element_ty), mask=inside)


# The kernel's launch: columns a row's program reads at a time, its warps, and whether it keeps per-lane
# running sums (LANES) or reduces each step.
CONFIG = {"BLOCK": 2048, "num_warps": 8, "LANES": True}
# The configurations benchmarks/loss_floor.py times on a GPU (tests/invact/test_triton_compiles.py
# compiles each for sm_90).
SWEEP = [{"BLOCK": b, "num_warps": w, "LANES": lanes} for b in (1024, 2048, 4096) for w in (4, 8, 16)
         for lanes in (True, False)]  # fmt: skip


def rows(z, t, scale, smoothing: float, ops: tuple, grad: bool, config: dict | None = None) -> torch.Tensor:
    """Each row's loss, fp32 (rows,), for z (rows, vocab) the whole vocabulary's logits of its rows,
    t (rows,) the targets (every one a valid class); with `grad`, each row's gradient
    d loss / d z times scale (rows,) fp32, written over z in its dtype. `config`: CONFIG's keys."""
    pre, pre_value, tanh, post, post_value = plan(ops)
    factor = (pre_value if pre == MUL else 1.0 / pre_value if pre == DIV else 1.0) * (
        post_value if post == MUL else 1.0 / post_value if post == DIV else 1.0
    )
    n, columns = z.shape
    config = config or CONFIG
    out = torch.empty(n, dtype=torch.float32, device=z.device)
    _rows_kernel[(n,)](
        z, t, scale if grad else out, out, columns, z.stride(0), float(smoothing), float(smoothing) / columns,
        factor, PRE=pre, pre_value=pre_value, TANH=tanh, POST=post, post_value=post_value,
        SMOOTH=smoothing != 0.0, GRAD=grad, LANES=config["LANES"],
        BLOCK=min(config["BLOCK"], triton.next_power_of_2(columns)), num_warps=config["num_warps"],
    )  # fmt: skip
    return out


_POINTERS = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16"}


def compile_for(dtype: torch.dtype, ops: tuple, smoothing: bool, grad: bool, config: dict | None = None,
                arch: int = 90):  # fmt: skip
    """The rows kernel compiled for NVIDIA compute capability `arch` (no GPU needed; not under
    TRITON_INTERPRET=1) for logits of `dtype`, the transform `ops`, with label smoothing or not, with the
    gradient pass or not, at `config` (CONFIG's keys; CONFIG by default)."""
    pre, _, tanh, post, _ = plan(ops)
    config = config or CONFIG
    function = _rows_kernel
    constexprs = {"PRE": pre, "TANH": tanh, "POST": post, "SMOOTH": smoothing, "GRAD": grad,
                  "LANES": config["LANES"], "BLOCK": config["BLOCK"]}  # fmt: skip
    pointers = {"z_ptr": _POINTERS[dtype], "t_ptr": "*i64", "scale_ptr": "*fp32", "loss_ptr": "*fp32"}
    signature = {}
    for arg in function.arg_names:
        if arg in constexprs:
            signature[arg] = "constexpr"
        elif arg in pointers:
            signature[arg] = pointers[arg]
        elif arg in ("columns", "stride"):
            signature[arg] = "i32"
        else:
            signature[arg] = "fp32"
    aligned = [i for i, arg in enumerate(function.arg_names) if arg.endswith("_ptr")]
    return build(function, signature, constexprs, aligned, config["num_warps"], arch)
