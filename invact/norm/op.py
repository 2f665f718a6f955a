"""Inverted normalization: an RMSNorm or LayerNorm that saves its output y (which the next Linear saves
anyway) and the per-row rstd for backward, instead of its input x.

A norm computes y = cast(h * w_eff + b) with h = (x - mean) * rstd (LayerNorm) or x * rstd (RMSNorm),
w_eff = offset + w. Its backward needs h, rstd and the parameters only, and h is one step from y:
h = (y - b) / w_eff. The variants (where the cast falls, Gemma's 1 + w, T5's cast to the weight's
dtype, torch's own ops) are data, printed from coeffs/norms.json into invact/_generated/norms.py; this
module evaluates each as the module it replaces does (the same torch ops in the same order, so y is
bitwise the module's on CPU), and `match` accepts a module only where its forward gives that y, bitwise,
on a probe.

Exactness. y is stored rounded: |fl(v) - v| <= u |v| + eta for v = h w_eff + b, with u the unit
roundoff of y's dtype (2^-8 bf16, 2^-11 fp16, 2^-24 fp32) and eta half its smallest subnormal. So the
recovered h carries
    |h_rec - h| <= u |h| + u rho_j,   rho_j = (|b_j| + eta / u) / |w_eff_j|
(plus the fp32 subtract and divide, 2 u_fp32 |h_rec|). Eager's own 16-bit h, which Hugging Face's
RMSNorm saves, carries u |h|. Where every channel has rho_j <= RHO_MAX the recovered h is within
u (|h| + RHO_MAX) of the true one and y is saved; else that call saves x, and backward computes h from
x exactly as eager does (a weight entry at or near zero, or a bias much larger than its weight). The
check is a few ops over the d weights, made again only when a parameter changes (its version counter:
the optimizer's in-place step bumps it); the first norm to find its parameters changed checks every
other norm's that changed too and reads the answers back at once (on CUDA one device sync per device
and optimizer step, where each norm read its own: InvNorm._invertible).

Where the variant multiplies by the weight in fp32 and then casts to a 16-bit y (Gemma's 1 + w, OLMo-2,
torch's RMSNorm), eager keeps the fp32 h, so its weight gradient carries no rounding of h; there the
call also keeps each element's rounding residual in 4 bits (encode_residual: n / 2 bytes), which cuts
h's error to about u |h| / 16 (without it the bf16 weight gradient's RMS error was 1.43-1.49x eager's
on 4096 x 1024 rows; with it 1.00x).

Backward from h (in fp32, or the input's dtype where that is wider): RMSNorm
dx = rstd (g - h mean(g h)) with g = dy w_eff, dw = sum over rows of dy h; LayerNorm through
torch.native_layer_norm_backward given h as its input, mean 0 and rstd 1, its dx then times rstd.
Where y is stored in the compute dtype (no residuals), the RMSNorm's terms come from y itself
(g h = dy y, dw = sum(dy y) / w_eff: _rms_backward), and the eager Function goes to these formulas
without backward's general Python (_lean): a small norm's cost is its host time.
"""

from __future__ import annotations

import re
import weakref
from typing import NamedTuple

import torch
from torch import nn

from invact._generated import norms as _spec
from invact._meta import stands_for
from invact._traced import trace_as
from invact.activation import _numba as _activation_numba
from invact.activation.ops import _backend_env_set, backend_for, direct_backward

SIXTEEN_BIT = (torch.float16, torch.bfloat16)

# rho_j above which a call saves x (see the module docstring): with rho <= 1 the recovered h is within
# u (|h| + 1) of the true h, two units of y's rounding at |h| = 1 (eager's own 16-bit h carries one;
# a normalized row has RMS 1).
RHO_MAX = 1.0


class Variant(NamedTuple):
    """One norm formula of the spec (codegen/norm_spec.py documents the fields)."""

    name: str
    center: bool
    upcast: str
    cast: str
    offset: int
    bias: bool
    eps: str


VARIANTS: dict[str, Variant] = {name: Variant(name, **fields) for name, fields in _spec.NORMS.items()}
CLASSES: dict[str, str] = dict(_spec.CLASSES)
FIND = re.compile(_spec.FIND)


def compute_dtype(v: Variant, dtype: torch.dtype) -> torch.dtype:
    """The dtype the statistics are computed in for an input of `dtype` (torch's native layer norm
    and rms_norm: its opmath type, float32 for 16-bit inputs)."""
    if v.upcast == "float32":
        return torch.float32
    return torch.float32 if dtype in SIXTEEN_BIT else dtype


def default_eps(v: Variant, dtype: torch.dtype) -> float:
    """torch's RMSNorm with eps=None: the machine epsilon of its compute dtype."""
    return torch.finfo(compute_dtype(v, dtype)).eps


def forward(x: torch.Tensor, weight, bias, eps: float, v: Variant):
    """(y, mean, rstd) as variant `v` computes them over x's last dimension: y in the dtype the module's
    own ops give, mean (None unless `v` centers) and rstd of shape (..., 1)."""
    return _forward(x, weight, bias, eps, v)[:3]


def _forward(x: torch.Tensor, weight, bias, eps: float, v: Variant):
    """forward's (y, mean, rstd), and the value y was rounded from where the variant multiplies by the
    weight in the compute dtype and then casts to a narrower one (else None)."""
    if v.upcast == "native":
        dtype = _layer_norm_dtype(x)
        if dtype != x.dtype:  # autocast runs F.layer_norm in another dtype (CUDA's: fp32)
            x, weight, bias = (None if t is None else t.to(dtype) for t in (x, weight, bias))
        return (*torch.native_layer_norm(x, (x.shape[-1],), weight, bias, eps), None)
    compute = compute_dtype(v, x.dtype)
    xf = x if x.dtype is compute else x.to(compute)  # (a call less where x is in it: host time)
    mean = xf.mean(-1, keepdim=True) if v.center else None
    if v.center:  # Cohere's LayerNorm: x - mean, formed twice by the module, the same values
        xf = xf - mean
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    h = xf * rstd  # the modules' order: x times rsqrt(variance + eps)
    if weight is None:
        return h.to(x.dtype), mean, rstd, None
    if v.cast == "before_weight":
        return weight * (h if h.dtype is x.dtype else h.to(x.dtype)), mean, rstd, None
    if v.cast == "after_weight":
        pre = h * (1.0 + weight.float()) if v.offset else weight * h
        y = pre.to(x.dtype)
        return y, mean, rstd, (pre if y.dtype != pre.dtype else None)
    # weight_dtype (T5): to the weight's dtype where that is 16-bit, then times it
    return weight * (h.to(weight.dtype) if weight.dtype in SIXTEEN_BIT else h), mean, rstd, None


_AUTOCAST_LAYER_NORM: dict[tuple, torch.dtype] = {}


def _layer_norm_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype F.layer_norm computes an input like x in: x's own, or under autocast the dtype
    autocast casts layer_norm's inputs to (torch.native_layer_norm, which the forward calls for its
    mean and rstd, has no autocast rule). Asked of F.layer_norm once per device type, autocast state
    and dtype."""
    device = x.device.type
    try:
        enabled = torch.is_autocast_enabled(device)
    except RuntimeError:  # a device type autocast does not know (meta: shapes only)
        return x.dtype
    if not enabled:
        return x.dtype
    key = (device, torch.get_autocast_dtype(device), x.dtype)
    if key not in _AUTOCAST_LAYER_NORM:
        with torch.no_grad():
            _AUTOCAST_LAYER_NORM[key] = torch.nn.functional.layer_norm(x.new_zeros(1, 2), (2,)).dtype
    return _AUTOCAST_LAYER_NORM[key]


def keeps_residual(variant: str, dtype: torch.dtype) -> bool:
    """A call of `variant` whose y is stored in `dtype` keeps y's 4-bit rounding residuals: the weight
    multiplies in the compute dtype, then y is cast to a 16-bit one."""
    v = VARIANTS[variant]
    return v.cast == "after_weight" and dtype in SIXTEEN_BIT and v.upcast != "native"


# Significant bits of the 16-bit storage dtypes (the leading bit included).
_PRECISION = {torch.bfloat16: 8, torch.float16: 11}
# Each element's rounding residual is kept in 4 bits (encode_residual): the recovered pre is within
# about 1/16 of y's ulp, so h_rec's error drops from u |h| to about u |h| / 16. fp16 keeps (pre - y) in
# sixteenths of y's ulp: |pre - y| is at most half an ulp, so codes -8..8 (8 clamped to 7).
_STEPS = 16


def _ulp(y32: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of `dtype` at each value of y (as fp32): 2^(e - precision) for y = m 2^e,
    m in [1/2, 1), and the subnormal spacing at zero and below the normal range."""
    info = torch.finfo(dtype)
    _, e = torch.frexp(y32)
    ulp = torch.ldexp(torch.ones_like(y32), e - _PRECISION[dtype])
    return torch.where(y32 == 0, info.smallest_normal * info.eps, ulp).clamp_min(
        info.smallest_normal * info.eps
    )


def _bf16_bits(y: torch.Tensor) -> torch.Tensor:
    """The fp32 bit patterns (int32) of a bf16 tensor's values."""
    return y.view(torch.int16).to(torch.int32) << 16


def encode_residual(pre: torch.Tensor, y: torch.Tensor, kernels: bool = True) -> torch.Tensor:
    """The 4-bit rounding residuals of y = pre.to(16-bit), two per byte (element 2i in the low nibble
    of byte i): ceil(n / 2) bytes. `kernels` False: torch ops only (a compiled graph's body)."""
    if (
        kernels
        and y.dtype == torch.bfloat16
        and y.is_cpu
        and pre.dtype == torch.float32
        and _numba_available()
    ):
        from invact.norm import _cpu as _norm_cpu

        return _norm_cpu.encode_bf16(pre.contiguous(), y.contiguous())  # the same bytes in one pass
    if y.dtype == torch.bfloat16:
        # bf16 is fp32's top 16 bits rounded: pre's pattern minus y's, d in [-2^15, 2^15] units of
        # fp32's last bit (patterns order like magnitudes, and pre and y share a sign), in 16 steps
        d = pre.view(torch.int32) - _bf16_bits(y)
        code = ((d + 0x8000) >> 12).clamp_(max=15).flatten()
    else:
        y32 = y.float()
        code = ((pre - y32) / _ulp(y32, y.dtype) * _STEPS).round_().clamp_(-8, 7).add_(8)
        code = code.to(torch.int32).flatten()
    if code.numel() % 2:
        code = torch.cat([code, code.new_zeros(1)])
    # the codes stay int32 until packed: in a compiled graph's body a byte per code would be a tensor
    # half again the packed one's size that the partitioner may keep instead (measured: Gemma's norms in
    # bf16 kept n bytes each where eager keeps n / 2)
    return (code[0::2] | (code[1::2] << 4)).to(torch.uint8)


def decode_residual(y: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """pre recovered from y and its residuals (encode_residual), as fp32 of y's shape, within 1/32 of
    y's ulp (bf16: the middle of pre's 2^12-unit step; fp16: + 1/16 at the clamp)."""
    # each byte's two nibbles by a broadcast shift, not a stack: in a compiled graph's body a stack (a
    # cat, which the partitioner does not recompute) was moved into the forward and its n bytes saved
    # in place of the n / 2 packed ones (Gemma's norms in bf16)
    nibbles = torch.tensor([0, 4], dtype=torch.uint8, device=packed.device)
    code = ((packed.unsqueeze(-1) >> nibbles) & 15).flatten()[: y.numel()].view(y.shape)
    if y.dtype == torch.bfloat16:  # y's pattern - 2^15 + the step's middle
        return (_bf16_bits(y) + (code.to(torch.int32) << 12) - 0x7800).view(torch.float32)
    y32 = y.float()
    return y32 + (code.float() - 8) / _STEPS * _ulp(y32, y.dtype)


def invertible(weight, bias, v: Variant, dtype: torch.dtype) -> bool:
    """h can be recovered from a y stored in `dtype` within u (|h| + RHO_MAX) (module docstring)."""
    failing = _failing(weight, bias, v, dtype)
    return not (failing if isinstance(failing, bool) else bool(failing))


def _failing_of(module: nn.Module, dtype: torch.dtype) -> bool | torch.Tensor:
    """_failing() of an InvNorm's parameters as they are now, for y in `dtype`."""
    params = module._parameters
    return _failing(params.get("weight"), params.get("bias"), VARIANTS[module._invact_variant], dtype)


def _read_back(failing: list) -> list[bool]:
    """Each of `failing` (_failing's bools and 0-d bool tensors) as a bool: the tensors stacked and read
    back once per device (on CUDA one device sync for all of them)."""
    answers = [f if isinstance(f, bool) else None for f in failing]
    by_device: dict = {}
    for i, f in enumerate(failing):
        if answers[i] is None:
            by_device.setdefault(f.device, []).append(i)
    for indices in by_device.values():
        values = (
            torch.stack([failing[i] for i in indices]).tolist()
            if len(indices) > 1
            else [bool(failing[indices[0]])]
        )
        for i, value in zip(indices, values, strict=True):
            answers[i] = value
    return answers


def _failing(weight, bias, v: Variant, dtype: torch.dtype) -> bool | torch.Tensor:
    """not invertible(...), as a 0-d bool tensor on the weight's device (not read back), or a bool where
    no weight has values to check."""
    if weight is None:
        return False  # y = h (+ b): nothing to divide by
    if weight.is_meta:  # shapes only (invact plan): as for parameters as initialized
        return False
    if hasattr(weight, "full_tensor"):  # a DTensor (FSDP2's sharded parameter): every rank checks all
        weight, bias = weight.full_tensor(), None if bias is None else bias.full_tensor()
    info = torch.finfo(dtype)
    u = info.eps / 2
    eta = info.smallest_normal * info.eps / 2  # half the smallest subnormal
    with torch.no_grad():
        w_eff = weight.float().abs() if not v.offset else (weight.float() + v.offset).abs()
        top = bias.float().abs() + eta / u if bias is not None else torch.full_like(w_eff, eta / u)
        # not (top > RHO_MAX w_eff): a NaN weight saves x too
        return ((top > RHO_MAX * w_eff) | w_eff.isnan()).any()


# Below this many elements the CPU backward runs the torch formula, not numba's one-pass kernel, whose
# dispatch and array conversions then cost more than the pass saves. Measured on an Intel Xeon (AVX-512),
# 1 thread, forward's y kept, rms and layer variants in fp32 and bf16: at 64 elements numba 48-60 us
# against the formula's 27-42; at 2^14 60-89 against 39-64; at 2^15 mixed (63-102 against 57-90); at
# 2^16 numba ahead on every variant (83-131 against 123-247).
NUMBA_MIN_ELEMENTS = 2**14


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def _triton_backend(t: torch.Tensor) -> bool:
    """The activations' rule (invact.activation.ops.backend_for): Triton for CUDA tensors, or
    INVACT_BACKEND."""
    return backend_for(t) == "triton"


def _numba_available() -> bool:
    return _activation_numba.available()


def backward(dy, kept, mean, rstd, weight, bias, v: Variant, from_x: bool, needs: tuple[bool, bool, bool],
             residual=None, kernels: bool = True):  # fmt: skip
    """(dx, dweight, dbias) from what the forward kept: y (from_x False) or x, and the statistics;
    `residual`: y's packed rounding residuals (encode_residual), where the forward kept them;
    `kernels` False: torch ops only, no Triton or numba kernel (a compiled graph's body)."""
    cd = compute_dtype(v, kept.dtype)
    rstd_c = _rows(rstd.to(cd))
    w_eff = _w_eff(weight, v, cd)
    fused = kernels and (
        _triton_backend(kept)
        or (kept.is_cpu and kept.numel() >= NUMBA_MIN_ELEMENTS and _numba_available())
        or _kernel_planned(kept)
    )
    if not from_x and cd == torch.float32 and fused:
        dx, dw, db = _fused_backward(dy, kept, residual, weight, bias, w_eff, rstd_c, v)
        return _cast_grads(dx if needs[0] else None, dw if needs[1] else None, db, dy, weight, bias, needs)
    if not from_x and residual is None and kept.dtype == cd and (bias is None or v.center):
        # the eager Function's (_lean)
        return _lean_backward(dy, kept, rstd, weight, bias, v, cd, needs, kernels)
    if from_x:  # exactly eager's h
        xc = _rows(kept.to(cd))
        h = (xc - _rows(mean.to(cd))) * rstd_c if v.center else xc * rstd_c
    else:  # h = (y - b) / w_eff, in the compute dtype (see the module docstring for its error)
        h = _rows(kept.to(cd) if residual is None else decode_residual(kept, residual))
        if bias is not None:
            h = h - bias.to(cd)
        if w_eff is not None:
            h = h / w_eff
    g_out = _rows(dy.to(cd))
    if v.center:
        b = None if bias is None else bias.to(cd)  # its values are not read: its gradient is sum(dy)
        dx, dw, db = _layer_grads(g_out, h, rstd_c, w_eff, b, needs)
    else:
        g = g_out if w_eff is None else g_out * w_eff
        dx = rstd_c * (g - h * (g * h).mean(-1, keepdim=True)) if needs[0] else None
        dw = (g_out * h).sum(0) if needs[1] and weight is not None else None
        db = None
    return _cast_grads(dx, dw, db, dy, weight, bias, needs)


def _kernel_planned(kept: torch.Tensor) -> bool:
    """A meta tensor standing for a device whose backward runs a one-pass kernel (invact plan): Triton's
    on CUDA (whether or not triton is installed here: the plan is the kernel's bytes), numba's on a CPU
    where it is installed and the rows hold as many elements as its rule takes."""
    if not kept.is_meta:
        return False
    device = stands_for()
    return device == "cuda" or (device == "cpu" and kept.numel() >= NUMBA_MIN_ELEMENTS and _numba_available())


def _fused_meta(dy, kept, residual):
    """_fused_backward's outputs on the meta device, as each kernel allocates them: Triton's dx in dy's
    dtype, its per-program partial sums (fp32, ROWS_PER_PROGRAM = 8 rows a program) and their two sums;
    numba's dx in dy's dtype where that is bf16 (else fp32) and its sums in fp64. A residual of another
    dtype than bf16 is decoded into y first, as on the device."""
    y = _rows(kept if residual is None or kept.dtype == torch.bfloat16 else decode_residual(kept, residual))
    rows, d = y.shape
    g = _rows(dy)
    if stands_for() == "cuda":
        dx = torch.empty_like(g)
        sums = torch.empty(-(-rows // 8), 2, d, dtype=torch.float32, device=dy.device).sum(0)
        return dx, sums[0].clone(), sums[1].clone()
    dtype = dy.dtype if dy.dtype == torch.bfloat16 else torch.float32
    dx = torch.empty(rows, d, dtype=dtype, device=dy.device)
    sums = torch.empty(2, d, dtype=torch.float64, device=dy.device)
    return dx, sums[0].clone(), sums[1].clone()


def _fused_backward(dy, kept, residual, weight, bias, w_eff, rstd_c, v: Variant):
    """backward's one-pass kernels on y: Triton (CUDA, or INVACT_BACKEND=triton), which decodes bf16
    residuals itself, else numba on CPU; on the meta device their outputs (_fused_meta). (dx, sum of
    dy h, sum of dy) over rows."""
    if kept.is_meta:
        return _fused_meta(dy, kept, residual)
    if _triton_backend(kept):
        from invact.norm import _triton as _norm_triton

        packed = residual if residual is not None and kept.dtype == torch.bfloat16 else None
        y = _rows(kept if residual is None or packed is not None else decode_residual(kept, residual))
        return _norm_triton.backward(y, packed, _rows(dy), weight, bias, rstd_c, v.center, v.offset)
    from invact.norm import _cpu as _norm_cpu

    if residual is not None and kept.dtype == torch.bfloat16:  # decoded in the kernel's pass
        return _norm_cpu.backward(_rows(kept), _rows(dy), w_eff, bias, rstd_c, v.center, residual)
    y = _rows(kept if residual is None else decode_residual(kept, residual))
    return _norm_cpu.backward(y, _rows(dy), w_eff, bias, rstd_c, v.center)


def _cast_grads(dx, dw, db, dy, weight, bias, needs):
    """(dx in dy's shape, dweight and dbias in their parameters' dtypes), None where not needed or
    where the module has no such parameter."""
    dx = None if dx is None else dx.reshape(dy.shape)
    dw = None if dw is None or weight is None else dw.to(weight.dtype)
    db = None if db is None or bias is None or not needs[2] else db.to(bias.dtype)
    return dx, dw, db


def _w_eff(weight, v: Variant, dtype: torch.dtype):
    """The effective weight offset + w in `dtype` (None without a weight)."""
    if weight is None:
        return None
    w = weight if weight.dtype == dtype else weight.to(dtype)
    return w + v.offset if v.offset else w


def _layer_grads(g_out, h, rstd, w_eff, b, needs):
    """A LayerNorm's (dx, dweight, dbias) in h's dtype from h (rows, d), through
    native_layer_norm_backward given h as its input, mean 0 and rstd 1, its dx then times rstd (rows,
    1); `b` only says whether there is a bias (its gradient is the sum of g_out)."""
    zeros = h.new_zeros(h.shape[0], 1)
    mask = [needs[0], needs[1] and w_eff is not None, needs[2] and b is not None]
    dx, dw, db = torch.ops.aten.native_layer_norm_backward(
        g_out, h, [h.shape[-1]], zeros, torch.ones_like(zeros), w_eff, b, mask
    )
    return None if dx is None else dx * rstd, dw, db


def _lean(y: torch.Tensor, weight, bias, v: Variant, pre) -> bool:
    """backward from y can take _lean_backward: y is stored in its compute dtype (fp32 or fp64: nothing
    rounded between h w_eff + b and y, so no residuals), on CPU below the one-pass kernel's size
    (backward's `fused` rule); an RMSNorm without a bias (_rms_backward) or any LayerNorm."""
    return (
        y.is_cpu
        and pre is None
        and (bias is None or v.center)
        and y.dtype is compute_dtype(v, y.dtype)
        and y.numel() < NUMBA_MIN_ELEMENTS
        and not _backend_env_set()
    )


def _lean_backward(dy, y, rstd, weight, bias, v: Variant, x_dtype, needs, kernels: bool = True):
    """(dx, dweight, dbias) where the forward's _lean holds: _rms_backward, or for a LayerNorm
    backward's own formula (h = (y - b) / w_eff through native_layer_norm_backward with mean 0 and
    rstd 1, its dx times rstd) with less Python: a small norm's cost is its host time."""
    if not v.center:
        return (*_rms_backward(dy, y, rstd, weight, v, x_dtype, needs, kernels), None)
    if kernels and _small(dy, y, rstd, weight, bias):
        return _small_backward(dy, y, rstd, weight, bias, v, x_dtype, needs)
    d = y.shape[-1]
    h, dy2 = y.reshape(-1, d), dy.reshape(-1, d)
    if dy2.dtype != h.dtype:
        dy2 = dy2.to(h.dtype)
    b = None if bias is None else (bias if bias.dtype == h.dtype else bias.to(h.dtype))
    w_eff = _w_eff(weight, v, h.dtype)
    if b is not None:
        h = h - b
    if w_eff is not None:
        h = h / w_eff
    dx, dw, db = _layer_grads(dy2, h, rstd.reshape(-1, 1), w_eff, b, needs)
    if dx is not None:
        dx = dx.view_as(dy)  # (view(dy.shape) parses a torch.Size: 2.4 us against 0.7)
        if dx.dtype != x_dtype:
            dx = dx.to(x_dtype)
    if dw is not None and dw.dtype != weight.dtype:
        dw = dw.to(weight.dtype)
    if db is not None and db.dtype != bias.dtype:
        db = db.to(bias.dtype)
    return dx, dw, db


_PLAIN = (torch.Tensor, nn.Parameter)  # not a subclass of either (a fake or functional tensor, DTensor)


def _serial_vector(t, d: int) -> bool:
    """None, or what the small serial backward may read d floats from by address: a plain,
    contiguous fp32 CPU tensor of d elements (a weight or a bias)."""
    return t is None or (
        type(t) in _PLAIN and t.is_cpu and t.dtype is torch.float32 and t.numel() == d and t.is_contiguous()
    )


def _small(dy, y, rstd, weight, bias) -> bool:
    """invact.norm._cpu.backward_small serves a lean backward of these tensors (_lean holds): all fp32
    and contiguous, of the sizes the kernel reads at their addresses, and numba installed."""
    d = y.shape[-1]
    return (
        # plain CPU tensors (the kernel reads and writes their addresses): not meta, CUDA, a tensor
        # subclass (fake, functional) or a torch.func wrapper
        type(y) is torch.Tensor
        and type(dy) is torch.Tensor
        and type(rstd) is torch.Tensor
        and y.is_cpu
        and dy.is_cpu
        and rstd.is_cpu
        and not (_is_wrapped(y) or _is_wrapped(dy))
        and y.dtype is torch.float32
        and dy.dtype is torch.float32
        and rstd.dtype is torch.float32
        and _serial_vector(weight, d)
        and _serial_vector(bias, d)
        and y.is_contiguous()
        and dy.is_contiguous()
        and rstd.is_contiguous()
        and dy.numel() == y.numel()
        and rstd.numel() * d == y.numel()
        and _numba_available()
    )


def _small_backward(dy, y, rstd, weight, bias, v: Variant, x_dtype, needs):
    """(dx, dweight, dbias) by invact.norm._cpu.backward_small, where _small holds: one numba pass on
    this thread, where the torch formulas take seven ops or more (their host time is a small norm's
    whole cost: 42 -> 8 us a call for an RMSNorm's (16, 64) rows on an Intel Xeon, 1 thread)."""
    global _SMALL
    if _SMALL is None:
        from invact.norm import _cpu as _norm_cpu

        _SMALL = _norm_cpu.backward_small
    want_w, want_b = needs[1] and weight is not None, len(needs) > 2 and needs[2] and bias is not None
    dx, dw, db = _SMALL(dy, y, rstd, weight, bias, float(v.offset), v.center, want_w, want_b)
    return (dx if dx.dtype is x_dtype else dx.to(x_dtype)) if needs[0] else None, dw, db


_SMALL = None


def _rms_backward(dy, y, rstd, weight, v: Variant, x_dtype, needs, kernels: bool = True):
    """(dx, dweight) of an RMSNorm from its output y = h w_eff in y's dtype (the forward's _lean): with
    g = dy w_eff, g h = dy y, so dx = rstd (g - h mean(dy y)) and dweight = sum over rows of dy y,
    over w_eff: seven ops, where backward's general formula takes nine, on y's own shape (no reshapes)
    and with little Python (a small norm's cost is its host time). Each term is the general formula's
    up to the order of its roundings (a product and a quotient by w_eff, in y's dtype). Without a
    weight, h = y and g = dy. rstd: one per row, as (rows, 1) or y's shape with a last dimension of 1."""
    if dy.dtype is not y.dtype:
        dy = dy.to(y.dtype)
    if kernels and _small(dy, y, rstd, weight, None):
        return _small_backward(dy, y, rstd, weight, None, v, x_dtype, needs)[:2]
    w_eff = _w_eff(weight, v, y.dtype)
    p = dy * y
    dx = dw = None
    if needs[0]:
        m = p.mean(-1, keepdim=True)
        g, h = (dy, y) if w_eff is None else (dy * w_eff, y / w_eff)
        dx = torch.addcmul(g, h, m, value=-1).mul_(rstd if rstd.dim() == m.dim() else rstd.view_as(m))
        if dx.dtype is not x_dtype:
            dx = dx.to(x_dtype)
    if needs[1] and weight is not None:
        dw = (p if p.dim() == 2 else p.reshape(-1, p.shape[-1])).sum(0).div_(w_eff)
        if dw.dtype != weight.dtype:
            dw = dw.to(weight.dtype)
    return dx, dw


@direct_backward
class _Norm(torch.autograd.Function):
    """y = the variant's norm of x; saves y (or x where `check` says h cannot be recovered from y),
    rstd (and mean when x is kept) and the parameters, which the module holds anyway."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, v, check):
        y, mean, rstd, pre = _forward(x, weight, bias, eps, v)
        ctx.set_materialize_grads(False)
        ctx.v, ctx.x_dtype = v, x.dtype
        ctx.from_x = from_x = not check(y.dtype)
        ctx.lean = not from_x and _lean(y, weight, bias, v, pre)
        if from_x:
            ctx.save_for_backward(x, mean, rstd, weight, bias, None)
        else:  # where y was rounded from an fp32 product, its residuals too (their docstring says why)
            ctx.save_for_backward(
                y, None, rstd, weight, bias, None if pre is None else encode_residual(pre, y)
            )
        return y

    @staticmethod
    def backward(ctx, dy):
        if dy is None:
            return None, None, None, None, None, None
        if torch.is_grad_enabled():  # create_graph=True: differentiable once (a second raises)
            return _norm_backward_once(ctx, dy)
        if ctx.lean and not ctx.v.center:  # _norm_backward's first case, a call less (host time)
            y, _, rstd, weight, _, _ = ctx.saved_tensors
            dx, dw = _rms_backward(dy, y, rstd, weight, ctx.v, ctx.x_dtype, ctx.needs_input_grad)
            return dx, dw, None, None, None, None
        return _norm_backward(ctx, dy)


def _norm_backward(ctx, dy):
    """_Norm's backward."""
    kept, mean, rstd, weight, bias, residual = ctx.saved_tensors
    needs = ctx.needs_input_grad
    if ctx.lean:
        return (*_lean_backward(dy, kept, rstd, weight, bias, ctx.v, ctx.x_dtype, needs), None, None, None)
    dx, dw, db = backward(dy, kept, mean, rstd, weight, bias, ctx.v, ctx.from_x, needs[:3], residual)
    if dx is not None:
        dx = dx.to(ctx.x_dtype)
    return dx, dw, db, None, None, None


_norm_backward_once = torch.autograd.function.once_differentiable(_norm_backward)


# _Norm's apply without autograd.Function.apply's Python layer (see invact.activation.ops._apply_plain)
_apply_norm = super(torch.autograd.Function, _Norm).apply
_is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


# torch.compile traces the norm as two custom ops (opaque to the partitioner, which then keeps what
# the forward op returns for backward: y, rstd, the residuals, and x only where h cannot be recovered).
# Whether x is kept is decided when the call is traced, not in the op: an output whose size the op
# decides at run time is a data-dependent shape, a graph break per norm without dynamo's
# capture_dynamic_output_shape_ops. The module's `_invact_keep_x` (the dtypes for which its parameters
# fail the check, set by the eager check and by the op) is read while tracing, and dynamo guards on it:
# where it changes, the call is traced again. The op checks the parameters at run time too (on CUDA
# one bool read back, only where a parameter changed: InvNorm._invertible's cache); a call traced
# without x whose parameters have become non-invertible since (an optimizer step) keeps its x aside,
# for its own backward alone (_SET_ASIDE), and marks its module, so the next call is traced keeping x.
_MODULES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # id -> InvNorm, for the op
_SET_ASIDE = torch.utils.weak.WeakTensorKeyDictionary()  # a call's rstd -> its x (see above)


def _known(module: nn.Module) -> None:
    """Let the op find `module` by id (see _MODULES)."""
    _MODULES[id(module)] = module


def _record(module: nn.Module, dtype: torch.dtype, answer: bool) -> None:
    """Keep `module._invact_keep_x` (what a traced call reads) in step with a check's answer for y's
    dtype."""
    if answer == (dtype in module._invact_keep_x):
        others = tuple(d for d in module._invact_keep_x if d != dtype)
        module._invact_keep_x = others if answer else (*others, dtype)


def _check(module: nn.Module | None, weight, bias, y_dtype: torch.dtype, variant: str) -> bool:
    """invertible() for a traced call of `module` (None: not known to the op), through the module's
    cache where the op got its own parameters; the answer recorded on the module."""
    if module is None:
        return invertible(weight, bias, VARIANTS[variant], y_dtype)
    params = module._parameters
    if params.get("weight") is weight and params.get("bias") is bias:
        return module._invertible(y_dtype)
    answer = invertible(weight, bias, VARIANTS[variant], y_dtype)  # another copy (FSDP2's unsharded)
    _record(module, y_dtype, answer)
    return answer


def _op_forward_impl(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float, variant: str,
    keep_x: bool, key: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    v = VARIANTS[variant]
    y, _, rstd, pre = _forward(x, weight, bias, eps, v)
    # rstd in the compute dtype: torch's CPU layer norm of 16-bit x and weights gives a 16-bit rstd where
    # its meta kernel (what the fake below runs) says float32 (torch 2.13)
    rstd = rstd.to(compute_dtype(v, x.dtype))
    residual = encode_residual(pre, y) if pre is not None else x.new_empty(0, dtype=torch.uint8)
    if keep_x:
        return y, rstd, residual, x.detach().flatten().clone()
    if not _check(_MODULES.get(key), weight, bias, y.dtype, variant):
        _SET_ASIDE[rstd] = x.detach().flatten().clone()
    return y, rstd, residual, x.new_empty(0)


_op_forward = torch.library.custom_op("invact::norm_forward", _op_forward_impl, mutates_args=())


@_op_forward.register_fake
def _(x, weight, bias, eps, variant, keep_x, key):
    v = VARIANTS[variant]
    y, _, rstd, pre = _forward(x, weight, bias, eps, v)  # torch ops on fake tensors: shapes and dtypes
    rstd = rstd.to(compute_dtype(v, x.dtype))
    residual = x.new_empty((y.numel() + 1) // 2 if pre is not None else 0, dtype=torch.uint8)
    return y, rstd, residual, x.new_empty(x.numel() if keep_x else 0)


def _op_backward_impl(
    dy: torch.Tensor, y: torch.Tensor, rstd: torch.Tensor, residual: torch.Tensor, x_kept: torch.Tensor,
    weight: torch.Tensor | None, bias: torch.Tensor | None, variant: str, x_dtype: torch.dtype,
    needs: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    v = VARIANTS[variant]
    if not x_kept.numel():
        x_kept = _SET_ASIDE.pop(rstd, x_kept)  # a call whose parameters failed the check (see above)
    from_x = x_kept.numel() > 0
    if from_x:
        kept = x_kept.view(y.shape)
        mean = kept.to(compute_dtype(v, kept.dtype)).mean(-1, keepdim=True) if v.center else None
        dx, dw, db = backward(dy, kept, mean, rstd, weight, bias, v, True, tuple(needs))
    else:
        dx, dw, db = backward(dy, y, None, rstd, weight, bias, v, False, tuple(needs),
                              residual if residual.numel() else None)  # fmt: skip
    # a fresh empty tensor per gradient not wanted: an op's outputs may not alias each other (frozen
    # weights, PEFT's base model, want neither dweight nor dbias)
    return (
        dy.new_empty(0) if dx is None else dx.to(x_dtype),
        dy.new_empty(0) if dw is None else dw,
        dy.new_empty(0) if db is None else db,
    )


_op_backward = torch.library.custom_op("invact::norm_backward", _op_backward_impl, mutates_args=())


@_op_backward.register_fake
def _(dy, y, rstd, residual, x_kept, weight, bias, variant, x_dtype, needs):
    dx = torch.empty_like(y, dtype=x_dtype) if needs[0] else dy.new_empty(0)
    dw = torch.empty_like(weight) if needs[1] and weight is not None else dy.new_empty(0)
    db = torch.empty_like(bias) if needs[2] and bias is not None else dy.new_empty(0)
    return dx, dw, db


def _op_setup_context(ctx, inputs, output):
    x, weight, bias, _, variant, _, _ = inputs
    y, rstd, residual, x_kept = output
    ctx.mark_non_differentiable(rstd, residual, x_kept)
    ctx.set_materialize_grads(False)
    ctx.variant, ctx.x_dtype = variant, x.dtype
    ctx.save_for_backward(y, rstd, residual, x_kept, weight, bias)


def _op_autograd_backward(ctx, dy, *_):
    if dy is None:
        return None, None, None, None, None
    y, rstd, residual, x_kept, weight, bias = ctx.saved_tensors
    needs = [bool(n) for n in ctx.needs_input_grad[:3]]
    dx, dw, db = torch.ops.invact.norm_backward(
        dy, y, rstd, residual, x_kept, weight, bias, ctx.variant, ctx.x_dtype, needs
    )
    return (dx if needs[0] else None, dw if needs[1] and weight is not None else None,
            db if needs[2] and bias is not None else None, None, None, None, None)  # fmt: skip


_op_forward.register_autograd(_op_autograd_backward, setup_context=_op_setup_context)


def _forward_traced(x, weight, bias, eps: float, variant: str, keep_x: bool, key: int):
    """invact::norm_forward's body in a compiled graph (invact._traced): the variant's torch ops, the
    residuals in torch ops, x kept where the call was traced keeping it. The parameters' check is not
    made here (no value is read in a graph): it was made when the call was traced, and is made again
    after every optimizer step and state-dict load (refresh)."""
    v = VARIANTS[variant]
    y, _, rstd, pre = _forward(x, weight, bias, eps, v)
    rstd = rstd.to(compute_dtype(v, x.dtype))
    no_bytes = x.new_empty(0, dtype=torch.uint8)
    residual = encode_residual(pre, y, kernels=False) if pre is not None else no_bytes
    return y, rstd, residual, x.detach().flatten().clone() if keep_x else x.new_empty(0)


def _backward_traced(dy, y, rstd, residual, x_kept, weight, bias, variant: str, x_dtype, needs: list[bool]):
    """invact::norm_backward's body in a compiled graph: backward's torch ops, from y (or x where kept)."""
    v = VARIANTS[variant]
    if x_kept.numel():
        kept = x_kept.view(y.shape)
        mean = kept.to(compute_dtype(v, kept.dtype)).mean(-1, keepdim=True) if v.center else None
        dx, dw, db = backward(dy, kept, mean, rstd, weight, bias, v, True, tuple(needs), kernels=False)
    else:
        dx, dw, db = backward(dy, y, None, rstd, weight, bias, v, False, tuple(needs),
                              residual if residual.numel() else None, kernels=False)  # fmt: skip
    return (
        dy.new_empty(0) if dx is None else dx.to(x_dtype),
        dy.new_empty(0) if dw is None else dw,
        dy.new_empty(0) if db is None else db,
    )


trace_as("invact::norm_forward", _forward_traced)
trace_as("invact::norm_backward", _backward_traced)


# Under torch.compile a call is traced keeping x or not (its `keep_x`, read from _invact_keep_x, a value
# Dynamo guards), and the compiled graph runs no Python to check the parameters again. So they are
# checked when a call is traced (_keep_x_traced, a constant to Dynamo: called once, on the real module),
# and again by refresh(): after every optimizer step (torch.optim's global step hook) and every
# load_state_dict of a traced norm. Where an answer changes, _invact_keep_x does, and the next call is
# traced again. A parameter changed otherwise between compiled calls is checked by refresh(model).
_TRACED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # InvNorm -> {y's dtype: versions}
_STEP_HOOK: list = []  # the optimizer step hook's handle, once registered


def _versions(module: nn.Module) -> tuple:
    """What says whether a module's parameters are still those last checked: their ids and versions."""
    params = module._parameters
    return tuple(
        (id(t), t._version) if t is not None else None for t in (params.get("weight"), params.get("bias"))
    )


def _keep_x_traced(key: int, dtype: torch.dtype) -> bool:
    """Whether a call of the InvNorm `key` (its id, _MODULES') being traced with y in `dtype` keeps x:
    its parameters checked now (on CUDA one bool read back), and the module entered among those
    refresh() checks again. Takes the id, a constant, not the module: torch 2.11's Dynamo hands a
    constant-result function constants only."""
    module = _MODULES[key]
    keep = not module._invertible(dtype)
    if module not in _TRACED:
        _TRACED[module] = {}
        module.register_load_state_dict_post_hook(lambda m, _keys: refresh([m]))
    _TRACED[module][dtype] = _versions(module)
    if not _STEP_HOOK:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _STEP_HOOK.append(register_optimizer_step_post_hook(_after_step))
    return keep


_keep_x_traced._dynamo_marked_constant = True  # as torch.compiler.assume_constant_result marks it


def _after_step(optimizer, args, kwargs) -> None:
    refresh()


def refresh(modules=None) -> None:
    """Check again the parameters of the norms traced under torch.compile (or of those in `modules`: a
    model, or an iterable of modules), for each dtype of y they were traced with, where a parameter has
    changed since its last check; where the answer changes, the next compiled call is traced again
    (keeping x, or no longer). One read back per device for all of them."""
    if modules is None:
        chosen = list(_TRACED)
    else:
        found = modules.modules() if isinstance(modules, nn.Module) else modules
        chosen = [m for m in found if m in _TRACED]
    todo = []
    for module in chosen:
        versions = _versions(module)
        for dtype, seen in _TRACED[module].items():
            if seen != versions:
                todo.append((module, dtype, versions, _failing_of(module, dtype)))
    answers = _read_back([f for *_, f in todo])  # one read back per device
    for (module, dtype, versions, _), failing in zip(todo, answers, strict=True):
        _record(module, dtype, not failing)
        _TRACED[module][dtype] = versions
        module._invact_checked = None  # the eager check's cache: computed again at its next call
