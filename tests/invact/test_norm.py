"""invact.norm: inverted RMSNorm / LayerNorm. Every class and variant comes from the norm spec
(invact/_generated/norms.py, printed from coeffs/norms.json)."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn

from invact import norm
from invact.norm import CLASSES, VARIANTS, InvNorm
from invact.norm import op as norm_op
from invact.norm.op import RHO_MAX

U32 = 2.0**-24  # fp32 unit roundoff
# The 16-bit gradients' promise (docs/results/accuracy.md): an inverted norm's bf16 and fp16 dx and
# dweight no farther from float64 (RMS) than 1.25x the replaced module's own; measured on CPU at
# 2048 x 512 (this test; Intel Xeon, torch 2.13): bf16 and fp16 dx 0.58-1.00x, dweight 0.06-1.06x.
RATIO_16BIT = 1.25


def _load(qualname: str):
    module, _, name = qualname.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


# (class, variant) for every class of the spec that imports here (timm is optional)
LISTED = [(cls, variant) for cls, variant in CLASSES.items() if _load(cls) is not None]
# one importable class per variant, the first the spec lists
ONE_PER_VARIANT = {variant: cls for cls, variant in reversed(LISTED)}


def _module(qualname: str, d: int, seed: int = 0) -> nn.Module:
    """An instance of the class at width d with random parameters (weight near its offset's 1)."""
    m = _load(qualname)(d)
    v = VARIANTS[CLASSES[qualname]]
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        m.weight.copy_(torch.randn(d, generator=g) * 0.1 + (0.0 if v.offset else 1.0))
        if getattr(m, "bias", None) is not None:
            m.bias.copy_(torch.randn(d, generator=g) * 0.1)
    return m


def _inverted(m: nn.Module) -> InvNorm:
    variant, _ = norm.match(m)
    return norm.replacement(m, variant)


def test_spec_has_every_variant_a_class():
    assert set(ONE_PER_VARIANT) == set(VARIANTS), "a variant no importable class of the spec computes"


@pytest.mark.parametrize("qualname,variant", LISTED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_forward_is_the_modules_bitwise(qualname, variant, dtype):
    m = _module(qualname, 48).to(dtype)
    assert norm.match(m)[0] == variant
    x = torch.randn(3, 7, 48).to(dtype).requires_grad_()
    ours = _inverted(m)(x)
    assert torch.equal(ours, m(x))


def _reference(m: nn.Module, x: torch.Tensor, dy: torch.Tensor):
    """float64 (dx, dweight) of the variant's formula, from the module's parameters."""
    v = VARIANTS[norm.match(m)[0]]
    x64 = x.detach().double().requires_grad_()
    w64 = m.weight.detach().double().requires_grad_()
    b64 = m.bias.detach().double() if getattr(m, "bias", None) is not None else None
    eps = getattr(m, norm.eps_name(m, v)) or torch.finfo(torch.float32).eps
    if v.center:
        mu = x64.mean(-1, keepdim=True)
        h = (x64 - mu) * torch.rsqrt((x64 - mu).pow(2).mean(-1, keepdim=True) + eps)
    else:
        h = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    y = h * (w64 + v.offset) + (b64 if b64 is not None else 0)
    y.backward(dy.double())
    return x64.grad, w64.grad, h.detach()


def _grads(module: nn.Module, x: torch.Tensor, dy: torch.Tensor):
    x = x.detach().clone().requires_grad_()
    module.weight.grad = None
    module(x).backward(dy)
    return x.grad.double(), module.weight.grad.double()


@pytest.mark.parametrize("variant", sorted(ONE_PER_VARIANT))
def test_fp32_gradients_within_the_derived_bound(variant):
    """Elementwise, against float64: the bound of the module docstring with y's rounding plus the
    fp32 statistics, and the backward's own fp32 arithmetic."""
    d, rows = 64, 32
    m = _module(ONE_PER_VARIANT[variant], d)
    x, dy = torch.randn(rows, d) * 3, torch.randn(rows, d)
    dx, dw = _grads(_inverted(m), x, dy)
    dx64, dw64, h = _reference(m, x, dy)
    v = VARIANTS[variant]
    w_eff = m.weight.detach().double() + v.offset
    b = m.bias.detach().double().abs() if getattr(m, "bias", None) is not None else 0.0
    rho = b / w_eff.abs()
    # h's error: y's rounding (1), the fp32 subtract and divide (2), the fp32 statistics (rstd from a
    # sum of d squares: d/2 + 3 roundings, relative)
    eps_h = (6 + d / 2) * U32 * (h.abs() + rho)
    rstd = torch.rsqrt(
        (x.double() - (x.double().mean(-1, keepdim=True) if v.center else 0)).pow(2).mean(-1, keepdim=True)
    )
    g = dy.double() * w_eff
    m_gh = (g * h).mean(-1, keepdim=True)
    # dx = rstd (g [- mean g] - h mean(g h)): first order in h's error, plus the backward's own
    # roundings (a mean over d elements: d roundings at worst, relative to the mean of |g h|)
    arith = (
        (4 + d)
        * U32
        * (g.abs() + h.abs() * (g * h).abs().mean(-1, keepdim=True) + g.abs().mean(-1, keepdim=True))
    )
    bound_dx = rstd * (eps_h * m_gh.abs() + h.abs() * (g.abs() * eps_h).mean(-1, keepdim=True) + arith)
    assert ((dx - dx64).abs() <= bound_dx).all(), float(((dx - dx64).abs() / bound_dx).max())
    # dweight = sum over rows of dy h: each term's h error, plus a sum of `rows` terms
    bound_dw = (dy.double().abs() * (eps_h + (rows + 2) * U32 * h.abs())).sum(0)
    assert ((dw - dw64).abs() <= bound_dw).all(), float(((dw - dw64).abs() / bound_dw).max())


def _rms(a, b) -> float:
    return float((a - b).pow(2).mean().sqrt())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("variant", sorted(ONE_PER_VARIANT))
def test_16bit_gradients_no_farther_from_float64_than_the_modules(variant, dtype):
    torch.manual_seed(0)
    d, rows = 512, 2048
    m = _module(ONE_PER_VARIANT[variant], d).to(dtype)
    x, dy = (torch.randn(rows, d) * 2).to(dtype), torch.randn(rows, d).to(dtype)
    eager = _grads(m, x, dy)
    ours = _grads(_inverted(m), x, dy)
    reference = _reference(m, x, dy)[:2]
    for name, e, o, r in zip(("dx", "dweight"), eager, ours, reference, strict=True):
        assert _rms(o, r) <= RATIO_16BIT * _rms(e, r), f"{name}: {_rms(o, r) / _rms(e, r):.3f}x the module's"


@pytest.mark.parametrize("variant", sorted(ONE_PER_VARIANT))
def test_a_zero_weight_entry_saves_x_and_stays_exact(variant):
    m = _module(ONE_PER_VARIANT[variant], 32)
    with torch.no_grad():
        m.weight[5] = -VARIANTS[variant].offset  # w_eff = 0: h cannot be recovered from y there
    inv = _inverted(m)
    x, dy = torch.randn(4, 32), torch.randn(4, 32)
    xa = x.clone().requires_grad_()
    y = inv(xa)
    saved = [t for t in y.grad_fn.saved_tensors if t is not None]
    assert any(t is xa or (t.shape == x.shape and torch.equal(t, x)) for t in saved), "x was not kept"
    y.backward(dy)
    dx, dw = xa.grad.double(), m.weight.grad.double()
    dx64, dw64, _ = _reference(m, x, dy)
    assert torch.isfinite(dx).all() and torch.isfinite(dw).all()
    # kept x: the module's own backward, fp32 against float64 (same arithmetic budget as above)
    assert _rms(dx, dx64) <= 1e-5 * float(dx64.pow(2).mean().sqrt())
    assert _rms(dw, dw64) <= 1e-5 * float(dw64.pow(2).mean().sqrt())


def test_invertible_follows_rho():
    v = VARIANTS["layer"]
    w = torch.ones(4)
    assert norm.invertible(w, torch.full((4,), RHO_MAX), v, torch.bfloat16)
    assert not norm.invertible(w, torch.full((4,), RHO_MAX * 1.01), v, torch.bfloat16)
    # fp16's subnormals: |w| under 2^-14 (eta / u) cannot carry an h of order 1
    r = VARIANTS["rms"]
    assert norm.invertible(torch.full((4,), 2.0**-13), None, r, torch.float16)
    assert not norm.invertible(torch.full((4,), 2.0**-15), None, r, torch.float16)
    assert norm.invertible(torch.full((4,), 2.0**-15), None, r, torch.bfloat16)
    assert not norm.invertible(torch.tensor([1.0, float("nan")]), None, r, torch.float32)


def test_decision_is_made_again_when_the_weight_changes():
    m = _module(ONE_PER_VARIANT["rms"], 16)
    inv = _inverted(m)
    x = torch.randn(2, 16, requires_grad=True)
    y = inv(x)  # held: before torch 2.13 a saved output reads as freed once its tensor is gone
    assert y.grad_fn.saved_tensors[0].shape == x.shape
    assert not _keeps_x(inv, x)
    with torch.no_grad():
        m.weight[0] = 0.0  # an optimizer's in-place step bumps the version counter the same way
    assert _keeps_x(inv, x)


def _keeps_x(inv: InvNorm, x: torch.Tensor) -> bool:
    y = inv(x)
    return any(t is not None and t is not y and torch.equal(t, x) for t in y.grad_fn.saved_tensors)


@pytest.mark.parametrize("variant", ["rms_torch", "layer"])  # the variants that keep float64 as float64
def test_gradcheck_float64(variant):
    m = _module(ONE_PER_VARIANT[variant], 6).double()
    inv = _inverted(m)
    x = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: torch.func.functional_call(inv, {"weight": w}, (x,)),
                                    (x, m.weight.detach().clone().requires_grad_()))  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_residual_round_trip_recovers_the_product(dtype):
    g = torch.Generator().manual_seed(0)
    pre = torch.randn(100_001, generator=g) * torch.logspace(-30, 30, 100_001)
    # exact ties: a bf16 value plus half its ulp (bit 15 of the fp32 pattern alone set)
    ties = (pre[:1000].to(torch.bfloat16).float().view(torch.int32) | 0x8000).view(torch.float32)
    pre = torch.cat([pre, ties])
    y = pre.to(dtype)
    back = norm.decode_residual(y, norm.encode_residual(pre, y))
    ulp = norm_op._ulp(y.float(), dtype)
    finite = torch.isfinite(y.float())
    err = (back - pre).abs()
    # within 1/32 of y's ulp, 1/16 at fp16's clamp (decode_residual's docstring), ties included
    assert (err[finite] <= ulp[finite] / (32 if dtype == torch.bfloat16 else 16)).all()


def test_unlisted_class_is_found_by_its_formula():
    class MyModelRMSNorm(nn.Module):  # a Hugging Face-style copy under another name
        def __init__(self, d):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(d))
            self.variance_epsilon = 1e-6

        def forward(self, x):
            dtype = x.dtype
            x = x.to(torch.float32)
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
            return self.weight * x.to(dtype)

    class OtherRMSNorm(MyModelRMSNorm):
        def forward(self, x):  # no square root: not a norm the spec has
            return self.weight * x / (x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)

    assert norm.is_candidate(MyModelRMSNorm(8))
    assert norm.match(MyModelRMSNorm(8))[0] == "rms"
    variant, why = norm.match(OtherRMSNorm(8))
    assert variant is None and "no norm formula" in why


class _EpsRMSNorm(nn.Module):
    """Llama's formula with epsilon held as `eps` (Llama 4's copy), not the spec's `variance_epsilon`."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(d) + 0.5)
        self.eps = 1e-5

    def forward(self, x):
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class _WeightlessRMSNorm(nn.Module):
    """No weight and no width attribute: it normalizes rows of any width (NanoChat's, HRM's)."""

    def __init__(self):
        super().__init__()
        self.eps = 1e-6

    def forward(self, x):
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)


@pytest.mark.parametrize("make", [lambda: _EpsRMSNorm(24), _WeightlessRMSNorm])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_epsilon_under_either_name_and_weightless_norms_are_matched(make, dtype):
    """Matched as 'rms', and then the very InvNorm Llama's RMSNorm gets for the same weight (ones where
    there is none) and epsilon: its output and dx bitwise, from y (not x)."""
    m = make()
    variant, why = norm.match(m)
    assert variant == "rms", why
    inv = norm.replacement(m, variant)
    assert inv.eps == m.eps and inv.eps_name == "eps"
    llama = _module(ONE_PER_VARIANT["rms"], 24)
    with torch.no_grad():
        llama.weight.copy_(m.weight if getattr(m, "weight", None) is not None else torch.ones(24))
    llama.variance_epsilon = m.eps
    x = torch.randn(5, 24).to(dtype)
    (a, b), dy = [x.clone().requires_grad_() for _ in range(2)], torch.randn(5, 24).to(dtype)
    y, theirs, reference = inv(a), m(x), _inverted(llama)(b)
    assert torch.equal(y, theirs) and torch.equal(y, reference)
    y.backward(dy)
    reference.backward(dy)
    assert torch.equal(a.grad, b.grad)
    assert not _keeps_x(inv, x.clone().requires_grad_())


def test_invnorm_answers_to_the_replaced_modules_epsilon_name():
    m = _module(ONE_PER_VARIANT["rms"], 8)
    inv = _inverted(m)
    assert inv.variance_epsilon == m.variance_epsilon
    with pytest.raises(AttributeError):
        inv.eps_of_another_name  # noqa: B018 - the lookup is the test


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", sorted(ONE_PER_VARIANT))
def test_autocast_gives_the_modules_output_and_gradient_dtypes(variant, dtype):
    m = _module(ONE_PER_VARIANT[variant], 32)
    x = torch.randn(4, 32).to(dtype).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        theirs, ours = m(x), _inverted(m)(x)
    assert torch.equal(theirs, ours)
    ours.float().sum().backward()
    assert x.grad.dtype == dtype and m.weight.grad.dtype == m.weight.dtype


def test_layer_norm_follows_autocasts_dtype(monkeypatch):
    """Where autocast runs F.layer_norm in fp32 (CUDA's rule), the inverted LayerNorm computes in fp32
    too: simulated on CPU by the answer _layer_norm_dtype caches."""
    m = _module(ONE_PER_VARIANT["layer"], 16).to(torch.bfloat16)
    x = torch.randn(3, 16).to(torch.bfloat16).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        key = ("cpu", torch.bfloat16, torch.bfloat16)
        monkeypatch.setitem(norm_op._AUTOCAST_LAYER_NORM, key, torch.float32)
        y = _inverted(m)(x)
    expected = torch.nn.functional.layer_norm(x.float(), (16,), m.weight.float(), m.bias.float(), m.eps)
    assert y.dtype == torch.float32 and torch.equal(y, expected)
    y.sum().backward()
    assert x.grad.dtype == torch.bfloat16 and m.weight.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("rows", [7, 1024])  # the serial kernel, and the parallel one (over SERIAL)
def test_cpu_kernel_reads_and_rounds_bf16_as_torch_does(rows):
    """The fused CPU backward reads bf16 y and dy as their bits and writes a bf16 dx: the fp32 path's
    dx rounded to nearest even, bitwise torch's cast."""
    pytest.importorskip("numba")
    from invact.norm import _cpu as _norm_cpu

    g = torch.Generator().manual_seed(0)
    d = 96
    y, dy = torch.randn(rows, d, generator=g).bfloat16(), torch.randn(rows, d, generator=g).bfloat16()
    w, b = torch.rand(d, generator=g) + 0.5, torch.randn(d, generator=g) * 0.1
    rstd = torch.rand(rows, 1, generator=g) + 0.5
    for center in (False, True):
        dx16, dw16, db16 = _norm_cpu.backward(y, dy, w, b, rstd, center)
        dx32, dw32, db32 = _norm_cpu.backward(y.float(), dy.float(), w, b, rstd, center)
        assert dx16.dtype == torch.bfloat16 and torch.equal(dx16, dx32.bfloat16())
        assert torch.equal(dw16, dw32) and torch.equal(db16, db32)


def _fused(kind: str):
    """The fused backward of `kind` with the CPU kernel's signature (the Triton one under the
    interpreter on CPU, see tests/conftest.py)."""
    if kind == "numba":
        pytest.importorskip("numba")
        from invact.norm import _cpu as _norm_cpu

        return _norm_cpu.backward
    pytest.importorskip("triton")
    from invact.norm import _triton as _norm_triton

    return lambda y, dy, w, b, rstd, center: _norm_triton.backward(y, None, dy, w, b, rstd, center, 0)


@pytest.mark.parametrize("kind", ["numba", "triton"])
@pytest.mark.parametrize("center", [False, True])
@pytest.mark.parametrize("rows,d", [(3, 5), (17, 100), (9, 64)])  # a partial last program, a masked row
def test_fused_backwards_within_fp32_rounding_of_the_formula(kind, center, rows, d):
    """Against the same formula in float64 on the same inputs: each fp32 operation of the kernels
    (h's scale and shift, g, the row sums over d, the final combination) within its rounding:
    (4 + d) u32 on the sums of the terms' magnitudes, and the row sums over `rows` for dw, db."""
    g = torch.Generator().manual_seed(rows * d)
    y, dy = torch.randn(rows, d, generator=g), torch.randn(rows, d, generator=g)
    w, b = torch.rand(d, generator=g) + 0.5, torch.randn(d, generator=g) * 0.1
    rstd = torch.rand(rows, 1, generator=g) + 0.5
    dx, dw, db = _fused(kind)(y, dy, w, b, rstd, center)
    h = (y.double() - b.double()) / w.double()
    gd = dy.double() * w.double()
    m_g = gd.mean(-1, keepdim=True) if center else 0.0
    m_gh = (gd * h).mean(-1, keepdim=True)
    want = rstd.double() * (gd - m_g - h * m_gh)
    terms = gd.abs() + gd.abs().mean(-1, keepdim=True) + h.abs() * (gd * h).abs().mean(-1, keepdim=True)
    assert ((dx.double() - want).abs() <= (4 + d) * U32 * rstd.double() * terms).all()
    dw_terms = (dy.double() * h).abs().sum(0)
    assert ((dw.double() - (dy.double() * h).sum(0)).abs() <= (4 + rows) * U32 * dw_terms).all()
    assert ((db.double() - dy.double().sum(0)).abs() <= (2 + rows) * U32 * dy.double().abs().sum(0)).all()


@pytest.mark.parametrize("variant", sorted(ONE_PER_VARIANT))
@pytest.mark.parametrize("rows,d", [(3, 5), (32, 64)])
def test_a_small_fp32_norm_backpropagates_by_the_serial_kernel(variant, rows, d, monkeypatch):
    """An fp32 norm below the parallel kernel's size runs its backward as one numba pass on the calling
    thread (its host time is the norm's whole cost, seven torch ops or more otherwise): a patched
    module's backward takes it, and its dx, dweight and dbias from y are within each fp32 operation's
    rounding of the formula in float64, as the fused kernels' (the same row pass, _rows)."""
    pytest.importorskip("numba")
    from invact.norm import _cpu as _norm_cpu

    calls = []
    small = _norm_cpu.backward_small
    monkeypatch.setattr(_norm_cpu, "backward_small", lambda *a: calls.append(a) or small(*a))
    monkeypatch.setattr(norm_op, "_SMALL", None)
    m = _module(ONE_PER_VARIANT[variant], d)
    x = torch.randn(rows, d, generator=torch.Generator().manual_seed(3), requires_grad=True)
    _inverted(m)(x).backward(torch.ones(rows, d))
    assert len(calls) == 1  # the module's backward
    g = torch.Generator().manual_seed(rows * d)
    y, dy = torch.randn(rows, d, generator=g), torch.randn(rows, d, generator=g)
    w, rstd = torch.rand(d, generator=g) + 0.5, torch.rand(rows, 1, generator=g) + 0.5
    v = VARIANTS[variant]
    b = torch.randn(d, generator=g) * 0.1 if getattr(m, "bias", None) is not None else None
    dx, dw, db = norm_op._lean_backward(dy, y, rstd, w, b, v, torch.float32, (True, True, True))
    assert len(calls) == 2
    w_eff = w.double() + v.offset
    h, gd = (y.double() - (0.0 if b is None else b.double())) / w_eff, dy.double() * w_eff
    m_g = gd.mean(-1, keepdim=True) if v.center else 0.0
    want = rstd.double() * (gd - m_g - h * (gd * h).mean(-1, keepdim=True))
    terms = gd.abs() + gd.abs().mean(-1, keepdim=True) + h.abs() * (gd * h).abs().mean(-1, keepdim=True)
    assert ((dx.double() - want).abs() <= (4 + d) * U32 * rstd.double() * terms).all()
    dw_terms = (dy.double() * h).abs().sum(0)
    assert ((dw.double() - (dy.double() * h).sum(0)).abs() <= (4 + rows) * U32 * dw_terms).all()
    if b is not None:
        assert ((db.double() - dy.double().sum(0)).abs() <= (2 + rows) * U32 * dy.double().abs().sum(0)).all()


@pytest.mark.parametrize("variant", sorted(ONE_PER_VARIANT))
def test_a_meta_norm_backward_reaches_no_kernel(variant, monkeypatch):
    """The serial kernel reads and writes its tensors' addresses: the meta tensors of a shapes-only
    backward (the FLOP counter's in benchmarks/speed.py, which crashed the process when they reached
    it) take the torch formulas and give the gradients' shapes."""
    pytest.importorskip("numba")
    from invact.norm import _cpu as _norm_cpu

    monkeypatch.setattr(_norm_cpu, "backward_small", lambda *a: pytest.fail("the kernel got meta tensors"))
    monkeypatch.setattr(norm_op, "_SMALL", None)
    v = VARIANTS[variant]
    meta = lambda *shape: torch.empty(shape, device="meta")  # noqa: E731
    y, dy, w, rstd = meta(4, 8), meta(4, 8), meta(8), meta(4, 1)
    b = meta(8) if v.center else None
    dx, dw, db = norm_op._lean_backward(dy, y, rstd, w, b, v, torch.float32, (True,) * 3)
    assert dx.shape == y.shape and dw.shape == w.shape and (db is None) == (not v.center)


@pytest.mark.parametrize("variant", sorted(ONE_PER_VARIANT))
def test_a_strided_weight_reaches_no_kernel(variant):
    """The serial kernel reads d contiguous weights at the weight's address: a weight that is every
    other element of a longer tensor takes the torch formulas, whose gradients it then equals bitwise."""
    pytest.importorskip("numba")
    g = torch.Generator().manual_seed(5)
    y, dy = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
    rstd = torch.rand(4, 1, generator=g)
    w, b = (torch.rand(16, generator=g) + 0.5)[::2], torch.randn(16, generator=g)[::2]
    v = VARIANTS[variant]
    b = b if v.center else None
    got = norm_op._lean_backward(dy, y, rstd, w, b, v, torch.float32, (True,) * 3)
    want = norm_op._lean_backward(dy, y, rstd, w, b, v, torch.float32, (True,) * 3, kernels=False)
    assert all((a is None and c is None) or torch.equal(a, c) for a, c in zip(got, want, strict=True))


def test_cpu_weight_gradient_over_many_rows_no_farther_from_float64_than_torchs():
    """dweight sums dy h over every row: the CPU kernel sums over rows in fp64 (in fp32 its error was
    9.5x that of torch's own dweight at 16384 rows); measured 0.47-0.51x (benchmarks/rope_inversion.py,
    fp32 rows)."""
    pytest.importorskip("numba")
    m = _module(ONE_PER_VARIANT["rms"], 128)  # autograd's dweight: a mul, then torch's sum over rows
    x, dy = torch.randn(16384, 128) * 2, torch.randn(16384, 128)
    eager, ours, reference = _grads(m, x, dy)[1], _grads(_inverted(m), x, dy)[1], _reference(m, x, dy)[1]
    assert _rms(ours, reference) <= _rms(eager, reference)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", sorted(ONE_PER_VARIANT))
def test_triton_backend_gives_the_cpu_backends_gradients(variant, dtype, monkeypatch):
    """INVACT_BACKEND=triton routes an inverted norm's backward to the Triton kernel (CUDA's path; on
    CPU under the interpreter), residuals included: its gradients within one bf16 ulp (the interpreter
    truncates casts where CPUs round) or fp32 rounding of the CPU backend's."""
    pytest.importorskip("triton")
    from invact.norm import _triton as _norm_triton

    d = 40
    m = _module(ONE_PER_VARIANT[variant], d).to(dtype)
    x, dy = torch.randn(6, d).to(dtype), torch.randn(6, d).to(dtype)
    want = _grads(_inverted(m), x, dy)
    calls = []
    kernel = _norm_triton.backward
    monkeypatch.setattr(_norm_triton, "backward", lambda *a: calls.append(1) or kernel(*a))
    monkeypatch.setenv("INVACT_BACKEND", "triton")
    got = _grads(_inverted(m), x, dy)
    assert calls, "the Triton kernel did not run"
    # fp32: both fused kernels within (4 + d) roundings of the formula (the test above)
    tol = (2.0**-7 if dtype == torch.bfloat16 else 2 * (4 + d) * U32) * max(
        float(t.abs().max()) for t in want
    )
    for a, b in zip(got, want, strict=True):
        assert (a - b).abs().max() <= tol


@pytest.mark.parametrize("n", [1, 7, 100_001])  # odd sizes: a lone last nibble; over SERIAL: parallel
def test_cpu_residual_encoding_gives_the_torch_ops_bytes(n, monkeypatch):
    """encode_residual's one-pass numba kernel (bf16 on CPU) writes the bytes of the torch ops it
    replaces, negative values and ties included."""
    pytest.importorskip("numba")
    g = torch.Generator().manual_seed(n)
    pre = torch.randn(n, generator=g) * torch.logspace(-30, 30, n)
    pre[: n // 2] = (pre[: n // 2].to(torch.bfloat16).float().view(torch.int32) | 0x8000).view(torch.float32)
    y = pre.to(torch.bfloat16)
    fast = norm.encode_residual(pre, y)
    monkeypatch.setattr(norm_op, "_numba_available", lambda: False)
    assert torch.equal(fast, norm.encode_residual(pre, y))


@pytest.mark.parametrize("rows", [7, 1024])  # the serial kernel, and the parallel one (over SERIAL)
def test_cpu_kernel_decodes_residuals_in_its_pass(rows):
    """Given a bf16 y and its residuals, the CPU backward decodes them element by element: dweight and
    dbias are bitwise those of the kernel run on the decoded fp32 y, and dx (fp32 here) within twice
    the kernel's own rounding bound (test_fused_backwards_within_fp32_rounding_of_the_formula): the
    two compiled loops may sum a row in different orders."""
    pytest.importorskip("numba")
    from invact.norm import _cpu as _norm_cpu

    g = torch.Generator().manual_seed(rows)
    d = 96
    pre = torch.randn(rows, d, generator=g) * 2
    y = pre.bfloat16()
    packed = norm.encode_residual(pre, y)
    decoded = norm.decode_residual(y, packed)
    dy = torch.randn(rows, d, generator=g)
    w, b = torch.rand(d, generator=g) + 0.5, torch.randn(d, generator=g) * 0.1
    rstd = torch.rand(rows, 1, generator=g) + 0.5
    for center in (False, True):
        dx, dw, db = _norm_cpu.backward(y, dy, w, b, rstd, center, packed)
        dx0, dw0, db0 = _norm_cpu.backward(decoded, dy, w, b, rstd, center)
        assert torch.equal(dw, dw0) and torch.equal(db, db0)
        h = (decoded.double() - b.double()) / w.double()
        gd = dy.double() * w.double()
        terms = gd.abs() + gd.abs().mean(-1, keepdim=True) + h.abs() * (gd * h).abs().mean(-1, keepdim=True)
        assert ((dx.double() - dx0.double()).abs() <= 2 * (4 + d) * U32 * rstd.double() * terms).all()


@pytest.mark.parametrize("device, dx_dtype", [
    ("cuda", torch.bfloat16),  # Triton's kernel: dx in dy's dtype (its sums fp32, (d,))
    ("cpu", torch.bfloat16),  # numba's: dx in bf16 where dy is (its sums fp64, (d,))
])  # fmt: skip
def test_a_planned_backward_allocates_what_the_kernel_allocates(device, dx_dtype):
    """On the meta device (invact plan) the one-pass backward of a norm that kept y allocates its
    kernel's outputs, not the torch formula's fp32 copies of (rows, d) (a plan of a patched step's
    backward was that much over a real one, where the kernel runs)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from invact._meta import standing_for

    class Allocated(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.big = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and not func.is_view and out.numel() >= rows * d:
                self.big.append((str(func), out.dtype))
            return out

    rows, d = 512, 64
    if device == "cpu" and not norm_op._numba_available():
        pytest.skip("numba's kernel is not installed: a CPU plan runs the torch formula")
    y = torch.empty(rows, d, dtype=torch.bfloat16, device="meta")
    dy = torch.empty_like(y)
    rstd = torch.empty(rows, 1, device="meta")
    weight = torch.empty(d, dtype=torch.bfloat16, device="meta")
    with standing_for(device), Allocated() as seen:
        dx, dw, _ = norm_op.backward(dy, y, None, rstd, weight, None, VARIANTS["rms"], False,
                                     (True, True, False))  # fmt: skip
    assert seen.big == [("aten.empty.memory_format" if device == "cpu" else "aten.empty_like.default",
                         dx_dtype)], seen.big  # fmt: skip
    assert dx.shape == (rows, d) and dw.shape == (d,)
