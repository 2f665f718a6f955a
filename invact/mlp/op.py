"""The MLP's op: an MLP block as one autograd Function (`_MLP`, which invact.mlp.Forward applies in
eager mode), for the host time a small layer waits for, and the custom ops invact::gated_linear and
invact::gate_up_linear (each with its backward op and its body in a compiled graph) that a recognised
gated MLP runs under torch.compile. Which modules run them, and when, is invact.mlp.

Forward: F.linear for the projections, invact's forward for act (the backend InvAct's eager path
takes), a multiply: the modules' own ops on the same operands, so the output is bitwise theirs. On the
Triton backend (CUDA) the gated form's act and multiply are one kernel (its gated_forward), and in
backward its dy = dh * u, q(y, bit) dy and du = dh * y another (gated_backward): the same roundings,
bitwise (tests/invact/test_triton.py), each reading its operands once (benchmarks/kernel_sass.py: 8 and
10 bytes an element in bf16 where the separate kernels move 10 and 18).
Backward: the ops torch's autograd runs for these modules (aten's derivatives of addmm/mm and mul,
torch 2.13: for F.linear(x, W, b) on the rows x2 = x.reshape(-1, k), dx = dout2 W, dW = dout2^T x2
(mm_mat2_backward's branch for the column-major W.t()), db = dout2 summed over rows; the multiply's
dy = dh * u and du = dh * y; dx of the gated form the sum of its two projections' parts, as autograd
adds them), so gradients are bitwise the unfused patched module's (tested in fp32 and bf16, 2-D and
3-D inputs, with and without biases). dg = q(y, bit) dy as InvAct's own backward (invact.activation.ops).

Under autocast (float32 x and weights, cast for the projections as autocast casts nn.Linear's
inputs) the Function runs the same casts in forward and keeps one cast copy of x (the modules keep
one per projection, as autocast caches only a leaf's cast) and the weights uncast (cast again in
backward), and casts each gradient back, as the cast ops' backward does; bitwise the modules'
gradients under the same autocast, x a leaf or not.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from invact._traced import trace_as
from invact.activation.activations import ACTIVATIONS
from invact.activation.ops import _current_level, _eager_backends, direct_backward, plain_dx
from invact.mlp import experts


@direct_backward
class _MLP(torch.autograd.Function):
    """F.linear(act(F.linear(x, w_gate, b_gate)) * F.linear(x, w_up, b_up), w_down, b_down), or with
    no gate F.linear(act(F.linear(x, w_up, b_up)), w_down, b_down), for a contiguous x of 2 or 3
    dimensions, on its rows: F.linear runs a 3-D contiguous input as its rows too (addmm, or mm on
    the folded input without a bias), so every product is the kernel the modules run. Written in the
    older style (forward takes ctx) for invact.activation.ops._EagerPlain's reason: less host time per
    apply."""

    @staticmethod
    def forward(ctx, x, x_again, w_up, b_up, w_gate, b_gate, w_down, b_down, act, precision_bit, up_first,
                compute):  # fmt: skip
        # x_again: x once more in the gated form, so that x's gradient gets its two projections' parts
        # one by one, in the order autograd adds them without this Function (see backward). compute:
        # the dtype the projections run in, autocast's where it casts x, else x's own.
        rows = x if x.dim() == 2 else x.view(-1, x.shape[-1])
        if compute is not x.dtype:  # autocast's cast of x, made once and kept, as the modules keep theirs
            rows = rows.to(compute)
        u = F.linear(rows, w_up, b_up)
        g = u if w_gate is None else F.linear(rows, w_gate, b_gate)
        forward, backward = _eager_backends(g)
        fused = None if w_gate is None else getattr(forward, "gated_forward", None)
        if fused is not None and g.is_contiguous() and u.is_contiguous() and g.dtype is u.dtype:
            y, bits, h = fused(act, g, u, precision_bit)  # act and the product in one pass (Triton)
        else:
            y, bits = forward.forward(act, g, precision_bit)
            h = y if w_gate is None else y * u
        out = F.linear(h, w_down, b_down)
        del h
        ctx.set_materialize_grads(False)  # no zero gradient built for an output nobody differentiates
        ctx.act, ctx.precision_bit, ctx.backend, ctx.up_first = act, precision_bit, backward, up_first
        ctx.x_dtype = x.dtype
        ctx.cast = x.dtype is not compute or w_down.dtype is not compute  # autocast's: _cast_back
        # autocast casts a leaf that needs grad once (its cast cache) and both projections share that
        # copy, whose gradient then sums their parts before the one cast back; any other x is cast per
        # projection, each part cast back, and summed in x's dtype (see _cast_back)
        ctx.cast_once = x.is_leaf and x.requires_grad and torch.is_autocast_cache_enabled()
        ctx.save_for_backward(rows, w_up, w_gate, w_down, y, None if w_gate is None else u,
                              bits if bits.numel() else None)  # fmt: skip
        return out if x.dim() == 2 else out.view(x.shape[0], x.shape[1], -1)  # x: 2-D or 3-D (_fused)

    @staticmethod
    def backward(ctx, dout):
        if dout is None:
            return (None,) * 12
        rows, w_up, w_gate, w_down, y, u, bits = ctx.saved_tensors
        need_x, _, need_w_up, need_b_up, need_w_gate, need_b_gate, need_w_down, need_b_down = (
            ctx.needs_input_grad[:8]
        )
        gated = w_gate is not None
        x_dtype, w_dtype = ctx.x_dtype, w_down.dtype
        if rows.dtype is not x_dtype:
            # Under autocast the projections ran on x and weights cast to y's dtype (the weights not
            # kept: cast again here, the same values) and autograd casts each part of a gradient back,
            # as the cast ops' backward does (cast_back below).
            w_up, w_down = w_up.to(y.dtype), w_down.to(y.dtype)
            w_gate = w_gate if w_gate is None else w_gate.to(y.dtype)
        shape = dout.shape
        if dout.dim() != 2:
            dout = dout.reshape(-1, shape[-1])  # the rows the down projection's mm saw
        d_w_down = dout.t().mm(y * u if gated else y) if need_w_down else None  # y * u: the product,
        d_b_down = dout.sum(0) if need_b_down else None  # recomputed by the forward's op on its operands
        dh = dout.mm(w_down)
        if bits is None:
            bits = y.new_empty(0, dtype=torch.uint8)
        fused = getattr(ctx.backend, "gated_backward", None) if gated else None
        du = None
        if fused is not None and _fuses(y, u, dh):  # dg and du in one pass (Triton); dh is then done with
            dg, du = fused(ctx.act, y, bits, u, dh, ctx.precision_bit)
            dh = None
        else:  # du = dh * y below, after dg's products (so that du is not alive beside them)
            dg = plain_dx(ctx.act, ctx.precision_bit, ctx.backend, y, bits, dh * u if gated else dh)
        w_g = w_gate if gated else w_up
        d_w_g = dg.t().mm(rows) if (need_w_gate if gated else need_w_up) else None
        d_b_g = dg.sum(0) if (need_b_gate if gated else need_b_up) else None
        dx = dg.mm(w_g) if need_x else None
        if dx is not None and len(shape) != 2:
            dx = dx.view(shape[0], shape[1], -1)  # 3-D
        if not gated:
            grads = dx, None, d_w_g, d_b_g, None, None, d_w_down, d_b_down
            return (*(_cast_back(grads, x_dtype, w_dtype) if ctx.cast else grads), None, None, None, None)
        if du is None:
            du = dh * y
        d_w_up = du.t().mm(rows) if need_w_up else None
        d_b_up = du.sum(0) if need_b_up else None
        dx_up = du.mm(w_up) if need_x else None
        if dx_up is not None and len(shape) != 2:
            dx_up = dx_up.view(shape[0], shape[1], -1)
        # Without this Function autograd runs the projection made last first (the higher sequence
        # number) and adds its part to x's gradient first; x's first input slot is added first here.
        first, second = (dx, dx_up) if ctx.up_first else (dx_up, dx)
        if first is not None and first.dtype is not x_dtype and ctx.cast_once:
            first, second = first + second, None  # both parts of the one cast copy's gradient
        grads = first, second, d_w_up, d_b_up, d_w_g, d_b_g, d_w_down, d_b_down
        return (*(_cast_back(grads, x_dtype, w_dtype) if ctx.cast else grads), None, None, None, None)


def _fuses(y: torch.Tensor, u: torch.Tensor, dh: torch.Tensor) -> bool:
    """Whether the backward's gated kernel serves y, u and dh: contiguous, one dtype, and outside what
    plain_dx hands to the op's own backward (torch.func transforms, create_graph)."""
    return (
        _current_level() is None
        and not torch.is_grad_enabled()
        and y.is_contiguous()
        and u.is_contiguous()
        and dh.is_contiguous()
        and y.dtype is u.dtype is dh.dtype
    )


def _cast_back(grads: tuple, x_dtype: torch.dtype, w_dtype: torch.dtype) -> tuple:
    """The gradients of (x, x_again, w_up, b_up, w_gate, b_gate, w_down, b_down) in their inputs'
    dtypes: under autocast each is cast back from the dtype it was computed in, part by part for x."""
    if grads[0] is None or grads[0].dtype is x_dtype:
        if all(g is None or g.dtype is w_dtype for g in grads[2:]):
            return grads
    dtypes = (x_dtype, x_dtype) + (w_dtype,) * 6
    return tuple(g if g is None else g.to(dtype) for g, dtype in zip(grads, dtypes, strict=True))


# apply without autograd.Function.apply's Python layer (see invact.activation.ops._apply_plain)
_apply = super(torch.autograd.Function, _MLP).apply


# The gated product and the down projection as one torch.library custom op, for torch.compile: a
# traced gated MLP (Forward under compile) runs its gate and up projections and its activation as the
# modules do, then down(y * u) as this op, whose autograd saves y, u and the weight and recomputes the
# product h = y * u in backward, as the eager Function does. Opaque to the partitioner, which otherwise
# saves h for the down projection's weight gradient (its min-cut weighs bytes moved, and recomputing h
# for a matmul moves as many as reading it back) beside the y and u the multiply keeps: measured with
# benchmarks/memory.py on a tiny Llama (2 layers of 64, fp32), compile + patch() then saved exactly one
# h per layer more than eager patch(). Its backward is an op too, so no node of it is left for the
# partitioner to move into the forward.
def _gated_linear_impl(y: torch.Tensor, u: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    """F.linear(y * u, weight, bias): y, u of shape (..., k), weight (n, k), bias (n,) or None."""
    return F.linear(y * u, weight, bias)


def _gated_linear_backward_impl(
    dout: torch.Tensor, y: torch.Tensor, u: torch.Tensor, weight: torch.Tensor, bias_grad: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dy, du, dweight, dbias) of _gated_linear_impl; dbias empty where there is no bias."""
    rows = dout.reshape(-1, dout.shape[-1])
    dweight = rows.t().mm((y * u).reshape(-1, y.shape[-1]))  # the product, recomputed
    dbias = rows.sum(0) if bias_grad else rows.new_empty(0)
    dh = dout.matmul(weight)
    return dh * u, dh * y, dweight, dbias


gated_linear = torch.library.custom_op("invact::gated_linear", _gated_linear_impl, mutates_args=())
_gated_linear_backward = torch.library.custom_op(
    "invact::gated_linear_backward", _gated_linear_backward_impl, mutates_args=()
)


@gated_linear.register_fake
def _(y, u, weight, bias):
    return y.new_empty((*y.shape[:-1], weight.shape[0]))


@_gated_linear_backward.register_fake
def _(dout, y, u, weight, bias_grad):
    return (torch.empty_like(y), torch.empty_like(u), torch.empty_like(weight),
            dout.new_empty(weight.shape[0] if bias_grad else 0))  # fmt: skip


def _gated_linear_setup(ctx, inputs, output) -> None:
    y, u, weight, bias = inputs
    ctx.bias_grad = bias is not None
    ctx.save_for_backward(y, u, weight)


def _gated_linear_autograd(ctx, dout):
    y, u, weight = ctx.saved_tensors
    dy, du, dweight, dbias = _gated_linear_backward(dout, y, u, weight, ctx.bias_grad)
    return dy, du, dweight, dbias if ctx.bias_grad else None


gated_linear.register_autograd(_gated_linear_autograd, setup_context=_gated_linear_setup)


# A fused gate_up (Phi-3's MLP: gate, up = gate_up(x).chunk(2, -1)) under torch.compile: down(act(gate)
# * up) as one op that saves gate_up's output, whose halves eager's gated path keeps too (y and u moved
# into that storage, plus the bits), and recomputes act(gate) with torch's own activation in backward
# (f' from the activation's float64 view). An InvAct op on the chunk would keep a new y beside the whole
# gate_up output that u keeps; the multiply and down projection in the graph would keep the product
# too (see gated_linear).
def _gate_up_linear_impl(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         activation: str) -> torch.Tensor:  # fmt: skip
    """F.linear(act(g) * u, weight, bias) for g, u = gate_up.chunk(2, -1): gate_up (..., 2k), weight
    (n, k), act torch's activation `activation` (a name in invact.activation.activations.ACTIVATIONS)."""
    g, u = gate_up.chunk(2, dim=-1)
    return F.linear(u * ACTIVATIONS[activation].torch_forward(g), weight, bias)


def _gate_up_linear_backward_impl(
    dout: torch.Tensor, gate_up: torch.Tensor, weight: torch.Tensor, bias_grad: bool, activation: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dgate_up, dweight, dbias) of _gate_up_linear_impl; dbias empty where there is no bias."""
    g, u = gate_up.chunk(2, dim=-1)
    act = ACTIVATIONS[activation]
    y = act.torch_forward(g)  # bitwise the forward's
    rows = dout.reshape(-1, dout.shape[-1])
    dweight = rows.t().mm((u * y).reshape(-1, y.shape[-1]))
    dbias = rows.sum(0) if bias_grad else rows.new_empty(0)
    return experts.gate_up_grad(dout.matmul(weight), g, u, y, act), dweight, dbias


gate_up_linear = torch.library.custom_op("invact::gate_up_linear", _gate_up_linear_impl, mutates_args=())
_gate_up_linear_backward = torch.library.custom_op(
    "invact::gate_up_linear_backward", _gate_up_linear_backward_impl, mutates_args=()
)


@gate_up_linear.register_fake
def _(gate_up, weight, bias, activation):
    return gate_up.new_empty((*gate_up.shape[:-1], weight.shape[0]))


@_gate_up_linear_backward.register_fake
def _(dout, gate_up, weight, bias_grad, activation):
    return (torch.empty_like(gate_up), torch.empty_like(weight),
            dout.new_empty(weight.shape[0] if bias_grad else 0))  # fmt: skip


def _gate_up_linear_setup(ctx, inputs, output) -> None:
    gate_up, weight, bias, activation = inputs
    ctx.bias_grad, ctx.activation = bias is not None, activation
    ctx.save_for_backward(gate_up, weight)


def _gate_up_linear_autograd(ctx, dout):
    gate_up, weight = ctx.saved_tensors
    dgate_up, dweight, dbias = _gate_up_linear_backward(dout, gate_up, weight, ctx.bias_grad, ctx.activation)
    return dgate_up, dweight, dbias if ctx.bias_grad else None, None


gate_up_linear.register_autograd(_gate_up_linear_autograd, setup_context=_gate_up_linear_setup)


# The two ops' bodies in a compiled graph (invact._traced): the same torch ops, except that each
# backward recomputes the product in the other operand order (bitwise the same: IEEE multiplication
# commutes), so that the joint graph's common-subexpression pass leaves it a backward node. Merged with
# the forward's product, it would be a forward tensor a matmul reads in backward, which the partitioner
# saves: the gated product eager patch() does not keep.
def _gated_linear_backward_traced(dout, y, u, weight, bias_grad: bool):
    rows = dout.reshape(-1, dout.shape[-1])
    dweight = rows.t().mm((u * y).reshape(-1, y.shape[-1]))  # the product, in the other order
    dbias = rows.sum(0) if bias_grad else rows.new_empty(0)
    dh = dout.matmul(weight)
    return dh * u, dh * y, dweight, dbias


def _gate_up_linear_traced(gate_up, weight, bias, activation: str):
    g, u = gate_up.chunk(2, dim=-1)
    return F.linear(u * ACTIVATIONS[activation].torch_forward(g), weight, bias)


def _gate_up_linear_backward_traced(dout, gate_up, weight, bias_grad: bool, activation: str):
    g, u = gate_up.chunk(2, dim=-1)
    act = ACTIVATIONS[activation]
    y = act.torch_forward(g)
    rows = dout.reshape(-1, dout.shape[-1])
    dweight = rows.t().mm((y * u).reshape(-1, y.shape[-1]))  # the forward's u * y, in the other order
    dbias = rows.sum(0) if bias_grad else rows.new_empty(0)
    return experts.gate_up_grad(dout.matmul(weight), g, u, y, act), dweight, dbias


trace_as("invact::gated_linear", _gated_linear_impl)
trace_as("invact::gated_linear_backward", _gated_linear_backward_traced)
trace_as("invact::gate_up_linear", _gate_up_linear_traced)
trace_as("invact::gate_up_linear_backward", _gate_up_linear_backward_traced)
