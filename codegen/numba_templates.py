"""The numba backward kernels' source, as templates the numba view (codegen.numba_view) fills in per
coefficient file and prints after the scalar functions into every `<act>_cpu.py` and --emit module."""

# The numba backward kernel, printed after the scalar functions into every <name>_cpu.py and --emit
# module (its comment below says why at module level); invact.activation._numba calls it.
NUMBA_COMMON = """

# The backward kernel: dx = dy * q(y, bit) in fp32, compiled by numba from the functions above and
# cached on disk (cache=True: a later process loads it instead of compiling). Fast-math flags that keep
# IEEE semantics for NaN and inf, which it relies on: FMA contraction, reassociation, reciprocal and
# approximate-function rewrites (within 6e-7 of the strict build; tests/invact/test_functional.py
# compares it with the torch-op backward).
_FASTMATH = {"contract", "reassoc", "arcp", "afn"}
_INF, _NAN = np.float32(np.inf), np.float32(np.nan)
"""

NUMBA_MONOTONE = '''

@numba.njit(fastmath=_FASTMATH, cache=True)
def _backward_span(y, dy, dx):  # pragma: no cover - runs compiled
    """dx = dy * q(y) on one thread's span (monotone: no bit). q itself at y = +-inf (x = +-inf); NaN
    stays NaN."""
    prefer_512_bit_vectors()
    for i in range(y.size):
        dx[i] = dy[i] * (_q_right(y[i]) if y[i] == y[i] else _NAN)


_SPAN = 2**16  # elements per call of _backward_span


@numba.njit(parallel=True, cache=True)
def backward_kernel(y, dy, dx):  # pragma: no cover - runs compiled
    """dx = dy * q(y) (see _backward_span), span by span of _SPAN elements across the threads: the
    serial function carries the vector-width attribute, which a prange body cannot."""
    for p in numba.prange((y.size + _SPAN - 1) // _SPAN):
        lo, hi = p * _SPAN, min(y.size, (p + 1) * _SPAN)
        _backward_span(y[lo:hi], dy[lo:hi], dx[lo:hi])
'''

# A whole branch as one inlined function, where a kernel evaluates every piece of it.
WHOLE_JIT = '_q_{name} = numba.njit(inline="always", fastmath=_FASTMATH, cache=True)(q_{name}_scalar)\n'
NUMBA_TWO_BRANCHES = '''{piece_jits}
# Elements per far-piece check: one AVX-512 vector of fp32 (two AVX2 ones), whose notes (below) are
# two uint64 words. A branch's far piece runs only in blocks holding an element beyond its split;
# with splits chosen for this (the floor family's block cost), few blocks have one.
_BLOCK = 16  # _SPAN (below) is a whole number of blocks
_SHIFTS = (np.uint64(32), np.uint64(16), np.uint64(8))


@numba.njit(fastmath=_FASTMATH, cache=True)
def _backward_span(y, flags, dy, dx):  # pragma: no cover - runs compiled
    """dx = dy * q(y, bit) on one thread's span: q_left where flags[i] & 1, else q_right; NaN where y
    is +-inf or NaN. First every element's near piece, in one loop over the span (vectorized, with
    one aliasing check: a loop per block paid one per block, measured 20% slower), noting which far
    piece each element needs (bit 0: left, bit 1: right). Then block by block, the far pieces its
    notes ask for (two words ORed, folded to a byte); in the last partial block, element by element."""
    prefer_512_bit_vectors()
    n = y.size
    need = np.empty((n + 7) // 8 * 8, dtype=np.uint8)
    words = need.view(np.uint64)  # read only: numba lost writes through its own views of slices
    for i in range(n):
        left = flags[i] & 1
        q = {near_q}
        need[i] = {need}
        dx[i] = dy[i] * (q if abs(y[i]) < _INF else _NAN)  # y = +-inf or NaN: NaN, as torch
    full = n - n % _BLOCK
    for b in range(full // _BLOCK):
        m = words[2 * b] | words[2 * b + 1]
        if m == 0:
            continue
        for shift in _SHIFTS:
            m |= m >> shift
        lo = b * _BLOCK
{far_passes}
{tail_passes}
'''

NUMBA_EVERY_PIECE = '''

@numba.njit(fastmath=_FASTMATH, cache=True)
def _backward_span(y, flags, dy, dx):  # pragma: no cover - runs compiled
    """dx = dy * q(y, bit) on one thread's span: q_left where flags[i] & 1, else q_right; NaN where y
    is +-inf or NaN."""
    prefer_512_bit_vectors()
    for i in range(y.size):
        # Both branches, every piece of each, then a select: branch-free, so it vectorizes.
        a, b = _q_left(y[i]), _q_right(y[i])
        q = a if flags[i] & 1 else b
        dx[i] = dy[i] * (q if abs(y[i]) < _INF else _NAN)  # y = +-inf or NaN: NaN, as torch
'''

# The two entries of a two-branch kernel, after its _backward_span: the flags per element, or packed.
NUMBA_SPANS = '''

_SPAN = 2**16  # elements per call of _backward_span: whole bytes of bits (and 256 KB of y)


@numba.njit(parallel=True, cache=True)
def backward_kernel(y, flags, dy, dx):  # pragma: no cover - runs compiled
    """dx = dy * q(y, bit) (see _backward_span), the bit of element i in flags[i] & 1 (uint8, or y's
    int32 view in precision-bit mode), span by span of _SPAN elements across the threads. A prange
    over blocks would put the block loops in numba's parallel body, which it compiled 4x slower
    (measured); each span a call of the serial function keeps them as fast as a serial loop."""
    for p in numba.prange((y.size + _SPAN - 1) // _SPAN):
        lo, hi = p * _SPAN, min(y.size, (p + 1) * _SPAN)
        _backward_span(y[lo:hi], flags[lo:hi], dy[lo:hi], dx[lo:hi])


@numba.njit(parallel=True, cache=True)
def backward_kernel_bits(y, bits, dy, dx):  # pragma: no cover - runs compiled
    """backward_kernel with the bits packed (uint8, LSB first: element i is bit i % 8 of byte i // 8).
    Each span unpacks its own into a buffer that stays in cache; measured on a 2-core Zen 4 (2^22
    elements) as fast as backward_kernel given unpacked flags, where unpacking them all first cost a
    pass writing and reading n bytes (the whole backward 1.85x -> 1.62x a same-bytes torch pass)."""
    for p in numba.prange((y.size + _SPAN - 1) // _SPAN):
        lo, hi = p * _SPAN, min(y.size, (p + 1) * _SPAN)
        flags = np.empty(_SPAN, dtype=np.uint8)
        words = flags.view(np.uint64)  # of the whole buffer: see unpack_bits
        unpack_bits(bits[lo // 8 : (hi + 7) // 8], flags[: hi - lo], words[: (hi - lo) // 8])
        _backward_span(y[lo:hi], flags[: hi - lo], dy[lo:hi], dx[lo:hi])
'''

# Where codegen printed NEAR_TABLE_<ISA>: the kernels that read it, for each such instruction set. The
# far pieces run on lists of the elements whose notes ask for them (_far_pieces, shared by the
# instruction sets).
NUMBA_FAR_LISTS = '''

# Blocks with far notes a span lists before their far pieces run (_far_pieces), and the room that
# takes: a block's elements each at most (_BLOCK, the most lanes a table kernel's block has). 128
# blocks (with their elements, 17 KB) stay in cache; N(0, 1) inputs fill the list about once per
# 2^16-element span.
_NOTED = 128
_NOTED_U = np.uint64(_NOTED)  # compared with an unsigned count: see _table_span_<isa>


@numba.njit(fastmath=_FASTMATH, cache=True)
def _far_pieces(y, dy, dx, starts, notes, count, lanes, at, values):  # pragma: no cover - runs compiled
    """The far pieces of the first `count` listed blocks (block starts[b] of `lanes` elements, its notes
    notes[b]: the left branch's in the low `lanes` bits, the right's above): dx[i] = dy[i] *
    q_<branch>_far(y[i]) on each noted element (NaN where y[i] is +-inf or NaN). Each branch's
    elements are listed in `at`, their y gathered into `values` (both with room for lanes * count),
    where the far piece runs vectorized, then scattered. A function of its own, called (not inlined)
    from a span's two call sites: inlined, its vectorized far pieces were compiled twice per span."""
    for branch in range(2):
        listed = 0
        for b in range(count):
            listed = _lookup.note(at, listed, starts[b], (notes[b] >> (branch * lanes)) & ((1 << lanes) - 1))
        for t in range(listed):
            values[t] = y[at[t]]
        if branch == 0:
            for t in range(listed):
                values[t] = _q_left_far(values[t])
        else:
            for t in range(listed):
                values[t] = _q_right_far(values[t])
        for t in range(listed):
            i = at[t]
            dx[i] = _lookup.far_value(values[t], y[i], dy[i])
'''
NUMBA_TABLE = '''

_near_block_{isa} = _lookup.near_table(
    NEAR_TABLE_G, NEAR_TABLE_{ISA}_SCALE, NEAR_TABLE_{ISA}, (LEFT_SPLIT, RIGHT_SPLIT),
    NEAR_TABLE_{ISA}_ENTRIES,
)
_LANES_{ISA} = _lookup.LANES["{isa}"]  # elements per block of the {isa} kernels


@numba.njit(inline="always", fastmath=_FASTMATH)
def _table_span_{isa}(y, flags, dy, dx, packed):  # pragma: no cover - runs compiled
    """_backward_span by NEAR_TABLE_{ISA}, block by block of _LANES_{ISA} elements: the near pieces of a
    block in one call of _near_block_{isa} (invact.activation._lookup), which returns its far notes. A block
    with notes is listed without a branch (its start and notes written, the count moved by one if it has
    any), and the list's far pieces run when it is full and at the end (_far_pieces). The near pieces'
    loop is bound by its chains' latency, so a branch mispredicted on a noted block cost it most of a
    block (measured on Zen 4, AVX2, N(0, 1) inputs: 0.16 ns per element where the far pieces took
    0.05). The bits: see invact.activation._lookup.branch_word. Inlined into one function per `packed`, a
    constant there: with both paths in one loop, LLVM kept the table's registers on the stack
    (measured slower)."""
    n = y.size
    starts, notes = np.empty(_NOTED, dtype=np.int64), np.empty(_NOTED, dtype=np.int64)
    at, values = np.empty(_NOTED * _BLOCK, dtype=np.int64), np.empty(_NOTED * _BLOCK, dtype=np.float32)
    # count unsigned: with an int64 index numba wraps negative indices at each store (three more
    # instructions a block in the assembly), and LLVM then kept the loop's index on the stack.
    count = np.uint64(0)
    full = n - n % _LANES_{ISA}
    for lo in range(0, full, _LANES_{ISA}):
        m = _near_block_{isa}(y, dy, dx, lo, _LANES_{ISA}, flags) if packed else _near_block_{isa}(
            y, dy, dx, lo, _LANES_{ISA}, _lookup.branch_word(flags, lo, _LANES_{ISA}, False))
        starts[count], notes[count] = lo, m
        count += np.uint64(m != 0)
        if _lookup.rarely(count == _NOTED_U):
            _far_pieces(y, dy, dx, starts, notes, np.int64(count), _LANES_{ISA}, at, values)
            count = np.uint64(0)
    if full < n:  # the partial block
        last = n - full
        m = _near_block_{isa}(y, dy, dx, full, last, _lookup.branch_word(flags, full, last, packed))
        starts[count], notes[count] = full, m
        count += np.uint64(m != 0)
    _far_pieces(y, dy, dx, starts, notes, np.int64(count), _LANES_{ISA}, at, values)


@numba.njit(fastmath=_FASTMATH, cache=True)
def _table_span_flags_{isa}(y, flags, dy, dx):  # pragma: no cover - runs compiled
    """_table_span_{isa} with one flag per element."""
    prefer_512_bit_vectors()
    _table_span_{isa}(y, flags, dy, dx, False)


@numba.njit(fastmath=_FASTMATH, cache=True)
def _table_span_bits_{isa}(y, bits, dy, dx):  # pragma: no cover - runs compiled
    """_table_span_{isa} with packed bits."""
    prefer_512_bit_vectors()
    _table_span_{isa}(y, bits, dy, dx, True)


@numba.njit(fastmath=_FASTMATH, cache=True)
def _table_span_bits_at_{isa}(y, bits, dy, dx, n):  # pragma: no cover - runs compiled
    """_table_span_bits_{isa} given addresses (data_ptr()s of contiguous tensors: n float32 each of y,
    dy and dx, (n + 7) // 8 bytes of bits), so that a small call builds no numpy array per argument."""
    prefer_512_bit_vectors()
    _table_span_{isa}(f32_at(y, n), u8_at(bits, (n + 7) // 8), f32_at(dy, n), f32_at(dx, n), True)


@numba.njit(parallel=True, cache=True)
def table_kernel_{isa}(y, flags, dy, dx):  # pragma: no cover - runs compiled
    """backward_kernel by NEAR_TABLE_{ISA} (needs {needs})."""
    for p in numba.prange((y.size + _SPAN - 1) // _SPAN):
        lo, hi = p * _SPAN, min(y.size, (p + 1) * _SPAN)
        _table_span_flags_{isa}(y[lo:hi], flags[lo:hi], dy[lo:hi], dx[lo:hi])


@numba.njit(parallel=True, cache=True)
def table_kernel_bits_{isa}(y, bits, dy, dx):  # pragma: no cover - runs compiled
    """backward_kernel_bits by NEAR_TABLE_{ISA} (needs {needs}): nothing unpacked, each block reads its
    byte(s) of bits."""
    for p in numba.prange((y.size + _SPAN - 1) // _SPAN):
        lo, hi = p * _SPAN, min(y.size, (p + 1) * _SPAN)
        _table_span_bits_{isa}(y[lo:hi], bits[lo // 8 : (hi + 7) // 8], dy[lo:hi], dx[lo:hi])
'''
# After the table kernels: which kernel invact.activation._numba calls.
NUMBA_TABLE_CHOICE = """

polynomial_kernel, polynomial_kernel_bits = backward_kernel, backward_kernel_bits
# The table kernels by the instruction set they need; what invact.activation._numba calls is the one for the
# instruction set numba compiles for, or the polynomial in g without one.
TABLE_KERNELS = {{
{kernels}
}}
if _lookup.instruction_set() in TABLE_KERNELS:
    backward_kernel, backward_kernel_bits = TABLE_KERNELS[_lookup.instruction_set()]
"""
TABLE_NEEDS = {"avx512": "AVX-512F", "avx2": "AVX2"}


# The partial block at the end of a span: its far pieces element by element, as its notes ask.
NUMBA_TAIL_PASS = """    for i in range(full, n):
        if need[i] & {note} and abs(y[i]) < _INF:
            dx[i] = dy[i] * _q_{name}_far(y[i])"""

NUMBA_FAR_PASS = """        if m & np.uint64({note}):
            for j in range(_BLOCK):
                i = lo + j
                beyond = {bit} & (y[i] >= {split}) & (abs(y[i]) < _INF)
                q = _q_{name}_far(y[i])
                dx[i] = dy[i] * q if beyond else dx[i]"""

BRANCH_BIT = {"left": "(flags[i] & 1 == 1)", "right": "(flags[i] & 1 == 0)"}
NOTE = {"left": 1, "right": 2}  # the bit of an element's note (need[i]) that asks for a branch's far piece
