"""Triton kernels, written once: the activation's forward and the generated q_left/q_right device
functions come in as constexpr arguments. Offsets are int64 (tensors over 2^31 elements); masks
handle any size. Forward: y = f(x) and the branch bits in one pass; backward: unpack, q in fp32,
times dy, stored in dy's dtype. On CPU tensors these run under TRITON_INTERPRET=1 (how CI tests them).
"""

from __future__ import annotations

import functools
import importlib

import torch
import triton
import triton.language as tl

BLOCK = 1024  # elements per program; a multiple of 8 so each program owns whole bytes of bits


@triton.jit
def gelu(x):
    return 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))


@triton.jit
def gelu_tanh(x):
    # 0.5 x (1 + tanh u) = x sigmoid(2u): no libdevice tanh (absent in the interpreter).
    u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    return x / (1.0 + tl.exp(-2.0 * u))


@triton.jit
def silu(x):
    return x / (1.0 + tl.exp(-x))


@triton.jit
def quick_gelu(x):
    return x * (1.0 / (1.0 + tl.exp(-1.702 * x)))


@triton.jit
def mish(x):
    # x tanh(softplus x) with tanh(log(1 + n)) = n (n + 2) / (n (n + 2) + 2), n = e^x; past x = 20
    # tanh(softplus x) is 1 in fp32, and n (n + 2) would overflow.
    n = tl.exp(tl.minimum(x, 20.0))
    m = n * (n + 2.0)
    return tl.where(x > 20.0, x, x * (m / (m + 2.0)))


FORWARD = {"gelu": gelu, "gelu_tanh": gelu_tanh, "silu": silu, "quick_gelu": quick_gelu, "mish": mish}


@triton.jit
def _int_view(v):
    if v.dtype == tl.float32:
        return v.to(tl.int32, bitcast=True)
    return v.to(tl.int16, bitcast=True)


@triton.jit
def _forward_kernel(x_ptr, y_ptr, bits_ptr, n, T: tl.constexpr, FN: tl.constexpr, PRECISION_BIT: tl.constexpr,
                    BLOCK: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    left = x < T  # masked lanes hold 0 > T: never set a bit
    y = FN(x).to(y_ptr.dtype.element_ty)
    if PRECISION_BIT:
        yi = _int_view(y)
        y = ((yi & ~1) | left.to(yi.dtype)).to(y_ptr.dtype.element_ty, bitcast=True)
    else:
        weights = (left.to(tl.int32) << (tl.arange(0, BLOCK) % 8)).reshape(BLOCK // 8, 8)
        packed = tl.sum(weights, axis=1).to(tl.uint8)
        boffs = pid * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
        tl.store(bits_ptr + boffs, packed, mask=boffs < (n + 7) // 8)
    tl.store(y_ptr + offs, y, mask=mask)


@triton.jit
def _backward_kernel(y_ptr, bits_ptr, dy_ptr, dx_ptr, n, QL: tl.constexpr, QR: tl.constexpr,
                     PRECISION_BIT: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    y_raw = tl.load(y_ptr + offs, mask=mask, other=0.0)
    if PRECISION_BIT:
        left = (_int_view(y_raw) & 1) != 0
    else:
        byte = tl.load(bits_ptr + (offs >> 3), mask=mask, other=0)
        left = ((byte >> (offs & 7).to(tl.uint8)) & 1) != 0
    y = y_raw.to(tl.float32)
    q = tl.where(left, QL(y), QR(y))
    q = tl.where(tl.abs(y) < float("inf"), q, float("nan"))  # non-finite y (x = +-inf or NaN): NaN, as torch
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(dx_ptr + offs, (dy * q).to(dx_ptr.dtype.element_ty), mask=mask)


@functools.cache
def _q(activation: str):
    gen = importlib.import_module(f"invact._generated.{activation}_triton")
    return gen.q_left, gen.q_right


def _grid(n: int):
    return (triton.cdiv(max(n, 1), BLOCK),)


def forward(activation: str, threshold: float, x: torch.Tensor, y: torch.Tensor, precision_bit: bool):
    """Flat x -> y (written in place) and the returned bits (empty in precision-bit mode)."""
    n = x.numel()
    bits = torch.empty(0 if precision_bit else (n + 7) // 8, dtype=torch.uint8, device=x.device)
    if n:
        fn = FORWARD[activation]
        _forward_kernel[_grid(n)](x, y, bits, n, T=threshold, FN=fn, PRECISION_BIT=precision_bit, BLOCK=BLOCK)
    return bits


def backward(activation: str, y: torch.Tensor, bits: torch.Tensor, dy: torch.Tensor, precision_bit: bool):
    n = y.numel()
    dx = torch.empty_like(dy)
    if n:
        ql, qr = _q(activation)
        _backward_kernel[_grid(n)](y, bits, dy, dx, n, QL=ql, QR=qr, PRECISION_BIT=precision_bit, BLOCK=BLOCK)
    return dx
