"""InvAct against torch on the CPU (torch backend): forward, gradient accuracy, edge cases."""

import functools
import itertools
import math
import re

import pytest
import torch
import torch.nn.functional as F

import invact
from invact.activation._float64 import derivative_from_output
from invact.activation.activations import ACTIVATIONS
from invact.activation.ops import invact as invact_op

NAMES = sorted(ACTIVATIONS)
HALF = (torch.float16, torch.bfloat16)
DTYPES = (torch.float32, *HALF)


def _run(name, x, mode="bits", dy=None):
    """(y, dx) through InvAct for a leaf copy of x."""
    x = x.detach().requires_grad_()
    y = invact_op(x, name, mode)
    y.backward(torch.ones_like(y) if dy is None else dy)
    return y.detach(), x.grad


def _exact_derivative(name, x):
    return ACTIVATIONS[name].df(x.double())


def _forward_ulps(act):
    """Max |y_torch - f(x)| in ulps of y, measured on this machine's torch: its fp32 kernels differ by
    CPU capability (measured with AVX2: gelu 8.4, gelu_tanh 2.6, silu 1.2 ulp near the cusp). Over
    every fp32 x within 0.05 of T (where the error matters), or x in [-20, 20] for a monotone f."""
    if act.monotone:
        x = torch.linspace(-20, 20, 2**20)
    else:
        ends = torch.tensor([act.threshold - 0.05, act.threshold + 0.05]).view(torch.int32).tolist()
        x = torch.arange(min(ends), max(ends), dtype=torch.int32).view(torch.float32)
    y = act.torch_forward(x)
    ulp = (torch.nextafter(y, torch.tensor(math.inf)) - y).double()
    return ((y.double() - act.f(x.double())).abs() / ulp).max().item()


@functools.cache
def _storage_error(name):
    """The most that torch's stored fp32 y can cost. Near the cusp f'(f^-1(y)) = sqrt(2 f''(T) (y - y_min))
    to first order, and |sqrt(a) - sqrt(b)| <= sqrt(|a - b|), so y off by u ulps moves it by at most
    sqrt(2 f''(T) u ulp(y_min)) (gelu here: 3.3e-4; the storage floor, y rounded correctly, is 4.8e-5).
    Away from the cusp f'(f^-1(y)) is smooth and the same ulps cost far less. A monotone f has no
    cusp: q moves linearly with y, u ulps cost u / 0.5 storage floors (the floor is half an ulp's)."""
    act = ACTIVATIONS[name]
    if act.monotone:
        return _forward_ulps(act) / 0.5 * act.generated.STORAGE_FLOOR["right"]["fp32"]
    h, t = 1e-4, torch.tensor(act.threshold, dtype=torch.float64)
    f2 = (act.df(t + h) - act.df(t - h)).item() / (2 * h)
    y_min = torch.tensor(act.y_min, dtype=torch.float32)
    ulp = (torch.nextafter(y_min, torch.tensor(math.inf)) - y_min).item()
    return math.sqrt(2 * f2 * _forward_ulps(act) * ulp)


def _fp32_bound(name):
    """max |q - f'(x)| for fp32 y: the family's error plus what storing y costs (see the test below)."""
    linf = max(e["linf_fp32"] for e in ACTIVATIONS[name].generated.ERRORS.values())
    return linf + _storage_error(name)


# Evaluating q in fp32 instead of float64: < 1e-6 where |q| <= 1.13, the smooth activations' range
# (measured 7.4e-7, tests/codegen/test_generated_precision.py); relative to |q| where q grows (relu2's
# 2 sqrt(y) reaches 30 here: its fp32 rounding is 30 times larger).
FP32_Q_ROUNDING = 1e-6


def _branch_masks(name, x):
    """[(branch, mask of x on it)]: left (x < T) and right, or right alone for a monotone f."""
    act = ACTIVATIONS[name]
    if act.monotone:
        return [("right", torch.ones_like(x, dtype=torch.bool))]
    left = x < act.threshold
    return [("left", left), ("right", ~left)]


def check_q_at_stored_y(act, y, q, masks):
    """q = dx / dy (float64, CPU) against f' at the y the kernel stored (in precision-bit mode, the y
    with the bit in its last place, which q also reads): the approximation's own error, which is
    what linf_fp32 measures, plus evaluating q in fp32 (FP32_Q_ROUNDING, returned per element). Also run
    by test_cuda.py."""
    at_stored_y = derivative_from_output(act, y, None if act.monotone else masks[0][1])
    rounding = FP32_Q_ROUNDING * at_stored_y.abs().clamp_min(1)
    for branch, mask in masks:
        err = (q[mask] - at_stored_y[mask]).abs() - rounding[mask]
        assert err.max().item() <= act.generated.ERRORS[branch]["linf_fp32"], (branch, err.max().item())
    return rounding


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_is_torch_bitwise(name, dtype):
    x = (torch.randn(4099) * 4).to(dtype)
    y, _ = _run(name, x)
    assert torch.equal(y, ACTIVATIONS[name].torch_forward(x))


@pytest.mark.parametrize("name", NAMES)
def test_fp32_gradient_error_is_the_familys(name):
    # The README's accuracy claim: over 2^20 random fp32 inputs, |dx - dy f'(x)| / |dy| is the family's L-inf.
    torch.manual_seed(0)
    x = torch.randn(2**20) * 3
    dy = torch.randn(2**20)
    y, dx = _run(name, x, dy=dy)
    q = dx.double() / dy.double()
    act = ACTIVATIONS[name]
    gen, masks = act.generated, _branch_masks(name, x)
    # Against f' at the y torch stored: the approximation's own error, which is what linf_fp32
    # measures, plus evaluating q in fp32 (see FP32_Q_ROUNDING).
    rounding = check_q_at_stored_y(act, y, q, masks)
    # Against f'(x): plus what storing y in fp32 costs, given how far torch's own forward is off.
    err = (q - _exact_derivative(name, x)).abs() - rounding
    for branch, mask in masks:
        bound = gen.ERRORS[branch]["linf_fp32"] + _storage_error(name)
        assert err[mask].max() <= bound, (branch, err[mask].max().item(), bound)
    # The default families' headline (README, `floor`): within 1e-5 wherever y's rounding is not the cusp's
    # sqrt: |x - T| > 0.05, where one ulp of y moves f'(f^-1(y)) by < 1e-6 (|f''/f'| < 20 there).
    away = torch.ones_like(x, dtype=torch.bool) if act.monotone else (x - act.threshold).abs() > 0.05
    assert err[away].max() <= 1e-5, err[away].max().item()  # (net of q's own fp32 rounding)


def _all_finite(dtype):
    codes = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    x = codes.view(dtype)
    return x[torch.isfinite(x)]


# Every finite 16-bit input: bf16 0.06, fp16 0.03 (where these come from: check_every_finite_16bit).
HALF_LIMITS = [(torch.bfloat16, 0.06), (torch.float16, 0.03)]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(("dtype", "limit"), HALF_LIMITS)
def test_every_finite_16bit_input(name, dtype, limit):
    check_every_finite_16bit(name, dtype, limit, "cpu")


def check_every_finite_16bit(name, dtype, limit, device):
    """dx for every finite x of a 16-bit dtype on `device`, against f'(x) in float64 (also run by
    test_cuda.py)."""
    act = ACTIVATIONS[name]
    x = _all_finite(dtype)
    y_torch = act.torch_forward(x)
    # y is not finite where f(x) itself passes the dtype's largest value (relu2 past x = 256 in fp16),
    # and near the top of the range where torch's own arithmetic overflows: its bf16 GELU returns NaN
    # for the 128 inputs with |x| >= 1.7e38 (max / 2) on some CPUs (AVX-512 builds measured; not with
    # AVX2); its hardswish forms x * 6 before dividing by 6 (past max / 6).
    torch_overflow = ~torch.isfinite(y_torch)
    beyond = act.f(x.double()).abs() > torch.finfo(dtype).max
    assert (beyond | (x.abs() >= torch.finfo(dtype).max / 6))[torch_overflow].all()
    y, dx = _run(name, x.to(device))
    dx = dx.cpu()
    ok = ~torch_overflow
    assert torch.isfinite(dx[ok]).all()
    df = _exact_derivative(name, x)
    # There y cannot tell x: dx is NaN (two branches) or q's limit at y = +-inf (monotone), which
    # is f' itself where f' tends to a constant (selu: its scale) and inf where it grows (relu2).
    lost = torch_overflow & ~((dx.double() - df).abs() <= limit * df.abs().clamp_min(1))
    assert not torch.isfinite(dx[lost]).any()
    # At the edge of a flat region (hardswish's x = -3) y is the flat region's value, so InvAct returns
    # its gradient, 0, where torch returns the one-sided derivative (-0.5): y cannot tell them apart.
    xd, step = x.double(), 1e-9 * (1 + x.double().abs())
    flat_edge = ((act.f(xd - step) == act.f(xd)) | (act.f(xd + step) == act.f(xd))) & (df.abs() > limit)
    ok &= ~flat_edge
    err = ((dx[ok].double() - df[ok]).abs() / df[ok].abs().clamp_min(1)).max().item()
    # Limits 0.06 (bf16) and 0.03 (fp16): storage floor ~0.015 / ~0.007 at the cusp, plus the
    # family's error (<= 2.2e-6) and dx's own rounding to the dtype (half an ulp of <= 1.13). Where
    # |f'| > 1 (relu2's 2x, selu's 1.05) both roundings scale with it: the error is taken relative.
    assert err <= limit, err


def _nan_where_torch_is_and_where_y_cannot_tell(act, x, y, dx, torch_grad):
    """InvAct's non-finite rule: its gradient is NaN wherever torch's is; beyond that only where y is
    NaN, and for two branches where y = +-inf (the kernels' rule: q is not fitted there). Torch's
    piecewise activations give a branch's constant there (every comparison with NaN is false: elu
    gives 1 at x = NaN; hardswish 0 at x = -inf, whose y is NaN, and 1 at x = inf). Two exceptions
    the other way, where InvAct returns the limit 0 and torch multiplies a 0 by an infinity: a clipped
    y at x = +-inf (gelu_10: its clamp's 0 times GELU's NaN derivative there), and y at f's infimum
    (sqrtsoftplus at x << 0, where softplus is 0 and torch's sqrt backward divides by it)."""
    unreadable = torch.isnan(y) if act.monotone else ~torch.isfinite(y)
    clipped_at_infinity = torch.isinf(x) & torch.isfinite(y) & (dx == 0)
    at_infimum = (y == act.y_min) & (dx == 0)
    assert ((torch.isnan(dx) | clipped_at_infinity | at_infimum) >= torch.isnan(torch_grad)).all()
    assert (unreadable >= (torch.isnan(dx) & ~torch.isnan(torch_grad))).all()


@pytest.mark.parametrize("name", NAMES)
def test_non_finite_inputs_propagate_like_torch(name):
    x = torch.tensor([float("inf"), float("-inf"), 1.0, float("nan")])
    xt = x.clone().requires_grad_()
    act = ACTIVATIONS[name]
    act.torch_forward(xt).sum().backward()
    y, dx = _run(name, x)
    _nan_where_torch_is_and_where_y_cannot_tell(act, x, y, dx, xt.grad)
    assert dx[-1].isnan() and torch.equal(y.isnan(), act.torch_forward(x).isnan())


@pytest.mark.parametrize("name", NAMES)
def test_layouts_sizes_and_empty(name):
    base = torch.randn(2, 3, 5, 7)
    cases = {
        "channels_last": base.to(memory_format=torch.channels_last),
        "transposed": base.transpose(1, 3),
        "strided": torch.randn(4, 11)[:, ::2],
        "odd size": torch.randn(13),
        "empty": torch.randn(0, 3),
        "scalar": torch.tensor(-0.9),
    }
    for label, x in cases.items():
        dy = torch.randn_like(x)
        y, dx = _run(name, x, dy=dy)
        xt = x.detach().requires_grad_()
        ACTIVATIONS[name].torch_forward(xt).backward(dy)
        assert torch.equal(y, ACTIVATIONS[name].torch_forward(x)), label
        # Both approximate f'(x): InvAct within its fp32 bound (test above) per unit of dy, torch's
        # within 1e-6; a layout mix-up would be off by O(1).
        assert dx.shape == x.shape, label
        assert ((dx - xt.grad).abs() <= _fp32_bound(name) * dy.abs() + 1e-6).all(), label


def test_precision_bit_mode():
    x = torch.randn(1001) * 3
    for name in NAMES:
        for dtype in DTYPES:
            xd = x.to(dtype)
            y, dx = _run(name, xd, mode="precision_bit")
            ref = ACTIVATIONS[name].torch_forward(xd)
            ulps = (y.view(torch.int16 if dtype in HALF else torch.int32).long()
                    - ref.view(torch.int16 if dtype in HALF else torch.int32).long()).abs()  # fmt: skip
            assert ulps.max() <= 1, (name, dtype)
            _, dx_bits = _run(name, xd)
            # q reads y one ulp off at most. Near the cusp q has a sqrt slope, so one ulp moves it by
            # about the dtype's storage floor: measured up to 2.62 floors (gelu fp32), bound 3.
            key = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
            floors = ACTIVATIONS[name].generated.STORAGE_FLOOR
            bound = 3 * max(f[key] for f in floors.values())
            assert (dx.float() - dx_bits.float()).abs().max() <= bound, (name, dtype)


def test_float64_gradcheck_and_double_backward():
    for name in NAMES:
        x = (torch.randn(64, dtype=torch.float64) * 3).requires_grad_()
        assert torch.autograd.gradcheck(lambda t, n=name: invact_op(t, n), (x,), eps=1e-6, atol=1e-7)
    x = torch.randn(8, requires_grad=True)
    (g,) = torch.autograd.grad(invact.functional.gelu(x).sum(), x, create_graph=True)
    with pytest.raises(
        RuntimeError, match="backward through invact.backward.default but no autograd formula"
    ):
        g.sum().backward()


def test_integer_input_raises_like_torch():
    x = torch.arange(5)
    for name in NAMES:
        try:
            ACTIVATIONS[name].torch_forward(x)
        except RuntimeError as e:
            with pytest.raises(RuntimeError, match=str(e)[:40].replace("(", r"\(").replace(")", r"\)")):
                invact_op(x, name)


def test_in_place_change_of_the_saved_output_raises():
    x = torch.randn(16, requires_grad=True)
    y = invact.functional.silu(x)
    y.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_no_grad_and_autocast_behave_like_torch():
    x = torch.randn(32)
    with torch.no_grad():
        assert torch.equal(invact.functional.gelu(x.requires_grad_()), F.gelu(x))
    x = torch.randn(32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert invact.functional.gelu(x).dtype == F.gelu(x).dtype
        assert invact.functional.silu(x.bfloat16()).dtype == F.silu(x.bfloat16()).dtype


def test_softplus_saves_no_bit_and_rejects_what_it_cannot_reproduce():
    x = torch.randn(1001) * 8
    for mode in ("bits", "precision_bit"):
        y, bits = torch.ops.invact.forward(x, "softplus", mode == "precision_bit")
        assert bits.numel() == 0 and torch.equal(y, F.softplus(x))  # monotone: y alone gives x
    assert "beta=1.0, threshold=20.0" in repr(invact.InvActSoftplus())
    with pytest.raises(
        ValueError,
        match=r"beta=2.0: InvActSoftplus reproduces beta=1 only \(torch computes softplus\(beta x\)",
    ):
        invact.InvActSoftplus(beta=2.0)
    with pytest.raises(ValueError, match="threshold=5.0: InvActSoftplus reproduces threshold=20 only"):
        invact.functional.softplus(x, threshold=5.0)


def test_modules_mirror_torch_constructors():
    assert isinstance(invact.InvActGELU(approximate="tanh"), torch.nn.Module)
    assert "approximate='tanh'" in repr(invact.InvActGELU("tanh"))
    invact.InvActSiLU(inplace=True)
    with pytest.raises(
        ValueError, match="approximate='fast': InvActGELU reproduces approximate='none' or 'tanh' only"
    ):
        invact.InvActGELU(approximate="fast")
    with pytest.raises(ValueError, match="mode must be 'bits' or 'precision_bit'"):
        invact.InvActQuickGELU(mode="sign")
    x = torch.randn(10, requires_grad=True)
    assert torch.equal(invact.InvActGELU("tanh")(x), F.gelu(x, approximate="tanh"))


def test_generic_module_and_function_serve_every_activation():
    x = torch.randn(64, requires_grad=True)
    for name in NAMES:
        assert repr(invact.InvAct(name, mode="precision_bit")) == f"InvAct({name!r}, mode='precision_bit')"
        assert torch.equal(invact.InvAct(name)(x), ACTIVATIONS[name].torch_forward(x))
        assert torch.equal(invact.functional.invact(x, name), ACTIVATIONS[name].torch_forward(x))
    message = f"unknown activation 'swish2' (choose from {', '.join(NAMES)})"
    with pytest.raises(ValueError, match=re.escape(message)):
        invact.InvAct("swish2")


def test_backend_override(monkeypatch):
    monkeypatch.setenv("INVACT_BACKEND", "cuda")
    with pytest.raises(ValueError, match="INVACT_BACKEND='cuda': expected one of torch, triton"):
        invact.backend_for(torch.zeros(1))
    monkeypatch.setenv("INVACT_BACKEND", "torch")
    assert invact.backend_for(torch.zeros(1)) == "torch"


def test_numba_and_torch_op_backwards_agree(monkeypatch):
    from invact.activation import _numba

    torch.manual_seed(1)
    x = torch.randn(10007) * 4  # 10% (mish) to 31% (gelu) of it in the left tails the numba kernel redoes
    for name, dtype, mode in itertools.product(NAMES, DTYPES, ("bits", "precision_bit")):
        fused = _run(name, x.to(dtype), mode)[1]
        monkeypatch.setattr(_numba, "available", lambda: False)
        plain = _run(name, x.to(dtype), mode)[1]
        monkeypatch.undo()
        # Two fp32 evaluations of one formula (exp32/log32 vs torch's, other association), each
        # within 1e-6 of it (tests/codegen/test_generated_precision.py): 2e-6; measured 1.07e-6.
        tol = 2e-6 if dtype == torch.float32 else math.ldexp(1, -7)  # half types: one ulp of dx <= 2
        assert (fused.float() - plain.float()).abs().max() <= tol, (name, dtype, mode)


# gelu_tanh's backward in torch computes x^3, which overflows float64 for |x| > 5.6e102: torch returns
# NaN there from a finite y (-0 or x), which y cannot tell apart from any other large |x|.
_TORCH_OVERFLOWS = {"gelu_tanh": 5.6e102}
# The float64 path inverts y by Newton's method to a 4e-16 relative step, so its f' differs from
# torch's f'(x) by about that times |x f''(x) / f'(x)| (small on these inputs): measured <= 2.3e-16.
FLOAT64_RTOL = 1e-12


@pytest.mark.parametrize("name", NAMES)
def test_float64_non_finite_and_huge_inputs_like_torch(name):
    x = torch.tensor([math.inf, -math.inf, math.nan, 1e308, -1e308, 1e200, -1e200, 40.0, -40.0, 1.0],
                     dtype=torch.float64)  # fmt: skip
    xt = x.clone().requires_grad_()
    act = ACTIVATIONS[name]
    act.torch_forward(xt).sum().backward()
    y, dx = _run(name, x)
    # Where y overflowed from a finite x (relu2: x^2 past 1.3e154) y cannot tell x: not comparable.
    comparable = (x.abs() <= _TORCH_OVERFLOWS.get(name, math.inf)) & (y.isfinite() | ~x.isfinite())
    c = comparable
    _nan_where_torch_is_and_where_y_cannot_tell(act, x[c], y[c], dx[c], xt.grad[c])
    ok = comparable & ~torch.isnan(xt.grad) & ~torch.isnan(dx)
    # y itself is rounded to float64: q(y) can be off by what one ulp of y moves it (elu at x = -40:
    # y = -1 + 4e-18 rounds to -1, so q = y + 1 reads 0 where f' = 4e-18).
    left = None if act.monotone else x < act.threshold
    at_y = derivative_from_output(act, y, left)
    neighbours = [torch.nextafter(y, y.new_tensor(d)) for d in (math.inf, -math.inf)]
    ulp_moves = torch.stack([(derivative_from_output(act, n, left) - at_y).abs() for n in neighbours]).amax(0)
    ulp_moves = ulp_moves.nan_to_num(nan=0.0)  # a neighbour outside f's range (y = 0 for relu2) moves nothing
    close = (dx - xt.grad).abs() <= FLOAT64_RTOL * xt.grad.abs() + ulp_moves
    assert (close | (dx == xt.grad))[ok].all()  # (equal: also +-inf, relu2's 2x at x = inf)
