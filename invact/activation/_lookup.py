"""The near pieces of a two-branch backward by table lookup in vector registers (AVX-512 or AVX2), for
the numba kernels printed into invact/_generated/<act>_cpu.py.

Where both branches' near pieces are polynomials in one g = sqrt(max(e1, y + a) + e2) (the floor
family's forms), codegen also prints them as tables: each branch's g from 0 to its split is cut into
n + 1 entries around the points where k g is a whole number j (k g = n at the split), and in each the
piece is a low-degree polynomial in u = k g - j in [-1/2, 1/2] (NEAR_TABLE_<ISA> in the generated
file, with its bound). One lookup instruction fetches a coefficient for every lane: on AVX-512 a
32-entry vpermi2ps for 16 lanes (degree 4 or less for the committed fits), on AVX2 an 8-entry vpermps
for 8 lanes (both branches' entries in 8, so a higher degree). k g + 1.5 * 2^23 holds the rounded k g
in its lowest bits, which is all a lookup reads of its index: a block costs a square root, a
multiply-add for the index, one for u, and a lookup and a multiply-add per coefficient, where the
polynomial in g needs a blend and a multiply-add per coefficient of degree 14. numba's loop
vectorizer cannot emit such a lookup (a table indexed per element becomes a gather, or scalar code),
so `near_table` writes the block's vector code itself, as LLVM IR, in a numba intrinsic.

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

from invact.activation._cpu_math import ROUNDING

# Table entries one lookup instruction reads, by the instruction set whose lookup it is, and the fp32
# lanes of the vector it fills: a block (one 512-bit register on AVX-512, one 256-bit on AVX2; 16
# lanes on AVX2 took two registers of each value and ran 8% slower, measured on Zen 4: LLVM spilled
# the branch masks and y to the stack).
LOOKUPS = {"avx512": 32, "avx2": 8}
LANES = {"avx512": 16, "avx2": 8}

_F32 = ir.FloatType()
_I32, _I64 = ir.IntType(32), ir.IntType(64)


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


def near_table(
    g: tuple[float, float, float],
    scale: tuple[float, float],
    table: tuple[tuple[float, ...], ...],
    splits: tuple[float, float],
    entries: tuple[int, int],
):
    """A numba intrinsic `near_block(y, dy, dx, start, count, bits) -> int64` for one block of up to
    `lanes` elements from `start` (16 for a 32-entry table, 8 for an 8-entry one: LANES; `count` of
    them, the rest of the vector masked off, nothing read or written past it): dx = dy * near(y, bit),
    NaN where y is +-inf or NaN. `bits`: the branch bits (1: left) as an integer whose bit i is element
    start + i's, or the packed bits array itself (uint8, LSB first), whose byte(s) at start / 8 the
    block then reads (a whole block: count = lanes). Returns the far notes: bit i (left) or lanes + i
    (right) where element start + i lies at or beyond its branch's split (+inf included), so that the
    far piece must overwrite dx there (see `far_value`); -inf and NaN are not noted, their near value
    is already NaN.

    g = sqrt(max(e1, y + a) + e2) for g = (e1, a, e2); scale = (left, right): each branch's fp32 factor
    k with k g = entries - 1 at its split; entries = (left, right), filling one lookup (LOOKUPS). Entry
    j of a branch holds its near piece on k g in [j - 1/2, j + 1/2] as a polynomial in u = k g - j
    (in [-1/2, 1/2]; [0, 1/2] for the first, [-1/2, 0] for the last): table[k][e], the coefficient of
    u^k in entry e, the right branch's entries first, then the left's; splits = (left, right)."""
    e1, a, e2 = g
    n_left, n_right = entries
    isa = next((isa for isa, n in LOOKUPS.items() if n == n_left + n_right), None)
    if isa is None or min(entries) < 2:
        raise ValueError(f"the two branches' entries {entries} fill none of the lookups {LOOKUPS}")
    if any(len(row) != n_left + n_right for row in table):
        raise ValueError(f"each table row needs {n_left + n_right} entries (two branches' entries)")
    rows = [[float(np.float32(v)) for v in row] for row in table]
    lanes = LANES[isa]
    v = _Vectors(lanes)

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
            sqrt, fma = v.function(builder, "sqrt", 1), v.function(builder, "fma", 3)
            lookup = _lookup(builder, v, n_left + n_right)

            def at(i):
                return builder.bitcast(builder.gep(data(i), [start]), v.f.as_pointer())

            # count is a constant `lanes` in a whole block's call: the masks fold away, the loads are plain
            within = builder.icmp_unsigned("<", ir.Constant(v.i, list(range(lanes))),
                                           v.broadcast(builder, builder.trunc(count, _I32)))  # fmt: skip
            yv, dyv = v.load(builder, at(0), within), v.load(builder, at(1), within)
            if packed:
                byte = builder.gep(data(5), [builder.lshr(start, ir.Constant(_I64, 3))])
                word = builder.load(builder.bitcast(byte, ir.IntType(lanes).as_pointer()), align=1)
            else:
                word = builder.trunc(args[5], ir.IntType(lanes))
            left = builder.bitcast(word, v.b)

            def pick(on_left: float, on_right: float):
                return builder.select(left, v.splat(on_left), v.splat(on_right))

            # g as the scalar functions compute it (a compare and select is one vmaxps; llvm.maxnum's NaN
            # rule would cost a fix-up). Past the split the entry is garbage, possibly inf, which the far
            # piece overwrites.
            shifted = builder.fadd(yv, v.splat(a))
            clamped = builder.select(builder.fcmp_ordered(">", shifted, v.splat(e1)), shifted, v.splat(e1))
            gv = builder.call(sqrt, [builder.fadd(clamped, v.splat(e2))])
            # k g rounded to the nearest whole j by adding ROUNDING (plus the left branch's first entry,
            # n_right): one multiply-add whose lowest bits are the entry, all a lookup reads of its
            # index, with no conversion, clamp or offset. Up to the split k g <= n (the branch's last
            # entry); fp32 rounding of g there moves k g by ~1e-6, far from n + 1/2.
            kv = pick(*scale)
            offset = pick(ROUNDING + n_right, ROUNDING)
            rounded = builder.call(fma, [gv, kv, offset])
            # u = k g - j, rounded once: the sum less its offset is j exactly (both in [2^23, 2^24)).
            u = builder.call(fma, [gv, kv, builder.fneg(builder.fsub(rounded, offset))])
            c = [lookup(row, builder.bitcast(rounded, v.i)) for row in rows]
            q = (
                _estrin(builder, fma, c, u)
                if len(c) - 1 >= ESTRIN_FROM_DEGREE
                else _horner(builder, fma, c, u)
            )
            # y - y is 0 for finite y and NaN for +-inf and NaN (IEEE; no fast-math flag here lets LLVM
            # fold it): NaN as torch gives there. Taken off dy (dy - 0 keeps dy's sign of zero), off
            # the polynomial's chain.
            dyv = builder.fsub(dyv, builder.fsub(yv, yv))
            v.store(builder, builder.fmul(dyv, q), at(2), within)
            # The notes as integers: the vector booleans far & left would be one AVX-512 instruction but
            # bit by bit on AVX2 (measured: 50 instructions a block).
            far = builder.and_(builder.fcmp_ordered(">=", yv, pick(*splits)), within)
            far = builder.zext(builder.bitcast(far, ir.IntType(lanes)), _I64)
            word = builder.zext(word, _I64)
            notes_left, notes_right = builder.and_(far, word), builder.and_(far, builder.not_(word))
            return builder.or_(notes_left, builder.shl(notes_right, ir.Constant(_I64, lanes)))

        return types.int64(y, dy, dx, types.int64, types.int64, bits), codegen

    return near_block


class _Vectors:
    """The LLVM vector types of a block of `lanes` fp32 lanes, and the intrinsics that take them."""

    def __init__(self, lanes: int):
        self.lanes = lanes
        self.f, self.i = ir.VectorType(_F32, lanes), ir.VectorType(_I32, lanes)
        self.b = ir.VectorType(ir.IntType(1), lanes)

    def splat(self, value: float) -> ir.Constant:
        return ir.Constant(self.f, [float(np.float32(value))] * self.lanes)

    def function(self, builder: ir.IRBuilder, name: str, arguments: int) -> ir.Function:
        """llvm.<name>.v<lanes>f32 taking `arguments` vectors."""
        kind = ir.FunctionType(self.f, [self.f] * arguments)
        return cgutils.get_or_insert_function(builder.module, kind, f"llvm.{name}.v{self.lanes}f32")

    def broadcast(self, builder: ir.IRBuilder, value: ir.Value) -> ir.Value:
        """An i32 in every lane."""
        vector = builder.insert_element(ir.Constant(self.i, ir.Undefined), value, ir.Constant(_I32, 0))
        return builder.shuffle_vector(
            vector, ir.Constant(self.i, ir.Undefined), ir.Constant(self.i, [0] * self.lanes)
        )

    def load(self, builder: ir.IRBuilder, pointer: ir.Value, lanes: ir.Value) -> ir.Value:
        """The lanes of *pointer where `lanes` is true (0 elsewhere), reading nothing else."""
        kind = ir.FunctionType(self.f, [self.f.as_pointer(), _I32, self.b, self.f])
        load = cgutils.get_or_insert_function(builder.module, kind, f"llvm.masked.load.v{self.lanes}f32.p0")
        return builder.call(load, [pointer, ir.Constant(_I32, 4), lanes, self.splat(0.0)])

    def store(self, builder: ir.IRBuilder, value: ir.Value, pointer: ir.Value, lanes: ir.Value) -> None:
        """*pointer := value where `lanes` is true, writing nothing else."""
        kind = ir.FunctionType(ir.VoidType(), [self.f, self.f.as_pointer(), _I32, self.b])
        store = cgutils.get_or_insert_function(builder.module, kind, f"llvm.masked.store.v{self.lanes}f32.p0")
        builder.call(store, [value, pointer, ir.Constant(_I32, 4), lanes])


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


def _lookup(builder: ir.IRBuilder, v: _Vectors, entries: int):
    """row, index -> row[index] in each lane: one vpermi2ps for 32 entries and 16 lanes (AVX-512), or
    one vpermps for 8 entries and 8 lanes (AVX2). Each reads only the low bits of the index it needs."""
    if entries == LOOKUPS["avx512"]:
        name, kind = "llvm.x86.avx512.vpermi2var.ps.512", ir.FunctionType(v.f, [v.f, v.i, v.f])
        permute = cgutils.get_or_insert_function(builder.module, kind, name)
        half = entries // 2
        return lambda row, index: builder.call(
            permute, [ir.Constant(v.f, row[:half]), index, ir.Constant(v.f, row[half:])]
        )
    kind = ir.FunctionType(v.f, [v.f, v.i])
    permute = cgutils.get_or_insert_function(builder.module, kind, "llvm.x86.avx2.permps")
    return lambda row, index: builder.call(permute, [ir.Constant(v.f, row), index])


@numba.njit(inline="always", fastmath={"contract", "reassoc", "arcp", "afn"})
def far_value(q, y, dy):  # pragma: no cover - runs compiled
    """dy * q for a far piece's value q at y, NaN where y is +-inf (noted by near_block like any
    element past the split) or NaN: y - y is 0 for finite y, NaN otherwise (these flags let LLVM
    reassociate and contract, not assume finite values, so it stays)."""
    return dy * (q + (y - y))


def _check_arrays(name: str, *arrays) -> None:
    for array in arrays:
        if not (isinstance(array, types.Array) and array.dtype == types.float32 and array.ndim == 1
                and array.layout == "C"):  # fmt: skip
            raise TypingError(f"{name} takes contiguous 1-D float32 arrays, not {array}")


@intrinsic
def _trailing_zeros(typingctx, value):
    """The number of zero bits below the lowest set bit of an int64 that is not 0 (one tzcnt)."""
    if value != types.int64:
        raise TypingError(f"_trailing_zeros takes an int64, not {value}")

    def codegen(context, builder, signature, args):
        cttz = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_I64, [_I64, ir.IntType(1)]), "llvm.cttz.i64"
        )
        return builder.call(cttz, [args[0], ir.Constant(ir.IntType(1), 1)])

    return types.int64(types.int64), codegen


@numba.njit(inline="always")
def note(at, count, lo, notes):  # pragma: no cover - runs compiled
    """Appends lo + i to at[count:] for each set bit i of `notes` (an int64: a block's far notes of one
    branch) and returns the new count. One pass per set bit (a tzcnt), where a pass over all 16 lanes
    that writes each index and moves the count by its bit cost 2 cycles a lane (measured on Zen 4:
    0.14 ns per element of N(0, 1) inputs, far more than the far pieces themselves)."""
    while notes:
        at[count] = lo + _trailing_zeros(notes)
        count += 1
        notes &= notes - 1
    return count


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
