"""The numba forward kernels give exactly the bits of the torch-op path they replace."""

import pytest
import torch

pytest.importorskip("numba")

from invact import _bits, _numba  # noqa: E402
from invact._bits import is_left  # noqa: E402
from invact.activations import ACTIVATIONS  # noqa: E402

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

    from invact._cpu_math import unpack_bits

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


@pytest.mark.parametrize("columns", [7, 16, 1001])
def test_forward_of_a_strided_input_packs_the_bits_in_ys_layout(columns):
    # A chunk of a fused projection: x's rows are strided, y (torch's output) is contiguous; the bits
    # follow y's element order, compared without copying x.
    from invact._layout import flat, like

    x = _inputs(8 * columns).view(4, 2 * columns).chunk(2, dim=-1)[0]
    y, bits = _numba.forward(ACTIVATIONS["gelu"], x, False)
    assert x.stride() != y.stride()
    assert torch.equal(bits, _bits.pack(is_left(flat(like(x, y)), T)))


def test_precision_bit_forward_of_a_strided_input_sets_ys_lowest_bits():
    from invact._layout import flat, like

    x = _inputs(8 * 101).view(4, 202).chunk(2, dim=-1)[0]
    y, bits = _numba.forward(ACTIVATIONS["gelu"], x, True)
    want = _bits.with_lsb(ACTIVATIONS["gelu"].torch_forward(x), is_left(like(x, y), T))
    assert bits.numel() == 0 and torch.equal(flat(y).view(torch.int32), flat(want).view(torch.int32))
