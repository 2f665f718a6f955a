"""The Triton kernels against the torch backend. On CPU they run under TRITON_INTERPRET=1 (set in
conftest.py), which is how CI tests them; on a GPU the same tests run the compiled kernels."""

import pytest
import torch

pytest.importorskip("triton")

from invact.activation import _triton  # noqa: E402
from invact.activation._portable import backward as torch_backward  # noqa: E402
from invact.activation.activations import ACTIVATIONS  # noqa: E402
from tests.invact.test_functional import FP32_Q_ROUNDING  # noqa: E402

NAMES = sorted(ACTIVATIONS)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# below one byte, one byte, a tail masked by rows of 8 (n % 8 == 0), several programs and a tail masked
# by rows, several programs and one masked by element, full blocks only (the unmasked EVEN kernels)
SIZES = (1, 7, 8, 1000, _triton.BLOCK + 8, 3 * _triton.BLOCK + 5, 2 * _triton.BLOCK)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in units in the last place of the dtype, on the ordered integer line."""
    ints = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[a.dtype]

    def ordered(t):
        i = t.view(ints).long()
        return torch.where(i < 0, -(i & (2 ** (8 * t.element_size() - 1) - 1)), i)

    return (ordered(a) - ordered(b)).abs()


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_forward_bits_match_the_torch_backend(name, dtype):
    act = ACTIVATIONS[name]
    for n in SIZES:
        x = (torch.randn(n, device=DEVICE) * 4).to(dtype)
        y, bits = _triton.forward(act, x, precision_bit=False)
        want_y, want_bits = torch.ops.invact.forward(x.cpu(), name, False)
        assert torch.equal(bits.cpu(), want_bits), (n, dtype)
        # Within 6 ulps of torch's on the scale of the terms (below), or as close to the true f as
        # torch's own forward to a factor 2: where torch's formula adds constants (laplace's
        # 0.5 erf(a x - b) + 0.5) the cancelling terms are O(1) whatever x is, and where torch rounds
        # a half-type formula op by op it is further from f than the kernel, which rounds once
        # (laplace in fp16: 32 ulps apart at x = 0.006, the kernel's y correct to the last bit).
        near = _scaled_ulps(y.cpu(), want_y, x.cpu()) <= 6
        truth = act.f(x.cpu().double())
        as_good = (y.cpu().double() - truth).abs() <= 2 * (want_y.double() - truth).abs()
        assert (near | as_good).all(), (n, dtype)


def _scaled_ulps(y: torch.Tensor, ref: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """|y - ref| in ulps of max(|ref|, |x|), the size of the terms before any cancellation. Plain ulps
    of y mean nothing where torch's own formula cancels (0.5 x (1 + erf) for x << 0: measured 8.8e8
    "ulps" apart, 1.2e-6 absolute). On this measure, over 20000 values with x ~ 4 N(0, 1): fp32 <= 5
    (gelu; kernel erf vs torch's vectorized erf), half types <= 1 (the interpreter truncates
    fp32 -> half where GPUs round; torch rounds quick_gelu's intermediate products in half)."""
    scale = torch.maximum(ref.float().abs(), x.float().abs()).clamp_min(torch.finfo(y.dtype).tiny)
    ulp = torch.finfo(y.dtype).eps * torch.exp2(torch.floor(torch.log2(scale)))
    return (y.float() - ref.float()).abs() / ulp


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("precision_bit", [False, True])
def test_backward_matches_the_torch_backend(name, precision_bit):
    torch.manual_seed(0)
    for n in SIZES:
        x = torch.randn(n) * 4
        y, bits = torch.ops.invact.forward(x, name, precision_bit)  # the same saved state for both
        dy = torch.randn(n)
        want = torch_backward(ACTIVATIONS[name], y, bits, dy, precision_bit)
        got = _triton.backward(ACTIVATIONS[name], y.to(DEVICE), bits.to(DEVICE), dy.to(DEVICE), precision_bit)
        # Gradients within 1e-5 (fp32), the default families' accuracy. Both evaluate the same generated
        # formula in fp32; the difference is libm rounding, measured <= 1e-6 for |dy| <= 5.
        assert (got.cpu() - want).abs().max() <= 1e-5, n


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16bit_backward_is_the_cpus_q16(name, dtype):
    """For y stored in 16 bits the kernel evaluates q16 (the 16-bit family's, with _log16), as the CPU
    backends do: with dy in fp32 (dx unrounded) they agree to fp32 rounding, FP32_Q_ROUNDING of
    test_functional.py (the same formula; the GPU contracts to FMAs). Every fitted activation's q16
    differs from its fp32 q by more than that (tests/invact/test_half.py), so the fp32 q fails here."""
    act = ACTIVATIONS[name]
    torch.manual_seed(0)
    for n in (1000, 2 * _triton.BLOCK):  # masked and full blocks
        x = (torch.randn(n) * 4).to(dtype)
        y, bits = torch.ops.invact.forward(x, name, False)
        dy = torch.randn(n)
        want = torch_backward(act, y, bits, dy, False)
        got = _triton.backward(act, y.to(DEVICE), bits.to(DEVICE), dy.to(DEVICE), False).cpu()
        assert got.dtype == torch.float32
        assert ((got - want).abs() <= FP32_Q_ROUNDING * want.abs().clamp_min(1)).all(), n


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_backward_stores_in_dy_dtype(dtype):
    x = (torch.randn(999) * 4).to(dtype)
    y, bits = torch.ops.invact.forward(x, "gelu", False)
    dy = torch.randn(999).to(dtype)
    got = _triton.backward(ACTIVATIONS["gelu"], y.to(DEVICE), bits.to(DEVICE), dy.to(DEVICE), False).cpu()
    want = torch_backward(ACTIVATIONS["gelu"], y, bits, dy, False)
    assert got.dtype == dtype
    assert _ulps(got, want).max() <= 1  # one rounding (the interpreter truncates where torch rounds)


def test_whole_op_through_the_triton_backend(monkeypatch):
    monkeypatch.setenv("INVACT_BACKEND", "triton")
    x = (torch.randn(2, 3, 33, device=DEVICE)).to(memory_format=torch.contiguous_format).requires_grad_()
    y = torch.ops.invact.forward(x, "silu", False)[0]
    y.backward(torch.ones_like(y))
    xt = x.detach().requires_grad_()
    torch.nn.functional.silu(xt).sum().backward()
    assert (x.grad - xt.grad).abs().max() <= 1e-3  # silu's family error 9.4e-4
    empty = torch.empty(0, 4, device=DEVICE, requires_grad=True)
    torch.ops.invact.forward(empty, "gelu", False)[0].sum().backward()
    assert empty.grad.shape == (0, 4)


@pytest.mark.gpu
def test_more_than_2_31_elements():
    n = 2**31 + 9  # int64 offsets: the last byte of bits and the last elements must be right
    x = torch.full((n,), -2.0, device="cuda", dtype=torch.bfloat16)
    x[-3:] = 1.0
    y, bits = _triton.forward(ACTIVATIONS["gelu"], x, precision_bit=False)
    assert bits.numel() == (n + 7) // 8
    # Byte 2^28 holds elements 2^31 .. 2^31 + 7 (x = -2 six times, then 1 twice: bits 0-5), and the
    # last byte element 2^31 + 8 alone (x = 1: no bit).
    assert bits[0].item() == 0xFF and bits[-2].item() == 0b0011_1111 and bits[-1].item() == 0
    assert y[-1].item() == torch.nn.functional.gelu(torch.tensor(1.0)).bfloat16().item()
    del x
    dx = _triton.backward(ACTIVATIONS["gelu"], y, bits, torch.ones_like(y), precision_bit=False)
    # Past element 2^31 the bits must still be read at the right place: the first 8 elements and the
    # last 8 (2^31 + 1 .. 2^31 + 8: five on the left branch, three on the right) get their branch's q,
    # which the torch backend computes from the same y and bits.
    ends = torch.cat([y[:8], y[-8:]]).cpu()
    want = torch_backward(ACTIVATIONS["gelu"], ends, torch.tensor([0xFF, 0b0001_1111], dtype=torch.uint8),
                          torch.ones(16, dtype=torch.bfloat16), False)  # fmt: skip
    # Both compute q in fp32 and round once to bf16: equal to one bf16 ulp (2^-8 relative); the other
    # branch's q would be O(1) away.
    assert torch.allclose(torch.cat([dx[:8], dx[-8:]]).cpu(), want, rtol=2**-8, atol=0)


# The gated MLP's kernels against the activation's kernels and torch's multiplies they stand for, bit
# for bit. In fp32 everywhere; in 16 bits on a GPU (the interpreter truncates fp32 -> 16 bits in the
# kernel where torch's multiply rounds, so off a GPU the half types cannot agree bitwise).
GATED_DTYPES = [torch.float32] + ([torch.bfloat16, torch.float16] if DEVICE == "cuda" else [])


GATED_CASES = [(name, pb, dtype) for name in NAMES for pb in (False, True) for dtype in GATED_DTYPES]


@pytest.mark.parametrize(("name", "precision_bit", "dtype"), GATED_CASES)
def test_gated_forward_is_forward_then_the_product(name, precision_bit, dtype):
    act = ACTIVATIONS[name]
    torch.manual_seed(0)
    for n in SIZES:
        g = (torch.randn(n, device=DEVICE) * 4).to(dtype)
        u = torch.randn(n, device=DEVICE).to(dtype)
        y, bits, h = _triton.gated_forward(act, g, u, precision_bit)
        want_y, want_bits = _triton.forward(act, g, precision_bit)
        assert torch.equal(y, want_y) and torch.equal(bits, want_bits), n
        assert torch.equal(h, want_y * u), n


@pytest.mark.parametrize(("name", "precision_bit", "dtype"), GATED_CASES)
def test_gated_backward_is_the_products_and_backward(name, precision_bit, dtype):
    act = ACTIVATIONS[name]
    torch.manual_seed(0)
    for n in SIZES:
        g = (torch.randn(n, device=DEVICE) * 4).to(dtype)
        y, bits = _triton.forward(act, g, precision_bit)
        u, dh = torch.randn(n, device=DEVICE).to(dtype), torch.randn(n, device=DEVICE).to(dtype)
        dg, du = _triton.gated_backward(act, y, bits, u, dh, precision_bit)
        assert torch.equal(dg, _triton.backward(act, y, bits, dh * u, precision_bit)), n
        assert torch.equal(du, dh * y), n


@pytest.mark.parametrize("dtype", GATED_DTYPES)
def test_a_gated_mlp_takes_the_gated_kernels_and_its_gradients_are_bitwise(monkeypatch, dtype):
    """A patched SwiGLU MLP on the Triton backend runs its activation and product through the gated
    kernels (one launch forward, one backward): output and every gradient equal, bit for bit, to the
    same Function through the activation's kernels and torch's multiplies (the kernels taken away)."""
    import copy

    import invact

    monkeypatch.setenv("INVACT_BACKEND", "triton")

    class SwiGLU(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj, self.up_proj = (
                torch.nn.Linear(16, 40, bias=False),
                torch.nn.Linear(16, 40, bias=False),
            )
            self.down_proj, self.act_fn = torch.nn.Linear(40, 16, bias=False), torch.nn.SiLU()

        def forward(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    torch.manual_seed(0)
    model = torch.nn.Sequential(SwiGLU()).to(DEVICE, dtype)
    assert invact.patch(model) == ["0.act_fn"]
    calls = []
    for kernel in ("gated_forward", "gated_backward"):
        real = getattr(_triton, kernel)
        monkeypatch.setattr(
            _triton, kernel, lambda *a, real=real, kernel=kernel: calls.append(kernel) or real(*a)
        )
    x = torch.randn(3, 7, 16, device=DEVICE, dtype=dtype, requires_grad=True)
    dy = torch.randn(3, 7, 16, device=DEVICE, dtype=dtype)

    def run(m):
        xi = x.detach().requires_grad_()
        out = m(xi)
        out.backward(dy)
        return out, xi.grad, [p.grad for p in m.parameters()]

    fused = run(model)
    assert calls == ["gated_forward", "gated_backward"]
    plain = copy.deepcopy(model)
    for p in plain.parameters():
        p.grad = None
    for kernel in ("gated_forward", "gated_backward"):
        monkeypatch.delattr(_triton, kernel)
    unfused = run(plain)
    assert torch.equal(fused[0], unfused[0]) and torch.equal(fused[1], unfused[1])
    assert all(torch.equal(a, b) for a, b in zip(fused[2], unfused[2], strict=True))
