"""The numba backend for CPU tensors: the backward, one kernel per activation compiled from its
numba view (fp32 scalar functions, invact/_generated/<act>_cpu.py), and the forward's bit packing
for float32 (one pass over x). Same signature as the other backends
(invact/activation/_portable.py).
Optional: without numba, CPU tensors take the portable backend (correct, ~15x slower than torch's own
backward).

The backward reads y, the packed bits (or y's own lowest bit in precision-bit mode; none for a
monotone activation) and dy, and writes dx in fp32 (the kernel is printed by codegen:
`backward_kernel_bits` and `backward_kernel` in each numba view). For the floor family's forms it
evaluates every element's near piece, and each branch's far piece (its exp or log) only on the
elements past its split. Where numba compiles for AVX-512 or AVX2 the near pieces come by table
lookup in registers (invact.activation._lookup: on AVX-512 32 entries for both branches and 16 lanes, a
polynomial of degree 4 or less in each; on AVX2 8 entries and 8 lanes, degree 7 or less), each block
reading its byte(s) of bits as they are and noting its far elements, whose pieces then run on a list;
elsewhere one polynomial in g whose coefficients each element selects by its bit, each thread first
unpacking its span's bits into a buffer in cache and running a branch's far piece on every 16-element
block that has an element past its split. Half-precision
tensors go through fp32 buffers of FP32_BLOCK elements around it (numba has no bf16: fp32_blocks).
Every kernel is compiled with
cache=True: the first call on a machine compiles them (about 5 s on a 2-core machine), later
processes load them from numba's disk cache; benchmarks/speed.py reports both first calls.

Up to SERIAL elements (one span) nothing runs in numba's parallel region: the backward calls the span
function its parallel kernel would call once, and the forward's bits come from serial kernels
(invact/activation/_numba_kernels.py: pack_less_serial_at, called with the tensors' addresses, and
set_lsb_less_serial) or, for the rarer layouts, numpy. The bits and dx are the same, bit for bit.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import NamedTuple

import torch

try:
    import numpy as np  # torch imports it already where it is installed
except ImportError:  # numba needs numpy: without it this backend is never chosen (available())
    np = None

from invact._layout import flat
from invact.activation import _bits, _portable
from invact.activation.activations import SIXTEEN_BIT, Activation

# Elements up to which every call here runs on the calling thread, without numba's parallel region:
# the kernels' span (_SPAN in invact/activation/_numba_kernels.py and in each numba view), so up to it a
# parallel kernel runs one span on one thread anyway, and the serial call leaves out only the region's fork
# and join. On a small tensor those cost more than the work, and more where the machine is busy: measured on
# a 2-core Intel Xeon (AVX-512) while another process kept one core busy, one activation's backward
# kernel on 64 elements took 5.9 us at best and 96 us at the median through the parallel kernel, 0.67 us
# through its serial span function; after a region numba's OpenMP worker spins on the other core, so
# torch's own ops in between slowed down too (torch's forward of that activation on 64 elements: 38 to
# 98 us, against 10 us in a process that had run no region); and a region can set torch's thread
# count (after torch.set_num_threads(1) and a parallel torch op, torch.get_num_threads() was 2 after
# one region on 8 elements). numpy's packbits (the layouts that take it here) took as long as numba's
# pack_less on one thread up to 2^16 elements (1.31 against 1.12 us at 64 elements, 8.29 against 8.57
# at 2^16; NUMBA_NUM_THREADS=1).
SERIAL = 2**16


def keeps_torch_threads(fn):
    """Decorator for the entry points (forward, backward; the helpers they call are covered by them):
    torch's thread count after `fn` as before it. numba's OpenMP threading layer shares
    the process's OpenMP runtime with torch, and starting it (its first parallel region, or even
    numba.get_num_threads()) set torch's count to numba's: after torch.set_num_threads(1),
    torch.get_num_threads() read 2 on a 2-core Intel Xeon, and every later torch op ran on 2 threads."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        threads = torch.get_num_threads()
        try:
            return fn(*args, **kwargs)
        finally:
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)

    return call


@functools.cache
def available() -> bool:
    """numba is installed (imported only when the first CPU backward runs: it loads scipy if present)."""
    return importlib.util.find_spec("numba") is not None


def _kernels():
    """The kernels every activation shares (imports numba, and loads them from numba's disk cache),
    about to run in parallel: on torch's thread count (_follow_torch_threads)."""
    from invact.activation import _numba_kernels

    _follow_torch_threads()
    return _numba_kernels


def _follow_torch_threads() -> None:
    """numba's parallel kernels on as many threads as torch's ops use (torch.set_num_threads holds for
    them too), at most numba's configured count. Starts numba's threading layer: callers keep torch's
    count (keeps_torch_threads)."""
    import numba

    threads = max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
    if numba.get_num_threads() != threads:
        numba.set_num_threads(threads)


def _words(flags):
    """The whole 8-byte words of a uint8 numpy array, as a uint64 view of the same memory."""
    return flags[: flags.size // 8 * 8].view(np.uint64)


def _packbits(less) -> torch.Tensor:
    """The packed bits (LSB first, in C order) of a bool numpy array, as a flat uint8 tensor that
    torch's allocator holds (the clone): a tensor over numpy's memory (torch.from_numpy) is invisible
    to torch's memory accounting (the profiler's, which invact plan's tests compare with a real
    forward). from_numpy then clone took 1.3 us, torch.empty then numpy's copyto 1.8 (measured on a
    2-core Intel Xeon)."""
    return torch.from_numpy(np.packbits(less, axis=None, bitorder="little")).clone()


def set_lsb_less_(y: torch.Tensor, x: torch.Tensor, threshold: float) -> torch.Tensor:
    """Precision-bit mode in one pass: y's lowest mantissa bit := x < threshold, in place, for flat
    contiguous float32 CPU tensors (the bool mask then two bitwise passes: three passes)."""
    kernel = _kernels().set_lsb_less_serial if x.numel() <= SERIAL else _kernels().set_lsb_less
    kernel(x.numpy(), y.view(torch.int32).numpy(), np.float32(threshold))
    return y


def pack_less(x: torch.Tensor, threshold: float) -> torch.Tensor:
    """The packed bits of x < threshold (LSB first) for a flat contiguous float32 CPU tensor, in one
    pass over x. The threshold is rounded to float32 first, as torch does when it compares with a
    Python float."""
    out = torch.empty((x.numel() + 7) // 8, dtype=torch.uint8)
    if x.numel() <= SERIAL:
        _kernels().pack_less_serial_at(x.data_ptr(), x.numel(), np.float32(threshold), out.data_ptr())
    else:
        _kernels().pack_less(x.numpy(), np.float32(threshold), out.numpy())
    return out


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """The packed bits (LSB first) of a flat contiguous bool CPU tensor."""
    flags = mask.view(torch.uint8).numpy()
    if flags.size <= SERIAL:  # numpy's packbits on this thread (SERIAL)
        return _packbits(flags)
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
    forward's). A contiguous float32 x of up to SERIAL elements (a small layer, whose cost is host time)
    takes the serial kernel straight, without keeps_torch_threads: nothing parallel runs there."""
    # (torch's forward, T in fp32, the serial kernel), set by _forward_any's first serial call
    serial = act.__dict__.get("_numba_serial_forward")
    if (
        serial is not None
        and not precision_bit
        and x.dtype is torch.float32
        and x.numel() <= SERIAL
        and x.is_contiguous()
    ):
        y = serial[0](x)  # contiguous as x (the stride test of _forward_any)
        out = torch.empty((x.numel() + 7) // 8, dtype=torch.uint8)
        serial[2](x.data_ptr(), x.numel(), serial[1], out.data_ptr())  # addresses: no numpy arrays
        return y, out
    return _forward_any(act, x, precision_bit)


@keeps_torch_threads
def _forward_any(act: Activation, x: torch.Tensor, precision_bit: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """forward's every case."""
    if x.dtype != torch.float32 or act.monotone:
        return _portable.forward(act, x, precision_bit)
    y = act.torch_forward(x)  # on x as given: torch's strided and contiguous paths round differently
    if x.stride() == y.stride():
        if x.numel() <= SERIAL and x.is_contiguous():  # on this thread (SERIAL), x as it lies
            if precision_bit:  # y is ours: its lowest mantissa bit becomes the branch bit
                x_flat = x.numpy(force=True).ravel()  # force: x may need grad (the array shares its memory)
                y_int = y.numpy().view(np.int32).ravel()
                _kernels().set_lsb_less_serial(x_flat, y_int, act.threshold_f32)
                return y, x.new_empty(0, dtype=torch.uint8)
            out = torch.empty((x.numel() + 7) // 8, dtype=torch.uint8)
            kernel = _kernels().pack_less_serial_at
            kernel(x.data_ptr(), x.numel(), act.threshold_f32, out.data_ptr())
            # forward's fast path from now on: act's torch forward, threshold and the kernel where one
            # dict lookup finds them (act's properties are a Python call each)
            act.__dict__["_numba_serial_forward"] = (act.torch_forward, act.threshold_f32, kernel)
            return y, out
        if precision_bit:
            set_lsb_less_(flat(y), flat(x), act.threshold)
            return y, x.new_empty(0, dtype=torch.uint8)
        return y, pack_less(flat(x), act.threshold)
    rows = _rows(x) if y.is_contiguous() else None
    if rows is not None and (precision_bit or rows[3] % 8 == 0):  # a chunk of a fused projection
        run, count, stride, cols = rows
        threshold = np.float32(act.threshold)  # as torch rounds a Python float it compares with
        if x.numel() <= SERIAL:  # numpy's ops on this thread, on x's rows where they lie (SERIAL)
            less = x.detach().view(count, cols).numpy() < threshold
            if precision_bit:
                y_int = y.numpy().view(np.int32).reshape(count, cols)
                np.bitwise_and(y_int, np.int32(-2), out=y_int)
                np.bitwise_or(y_int, less, out=y_int)
                return y, x.new_empty(0, dtype=torch.uint8)
            return y, _packbits(less)
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


class Kernels(NamedTuple):
    """An activation's backward kernels (its numba view's): `flags` (y, flags, dy, dx), or (y, dy, dx)
    for a monotone activation, and `bits` (y, bits, dy, dx), each over all elements in parallel
    spans; `span_flags` and `span_bits`, the serial functions these call on each span of `span`
    elements, or None where the view has none (then `span` is 0 and the parallel kernels serve every
    size; without span_bits the bits are unpacked by numpy for span_flags, as the polynomial kernel
    unpacks them for its span function)."""

    span: int
    flags: object
    bits: object
    span_flags: object
    span_bits: object
    span_bits_at: object  # span_bits given the tensors' addresses and the count (None where absent)


def kernels_of(act: Activation) -> Kernels:
    """find_kernels(act), looked up once per activation and kept in its instance dict (as a cached
    property would keep it; invact.activation.activations does not import this module: no import circle)."""
    kernels = act.__dict__.get("_numba_kernels")
    if kernels is None:
        kernels = act.__dict__["_numba_kernels"] = find_kernels(act)
    return kernels


def find_kernels(act: Activation) -> Kernels:
    """The kernels of `act` (kernels_of keeps them): the table kernels' span functions
    where backward_kernel is the table kernel of an instruction set (TABLE_KERNELS), else
    _backward_span (the polynomial's, or a monotone activation's)."""
    cpu = act.cpu  # imports numba and loads the view's kernels from its disk cache
    span_flags, span_bits, span_bits_at = getattr(cpu, "_backward_span", None), None, None
    for isa, (table, _) in getattr(cpu, "TABLE_KERNELS", {}).items():
        if cpu.backward_kernel is table:
            span_flags = getattr(cpu, f"_table_span_flags_{isa}", None)
            span_bits = getattr(cpu, f"_table_span_bits_{isa}", None)
            span_bits_at = getattr(cpu, f"_table_span_bits_at_{isa}", None)
            if span_flags is None or span_bits is None:  # not the view this module knows: in parallel
                span_flags = span_bits = span_bits_at = None
    span = getattr(cpu, "_SPAN", 0) if span_flags is not None else 0
    bits = getattr(cpu, "backward_kernel_bits", None)
    return Kernels(span, cpu.backward_kernel, bits, span_flags, span_bits, span_bits_at)


def _flags(y: torch.Tensor, bits: torch.Tensor, precision_bit: bool) -> np.ndarray:
    """One branch flag per element for the kernels that read flags: y's integer view (its lowest bit)
    in precision-bit mode, else the packed bits unpacked (0 or 1)."""
    if precision_bit:
        return _bits.int_view(y).contiguous().numpy().ravel()
    return np.unpackbits(bits.contiguous().numpy(), count=y.numel(), bitorder="little")


def backward(act: Activation, y: torch.Tensor, bits: torch.Tensor, dy: torch.Tensor, precision_bit: bool
             ) -> torch.Tensor:  # fmt: skip
    """backward_any, where fp32 y, dy and packed bits of one span run its serial function straight,
    without keeps_torch_threads (nothing parallel runs there), given the tensors' addresses (the table
    views' span_bits_at: no numpy array per argument): a small layer's cost is host time."""
    kernels = act.__dict__.get("_numba_kernels")
    if (
        kernels is not None
        and kernels.span_bits_at is not None
        and not precision_bit
        and y.dtype is torch.float32
        and dy.dtype is torch.float32
        and y.numel() <= kernels.span
        and y.is_contiguous()
        and dy.is_contiguous()
        and dy.numel() == y.numel()  # the kernel reads what the addresses hold: sizes checked here
        and bits.numel() >= (y.numel() + 7) // 8
        and bits.dtype is torch.uint8
    ):
        dx = torch.empty_like(y)
        bits = bits.contiguous()
        kernels.span_bits_at(y.data_ptr(), bits.data_ptr(), dy.data_ptr(), dx.data_ptr(), y.numel())
        return dx
    return backward_any(act, y, bits, dy, precision_bit)


@keeps_torch_threads
def backward_any(act: Activation, y: torch.Tensor, bits: torch.Tensor, dy: torch.Tensor, precision_bit: bool
                 ) -> torch.Tensor:  # fmt: skip
    """dx = dy * q(y, bit) for flat CPU tensors, or contiguous ones of one shape (dx then in y's, in
    dy's dtype). The bits come packed (`bits`, uint8, LSB first) or, in precision-bit mode, as y's
    own integer view, whose lowest bit is the branch bit; neither for a monotone activation. Packed
    bits go to the kernel as they are (`backward_kernel_bits`: each thread unpacks its span's into a
    buffer that stays in cache). Up to one span (SERIAL) the span's serial function runs on this
    thread: the function the parallel kernel calls on its one span.

    The kernels read and write fp32 (numba has no bf16): an operand in another dtype goes through an
    fp32 buffer of at most FP32_BLOCK elements (fp32_blocks). On the meta device (invact plan's step,
    planned for a CPU: invact._meta) the same tensors are allocated and no kernel runs."""
    if getattr(act.cpu, "backward_kernel", None) is None:
        # an emitted activation whose numba view did not import (invact.loader warns): torch's ops
        return _portable.backward(act, y, bits, dy, precision_bit)
    if y.numel() > SERIAL and not y.is_meta:  # the parallel kernels below
        _follow_torch_threads()
    dx = torch.empty(y.shape, dtype=dy.dtype, device=y.device)
    for start, y32, dy32, dx32 in fp32_blocks(y.reshape(-1), dy.reshape(-1), dx.view(-1)):
        if not y.is_meta:
            _kernel(act, y, start, y32, bits, dy32, dx32, precision_bit)
    return dx


# Elements per block of fp32 buffers (fp32_blocks) for a backward whose y, dy or dx is not fp32:
# 12 bytes per element of them live at once, besides dx, rather than whole fp32 copies of y and dy
# and an fp32 dx (a bf16 backward held 14 bytes per element, where torch's own allocates dx's 2). A
# multiple of 8 (whole bytes of packed bits) and of the kernels' span (_SPAN, 2**16): 16 spans, so
# up to 16 threads share each block. Smaller buffers also stay out of fresh pages: measured by
# benchmarks/cpu_fp32_block.py (results/cpu_fp32_block_cpu.json: a 2-core Intel Xeon, AVX-512, 2
# threads, bf16, two activations of the spec), blocks of 2**20 against one block of the whole tensor
# took 31.0 and 38.9 ms against 93.9 and 90.2 ms at 2**24 elements, 7.4 and 7.2 against 8.4 and 7.8
# ms at 2**22; up to 2**20 elements one block either way. Blocks of 2**17, 2**18 and 2**19 took 2 to
# 19% longer than 2**20 at 2**22 and 2**24 elements (the same machine, an earlier script's run).
FP32_BLOCK = 2**20


def fp32_blocks(y: torch.Tensor, dy: torch.Tensor, dx: torch.Tensor):
    """(start, y32, dy32, dx32) for each block of at most FP32_BLOCK elements of the flat tensors y,
    dy and dx: a fp32 operand's own elements (a view), any other's in an fp32 buffer, y's and dy's
    converted into it before the block is yielded, dx's copied out of it (rounded to dx's dtype) once
    the caller is done with the block. One buffer per converted operand for all blocks."""
    n = y.numel()
    size = min(n, FP32_BLOCK)
    buffers = [None if t.dtype is torch.float32 else torch.empty(size, device=t.device) for t in (y, dy, dx)]
    y = y.contiguous()  # flat already (the callers' layout), contiguous but for a rare stride
    dy = dy.contiguous()
    for start in range(0, n, size) if n else ():
        stop = min(n, start + size)
        y32, dy32, dx32 = (
            t[start:stop] if b is None else b[: stop - start]
            for t, b in zip((y, dy, dx), buffers, strict=True)
        )
        if buffers[0] is not None:
            y32.copy_(y[start:stop])
        if buffers[1] is not None:
            dy32.copy_(dy[start:stop])
        yield start, y32, dy32, dx32
        if buffers[2] is not None:
            dx[start:stop].copy_(dx32)


def _kernel(act: Activation, y: torch.Tensor, start: int, y32, bits, dy32, dx32, precision_bit: bool) -> None:
    """The backward kernel on one block: y32, dy32 and dx32 its fp32 operands (contiguous), from
    element `start` of y (whose own dtype picks the 16-bit q, and whose integer view holds the
    precision bits) and of the packed `bits` (whole bytes: start is a multiple of FP32_BLOCK)."""
    n = y32.numel()
    y = y.reshape(-1)[start : start + n]
    bits = bits if precision_bit or act.monotone else bits.contiguous()[start // 8 : (start + n + 7) // 8]
    arrays = y32.numpy(), dy32.numpy(), dx32.numpy()  # contiguous 1-D: views
    if y.dtype in SIXTEEN_BIT and act.has_16bit_q:  # the 16-bit q the GPU kernels evaluate
        kernel = act.cpu.backward16_kernel  # one flag per element (Activation.q16, codegen.half)
        if act.monotone:
            kernel(*arrays)
        else:
            kernel(arrays[0], _flags(y, bits, precision_bit), arrays[1], arrays[2])
        return
    k = kernels_of(act)
    serial = n <= k.span  # 0 where the view has no span function
    if act.monotone:
        (k.span_flags if serial else k.flags)(*arrays)
    elif precision_bit:
        (k.span_flags if serial else k.flags)(arrays[0], _flags(y, bits, True), arrays[1], arrays[2])
    elif not serial:
        k.bits(arrays[0], bits.numpy(), arrays[1], arrays[2])
    elif k.span_bits is not None:
        k.span_bits(arrays[0], bits.numpy(), arrays[1], arrays[2])
    else:  # the polynomial's span function reads one flag per element (0 or 1)
        k.span_flags(arrays[0], _flags(y, bits, False), arrays[1], arrays[2])
