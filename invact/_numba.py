"""The numba backend for CPU tensors: the backward, one kernel per activation compiled from its
numba view (fp32 scalar functions, invact/_generated/<act>_cpu.py), and the forward's bit packing
for float32 (one pass over x). Same signature as the other backends
(invact/_portable.py).
Optional: without numba, CPU tensors take the portable backend (correct, ~15x slower than torch's own
backward).

The backward reads y, the packed bits (or y's own lowest bit in precision-bit mode; none for a
monotone activation) and dy, and writes dx in fp32 (the kernel is printed by codegen:
`backward_kernel_bits` and `backward_kernel` in each numba view). For the floor family's forms it
evaluates every element's near piece, and each branch's far piece (its exp or log) only on the
elements past its split. Where numba compiles for AVX-512 or AVX2 the near pieces come by table
lookup in registers (invact._lookup: on AVX-512 32 entries for both branches and 16 lanes, a
polynomial of degree 4 or less in each; on AVX2 8 entries and 8 lanes, degree 7 or less), each block
reading its byte(s) of bits as they are and noting its far elements, whose pieces then run on a list;
elsewhere one polynomial in g whose coefficients each element selects by its bit, each thread first
unpacking its span's bits into a buffer in cache and running a branch's far piece on every 16-element
block that has an element past its split. Half-precision
tensors are converted to fp32 around it (numba has no bf16). Every kernel is compiled with
cache=True: the first call on a machine compiles them (about 5 s on a 2-core machine), later
processes load them from numba's disk cache; benchmarks/speed.py reports both first calls.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from invact import _bits, _portable
from invact._layout import flat
from invact.activations import Activation


@functools.cache
def available() -> bool:
    """numba is installed (imported only when the first CPU backward runs: it loads scipy if present)."""
    return importlib.util.find_spec("numba") is not None


def _kernels():
    """The kernels every activation shares (imports numba, and loads them from numba's disk cache)."""
    from invact import _numba_kernels

    return _numba_kernels


def _words(flags):
    """The whole 8-byte words of a uint8 numpy array, as a uint64 view of the same memory."""
    import numpy as np

    return flags[: flags.size // 8 * 8].view(np.uint64)


def set_lsb_less_(y: torch.Tensor, x: torch.Tensor, threshold: float) -> torch.Tensor:
    """Precision-bit mode in one pass: y's lowest mantissa bit := x < threshold, in place, for flat
    contiguous float32 CPU tensors (the bool mask then two bitwise passes: three passes)."""
    import numpy as np

    _kernels().set_lsb_less(x.numpy(), y.view(torch.int32).numpy(), np.float32(threshold))
    return y


def pack_less(x: torch.Tensor, threshold: float) -> torch.Tensor:
    """The packed bits of x < threshold (LSB first) for a flat contiguous float32 CPU tensor, in one
    pass over x. The threshold is rounded to float32 first, as torch does when it compares with a
    Python float."""
    import numpy as np

    out = torch.empty((x.numel() + 7) // 8, dtype=torch.uint8)
    _kernels().pack_less(x.numpy(), np.float32(threshold), out.numpy())
    return out


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """The packed bits (LSB first) of a flat contiguous bool CPU tensor."""
    flags = mask.view(torch.uint8).numpy()
    out = torch.empty((flags.size + 7) // 8, dtype=torch.uint8)
    _kernels().pack_flags(flags, _words(flags), out.numpy())
    return out


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int] | None:
    """x as rows of its last dimension, where that dimension is contiguous and the others merge into
    one with a stride of at least a row (a chunk of a fused projection's output): (the 1-D run of
    storage from x's first element to its last, rows, row stride, columns), in elements; None for any
    other layout."""
    if x.dim() == 0 or x.numel() == 0 or x.stride(-1) != 1:
        return None
    cols = x.shape[-1]
    try:
        rows = x.view(-1, cols)
    except RuntimeError:  # the leading dimensions do not merge
        return None
    count, stride = rows.shape[0], rows.stride(0)
    if count > 1 and stride < cols:  # overlapping rows (an expanded tensor)
        return None
    return rows.as_strided(((count - 1) * stride + cols,), (1,)), count, stride, cols


def forward(act: Activation, x: torch.Tensor, precision_bit: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's forward, then the bits in one fused pass for float32 (other dtypes: the portable
    forward's)."""
    if x.dtype != torch.float32 or act.monotone:
        return _portable.forward(act, x, precision_bit)
    y = act.torch_forward(x)  # on x as given: torch's strided and contiguous paths round differently
    if x.stride() == y.stride():
        if precision_bit:  # y is ours: its lowest mantissa bit becomes the branch bit
            set_lsb_less_(flat(y), flat(x), act.threshold)
            return y, x.new_empty(0, dtype=torch.uint8)
        return y, pack_less(flat(x), act.threshold)
    rows = _rows(x) if y.is_contiguous() else None
    if rows is not None and (precision_bit or rows[3] % 8 == 0):  # a chunk of a fused projection
        import numpy as np

        run, count, stride, cols = rows
        threshold = np.float32(act.threshold)  # as torch rounds a Python float it compares with
        if precision_bit:
            y_int = y.view(torch.int32).view(-1).numpy()
            _kernels().set_lsb_less_rows(run.numpy(), count, stride, cols, y_int, threshold)
            return y, x.new_empty(0, dtype=torch.uint8)
        out = torch.empty(count * cols // 8, dtype=torch.uint8)
        _kernels().pack_less_rows(run.numpy(), count, stride, cols, threshold, out.numpy())
        return y, out
    # Any other layout: compared in y's layout into a byte per element, rather than x copied into it
    # (four bytes per element).
    left = flat(torch.lt(x, act.threshold, out=torch.empty_like(y, dtype=torch.bool)))
    if precision_bit:
        flat(y).view(torch.int32).bitwise_and_(-2).bitwise_or_(left.view(torch.uint8))
        return y, x.new_empty(0, dtype=torch.uint8)
    return y, pack_mask(left)


def backward(act: Activation, y: torch.Tensor, bits: torch.Tensor, dy: torch.Tensor, precision_bit: bool
             ) -> torch.Tensor:  # fmt: skip
    """dx = dy * q(y, bit) for flat CPU tensors. The bits come packed (`bits`, uint8, LSB first) or, in
    precision-bit mode, as y's own integer view, whose lowest bit is the branch bit; neither for a
    monotone activation. Packed bits go to the kernel as they are (`backward_kernel_bits`: each thread
    unpacks its span's into a buffer that stays in cache)."""
    flags = _bits.int_view(y) if precision_bit and not act.monotone else None
    bits = None if act.monotone or precision_bit else bits
    kernel = act.cpu.backward_kernel  # printed by codegen into the activation's numba view
    y32, dy32 = y.float().contiguous(), dy.float().contiguous()
    dx32 = torch.empty_like(y32)
    arrays = y32.numpy(), dy32.numpy(), dx32.numpy()
    if bits is None and flags is None:
        kernel(*arrays)
        return dx32.to(dy.dtype)
    if flags is not None:
        kernel(arrays[0], flags.contiguous().numpy(), arrays[1], arrays[2])
    else:
        act.cpu.backward_kernel_bits(arrays[0], bits.contiguous().numpy(), arrays[1], arrays[2])
    return dx32.to(dy.dtype)
