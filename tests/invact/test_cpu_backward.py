"""The numba backward kernels (invact/_generated/<act>_cpu.py), every one a file has: the polynomial in g
(_backward_span) and the near tables (_table_span_<isa>), each where the CPU runs it. Their far
pieces: each element gets its own branch's piece whichever block and span it lies in, whether a far
piece runs for it or not (in its block for the polynomial, on a list of noted elements for the
tables, also when that list fills), and in the partial block at the end. Their packed-bits entry:
the same dx as with the flags unpacked, at every size and span boundary."""

import math
import re

import pytest
import torch

pytest.importorskip("numba")

from invact.activation import _bits, _lookup, _portable  # noqa: E402
from invact.activation.activations import ACTIVATIONS  # noqa: E402

# The activations whose kernel skips far pieces: the floor family's two-branch forms (codegen prints
# the block loops, with _BLOCK, where a branch's far piece alone calls exp or log).
SKIPPING = sorted(n for n, a in ACTIVATIONS.items() if not a.monotone and hasattr(a.cpu, "_BLOCK"))
# Two fp32 evaluations of one formula, each within 1e-6 of it (tests/codegen/test_generated_precision.py).
FP32_TWO_EVALUATIONS = 2e-6
FAR_X = 6.0  # beyond every split: y -> 0- on the left branch, y = x past the largest right split (4)


# The kernel pairs (flags, packed bits) a numba view can hold: the polynomial in g, and a table kernel
# per instruction set codegen printed a table for (TABLE_KERNELS), skipped where the CPU cannot run it.


def _with_variants(names: list[str]) -> list[tuple[str, str]]:
    """(activation, kernel variant) pairs: "polynomial", and each instruction set with a table."""
    return [(n, v) for n in names for v in ["polynomial", *getattr(ACTIVATIONS[n].cpu, "TABLE_KERNELS", {})]]


def _kernels(name: str, variant: str):
    module = ACTIVATIONS[name].cpu
    if not hasattr(module, "TABLE_KERNELS"):  # the only kernel, not renamed
        return module.backward_kernel, module.backward_kernel_bits
    if variant == "polynomial":
        return module.polynomial_kernel, module.polynomial_kernel_bits
    if not _lookup.runs(variant):
        pytest.skip(f"numba does not compile for {variant} here")
    return module.TABLE_KERNELS[variant]


def _span(name: str) -> tuple[int, int]:
    module = ACTIVATIONS[name].cpu
    return module._BLOCK, module._SPAN


def _inputs(name: str, n: int) -> torch.Tensor:
    """x next to the threshold (near pieces), with far elements of each branch, NaN and inf placed in
    chosen blocks: alone in a block, both in one, at span boundaries and in the last partial block."""
    act = ACTIVATIONS[name]
    block, span = _span(name)
    x = act.threshold + (torch.rand(n, generator=torch.Generator().manual_seed(n)) - 0.5) * 0.4
    marks = {0: -FAR_X, block + 3: FAR_X, 2 * block: -FAR_X, 2 * block + 1: FAR_X, 4 * block + 5: math.nan,
             5 * block: math.inf, span - 1: -FAR_X, span: FAR_X, n - 1: FAR_X, n - 2: -FAR_X}  # fmt: skip
    for position, value in marks.items():
        if position < n:
            x[position] = value
    return x


@pytest.mark.parametrize("n", [1, 15, 16, 17, 100, "two spans and a partial block"])
@pytest.mark.parametrize(("name", "variant"), _with_variants(SKIPPING))
def test_every_element_gets_its_piece(name, n, variant):
    kernel, _ = _kernels(name, variant)
    block, span = _span(name)
    n = 2 * span + block + 5 if isinstance(n, str) else n
    act = ACTIVATIONS[name]
    x = _inputs(name, n)
    y, dy = act.torch_forward(x), torch.randn(n, generator=torch.Generator().manual_seed(0))
    left = _bits.is_left(x, act.threshold)
    dx = torch.empty(n)
    kernel(y.numpy(), left.to(torch.uint8).numpy(), dy.numpy(), dx.numpy())
    want = _portable.backward(act, y, _bits.pack(left), dy, False)
    assert torch.equal(dx.isnan(), want.isnan())
    finite = ~want.isnan()
    assert (dx[finite] - want[finite]).abs().max() <= FP32_TWO_EVALUATIONS * dy.abs().max()


# The table kernels list the blocks with far elements and run their far pieces when the list holds
# _NOTED blocks: wide inputs put far elements in most blocks, so a span fills it many times.
WIDE_X = 4.0  # x ~ N(0, 4^2): a quarter of the elements past the left split or the right one
TABLES = [(name, variant) for name, variant in _with_variants(SKIPPING) if variant != "polynomial"]


@pytest.mark.parametrize("packed", [False, True], ids=["flags", "packed bits"])
@pytest.mark.parametrize(("name", "variant"), TABLES)
def test_far_lists_that_fill_run_every_far_piece(name, variant, packed):
    kernels = _kernels(name, variant)
    module = ACTIVATIONS[name].cpu
    act = ACTIVATIONS[name]
    n = module._SPAN + 13
    x = torch.randn(n, generator=torch.Generator().manual_seed(2)) * WIDE_X
    y, dy = act.torch_forward(x), torch.randn(n, generator=torch.Generator().manual_seed(3))
    left = _bits.is_left(x, act.threshold)
    far = torch.where(left, y >= module.LEFT_SPLIT, y >= module.RIGHT_SPLIT)
    lanes = _lookup.LANES[variant]
    blocks_with_far = far[: n - n % lanes].view(-1, lanes).any(dim=1).sum().item()
    assert blocks_with_far > 4 * module._NOTED  # the list fills, and runs, several times
    dx = torch.empty(n)
    bits = _bits.pack(left).numpy() if packed else left.to(torch.uint8).numpy()
    kernels[packed](y.numpy(), bits, dy.numpy(), dx.numpy())
    want = _portable.backward(act, y, _bits.pack(left), dy, False)
    assert (dx - want).abs().max() <= FP32_TWO_EVALUATIONS * dy.abs().max()


TWO_BRANCH = sorted(n for n, a in ACTIVATIONS.items() if not a.monotone)


@pytest.mark.parametrize("n", [1, 7, 9, "a span less 3", "a span and 13", "two spans and 5"])
@pytest.mark.parametrize(("name", "variant"), _with_variants(TWO_BRANCH))
def test_packed_bits_give_the_same_dx_as_unpacked_flags(name, n, variant):
    flags_kernel, bits_kernel = _kernels(name, variant)
    span = ACTIVATIONS[name].cpu._SPAN
    sizes = {"a span less 3": span - 3, "a span and 13": span + 13, "two spans and 5": 2 * span + 5}
    n = sizes.get(n, n)
    act = ACTIVATIONS[name]
    wide = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3  # both branches, and their tails
    x = _inputs(name, n) if name in SKIPPING else wide
    y, dy = act.torch_forward(x), torch.randn(n, generator=torch.Generator().manual_seed(1))
    left = _bits.is_left(x, act.threshold)
    unpacked, packed = torch.empty(n), torch.empty(n)
    flags_kernel(y.numpy(), left.to(torch.uint8).numpy(), dy.numpy(), unpacked.numpy())
    bits_kernel(y.numpy(), _bits.pack(left).numpy(), dy.numpy(), packed.numpy())
    assert torch.equal(packed.isnan(), unpacked.isnan())
    assert torch.equal(packed.nan_to_num(), unpacked.nan_to_num())  # the same kernel: bit for bit


# One activation per kernel template codegen prints: monotone, a select between both branches' every
# piece, and block skipping (the floor family's split branches).
_EVERY_PIECE = sorted(n for n in TWO_BRANCH if n not in SKIPPING)
KERNEL_KINDS = {
    "monotone": sorted(n for n, a in ACTIVATIONS.items() if a.monotone)[:1],
    "every piece": _EVERY_PIECE[:1],
    "skipping": SKIPPING[:1],
}


@pytest.mark.parametrize("kind", [k for k, names in KERNEL_KINDS.items() if names])
def test_backward_span_asks_for_512_bit_vectors(kind):
    """_backward_span carries "prefer-vector-width"="512"
    (invact.activation._cpu_math.prefer_512_bit_vectors), and on an AVX-512 host compiles to zmm registers:
    LLVM's Intel tunings would otherwise pick 256-bit ones. Compiled afresh, without numba's cache (cached
    code cannot be inspected)."""
    import numba

    act = ACTIVATIONS[KERNEL_KINDS[kind][0]]
    span = numba.njit(fastmath=act.cpu._FASTMATH)(act.cpu._backward_span.py_func)
    y = torch.rand(64).numpy()
    span(y, y.copy(), y.copy()) if act.monotone else span(y, (y > 0.5).astype("uint8"), y.copy(), y.copy())
    (signature,) = span.signatures
    assert '"prefer-vector-width"="512"' in span.inspect_llvm(signature)
    if _lookup.instruction_set() == "avx512":
        assert "zmm" in span.inspect_asm(signature)


@pytest.mark.parametrize("name", [n for n in SKIPPING if hasattr(ACTIVATIONS[n].cpu, "TABLE_KERNELS")])
def test_the_kernel_invact_calls_is_the_table_for_the_instruction_set_numba_compiles_for(name):
    module = ACTIVATIONS[name].cpu
    polynomial = (module.polynomial_kernel, module.polynomial_kernel_bits)
    want = module.TABLE_KERNELS.get(_lookup.instruction_set(), polynomial)
    assert (module.backward_kernel, module.backward_kernel_bits) == want


@pytest.mark.parametrize(
    ("cpu_name", "features", "host", "want"),
    [
        (None, None, "+avx2,+fma,+avx512f", "avx512"),  # the host's features
        (None, None, "+avx2,+fma,-avx512f", "avx2"),
        (None, None, "+avx2,-fma,-avx512f", None),
        # numba passes LLVM the host's features under a named CPU too, unless they are named
        ("haswell", None, "+avx2,+fma,+avx512f", "avx512"),
        ("haswell", "+avx2,+fma", "+avx2,+fma,+avx512f", "avx2"),
        ("haswell", "", "+avx2,+fma,+avx512f", None),  # left out under a named CPU: counted absent
        (None, "+avx2", "+avx2,+fma,+avx512f", "avx512"),  # left out, no named CPU: the host's
        ("skylake-avx512", "+avx2,+fma,+avx512f", "+avx2,-avx512f", "avx512"),
    ],
)
def test_instruction_set_follows_the_cpu_numba_compiles_for(monkeypatch, cpu_name, features, host, want):
    from llvmlite import binding
    from numba.core import config

    class _Features:
        def flatten(self):
            return host

    monkeypatch.setattr(config, "CPU_NAME", cpu_name)
    monkeypatch.setattr(config, "CPU_FEATURES", features)
    monkeypatch.setattr(binding, "get_host_cpu_features", lambda: _Features())
    _lookup.instruction_set.cache_clear()
    try:
        assert _lookup.instruction_set() == want
    finally:
        _lookup.instruction_set.cache_clear()


# (left, right) entries: 31 and 9 fill no lookup; (1, 7) fills AVX2's but leaves the left branch one
# entry, where it needs two (its split's g at k g = entries - 1 >= 1).
@pytest.mark.parametrize("entries", [(16, 15), (4, 5), (1, 7)])
def test_near_table_refuses_entries_that_do_not_fill_a_lookup(entries):
    row = (0.0,) * sum(entries)
    with pytest.raises(ValueError, match=re.escape(f"entries {entries} fill none of the lookups")):
        _lookup.near_table((0.0, 0.0, 0.0), (1.0, 1.0), (row,), (0.0, 0.0), entries)
