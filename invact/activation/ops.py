"""The InvAct operator: op registration and backend choice. torch.library custom ops
`invact::forward` / `invact::backward` with fake implementations (torch.compile traces them without
graph breaks) and autograd, and the eager autograd.Function that runs the same bodies.

Saved for backward: y (the output: the next layer saves the same storage) and ceil(n/8) bytes of
bits, or nothing extra in precision-bit mode or for a monotone activation. Backends, one signature
(invact/activation/_portable.py): Triton (invact/activation/_triton.py) for CUDA tensors, numba
(invact/activation/_numba.py) for CPU tensors when installed, the portable torch ops elsewhere;
INVACT_BACKEND=torch|triton overrides.
float64 takes the float64 backward (invact/activation/_float64.py: inversion in float64), so gradcheck holds.
"""

from __future__ import annotations

import os
from types import ModuleType

import torch

from invact._budget import _transforms_active, traces_custom_ops
from invact._layout import flat, like, shaped_like
from invact._meta import stands_for
from invact._traced import trace_as
from invact.activation import _bits, _float64, _numba, _portable
from invact.activation.activations import ACTIVATIONS, Activation

BACKENDS = ("torch", "triton")
MODES = ("bits", "precision_bit")


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def check_mode(mode: str) -> None:
    """ValueError unless `mode` is one of MODES (the modules check it when built, the op when called)."""
    if mode not in MODES:
        raise ValueError(f"mode must be 'bits' or 'precision_bit', got {mode!r}")


def backend_for(t: torch.Tensor) -> str:
    """INVACT_BACKEND if set, else triton for CUDA tensors (when installed), else torch."""
    if not _backend_env_set():  # the common case, without os.environ.get's KeyError (see below)
        return "triton" if t.is_cuda and _triton_available() else "torch"
    choice = os.environ.get("INVACT_BACKEND", "").strip().lower()
    if choice:
        if choice not in BACKENDS:
            raise ValueError(f"INVACT_BACKEND={choice!r}: expected one of {', '.join(BACKENDS)}")
        if choice == "triton" and not _triton_available():
            raise RuntimeError("INVACT_BACKEND=triton but triton is not installed")
        return choice
    return "triton" if t.is_cuda and _triton_available() else "torch"


def _backend(t: torch.Tensor, backward: bool) -> ModuleType:
    """The module whose forward(act, x, precision_bit) / backward(act, y, bits, dy, precision_bit)
    serves tensors like t."""
    if t.dtype == torch.float64:
        return _float64 if backward else _portable
    if backend_for(t) == "triton":
        from invact.activation import _triton

        return _triton
    return _numba if t.is_cpu and _numba.available() else _portable


# The eager path looks at INVACT_BACKEND on every call (it may be set at run time), where it is
# mostly unset, and there os.environ.get raises and catches a KeyError or two: measured on a 2-core
# Intel Xeon, that lookup took 6 us of an MLP block's forward + backward (InvAct's 27 us over torch's
# went to 21 us without it). CPython's os.environ keeps the variables in a dict under encoded keys
# (os._Environ._data, encodekey): a membership test there raises nothing. Where os.environ is anything
# else (a mapping put in its place), it is asked as a mapping.
_ENV_KEY = os.environ.encodekey("INVACT_BACKEND") if hasattr(os.environ, "encodekey") else None


def _backend_env_set() -> bool:
    """INVACT_BACKEND is in the environment (backend_for reads and checks its value)."""
    data = getattr(os.environ, "_data", None)
    if _ENV_KEY is not None and type(data) is dict:
        return _ENV_KEY in data
    return "INVACT_BACKEND" in os.environ


def _eager_backends(x: torch.Tensor) -> tuple[ModuleType, ModuleType]:
    """(_backend(x, False), _backend(x, True)) with one look at the environment: the eager Function
    chooses both in its forward."""
    if x.dtype == torch.float64:
        return _portable, _float64
    if x.is_cpu and not _backend_env_set():
        backend = _numba if _numba.available() else _portable
    else:
        backend = _backend(x, False)
    return backend, backend


def _saves_bits(act: Activation, x: torch.Tensor, precision_bit: bool) -> bool:
    """Packed bits are stored unless f is monotone (no bit) or precision-bit mode hides it in y."""
    return not (act.monotone or (precision_bit and x.dtype != torch.float64))


def _forward_impl(x: torch.Tensor, activation: str, precision_bit: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, bits): the body of invact::forward, also called directly by the eager path."""
    return _backend(x, backward=False).forward(ACTIVATIONS[activation], x, precision_bit)


_forward = torch.library.custom_op("invact::forward", _forward_impl, mutates_args=())


@_forward.register_fake
def _(x, activation, precision_bit):
    saves = _saves_bits(ACTIVATIONS[activation], x, precision_bit)
    return torch.empty_like(x), x.new_empty(_bits.packed_size(x.numel()) if saves else 0, dtype=torch.uint8)


def _backward_impl(
    dy: torch.Tensor, y: torch.Tensor, bits: torch.Tensor, activation: str, precision_bit: bool
) -> torch.Tensor:
    """dx: the body of invact::backward, also called directly by the eager path."""
    backend = _backend(y, backward=True)
    dx = backend.backward(ACTIVATIONS[activation], flat(y), bits, flat(like(dy, y)), precision_bit)
    return shaped_like(dx, y)


_backward = torch.library.custom_op("invact::backward", _backward_impl, mutates_args=())


@_backward.register_fake
def _(dy, y, bits, activation, precision_bit):
    return torch.empty_like(y, dtype=dy.dtype)


def _forward_traced(x: torch.Tensor, activation: str, precision_bit: bool):
    """invact::forward's body in a compiled graph (invact._traced): torch's op and the bits, in torch
    ops that inductor fuses into one pass."""
    return _portable.forward(ACTIVATIONS[activation], x, precision_bit, pack=_bits.pack_indexed)


def _backward_traced(dy, y, bits, activation: str, precision_bit: bool) -> torch.Tensor:
    """invact::backward's body in a compiled graph: dy * q(y, bit) in torch ops (the q each dtype's
    kernels evaluate), which inductor fuses with the ops around it."""
    dx = _portable.backward(ACTIVATIONS[activation], flat(y), bits, flat(like(dy, y)), precision_bit)
    return shaped_like(dx, y)


# From this many elements a CPU activation stays the op (numba's kernels, invact/activation/_numba.py) in a
# compiled graph: inductor's code for the backward's body evaluates both branches' q for every element
# where the kernel evaluates one from its tables, and the forward's packs the bits by an indexed read.
# Measured on an Intel Xeon (AVX-512), 2 threads, speed.py --compile, compiled + patch() over compiled
# torch: speed.py's Linear and activation row (4096 x 512) with both bodies 1.41x, the backward the op
# 1.12x, both the ops 1.00x (its MLP row 1.15x, 1.11x, 1.03x). Below it the ops' Python (about 130 us a
# forward + backward there) costs more than the bodies' arithmetic.
CPU_BODY_MAX_ELEMENTS = 2**15


def _body_here(t: torch.Tensor) -> bool:
    """Whether an activation op on tensors like t runs as its body in a compiled graph: not float64 (its
    backward's Newton inversion reads values, invact.activation._float64); on CPU only below
    CPU_BODY_MAX_ELEMENTS (a symbolic size, under dynamic shapes, takes the body: no guard on it)."""
    if t.dtype == torch.float64:
        return False
    n = t.numel()
    return t.device.type != "cpu" or not isinstance(n, int) or n < CPU_BODY_MAX_ELEMENTS


trace_as("invact::forward", _forward_traced, when=lambda x, *_: x.dtype == torch.float64 or _body_here(x))
trace_as("invact::backward", _backward_traced, when=lambda dy, y, *_: _body_here(y))


def _save(ctx, y, bits, activation, precision_bit):
    ctx.activation, ctx.precision_bit = activation, precision_bit
    if bits.numel():
        ctx.save_for_backward(y, bits)
    else:  # precision-bit mode, a monotone activation or an empty input: nothing beyond y
        ctx.save_for_backward(y)


def _saved(ctx):
    y, *rest = ctx.saved_tensors
    return y, rest[0] if rest else y.new_empty(0, dtype=torch.uint8)  # no bits were saved


def _setup_context(ctx, inputs, output):
    _, activation, precision_bit = inputs
    ctx.mark_non_differentiable(output[1])
    # No zero gradient is built for the bits (an output nobody differentiates): by default autograd
    # fills one, a ceil(n/8)-byte tensor and a kernel launch per backward.
    ctx.set_materialize_grads(False)
    _save(ctx, *output, activation, precision_bit)


def _autograd_backward(ctx, dy, _dbits):
    if dy is None:  # y's gradient is zero (grads are not materialized: _setup_context)
        return None, None, None
    y, bits = _saved(ctx)
    return torch.ops.invact.backward(dy, y, bits, ctx.activation, ctx.precision_bit), None, None


_forward.register_autograd(_autograd_backward, setup_context=_setup_context)


def _eager_backward(ctx, dy):
    """_Eager's backward: dx for (x, activation, precision_bit)."""
    if dy is None:  # y's gradient is zero (grads are not materialized: _setup_context)
        return None, None, None
    y, bits = _saved(ctx)
    return _eager_backward_of(ctx.activation, ctx.precision_bit, y, bits, dy)


def _eager_backward_of(activation: str, precision_bit: bool, y, bits, dy):
    """Both eager Functions' backward from their saved y and bits."""
    # create_graph=True: through the op, whose missing autograd formula then raises a clear error
    # if anyone differentiates again (q approximates f'; nothing approximates f'').
    if torch._C._functorch.maybe_current_level() is not None:  # inside torch.func.grad/vjp/vmap
        # Its tensors are wrappers without storage, which neither the op nor the kernels take: the
        # portable backward, in torch ops, runs on them.
        act = ACTIVATIONS[activation]
        dx = _portable.backward(act, flat(y), bits, flat(like(dy, y)), precision_bit)
        return shaped_like(dx, y), None, None
    if y.is_meta and not torch.is_grad_enabled():
        return _meta_backward(ACTIVATIONS[activation], precision_bit, y, bits, dy), None, None
    backward = torch.ops.invact.backward if torch.is_grad_enabled() else _backward_impl
    return backward(dy, y, bits, activation, precision_bit), None, None


def _meta_backward(act: Activation, precision_bit: bool, y, bits, dy) -> torch.Tensor:
    """dx on the meta device (shapes only: `invact plan`), allocating what the backward on the device
    type the plan is for allocates (invact._meta): on a CPU the numba backend's (its fp32 blocks,
    where y or dy is not fp32) or the portable one's, in its own torch ops; elsewhere, and in float64
    (whose Newton iterations read values), the op's fake kernel: dx alone, as Triton's kernels write it."""
    if stands_for() == "cpu" and y.dtype != torch.float64:
        backward = _numba.backward_any if _numba.available() else _portable.backward
        dx = backward(act, flat(y), bits, flat(like(dy, y)), precision_bit)
        return shaped_like(dx.view(-1), y)
    return torch.ops.invact.backward(dy, y, bits, act.name, precision_bit)


def direct_backward(function: type) -> type:
    """Has the autograd engine call `function.backward(ctx, *grads)` straight, a decorator for the eager
    Functions of each op kind (_EagerPlain, invact.mlp's, invact.norm's, invact.loss's). The engine
    calls the `apply` of the Function's node class (function._backward_cls, made by torch's
    FunctionMeta); torch's BackwardCFunction.apply first looks up backward, vjp and boxed_grads_call on
    the Function class and then calls backward (about 2.5 us of every backward of a tiny Llama's eager
    step on an Intel Xeon, one per Function). For a Function that defines backward alone (no vjp, no
    boxed grads); where torch's node class no longer has that apply, it is left as it is."""
    node = function._backward_cls
    if function.vjp is not torch.autograd.Function.vjp or getattr(function, "boxed_grads_call", False):
        raise TypeError(f"{function.__name__}: direct_backward takes a Function with backward alone")
    if node.apply is torch.autograd.function.BackwardCFunction.apply:
        node.apply = function.backward
    return function


class _Eager(torch.autograd.Function):
    """The same forward, saved state and backward as the custom op, without the op's dispatch: in
    eager mode that costs a host-side latency before the first kernel is queued (measured on a 2-core
    AMD EPYC: 60 us for invact::forward against 29 us for its body). torch.compile traces the op.
    Written in the torch.func style (setup_context, a vmap rule), so torch.func.grad, vjp, jacrev and
    vmap work; under them a second derivative is the derivative of q (f'' to the family's accuracy
    away from the cusp), while eager double backward raises."""

    @staticmethod
    def forward(x, activation, precision_bit):
        return _forward_impl(x, activation, precision_bit)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _setup_context(ctx, inputs, output)

    @staticmethod
    def backward(ctx, dy, _dbits):
        return _eager_backward(ctx, dy)

    @staticmethod
    def jvp(ctx, *tangents):
        raise NotImplementedError(
            "invact: forward-mode AD (torch.func.jvp, jacfwd, hessian) is not supported; reverse mode "
            "(grad, vjp, jacrev, vmap of those) is. Use torch's activation where you need forward mode."
        )

    @staticmethod
    def vmap(info, in_dims, x, activation, precision_bit):
        # Pointwise: the batch is one bigger tensor. The bits it saved for itself are packed across
        # samples, so each sample's backward gets its own bytes: the same bits, packed per row.
        x = x.movedim(in_dims[0], 0).contiguous()  # each sample's elements in one row, in order
        y, bits = _Eager.apply(x, activation, precision_bit)
        if not bits.numel():
            return (y, bits), (0, None)
        left = _bits.is_left(x.reshape(x.shape[0], -1), ACTIVATIONS[activation].threshold)
        left = torch.cat([left, left.new_zeros(left.shape[0], (-left.shape[1]) % 8)], dim=1)
        return (y, _bits.pack(left.reshape(-1)).view(x.shape[0], -1)), (0, 0)


@direct_backward
class _EagerPlain(torch.autograd.Function):
    """_Eager in the older style (forward takes ctx), for calls outside torch.func transforms: the same
    body, saved state and backward, with less host time per call. A Function that defines
    setup_context binds its arguments with inspect.signature on every apply (measured on a 2-core AMD
    EPYC with stand-in kernels: apply 32.5 us against 8.5 us, forward + backward 80 us against 49 us;
    on a GPU the host's time per call is what a small layer waits for). Its one output is y: the bits
    are saved for backward without being an output (no second output for autograd to wrap and mark
    non-differentiable), and the backends for forward and backward are chosen once, in forward."""

    @staticmethod
    def forward(ctx, x, activation, precision_bit):
        act = ACTIVATIONS[activation]
        forward, backward = _eager_backends(x)
        y, bits = forward.forward(act, x, precision_bit)
        # No zero gradient is built for a y nobody differentiates (see _setup_context).
        ctx.set_materialize_grads(False)
        ctx.act, ctx.precision_bit, ctx.backend = act, precision_bit, backward
        if bits.numel():
            ctx.save_for_backward(y, bits)
        else:  # precision-bit mode, a monotone activation or an empty input: nothing beyond y
            ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, dy):
        if dy is None:  # y's gradient is zero (grads are not materialized)
            return None, None, None
        saved = ctx.saved_tensors
        y = saved[0]
        bits = saved[1] if len(saved) == 2 else y.new_empty(0, dtype=torch.uint8)  # no bits were saved
        return plain_dx(ctx.act, ctx.precision_bit, ctx.backend, y, bits, dy), None, None


def plain_dx(act: Activation, precision_bit: bool, backend: ModuleType, y, bits, dy) -> torch.Tensor:
    """dx from y, the bits and dy in a backward outside torch.func transforms (_EagerPlain's, and
    invact.mlp's), `backend` chosen in the forward (_eager_backends)."""
    if _current_level() is not None or torch.is_grad_enabled() or y.is_meta:
        # inside a torch.func transform, under create_graph=True, or on the meta device: as _Eager
        return _eager_backward_of(act.name, precision_bit, y, bits, dy)[0]
    if backend is _numba and y.is_contiguous() and dy.is_contiguous():  # both flat by storage order
        return _numba.backward(act, y, bits, dy, precision_bit)
    return shaped_like(backend.backward(act, flat(y), bits, flat(like(dy, y)), precision_bit), y)


# _EagerPlain's apply without autograd.Function.apply's Python layer (which, for a Function without
# setup_context and outside torch.func transforms, only unwraps dead torch.func wrappers: invact() takes
# that layer where x is one).
_apply_plain = super(torch.autograd.Function, _EagerPlain).apply


def _functorch_wrapped(x: torch.Tensor) -> bool:
    """x is a torch.func transform's tensor (vmap's batched or grad's tracking tensor): its own
    requires_grad says nothing about whether an outer transform differentiates through it."""
    return torch._C._functorch.is_functorch_wrapped_tensor(x)


_is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
_current_level = torch._C._functorch.maybe_current_level


def invact(x: torch.Tensor, activation: str, mode: str = "bits") -> torch.Tensor:
    """y = f(x), saving y and the branch bits for backward. `mode`: "bits" or "precision_bit"."""
    # The common case first, in one condition: eager, recording, bits mode or a precision-bit dtype.
    if (
        torch.is_grad_enabled()
        and x.requires_grad
        and (mode == "bits" or (mode == "precision_bit" and _bits.supports_precision_bit(x.dtype)))
        and x.is_floating_point()
        and not torch.compiler.is_compiling()
        and not _transforms_active()
        and not _is_wrapped(x)  # a dead torch.func wrapper: autograd.Function.apply unwraps it
    ):
        return _apply_plain(x, activation, mode == "precision_bit")
    check_mode(mode)
    act = ACTIVATIONS[activation]
    precision_bit = mode == "precision_bit"
    if not x.is_floating_point():
        return act.torch_forward(x)  # raises torch's own error for integer input
    if precision_bit and not (_bits.supports_precision_bit(x.dtype) or x.dtype == torch.float64):
        raise TypeError(f"precision_bit mode supports float32, float16 and bfloat16, not {x.dtype}")
    if torch.compiler.is_compiling() and not traces_custom_ops():
        # torch's op (the right gradient, no saving) under torch.func's grad or vmap, where torch 2.13
        # cannot differentiate a custom op's registered autograd (nor an autograd.Function: dynamo
        # rewrites it without setup_context; pytorch/pytorch#170834, #174067), and under a memory
        # budget, which may recompute torch's op (invact._budget). Tested before x.requires_grad:
        # _functorch_wrapped cannot be traced.
        return act.torch_forward(x)
    if not (torch.is_grad_enabled() and (x.requires_grad or _functorch_wrapped(x))):
        return act.torch_forward(x)  # nothing to save: torch's op as is
    if torch.compiler.is_compiling():
        # A strided x is a chunk of a fused gate_up output (Phi-3, the MoE experts): u keeps that
        # storage saved, g with it, so the partitioner recomputes act(g) from g for free, where the op
        # would add y and its bits (eager's gated path moves them; under compile it stands aside).
        # Measured by benchmarks/memory.py (fp32, CPU, share of eager's saved bytes): with the op here,
        # Phi-3, Mixtral, Qwen2-MoE and Qwen3-MoE under compile + patch() held 2.7-10.4 points more
        # than under compile alone; with torch's activation 5.0-9.0 points less.
        if not x.is_contiguous():
            return act.torch_forward(x)
        return torch.ops.invact.forward(x, activation, precision_bit)[0]
    if not _transforms_active():
        return _EagerPlain.apply(x, activation, precision_bit)
    if _functorch_wrapped(x):  # storage order is logical order: the transforms' tensors flatten plainly
        x = x.contiguous()
    return _Eager.apply(x, activation, precision_bit)[0]
