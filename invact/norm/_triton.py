"""The Triton backward of an inverted norm (invact.norm), for CUDA tensors: one program per block of
rows reads y (bf16 y with its 4-bit residuals where the variant keeps them) and dy, writes dx, and
sums dy h and dy over its rows into one row of a partial buffer, which torch sums over programs for
dweight and dbias. The same math as the CPU kernel (invact/norm/_cpu.py): per row, with
h = (y - b) / w_eff (b / w_eff and 1 / w_eff made once per program) and g = dy w_eff,
    dx = rstd (g - [mean g] - h mean(g h))
in fp32. The forward stays the replaced module's own torch ops (so y is its y on the GPU too). On CPU
tensors this runs under TRITON_INTERPRET=1 (how CI tests it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from invact._triton_build import build

ROWS_PER_PROGRAM = 8  # rows a program walks: its partial dweight / dbias row is written once


@triton.jit
def _backward_kernel(y_ptr, res_ptr, dy_ptr, w_ptr, b_ptr, rstd_ptr, dx_ptr, part_ptr, rows, d,
                     CENTER: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, OFFSET: tl.constexpr,
                     RESIDUAL: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < d
    if HAS_W:
        w = tl.load(w_ptr + cols, mask=mask, other=1.0).to(tl.float32) + OFFSET
    else:
        w = tl.full([BLOCK_D], 1.0, tl.float32)
    scale = 1.0 / w
    if HAS_B:
        shift = tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32) * scale
    else:
        shift = tl.zeros([BLOCK_D], tl.float32)
    dw = tl.zeros([BLOCK_D], tl.float32)
    db = tl.zeros([BLOCK_D], tl.float32)
    for i in range(ROWS):
        r = pid * ROWS + i
        if r < rows:
            offs = r.to(tl.int64) * d + cols
            if RESIDUAL:  # bf16 bits and the nibble of pre's next bits (invact.norm.decode_residual)
                bits = tl.load(y_ptr + offs, mask=mask, other=0).to(tl.int16, bitcast=True).to(tl.int32)
                byte = tl.load(res_ptr + offs // 2, mask=mask, other=0).to(tl.int32)
                code = (byte >> ((offs % 2).to(tl.int32) * 4)) & 15
                y = ((bits << 16) + (code << 12) - 0x7800).to(tl.float32, bitcast=True)
            else:
                y = tl.load(y_ptr + offs, mask=mask, other=0).to(tl.float32)
            g_out = tl.load(dy_ptr + offs, mask=mask, other=0).to(tl.float32)
            h = tl.where(mask, y * scale - shift, 0.0)
            g = g_out * w
            m_gh = tl.sum(g * h, axis=0) / d
            if CENTER:
                m_g = tl.sum(g, axis=0) / d
            else:
                m_g = 0.0
            a = tl.load(rstd_ptr + r).to(tl.float32)
            dx = a * (g - m_g - h * m_gh)
            tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
            dw += g_out * h
            db += g_out
    tl.store(part_ptr + pid * 2 * d + cols, dw, mask=mask)
    tl.store(part_ptr + pid * 2 * d + d + cols, db, mask=mask)


def backward(y: torch.Tensor, residual, dy: torch.Tensor, weight, bias, rstd: torch.Tensor, center: bool,
             offset: int):  # fmt: skip
    """(dx in dy's dtype, sum over rows of dy h, sum over rows of dy), the sums fp32, for y and dy of
    shape (rows, d), `residual` y's packed residuals or None, weight and bias (d,) or None, rstd
    (rows, 1)."""
    rows, d = y.shape
    y, dy = y.contiguous(), dy.contiguous()
    dx = torch.empty_like(dy)
    programs = max(1, triton.cdiv(rows, ROWS_PER_PROGRAM))
    partial = torch.empty(programs, 2, d, dtype=torch.float32, device=y.device)
    _backward_kernel[(programs,)](
        y, residual if residual is not None else y, dy, weight if weight is not None else y,
        bias if bias is not None else y, rstd.reshape(rows).contiguous(), dx, partial, rows, d,
        CENTER=center, HAS_W=weight is not None, HAS_B=bias is not None, OFFSET=float(offset),
        RESIDUAL=residual is not None, ROWS=ROWS_PER_PROGRAM, BLOCK_D=triton.next_power_of_2(d),
    )  # fmt: skip
    sums = partial.sum(0)
    return dx, sums[0].clone(), sums[1].clone()


# What kernel_sass.py compiles: the normalized width of a transformer (Llama-3-8B's 4096) with the
# launch's default 4 warps, as a launch specializes it (pointers and d 16-byte aligned).
SASS_WIDTH, SASS_WARPS = 4096, 4
_POINTERS = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16"}


def compile_for(dtype: torch.dtype, residual: bool, center: bool, d: int = SASS_WIDTH, arch: int = 90):
    """The backward kernel compiled for NVIDIA compute capability `arch` (no GPU needed; not under
    TRITON_INTERPRET=1) for y, dy and dx of `dtype`, with residuals or not, a LayerNorm (center, a
    bias) or an RMSNorm, at width d."""
    function = _backward_kernel
    constexprs = {"CENTER": center, "HAS_W": True, "HAS_B": center, "OFFSET": 0.0, "RESIDUAL": residual,
                  "ROWS": ROWS_PER_PROGRAM, "BLOCK_D": triton.next_power_of_2(d)}  # fmt: skip
    signature = {}
    for arg in function.arg_names:
        if arg in constexprs:
            signature[arg] = "constexpr"
        elif arg in ("y_ptr", "dy_ptr", "dx_ptr"):
            signature[arg] = _POINTERS[dtype]
        elif arg.endswith("_ptr"):
            signature[arg] = "*u8" if arg == "res_ptr" else "*fp32"
        else:
            signature[arg] = "i32"
    aligned = [i for i, arg in enumerate(function.arg_names) if arg.endswith("_ptr") or arg == "d"]
    return build(function, signature, constexprs, aligned, SASS_WARPS, arch)
