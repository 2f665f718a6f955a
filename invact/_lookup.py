"""The near pieces of a two-branch backward by table lookup in vector registers (AVX-512 or AVX2), for
the numba kernels printed into invact/_generated/<act>_cpu.py.

Where both branches' near pieces are polynomials in one g = sqrt(max(e1, y + a) + e2) (the floor
family's forms), codegen also prints them as tables: each branch's range of g up to its split is cut
into equal intervals, and on each the piece is a low-degree polynomial in the interval's own
u = n g / g_max - j in [0, 1] (NEAR_TABLE_<ISA> in the generated file, with its bound). One lookup
instruction fetches a coefficient for every lane: on AVX-512 a 32-entry vpermi2ps (16 intervals per
branch, degree 5 or less for the committed fits), on AVX2 an 8-entry vpermps (8 intervals for both
branches together, so a higher degree). A block then costs a square root, one lookup and one
multiply-add per coefficient, where the polynomial in g needs a blend and a multiply-add per
coefficient of degree 14. numba's loop vectorizer cannot emit such a lookup (a table indexed per
element becomes a gather, or scalar code), so `near_table` writes the block's vector code itself, as
LLVM IR, in a numba intrinsic.

Which table a machine reads follows the instruction set numba compiles for (`instruction_set`); with
neither, the kernels keep the polynomial in g. The IR here is compiled into each cached kernel:
codegen names this file, with its sha256, in the header of every generated file that uses it, so an
edit regenerates them (and renews numba's cache).
"""

from __future__ import annotations

import functools

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils, config
from numba.core.errors import TypingError
from numba.core.extending import intrinsic

LANES = 16  # fp32 lanes of one 512-bit vector (two 256-bit ones): a block
# Table entries one lookup instruction reads, by the instruction set whose lookup it is.
LOOKUPS = {"avx512": 32, "avx2": 8}

_F32 = ir.FloatType()
_I32, _I64 = ir.IntType(32), ir.IntType(64)
_VF, _VI = ir.VectorType(_F32, LANES), ir.VectorType(_I32, LANES)
_VB = ir.VectorType(ir.IntType(1), LANES)


@functools.cache
def instruction_set() -> str | None:
    """ "avx512" where numba compiles for a CPU with AVX-512F, else "avx2" where it has AVX2 and FMA,
    else None. numba passes LLVM the features NUMBA_CPU_FEATURES lists, or, where that is unset, the
    host's (even under NUMBA_CPU_NAME: a build for haswell on an AVX-512 host emits AVX-512 code unless
    NUMBA_CPU_FEATURES is set too). A feature that list leaves out is the named CPU's default: the
    host's where no NUMBA_CPU_NAME is set, else counted absent (the slower kernel, never a wrong one)."""
    from llvmlite import binding

    host = binding.get_host_cpu_features().flatten()
    named = set((host if config.CPU_FEATURES is None else config.CPU_FEATURES).split(","))

    def has(feature: str) -> bool:
        if f"+{feature}" in named or f"-{feature}" in named:
            return f"+{feature}" in named
        return not config.CPU_NAME and f"+{feature}" in host.split(",")

    if has("avx512f"):
        return "avx512"
    return "avx2" if has("avx2") and has("fma") else None


def runs(isa: str) -> bool:
    """A kernel compiled with `isa`'s lookup (a LOOKUPS key) runs here: numba compiles for that
    instruction set or for AVX-512, which has AVX2's."""
    return instruction_set() in (isa, "avx512")


def _splat(value: float) -> ir.Constant:
    return ir.Constant(_VF, [float(np.float32(value))] * LANES)


def near_table(
    g: tuple[float, float, float],
    g_max: tuple[float, float],
    table: tuple[tuple[float, ...], ...],
    splits: tuple[float, float],
    intervals: tuple[int, int],
):
    """A numba intrinsic `near_block(y, dy, dx, start, count, bits) -> int64` for one block of up to 16
    elements from `start` (`count` of them; the rest of the vector is masked off, nothing is read or
    written past it): dx = dy * near(y, bit), NaN where y is +-inf or NaN. `bits`: the branch bits
    (1: left) as an integer whose bit i is element start + i's, or the packed bits array itself (uint8,
    LSB first), whose two bytes at start / 8 the block then reads (a whole block: count = 16).
    Returns the far notes: bit i (left) or 16 + i (right) where element start + i lies at or beyond
    its branch's split (+inf included), so that the far piece must overwrite dx there (see
    `far_value`); -inf and NaN are not noted, their near value is already NaN.

    g = sqrt(max(e1, y + a) + e2) for g = (e1, a, e2); g_max = (left, right): each branch's g at its
    split; intervals = (left, right): each branch's number of intervals, filling one lookup (LOOKUPS:
    32 entries, one AVX-512 vpermi2ps per coefficient, or 8, one AVX2 vpermps per 8 lanes); table[k][j]:
    coefficient of u^k on interval j, the right branch's intervals first, then the left's;
    splits = (left, right)."""
    e1, a, e2 = g
    entries = sum(intervals)
    if entries not in LOOKUPS.values():
        raise ValueError(f"the two branches' intervals fill {entries} entries, not a lookup's {LOOKUPS}")
    if any(len(row) != entries for row in table):
        raise ValueError(f"each table row needs {entries} entries (two branches' intervals)")
    n_left, n_right = intervals
    rows = [[float(np.float32(v)) for v in row] for row in table]
    steps = tuple(n / m for n, m in zip(intervals, g_max, strict=True))  # intervals per unit of g

    @intrinsic
    def near_block(typingctx, y, dy, dx, start, count, bits):
        _check_arrays("near_block", y, dy, dx)
        packed = isinstance(bits, types.Array)
        if packed and not (bits.dtype == types.uint8 and bits.ndim == 1 and bits.layout == "C"):
            raise TypingError("near_block reads packed bits from a contiguous 1-D uint8 array")

        def codegen(context, builder, signature, args):
            def data(i):
                return context.make_array(signature.args[i])(context, builder, args[i]).data

            start, count = args[3], args[4]
            module = builder.module

            def function(name, n):
                return cgutils.get_or_insert_function(module, ir.FunctionType(_VF, [_VF] * n), name)

            sqrt, fma = function("llvm.sqrt.v16f32", 1), function("llvm.fma.v16f32", 3)
            lookup = _lookup(builder, entries)
            masked_load, masked_store = _masked_load(module), _masked_store(module)

            def at(i):
                return builder.bitcast(builder.gep(data(i), [start]), _VF.as_pointer())

            # count is a constant 16 in a whole block's call: the masks fold away and the loads are plain
            lanes = builder.icmp_unsigned("<", ir.Constant(_VI, list(range(LANES))),
                                          _broadcast(builder, builder.trunc(count, _I32)))  # fmt: skip
            align = ir.Constant(_I32, 4)
            yv = builder.call(masked_load, [at(0), align, lanes, _splat(0.0)])
            dyv = builder.call(masked_load, [at(1), align, lanes, _splat(0.0)])
            if packed:
                byte = builder.gep(data(5), [builder.lshr(start, ir.Constant(_I64, 3))])
                word = builder.load(builder.bitcast(byte, ir.IntType(LANES).as_pointer()), align=1)
            else:
                word = builder.trunc(args[5], ir.IntType(LANES))
            left = builder.bitcast(word, _VB)

            def pick(on_left: float, on_right: float):
                return builder.select(left, _splat(on_left), _splat(on_right))

            def pick_int(on_left: int, on_right: int):
                return builder.select(
                    left, ir.Constant(_VI, [on_left] * LANES), ir.Constant(_VI, [on_right] * LANES)
                )

            # g as the scalar functions compute it (a compare and select is one vmaxps; llvm.maxnum's NaN
            # rule would cost a fix-up). Not clamped to g_max: past the split u exceeds 1 and the value
            # is garbage, possibly inf, which the far piece overwrites.
            shifted = builder.fadd(yv, _splat(a))
            clamped = builder.select(builder.fcmp_ordered(">", shifted, _splat(e1)), shifted, _splat(e1))
            gv = builder.call(sqrt, [builder.fadd(clamped, _splat(e2))])
            scaled = builder.fmul(gv, pick(*steps))
            j = builder.fptosi(scaled, _VI)  # truncation: the interval; n at g_max itself, so at most n - 1:
            last = pick_int(n_left - 1, n_right - 1)
            j = builder.select(builder.icmp_signed("<", j, last), j, last)
            u = builder.fsub(scaled, builder.sitofp(j, _VF))  # exact where j <= scaled <= 2j (Sterbenz)
            index = builder.add(j, pick_int(n_right, 0))
            c = [lookup(row, index) for row in rows]
            q = (
                _estrin(builder, fma, c, u)
                if len(c) - 1 >= ESTRIN_FROM_DEGREE
                else _horner(builder, fma, c, u)
            )
            # y - y is 0 for finite y and NaN for +-inf and NaN (IEEE; no fast-math flag here lets LLVM
            # fold it): NaN as torch gives there, one subtraction and one addition.
            q = builder.fadd(q, builder.fsub(yv, yv))
            builder.call(masked_store, [builder.fmul(dyv, q), at(2), align, lanes])
            # The notes as integers: the vector booleans far & left would be one AVX-512 instruction but
            # bit by bit on AVX2 (measured: 50 instructions a block).
            far = builder.and_(builder.fcmp_ordered(">=", yv, pick(*splits)), lanes)
            far = builder.zext(builder.bitcast(far, ir.IntType(LANES)), _I64)
            word = builder.zext(word, _I64)
            notes_left, notes_right = builder.and_(far, word), builder.and_(far, builder.not_(word))
            return builder.or_(notes_left, builder.shl(notes_right, ir.Constant(_I64, LANES)))

        return types.int64(y, dy, dx, types.int64, types.int64, bits), codegen

    return near_block


# The degree from which the polynomial in u is evaluated by Estrin's scheme rather than Horner's.
# Measured on Zen 4 in cache: at degree 9 (an AVX2 table) Estrin's shorter chain was 6% faster; at degree
# 4 (an AVX-512 table; interleaved with Horner's) its extra multiplies cost 5%.
ESTRIN_FROM_DEGREE = 6


def _horner(builder: ir.IRBuilder, fma: ir.Function, c: list[ir.Value], u: ir.Value) -> ir.Value:
    """c[0] + c[1] u + ... by Horner's scheme: len(c) - 1 multiply-adds in one chain."""
    q = c[-1]
    for ck in reversed(c[:-1]):
        q = builder.call(fma, [q, u, ck])
    return q


def _estrin(builder: ir.IRBuilder, fma: ir.Function, c: list[ir.Value], u: ir.Value) -> ir.Value:
    """c[0] + c[1] u + ... by Estrin's scheme: pairs c[2i] + c[2i+1] u, then pairs of those with u^2,
    and so on; a chain of log2(len(c)) multiply-adds where Horner's is len(c) - 1 long."""
    power = u
    while len(c) > 1:
        pairs = [builder.call(fma, [c[i + 1], power, c[i]]) for i in range(0, len(c) - 1, 2)]
        c = pairs + c[len(c) - len(c) % 2 :]
        if len(c) > 1:
            power = builder.fmul(power, power)
    return c[0]


def _lookup(builder: ir.IRBuilder, entries: int):
    """row, index -> row[index] in each of the 16 lanes: one vpermi2ps (32 entries: AVX-512), or one
    vpermps per 8-lane half (8 entries: AVX2)."""
    module = builder.module
    if entries == LOOKUPS["avx512"]:
        permute = cgutils.get_or_insert_function(
            module, ir.FunctionType(_VF, [_VF, _VI, _VF]), "llvm.x86.avx512.vpermi2var.ps.512"
        )

        def lookup(row, index):
            return builder.call(
                permute, [ir.Constant(_VF, row[:LANES]), index, ir.Constant(_VF, row[LANES:])]
            )

        return lookup
    half_f, half_i = ir.VectorType(_F32, LANES // 2), ir.VectorType(_I32, LANES // 2)
    permute = cgutils.get_or_insert_function(
        module, ir.FunctionType(half_f, [half_f, half_i]), "llvm.x86.avx2.permps"
    )
    low, high = (ir.Constant(half_i, list(range(h, h + LANES // 2))) for h in (0, LANES // 2))

    def lookup(row, index):
        table = ir.Constant(half_f, row)
        parts = [
            builder.call(permute, [table, builder.shuffle_vector(index, index, half)]) for half in (low, high)
        ]
        return builder.shuffle_vector(*parts, ir.Constant(_VI, list(range(LANES))))

    return lookup


@numba.njit(inline="always", fastmath={"contract", "reassoc", "arcp", "afn"})
def far_value(q, y, dy):  # pragma: no cover - runs compiled
    """dy * q for a far piece's value q at y, NaN where y is +-inf (noted by near_block like any
    element past the split) or NaN: y - y is 0 for finite y, NaN otherwise (these flags let LLVM
    reassociate and contract, not assume finite values, so it stays)."""
    return dy * (q + (y - y))


def _masked_load(module: ir.Module) -> ir.Function:
    return cgutils.get_or_insert_function(
        module, ir.FunctionType(_VF, [_VF.as_pointer(), _I32, _VB, _VF]), "llvm.masked.load.v16f32.p0"
    )


def _masked_store(module: ir.Module) -> ir.Function:
    return cgutils.get_or_insert_function(
        module,
        ir.FunctionType(ir.VoidType(), [_VF, _VF.as_pointer(), _I32, _VB]),
        "llvm.masked.store.v16f32.p0",
    )


def _check_arrays(name: str, *arrays) -> None:
    for array in arrays:
        if not (isinstance(array, types.Array) and array.dtype == types.float32 and array.ndim == 1
                and array.layout == "C"):  # fmt: skip
            raise TypingError(f"{name} takes contiguous 1-D float32 arrays, not {array}")


@intrinsic
def store_lanes(typingctx, dst, src, start, mask):
    """dst[start + i] = src[i] for each i < 16 whose bit i of `mask` is set; nothing else is read or
    written (one masked vector store). How a block's far pieces, computed for all 16 elements in a
    vectorized loop, land on the elements that need them: numba's loop vectorizer gives up on a loop
    that stores a select between the new value and dx's own (measured: scalar code)."""
    _check_arrays("store_lanes", dst, src)

    def codegen(context, builder, signature, args):
        def data(i):
            return context.make_array(signature.args[i])(context, builder, args[i]).data

        target = builder.bitcast(builder.gep(data(0), [args[2]]), _VF.as_pointer())
        source = builder.bitcast(data(1), _VF.as_pointer())
        # bit i of the mask to lane i by a broadcast, an and and a compare: a bitcast of the integer to
        # 16 booleans is one instruction on AVX-512 but bit by bit on AVX2 (measured: 50 instructions)
        bit = builder.and_(
            _broadcast(builder, builder.trunc(args[3], _I32)),
            ir.Constant(_VI, [1 << i for i in range(LANES)]),
        )
        lanes = builder.icmp_unsigned("!=", bit, ir.Constant(_VI, [0] * LANES))
        align = ir.Constant(_I32, 4)
        values = builder.call(_masked_load(builder.module), [source, align, lanes, _splat(0.0)])
        builder.call(_masked_store(builder.module), [values, target, align, lanes])
        return context.get_dummy_value()

    return types.none(dst, src, types.int64, types.int64), codegen


@numba.njit(inline="always")
def branch_word(flags, lo, count, packed):  # pragma: no cover - runs compiled
    """The branch bits of elements lo .. lo + count - 1 (count <= 16) as one integer, element lo + i at
    bit i: from bytes of packed bits (LSB first; lo a multiple of 8) where `packed`, else from
    flags[lo + i] & 1 (one flag per element: uint8, or y's int32 view in precision-bit mode)."""
    if packed:
        word = np.int64(flags[lo // 8])
        return word | (np.int64(flags[lo // 8 + 1]) << 8) if count > 8 else word
    word = np.int64(0)
    for j in range(count):
        word |= (np.int64(flags[lo + j]) & 1) << j
    return word


def _broadcast(builder: ir.IRBuilder, value: ir.Value) -> ir.Value:
    """An i32 in every lane of a 16-lane vector."""
    vector = builder.insert_element(ir.Constant(_VI, ir.Undefined), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(vector, ir.Constant(_VI, ir.Undefined), ir.Constant(_VI, [0] * LANES))


@intrinsic
def rarely(typingctx, value):
    """value != 0, hinted to LLVM as rarely true (llvm.expect)."""

    def codegen(context, builder, signature, args):
        nonzero = builder.icmp_unsigned("!=", args[0], ir.Constant(args[0].type, 0))
        expect = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.IntType(1), [ir.IntType(1), ir.IntType(1)]), "llvm.expect.i1"
        )
        return builder.call(expect, [nonzero, ir.Constant(ir.IntType(1), 0)])

    return types.boolean(value), codegen
