"""The numba forward kernels give exactly the bits of the torch-op path they replace."""

import pytest
import torch

pytest.importorskip("numba")

from invact.activation import _bits, _numba  # noqa: E402
from invact.activation._bits import is_left  # noqa: E402
from invact.activation.activations import ACTIVATIONS  # noqa: E402

T = ACTIVATIONS["gelu"].threshold
SPAN = _numba._kernels()._SPAN


def _inputs(n: int) -> torch.Tensor:
    """Random values plus the edge cases of the comparison: T rounded to fp32, its neighbours, NaN, inf."""
    x = torch.randn(n) * 3
    t32 = torch.tensor(T, dtype=torch.float32)
    below, above = torch.nextafter(t32, torch.tensor(-1.0)), torch.nextafter(t32, torch.tensor(0.0))
    edges = torch.stack([t32, below, above, *torch.tensor([float("nan"), float("inf"), float("-inf")])])
    x[: min(n, 6)] = edges[: min(n, 6)]
    return x


# sizes around a byte, and past the span each thread packs (one span, then a partial one)
@pytest.mark.parametrize("n", [1, 7, 8, 13, 1000, SPAN, SPAN + 5, 2 * SPAN + 13])
def test_pack_less_matches_the_mask_then_pack(n):
    x = _inputs(n)
    assert torch.equal(_numba.pack_less(x, T), _bits.pack(is_left(x, T)))


@pytest.mark.parametrize("n", [1, 7, 8, 13, 1000, 2**16 + 5])
def test_unpack_bits_matches_torchs_unpack(n):
    import numpy as np

    from invact.activation._cpu_math import unpack_bits

    bits = _bits.pack(torch.rand(n) < 0.5)
    flags = np.empty(n, dtype=np.uint8)
    unpack_bits(bits.numpy(), flags, _numba._words(flags))
    assert torch.equal(torch.from_numpy(flags), _bits.unpack(bits, n).to(torch.uint8))  # 0 or 1 each


@pytest.mark.parametrize("n", [1, 13, 2**16 + 5])
def test_set_lsb_less_matches_the_mask_then_with_lsb(n):
    x = _inputs(n)
    y = torch.randn(n)
    want = _bits.with_lsb(y, is_left(x, T))
    assert torch.equal(_numba.set_lsb_less_(y.clone(), x, T).view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("n", [1, 7, 8, 13, 1000, 2 * SPAN + 13])
def test_pack_mask_matches_torchs_pack(n):
    mask = torch.rand(n) < 0.5
    assert torch.equal(_numba.pack_mask(mask), _bits.pack(mask))


# (rows, columns) of the chunk: columns not a multiple of 8 (bits by a torch compare), a multiple of
# 8 (bits packed row by row where x lies), rows past one thread's turn of about a span's elements
STRIDED = [(4, 7), (4, 16), (4, 1001), (3, 2056), (2 * SPAN // 16 + 3, 16)]


def _chunk(rows: int, columns: int) -> torch.Tensor:
    """The first half of a fused (rows, 2 * columns) output: strided rows, the last dimension dense."""
    return _inputs(2 * rows * columns).view(rows, 2 * columns).chunk(2, dim=-1)[0]


def _strided_layouts(rows: int, columns: int) -> dict[str, torch.Tensor]:
    """A chunk as it comes (2-D), as (batch, sequence, width) (the leading dimensions merge into rows),
    and transposed (the last dimension strided: the torch compare's path)."""
    chunk = _chunk(rows, columns)
    batched = _inputs(4 * rows * columns).view(2, rows, 2 * columns).chunk(2, dim=-1)[0]
    return {"2-D": chunk, "3-D": batched, "transposed": chunk.t()}


@pytest.mark.parametrize("layout", ["2-D", "3-D", "transposed"])
@pytest.mark.parametrize(("rows", "columns"), STRIDED)
def test_forward_of_a_strided_input_packs_the_bits_in_ys_layout(rows, columns, layout):
    # The bits follow y's element order (torch's output of a strided x is contiguous), compared
    # without copying x.
    from invact._layout import flat, like

    x = _strided_layouts(rows, columns)[layout]
    y, bits = _numba.forward(ACTIVATIONS["gelu"], x, False)
    assert x.stride() != y.stride()
    assert torch.equal(bits, _bits.pack(is_left(flat(like(x, y)), T)))


@pytest.mark.parametrize("layout", ["2-D", "3-D", "transposed"])
@pytest.mark.parametrize(("rows", "columns"), STRIDED)
def test_precision_bit_forward_of_a_strided_input_sets_ys_lowest_bits(rows, columns, layout):
    from invact._layout import flat, like

    x = _strided_layouts(rows, columns)[layout]
    y, bits = _numba.forward(ACTIVATIONS["gelu"], x, True)
    want = _bits.with_lsb(ACTIVATIONS["gelu"].torch_forward(x), is_left(like(x, y), T))
    assert bits.numel() == 0 and torch.equal(flat(y).view(torch.int32), flat(want).view(torch.int32))


@pytest.mark.parametrize(("shape", "rows"), [((4, 6, 16), (24, 32, 16)), ((2, 3, 8), (6, 16, 8))])
def test_rows_of_a_chunk(shape, rows):
    # (rows, row stride, columns) of the first half of a fused output along its last dimension
    x = torch.zeros(*shape[:-1], 2 * shape[-1]).chunk(2, dim=-1)[0]
    run, *found = _numba._rows(x)
    assert tuple(found) == rows and run.data_ptr() == x.data_ptr()
    assert run.numel() == (rows[0] - 1) * rows[1] + rows[2]


def test_rows_refuses_layouts_that_are_not_rows():
    x = torch.zeros(4, 6)
    assert _numba._rows(x.t()) is None  # the last dimension strided
    assert _numba._rows(x[:, ::2]) is None
    assert _numba._rows(torch.zeros(4, 1, 16).expand(4, 3, 16)) is None  # leading dims do not merge
    assert _numba._rows(torch.zeros(1, 16).expand(4, 16)) is None  # overlapping rows
