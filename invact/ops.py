"""The InvAct operator: op registration and backend choice. torch.library custom ops
`invact::forward` / `invact::backward` with fake implementations (torch.compile traces them without
graph breaks) and autograd, and the eager autograd.Function that runs the same bodies.

Saved for backward: y (the output: the next layer saves the same storage) and ceil(n/8) bytes of
bits, or nothing extra in precision-bit mode or for a monotone activation. Backends, one signature
(invact/_portable.py): Triton (invact/_triton.py) for CUDA tensors, numba (invact/_numba.py) for CPU
tensors when installed, the portable torch ops elsewhere; INVACT_BACKEND=torch|triton overrides.
float64 takes the float64 backward (invact/_float64.py: inversion in float64), so gradcheck holds.
"""

from __future__ import annotations

import os
from types import ModuleType

import torch

from invact import _bits, _float64, _numba, _portable
from invact._layout import flat, like, shaped_like
from invact.activations import ACTIVATIONS, Activation

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
        from invact import _triton

        return _triton
    return _numba if t.device.type == "cpu" and _numba.available() else _portable


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
    """Both eager Functions' backward: dx for (x, activation, precision_bit)."""
    if dy is None:  # y's gradient is zero (grads are not materialized: _setup_context)
        return None, None, None
    y, bits = _saved(ctx)
    # create_graph=True: through the op, whose missing autograd formula then raises a clear error
    # if anyone differentiates again (q approximates f'; nothing approximates f'').
    if torch._C._functorch.maybe_current_level() is not None:  # inside torch.func.grad/vjp/vmap
        # Its tensors are wrappers without storage, which neither the op nor the kernels take: the
        # portable backward, in torch ops, runs on them.
        act = ACTIVATIONS[ctx.activation]
        dx = _portable.backward(act, flat(y), bits, flat(like(dy, y)), ctx.precision_bit)
        return shaped_like(dx, y), None, None
    # On the meta device (shapes only: `invact plan`) the op's fake kernel gives dx: the float64
    # backward's Newton iterations read values, which meta tensors have none of.
    backward = torch.ops.invact.backward if torch.is_grad_enabled() or y.is_meta else _backward_impl
    return backward(dy, y, bits, ctx.activation, ctx.precision_bit), None, None


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


class _EagerPlain(torch.autograd.Function):
    """_Eager in the older style (forward takes ctx), for calls outside torch.func transforms: the same
    body, saved state and backward, with less host time per call. A Function that defines
    setup_context binds its arguments with inspect.signature on every apply (measured on a 2-core AMD
    EPYC with stand-in kernels: apply 32.5 us against 8.5 us, forward + backward 80 us against 49 us;
    on a GPU the host's time per call is what a small layer waits for)."""

    @staticmethod
    def forward(ctx, x, activation, precision_bit):
        output = _forward_impl(x, activation, precision_bit)
        _setup_context(ctx, (x, activation, precision_bit), output)
        return output

    @staticmethod
    def backward(ctx, dy, _dbits):
        return _eager_backward(ctx, dy)


def _functorch_wrapped(x: torch.Tensor) -> bool:
    """x is a torch.func transform's tensor (vmap's batched or grad's tracking tensor): its own
    requires_grad says nothing about whether an outer transform differentiates through it."""
    return torch._C._functorch.is_functorch_wrapped_tensor(x)


def invact(x: torch.Tensor, activation: str, mode: str = "bits") -> torch.Tensor:
    """y = f(x), saving y and the branch bits for backward. `mode`: "bits" or "precision_bit"."""
    check_mode(mode)
    act = ACTIVATIONS[activation]
    if not x.is_floating_point():
        return act.torch_forward(x)  # raises torch's own error for integer input
    if mode == "precision_bit" and not (_bits.supports_precision_bit(x.dtype) or x.dtype == torch.float64):
        raise TypeError(f"precision_bit mode supports float32, float16 and bfloat16, not {x.dtype}")
    if not (torch.is_grad_enabled() and (x.requires_grad or _functorch_wrapped(x))):
        return act.torch_forward(x)  # nothing to save: torch's op as is
    if torch.compiler.is_compiling():
        return torch.ops.invact.forward(x, activation, mode == "precision_bit")[0]
    if not torch._C._are_functorch_transforms_active():
        return _EagerPlain.apply(x, activation, mode == "precision_bit")[0]
    if _functorch_wrapped(x):  # storage order is logical order: the transforms' tensors flatten plainly
        x = x.contiguous()
    return _Eager.apply(x, activation, mode == "precision_bit")[0]
