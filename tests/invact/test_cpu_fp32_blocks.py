"""The CPU backward of a 16-bit activation (invact.activation._numba.backward_any): y, dy and dx go
through fp32 buffers of FP32_BLOCK elements, the same dx bit for bit as one block of the whole tensor,
holding 12 bytes per element of a block besides dx; and on the meta device, planned for a CPU
(invact._meta), the same tensors are allocated (invact plan's step follows them)."""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

pytest.importorskip("numba")

from invact._meta import standing_for  # noqa: E402
from invact.activation import _numba, ops  # noqa: E402
from invact.activation.activations import ACTIVATIONS  # noqa: E402

NAMES = sorted(ACTIVATIONS)
# (y's dtype, dy's dtype): a 16-bit step, and y in bf16 with an fp32 gradient (dx then fp32, written
# by the kernel straight)
DTYPES = [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16), (torch.bfloat16, torch.float32)]
SMALL_BLOCK = 2**12  # a multiple of 8 (whole bytes of bits) below the kernels' span: many blocks cheaply
FP32 = 4  # bytes per fp32 element of each of the three buffers


def _case(name: str, dtype: torch.dtype, dy_dtype: torch.dtype, n: int, precision_bit: bool):
    act = ACTIVATIONS[name]
    g = torch.Generator().manual_seed(n)
    x = ((act.threshold or 0.0) + torch.randn(n, generator=g) * 3).to(dtype)  # None: monotone
    y, bits = ops._forward_impl(x, name, precision_bit)
    dy = torch.randn(n, generator=g).to(dy_dtype)
    return act, y, bits, dy


def _modes(name: str) -> list[bool]:
    return [False] if ACTIVATIONS[name].monotone else [False, True]


@pytest.mark.parametrize(("dtype", "dy_dtype"), DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize(
    ("name", "precision_bit"), [(n, p) for n in NAMES for p in _modes(n)], ids=lambda v: str(v)
)
def test_blocks_give_the_whole_tensors_dx_bit_for_bit(monkeypatch, name, precision_bit, dtype, dy_dtype):
    n = 3 * SMALL_BLOCK + 13  # a partial block at the end, whose bits end inside a byte
    act, y, bits, dy = _case(name, dtype, dy_dtype, n, precision_bit)
    monkeypatch.setattr(_numba, "FP32_BLOCK", n)
    whole = _numba.backward_any(act, y, bits, dy, precision_bit)
    monkeypatch.setattr(_numba, "FP32_BLOCK", SMALL_BLOCK)
    blocked = _numba.backward_any(act, y, bits, dy, precision_bit)
    assert blocked.dtype == dy_dtype and blocked.shape == y.shape
    assert torch.equal(blocked.view(torch.uint8), whole.view(torch.uint8)), name


def test_the_block_is_whole_spans_of_every_kernel_and_whole_bytes_of_bits():
    spans = {getattr(a.cpu, "_SPAN", 8) for a in ACTIVATIONS.values()}
    assert _numba.FP32_BLOCK % 8 == 0 and all(_numba.FP32_BLOCK % s == 0 for s in spans), spans


def _profiled_peak(fn) -> int:
    """The largest running sum of the CPU allocator's allocations and frees while fn runs (bytes)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    running = peak = 0
    for _, nbytes in sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                            if e.name() == "[memory]"):  # fmt: skip
        running += nbytes
        peak = max(peak, running)
    return peak


@pytest.mark.parametrize("n", [SMALL_BLOCK // 2 + 3, 5 * SMALL_BLOCK + 7], ids=["one block", "six blocks"])
def test_a_bf16_backward_holds_dx_and_three_fp32_blocks(monkeypatch, n):
    monkeypatch.setattr(_numba, "FP32_BLOCK", SMALL_BLOCK)
    act, y, bits, dy = _case("gelu", torch.bfloat16, torch.bfloat16, n, False)
    _numba.backward_any(act, y, bits, dy, False)  # numba's first call compiles or loads the kernels
    dx_bytes = n * 2
    assert _profiled_peak(lambda: _numba.backward_any(act, y, bits, dy, False)) == dx_bytes + 3 * FP32 * min(
        n, SMALL_BLOCK
    )


def _live_peak(fn, known: list[torch.Tensor]) -> int:
    """The peak of live bytes invact.planner.live_bytes.LiveBytes follows while fn runs (torch's ops alone),
    above the `known` tensors' (fn's inputs: a view of one is no new memory)."""
    from invact.planner.live_bytes import LiveBytes

    live = LiveBytes({"inputs": known})
    try:
        with live, torch.no_grad():  # as in backward: plain_dx takes the op under grad mode
            fn()
        return live.peak - live.at_peak["inputs"]
    finally:
        live.close()


@pytest.mark.parametrize(("dtype", "dy_dtype"), DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("n", [SMALL_BLOCK // 2 + 3, 5 * SMALL_BLOCK + 7], ids=["one block", "six blocks"])
def test_on_meta_planned_for_a_cpu_the_backward_allocates_as_on_the_cpu(monkeypatch, n, dtype, dy_dtype):
    monkeypatch.setattr(_numba, "FP32_BLOCK", SMALL_BLOCK)
    act, y, bits, dy = _case("silu", dtype, dy_dtype, n, False)
    _numba.backward_any(act, y, bits, dy, False)
    real = _live_peak(lambda: ops.plain_dx(act, False, _numba, y, bits, dy), [y, bits, dy])
    on_meta = [t.to("meta") for t in (y, bits, dy)]
    with standing_for("cpu"):
        meta = _live_peak(lambda: ops.plain_dx(act, False, _numba, *on_meta), on_meta)
    with standing_for("cuda"):  # Triton's kernels write dx alone
        cuda = _live_peak(lambda: ops.plain_dx(act, False, _numba, *on_meta), on_meta)
    assert meta == real > cuda == n * dy.element_size()
