"""The Triton backend, for CUDA tensors: two kernels written once, into which the activation's Triton
view (its forward and q_left/q_right device functions, invact/_generated/<name>_triton.py) comes
as constexpr arguments. Same signature as the other backends (invact/activation/_portable.py). Offsets are
int64 (tensors over 2^31 elements); masks handle any size. Forward: y = f(x) and the branch bits in one
pass; backward: unpack, q in fp32, times dy, stored in dy's dtype. On CPU tensors these run under
TRITON_INTERPRET=1 (how CI tests them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from invact._layout import flat, is_dense
from invact._triton_build import build
from invact.activation.activations import SIXTEEN_BIT, Activation

BLOCK = 1024  # default elements per program (see Config)


@triton.jit
def _int_view(v):
    # One return after a static if/else: the compiler builds the code after a static `if: return` for
    # every dtype too (Triton 3.6 on sm_90: bitcast of 32 bits to int16), which the interpreter never shows.
    if v.dtype == tl.float32:
        out = v.to(tl.int32, bitcast=True)
    else:
        out = v.to(tl.int16, bitcast=True)
    return out


@triton.jit
def _offsets(BLOCK: tl.constexpr):
    """(BLOCK // 8, 8) offsets within a program's block: row r is the 8 elements of its byte r."""
    return tl.arange(0, BLOCK // 8)[:, None] * 8 + tl.arange(0, 8)[None, :]


@triton.jit
def _mask(offs, rest, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """Which of the block's (BLOCK // 8, 8) elements lie before `rest`. ROWS (n, so rest, a multiple
    of 8: every byte of bits whole) decides per row of 8: one predicate over a thread's 8 contiguous
    elements, which still loads them as one vector (an element-wise mask loads them one at a time,
    in 16-bit one 2-byte load each: benchmarks/kernel_sass.py predicts the fitted 16-bit backwards
    at 96-99% of the copy's GB/s masked by rows, 88-95% masked per element)."""
    if ROWS:
        out = tl.broadcast_to((tl.arange(0, BLOCK // 8) * 8 < rest)[:, None], (BLOCK // 8, 8))
    else:
        out = offs < rest
    return out


@triton.jit
def _load(pointers, mask, EVEN: tl.constexpr, ROWS: tl.constexpr):
    """The values at `pointers` where `mask`. EVEN (n a multiple of BLOCK: every program's block full)
    loads with no mask: a mask that may differ between neighbours keeps the compiler from vectorizing
    (one 2-byte load per element in bf16, bits packed across threads by shuffles), and without one
    each thread loads its 8 contiguous elements at once and packs their byte alone. Under ROWS a
    masked row is masked whole, so nothing computed from it is stored: its lanes are left unset (no
    zeroing of registers); per element they are 0 (0 > T: an element past n sets no bit of its byte)."""
    if EVEN:
        out = tl.load(pointers)
    elif ROWS:
        out = tl.load(pointers, mask=mask)
    else:
        out = tl.load(pointers, mask=mask, other=0)
    return out


@triton.jit
def _store(pointers, values, mask, EVEN: tl.constexpr):
    """`values` at `pointers` where `mask` (everywhere under EVEN, see _load)."""
    if EVEN:
        tl.store(pointers, values)
    else:
        tl.store(pointers, values, mask=mask)


@triton.jit
def _y_and_bits(x_ptr, y_ptr, bits_ptr, start, rest, offs, mask, T: tl.constexpr, FN: tl.constexpr,
                PRECISION_BIT: tl.constexpr, MONOTONE: tl.constexpr, EVEN: tl.constexpr, ROWS: tl.constexpr,
                BLOCK: tl.constexpr):  # fmt: skip
    """y = f(x) of a program's block in y's dtype, its low bit the branch in precision-bit mode; the
    block's bits stored (bits mode); y returned, not stored."""
    x = _load(x_ptr + offs, mask, EVEN, ROWS).to(tl.float32)
    left = x < T  # masked lanes hold 0 > T: never set a bit
    y = FN(x).to(y_ptr.dtype.element_ty)
    if MONOTONE:  # no bit at all
        pass
    elif PRECISION_BIT:
        yi = _int_view(y)
        y = ((yi & ~1) | left.to(yi.dtype)).to(y_ptr.dtype.element_ty, bitcast=True)
    else:  # byte r = sum over its row of bit << column: a reduction of 8 neighbours
        packed = tl.sum(left.to(tl.int32) << tl.arange(0, 8)[None, :], axis=1).to(tl.uint8)
        boffs = tl.arange(0, BLOCK // 8)
        _store(bits_ptr + start // 8 + boffs, packed, boffs < (rest + 7) // 8, EVEN)
    return y


@triton.jit
def _forward_kernel(x_ptr, y_ptr, bits_ptr, n, T: tl.constexpr, FN: tl.constexpr, PRECISION_BIT: tl.constexpr,
                    MONOTONE: tl.constexpr, EVEN: tl.constexpr, ROWS: tl.constexpr,
                    BLOCK: tl.constexpr):  # fmt: skip
    start = tl.program_id(0).to(tl.int64) * BLOCK
    rest = tl.minimum(n - start, BLOCK).to(tl.int32)
    offs, x_ptr, y_ptr = _offsets(BLOCK), x_ptr + start, y_ptr + start
    mask = _mask(offs, rest, ROWS, BLOCK)
    y = _y_and_bits(x_ptr, y_ptr, bits_ptr, start, rest, offs, mask, T, FN, PRECISION_BIT, MONOTONE, EVEN,
                    ROWS, BLOCK)  # fmt: skip
    _store(y_ptr + offs, y, mask, EVEN)


@triton.jit
def _gated_forward_kernel(x_ptr, u_ptr, y_ptr, h_ptr, bits_ptr, n, T: tl.constexpr, FN: tl.constexpr,
                          PRECISION_BIT: tl.constexpr, MONOTONE: tl.constexpr, EVEN: tl.constexpr,
                          ROWS: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """_forward_kernel on the gate x, and the gated product h = y * u of y as stored (its precision bit
    included): fp32 product rounded once to h's dtype, as torch's multiply of two such tensors."""
    start = tl.program_id(0).to(tl.int64) * BLOCK
    rest = tl.minimum(n - start, BLOCK).to(tl.int32)
    offs, x_ptr, y_ptr = _offsets(BLOCK), x_ptr + start, y_ptr + start
    u_ptr, h_ptr = u_ptr + start, h_ptr + start
    mask = _mask(offs, rest, ROWS, BLOCK)
    y = _y_and_bits(x_ptr, y_ptr, bits_ptr, start, rest, offs, mask, T, FN, PRECISION_BIT, MONOTONE, EVEN,
                    ROWS, BLOCK)  # fmt: skip
    _store(y_ptr + offs, y, mask, EVEN)
    u = _load(u_ptr + offs, mask, EVEN, ROWS).to(tl.float32)
    _store(h_ptr + offs, (y.to(tl.float32) * u).to(h_ptr.dtype.element_ty), mask, EVEN)


@triton.jit
def _q(y_raw, bits_ptr, start, rest, QL: tl.constexpr, QR: tl.constexpr, PRECISION_BIT: tl.constexpr,
       MONOTONE: tl.constexpr, EVEN: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """q(y, bit) in fp32 for a program's block of y as loaded (its dtype: the precision bit's)."""
    y = y_raw.to(tl.float32)
    if MONOTONE:  # one branch, no bit; q itself at y = +-inf (x = +-inf), NaN stays NaN
        q = tl.where(y == y, QR(y), float("nan"))
    else:
        if PRECISION_BIT:
            left = (_int_view(y_raw) & 1) != 0
        else:  # one byte load per row of 8, shifted across the row
            boffs = tl.arange(0, BLOCK // 8)
            byte = _load(bits_ptr + start // 8 + boffs, boffs < (rest + 7) // 8, EVEN, ROWS).to(tl.int32)
            left = ((byte[:, None] >> tl.arange(0, 8)[None, :]) & 1) != 0
        q = tl.where(left, QL(y), QR(y))
        q = tl.where(tl.abs(y) < float("inf"), q, float("nan"))  # y = +-inf or NaN: NaN, as torch
    return q


@triton.jit
def _backward_kernel(y_ptr, bits_ptr, dy_ptr, dx_ptr, n, QL: tl.constexpr, QR: tl.constexpr,
                     PRECISION_BIT: tl.constexpr, MONOTONE: tl.constexpr, EVEN: tl.constexpr,
                     ROWS: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    start = tl.program_id(0).to(tl.int64) * BLOCK
    rest = tl.minimum(n - start, BLOCK).to(tl.int32)
    offs, y_ptr, dy_ptr, dx_ptr = _offsets(BLOCK), y_ptr + start, dy_ptr + start, dx_ptr + start
    mask = _mask(offs, rest, ROWS, BLOCK)
    y_raw = _load(y_ptr + offs, mask, EVEN, ROWS)
    q = _q(y_raw, bits_ptr, start, rest, QL, QR, PRECISION_BIT, MONOTONE, EVEN, ROWS, BLOCK)
    dy = _load(dy_ptr + offs, mask, EVEN, ROWS).to(tl.float32)
    _store(dx_ptr + offs, (dy * q).to(dx_ptr.dtype.element_ty), mask, EVEN)


@triton.jit
def _gated_backward_kernel(y_ptr, bits_ptr, u_ptr, dh_ptr, dg_ptr, du_ptr, n, QL: tl.constexpr,
                           QR: tl.constexpr, PRECISION_BIT: tl.constexpr, MONOTONE: tl.constexpr,
                           EVEN: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """The gated product h = y * u's backward and the activation's, in one pass: dy = dh * u rounded to
    its dtype (the multiply's gradient as torch computes it), dg = q(y, bit) dy as _backward_kernel,
    du = dh * y rounded to its dtype."""
    start = tl.program_id(0).to(tl.int64) * BLOCK
    rest = tl.minimum(n - start, BLOCK).to(tl.int32)
    offs = _offsets(BLOCK)
    y_ptr, u_ptr, dh_ptr = y_ptr + start, u_ptr + start, dh_ptr + start
    dg_ptr, du_ptr = dg_ptr + start, du_ptr + start
    mask = _mask(offs, rest, ROWS, BLOCK)
    y_raw = _load(y_ptr + offs, mask, EVEN, ROWS)
    q = _q(y_raw, bits_ptr, start, rest, QL, QR, PRECISION_BIT, MONOTONE, EVEN, ROWS, BLOCK)
    dh = _load(dh_ptr + offs, mask, EVEN, ROWS).to(tl.float32)
    u = _load(u_ptr + offs, mask, EVEN, ROWS).to(tl.float32)
    dy = (dh * u).to(dg_ptr.dtype.element_ty).to(tl.float32)
    _store(dg_ptr + offs, (dy * q).to(dg_ptr.dtype.element_ty), mask, EVEN)
    _store(du_ptr + offs, (dh * y_raw.to(tl.float32)).to(du_ptr.dtype.element_ty), mask, EVEN)


@dataclass(frozen=True)
class Config:
    """A launch configuration: `block` elements per program (a power of two >= 8, so each program owns
    whole bytes of bits) over `num_warps` warps: block / (32 num_warps) elements per thread."""

    block: int
    num_warps: int

    def __post_init__(self):
        if self.block < 8 or self.block & (self.block - 1):
            raise ValueError(f"block must be a power of two >= 8, got {self.block}")
        if self.num_warps < 1 or self.num_warps & (self.num_warps - 1):
            raise ValueError(f"num_warps must be a power of two, got {self.num_warps}")


# Default launch configuration of each kernel. benchmarks/tune.py sweeps block x num_warps on the GPU
# at hand and writes results/tune_<device>.json; the values here are what it chose (see that file).
CONFIGS = {"forward": Config(block=BLOCK, num_warps=4), "backward": Config(block=BLOCK, num_warps=4)}


# The compiled kernel of each launch specialization (see _specialization), with its constexpr
# arguments in signature order; nothing under TRITON_INTERPRET=1, where launches return no kernel.
_COMPILED: dict[tuple, tuple] = {}


def _specialization(kernel, config: Config, n: int, tensors: tuple, constexprs: dict) -> tuple:
    """What Triton compiles a launch for: each pointer's dtype and 16-byte alignment, n's width and
    whether it is 1 or a multiple of 16 (Triton's rules for integer arguments), the constexprs and the
    launch configuration. tests/invact/test_cuda.py checks that each key finds the kernel Triton's own
    launcher picks."""
    pointers = tuple((t.dtype, t.data_ptr() % 16 == 0) for t in tensors)
    integer = (n % 16 == 0, n == 1, n >= 2**31)
    # Device functions by id: hashing a JITFunction hashes its source key in Python on every lookup.
    # The cached entry holds them (the launch's argument tail), so an id is never reused while keyed.
    values = tuple(v if isinstance(v, (bool, int, float)) else id(v) for v in constexprs.values())
    return (id(kernel), config, tensors[0].device.index, pointers, integer, values)


def _launch(kernel, config: Config, n: int, *tensors, **constexprs):
    """kernel over n elements. The first launch of each specialization goes through Triton's launcher,
    which compiles (or loads) the kernel; later ones call the compiled kernel directly, skipping the
    launcher's argument binding and cache-key building (host time per launch on the H100 machine:
    27 us through the launcher). Specialized on n: no masks for a multiple of the block, masks by rows
    of 8 for a multiple of 8; past one block, any other n is two launches (the last n % 8 elements
    alone)."""
    device = tensors[0].device
    if device.type == "cuda" and device.index != torch.cuda.current_device():
        # Triton launches on the current device; tensors on another (a model split across GPUs in one
        # process) need it made current, as torch's own ops do.
        with torch.cuda.device(device):
            return _launch(kernel, config, n, *tensors, **constexprs)
    odd = n % 8
    if odd and n > config.block:
        # Masks per element load a thread's elements one at a time (kernels at 88-95% of the copy,
        # benchmarks/kernel_sass.py --tails): they take only the last n % 8 elements, the rest runs
        # masked by rows (or not at all). The bits of those elements are their own byte (the rest is
        # a multiple of 8), where that launch's pointers start.
        rows = n - odd
        _launch(kernel, config, rows, *tensors, **constexprs)
        tail = (t[rows // 8 :] if t.dtype == torch.uint8 else t[rows:] for t in tensors)  # bits: uint8
        _launch(kernel, config, odd, *tail, **constexprs)
        return
    grid = (triton.cdiv(max(n, 1), config.block), 1, 1)
    constexprs["EVEN"], constexprs["ROWS"] = n % config.block == 0, odd == 0
    key = _specialization(kernel, config, n, tensors, constexprs)
    hit = _COMPILED.get(key)
    if hit is not None:
        compiled, tail = hit
        compiled[grid](*tensors, n, *tail)
        return
    compiled = kernel[grid](*tensors, n, **constexprs, BLOCK=config.block, num_warps=config.num_warps)
    if compiled is None:  # the interpreter: no compiled kernel to keep
        return
    # The first launch of this specialization. The compiled kernel's launcher takes every argument,
    # constexprs too, in the kernel's signature order.
    tail = [constexprs[name] for name in kernel.arg_names[len(tensors) + 1 : -1]] + [config.block]
    _COMPILED[key] = (compiled, tail)


def forward_constexprs(act: Activation, precision_bit: bool) -> dict:
    """_forward_kernel's constexpr arguments for `act` (BLOCK aside)."""
    monotone = act.monotone
    return dict(T=0.0 if monotone else act.threshold, FN=act.triton.forward, PRECISION_BIT=precision_bit,
                MONOTONE=monotone)  # fmt: skip


def backward_constexprs(act: Activation, precision_bit: bool, dtype: torch.dtype = torch.float32) -> dict:
    """_backward_kernel's constexpr arguments for `act` on y of `dtype` (BLOCK and EVEN aside): q, or
    for bf16 and fp16 q16, the 16-bit family's (Activation.q16)."""
    view = act.triton
    left, right = (view.q16_left, view.q16_right) if dtype in SIXTEEN_BIT else (view.q_left, view.q_right)
    return dict(QL=left or right, QR=right, PRECISION_BIT=precision_bit, MONOTONE=view.q_left is None)


_POINTER_TYPES = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16"}

# The kernels by name: the activation's forward and backward, and the gated MLP's (the activation with
# the product y * u and its gradients: invact.mlp's eager Function on CUDA).
KERNELS = {"forward": _forward_kernel, "backward": _backward_kernel, "gated_forward": _gated_forward_kernel,
           "gated_backward": _gated_backward_kernel}  # fmt: skip


def compile_for(kernel: str, act: Activation, dtype: torch.dtype, precision_bit: bool, arch: int = 90,
                index: str = "i32", even: bool = True, rows: bool = True):  # fmt: skip
    """Triton's compiled kernel (a name of KERNELS) for `act` on tensors of `dtype`, built for
    NVIDIA compute capability `arch` (90: H100/H200, 80: A100) as the launches specialize it, with n
    of type `index` ("i64" past 2^31 elements), a multiple of the block (`even`, no masks) or not, and
    then a multiple of 8 (`rows`: masks per row of 8) or not (masks per element).
    Needs no GPU (Triton's compiler and the ptxas it ships
    run on the CPU), but the real compiler: not under TRITON_INTERPRET=1. Its .asm holds the PTX and
    the cubin."""
    function = KERNELS[kernel]
    config = CONFIGS[kernel.removeprefix("gated_")]  # the gated kernels launch as their plain ones
    if kernel.endswith("forward"):
        constexprs = forward_constexprs(act, precision_bit)
    else:
        constexprs = backward_constexprs(act, precision_bit, dtype)
    constexprs["EVEN"], constexprs["ROWS"], constexprs["BLOCK"] = even, even or rows, config.block
    signature = {}
    for arg in function.arg_names:
        if arg in constexprs:
            signature[arg] = "constexpr"
        elif arg.endswith("_ptr"):
            signature[arg] = "*u8" if arg == "bits_ptr" else _POINTER_TYPES[dtype]
        else:
            signature[arg] = index
    # What Triton's launcher adds for aligned arguments ("D" in its specialization key): pointers
    # 16-byte aligned (torch's allocations are), and n divisible by 16 when it fills whole blocks.
    # Without it the compiler may not assume aligned addresses and loads one element at a time.
    aligned = [i for i, arg in enumerate(function.arg_names) if arg.endswith("_ptr") or (arg == "n" and even)]
    return build(function, signature, constexprs, aligned, config.num_warps, arch)


def forward(act: Activation, x: torch.Tensor, precision_bit: bool, config: Config | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """y = f(x) with x's layout (a copy of x if it is not dense) and the bits, in one pass. `config`:
    CONFIGS["forward"] unless given."""
    x = x if x.is_contiguous() or is_dense(x) else x.contiguous()
    y = torch.empty_like(x)
    n = x.numel()
    saves_bits = not (precision_bit or act.monotone)
    bits = torch.empty((n + 7) // 8 if saves_bits else 0, dtype=torch.uint8, device=x.device)
    if n:
        constexprs = forward_constexprs(act, precision_bit)
        _launch(_forward_kernel, config or CONFIGS["forward"], n, flat(x), flat(y), bits, **constexprs)
    return y, bits


def backward(act: Activation, y: torch.Tensor, bits: torch.Tensor, dy: torch.Tensor, precision_bit: bool,
             config: Config | None = None):  # fmt: skip
    """Flat (y, bits, dy) -> dx in dy's dtype. `config`: CONFIGS["backward"] unless given."""
    n = y.numel()
    dx = torch.empty_like(dy)
    if n:
        constexprs = backward_constexprs(act, precision_bit, y.dtype)
        _launch(_backward_kernel, config or CONFIGS["backward"], n, y, bits, dy, dx, **constexprs)
    return dx


def gated_forward(act: Activation, g: torch.Tensor, u: torch.Tensor, precision_bit: bool,
                  config: Config | None = None) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """(y, bits, h) for a gated MLP's gate g and up projection u (contiguous, one shape and dtype): y and
    the bits as forward() makes them, and h = y * u as torch multiplies them (fp32 product rounded once),
    in one pass: it reads g and u and writes y, h and the bits, where forward() and a multiply read y
    back. `config`: CONFIGS["forward"] unless given."""
    y, h = torch.empty_like(g), torch.empty_like(g)
    n = g.numel()
    saves_bits = not (precision_bit or act.monotone)
    bits = torch.empty((n + 7) // 8 if saves_bits else 0, dtype=torch.uint8, device=g.device)
    if n:
        constexprs = forward_constexprs(act, precision_bit)
        _launch(_gated_forward_kernel, config or CONFIGS["forward"], n, g.view(-1), u.view(-1), y.view(-1),
                h.view(-1), bits, **constexprs)  # fmt: skip
    return y, bits, h


def gated_backward(act: Activation, y: torch.Tensor, bits: torch.Tensor, u: torch.Tensor, dh: torch.Tensor,
                   precision_bit: bool, config: Config | None = None) -> tuple:  # fmt: skip
    """(dg, du) of h = act(g) * u from dh (y, u and dh contiguous, one shape and dtype): dg = q(y, bit)
    (dh * u), the product rounded to dh's dtype first as torch's multiply and backward() do, and
    du = dh * y, in one pass over y, the bits, u and dh. `config`: CONFIGS["backward"] unless given."""
    dg, du = torch.empty_like(dh), torch.empty_like(dh)
    n = y.numel()
    if n:
        constexprs = backward_constexprs(act, precision_bit, y.dtype)
        _launch(_gated_backward_kernel, config or CONFIGS["backward"], n, y.view(-1), bits, u.view(-1),
                dh.view(-1), dg.view(-1), du.view(-1), **constexprs)  # fmt: skip
    return dg, du
