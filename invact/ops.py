"""The InvAct operator: torch.library custom ops `invact::forward` / `invact::backward` with fake
implementations (torch.compile traces them without graph breaks) and autograd.

Saved for backward: y (the output: the next layer saves the same storage) and ceil(n/8) bytes of
bits, or nothing extra in precision-bit mode or for a monotone activation. Backends:
Triton for CUDA tensors, torch (with the numba kernel when installed) for CPU,
INVACT_BACKEND=torch|triton to override. float64 takes the exact path (inversion in float64), so
gradcheck holds.
"""

from __future__ import annotations

import os

import torch

from invact import _bits, _cpu, _exact
from invact.activations import ACTIVATIONS, Activation

BACKENDS = ("torch", "triton")
MODES = ("bits", "precision_bit")
_EXACT_DTYPES = (torch.float64,)


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


def _is_dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: its elements fill one block of storage, in some dimension order."""
    expected = 1
    for stride, size in sorted((s, n) for s, n in zip(t.stride(), t.shape, strict=True) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A 1-D view of a dense tensor in storage order (contiguous, channels_last, any permutation)."""
    return t.view(-1) if t.is_contiguous() else t.as_strided((t.numel(),), (1,), t.storage_offset())


def _shaped_like(flat: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Inverse of _flat for a fresh buffer: `flat` seen with ref's shape and strides."""
    return flat.as_strided(ref.shape, ref.stride())


def _like(t: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """t laid out with ref's strides, so both flatten to the same element order."""
    return t if t.stride() == ref.stride() else torch.empty_like(ref, dtype=t.dtype).copy_(t)


def _is_left(x_flat: torch.Tensor, threshold: float) -> torch.Tensor:
    """The bit: x < T, compared in fp32 for half types (as the Triton kernels do), else in x's dtype."""
    xs = x_flat if x_flat.dtype in (torch.float32, torch.float64) else x_flat.float()
    return xs < threshold


def _saves_bits(act: Activation, x: torch.Tensor, precision_bit: bool) -> bool:
    """Packed bits are stored unless f is monotone (no bit) or precision-bit mode hides it in y."""
    return not (act.monotone or (precision_bit and x.dtype not in _EXACT_DTYPES))


def _forward_impl(x: torch.Tensor, activation: str, precision_bit: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, bits): the body of invact::forward, also called directly by the eager path."""
    act = ACTIVATIONS[activation]
    exact = x.dtype in _EXACT_DTYPES
    if backend_for(x) == "triton" and not exact:
        from invact import _triton

        x = x if _is_dense(x) else x.contiguous()
        y = torch.empty_like(x)
        bits = _triton.forward(activation, act.threshold, _flat(x), _flat(y), precision_bit)
        return y, bits
    y = act.torch_forward(x)  # on x as given: torch's strided and contiguous paths round differently
    no_bits = x.new_empty(0, dtype=torch.uint8)
    if act.monotone:
        return y, no_bits
    x_flat = _flat(_like(x, y))
    fused = x.dtype == torch.float32 and x.device.type == "cpu" and _cpu.available()
    if precision_bit and not exact:  # y is ours: its lowest mantissa bit becomes the branch bit
        if fused:
            _cpu.set_lsb_less_(_flat(y), x_flat, act.threshold)
            return y, no_bits
        return _bits.with_lsb(y, _shaped_like(_is_left(x_flat, act.threshold), y)), no_bits
    if fused:
        return y, _cpu.pack_less(x_flat, act.threshold)
    return y, _bits.pack(_is_left(x_flat, act.threshold))


_forward = torch.library.custom_op("invact::forward", _forward_impl, mutates_args=())


@_forward.register_fake
def _(x, activation, precision_bit):
    saves = _saves_bits(ACTIVATIONS[activation], x, precision_bit)
    return torch.empty_like(x), x.new_empty(_bits.packed_size(x.numel()) if saves else 0, dtype=torch.uint8)


def _backward_impl(
    dy: torch.Tensor, y: torch.Tensor, bits: torch.Tensor, activation: str, precision_bit: bool
) -> torch.Tensor:
    """dx: the body of invact::backward, also called directly by the eager path."""
    act = ACTIVATIONS[activation]
    y_flat, dy_flat = _flat(y), _flat(_like(dy, y))
    if y.dtype in _EXACT_DTYPES:
        left = None if act.monotone else _bits.unpack(bits, y.numel())
        dx = (dy_flat * _exact.derivative_from_output(act, y_flat, left)).to(dy.dtype)
    elif backend_for(y) == "triton":
        from invact import _triton

        dx = _triton.backward(activation, y_flat, bits, dy_flat, precision_bit)
    elif _cpu.available() and y.device.type == "cpu":
        if act.monotone:
            dx = _cpu.backward(activation, y_flat, dy_flat)
        elif precision_bit:
            dx = _cpu.backward(activation, y_flat, dy_flat, flags=_bits.int_view(y_flat))
        else:
            dx = _cpu.backward(activation, y_flat, dy_flat, bits=bits)
    else:
        dx = torch_backward(act, y_flat, bits, dy_flat, precision_bit)
    return _shaped_like(dx, y)


def torch_backward(act: Activation, y, bits, dy, precision_bit: bool) -> torch.Tensor:
    """The portable backward from the generated torch functions (flat tensors, any device)."""
    y32 = y.float()
    if act.monotone:  # q itself at y = +-inf (x = +-inf, as torch); NaN stays NaN
        q = torch.where(torch.isnan(y32), torch.nan, act.generated.q_right(y32))
    else:
        left = _bits.lsb(y) if precision_bit else _bits.unpack(bits, y.numel())
        q = torch.where(left, act.generated.q_left(y32), act.generated.q_right(y32))
        q = torch.where(torch.isfinite(y32), q, torch.nan)  # x = +-inf or NaN: NaN, as torch
    return (dy.float() * q).to(dy.dtype)


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
    _save(ctx, *output, activation, precision_bit)


def _autograd_backward(ctx, dy, _dbits):
    y, bits = _saved(ctx)
    return torch.ops.invact.backward(dy, y, bits, ctx.activation, ctx.precision_bit), None, None


_forward.register_autograd(_autograd_backward, setup_context=_setup_context)


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
        y, bits = _saved(ctx)
        # create_graph=True: through the op, whose missing autograd formula then raises a clear error
        # if anyone differentiates again (q approximates f'; nothing approximates f'').
        if torch._C._functorch.maybe_current_level() is not None:  # inside torch.func.grad/vjp/vmap
            # Its tensors are wrappers without storage, which neither the op nor the kernels take: the
            # portable backward, in torch ops, runs on them.
            act = ACTIVATIONS[ctx.activation]
            dx = torch_backward(act, _flat(y), bits, _flat(_like(dy, y)), ctx.precision_bit)
            return _shaped_like(dx, y), None, None
        backward = torch.ops.invact.backward if torch.is_grad_enabled() else _backward_impl
        return backward(dy, y, bits, ctx.activation, ctx.precision_bit), None, None

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
        left = _is_left(x.reshape(x.shape[0], -1), ACTIVATIONS[activation].threshold)
        left = torch.cat([left, left.new_zeros(left.shape[0], (-left.shape[1]) % 8)], dim=1)
        return (y, _bits.pack(left.reshape(-1)).view(x.shape[0], -1)), (0, 0)


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
    if mode == "precision_bit" and not (_bits.supports_precision_bit(x.dtype) or x.dtype in _EXACT_DTYPES):
        raise TypeError(f"precision_bit mode supports float32, float16 and bfloat16, not {x.dtype}")
    if not (torch.is_grad_enabled() and (x.requires_grad or _functorch_wrapped(x))):
        return act.torch_forward(x)  # nothing to save: torch's op as is
    if torch.compiler.is_compiling():
        return torch.ops.invact.forward(x, activation, mode == "precision_bit")[0]
    if _functorch_wrapped(x):  # storage order is logical order: the transforms' tensors flatten plainly
        x = x.contiguous()
    return _Eager.apply(x, activation, mode == "precision_bit")[0]
