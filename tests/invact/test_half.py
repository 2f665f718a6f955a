"""The 16-bit q (codegen.half): its log, its accuracy at every y a 16-bit tensor can hold, and that the
backends evaluate it for bf16 and fp16 and the fp32 family's q for fp32."""

import importlib
import json

import numpy as np
import pytest
import torch

from codegen.common import COEFFS
from fitting.activations import get_activation
from fitting.evaluate import FORMATS, dtype_eval_points
from fitting.targets import target
from invact.activation import _bits, _numba, _portable
from invact.activation.activations import ACTIVATIONS
from invact.activation.ops import invact as invact_op
from tests.invact.test_functional import FP32_Q_ROUNDING

SIXTEEN = sorted(json.loads((COEFFS / "defaults_16bit.json").read_text()))
FORMAT_OF = {torch.bfloat16: "bf16", torch.float16: "fp16"}

# _log16's error: its polynomial's minimax error on the mantissa range (2.9e-7, codegen.half), plus
# fp32 rounding of e log 2 and of the sum (each <= |log v| 2^-24 <= 88.8 * 6e-8 = 5.3e-6 over the
# normal range): 1.1e-5. Measured 8.1e-6.
LOG16_ERROR = 1.1e-5
# What that error moves q by, where the 'half' forms use log (a far piece u P(w), w = sqrt(-log u)):
# u P'(w) d / (2 w) for d = LOG16_ERROR, at most 1e-6 over the built-in fits (codegen.half); measured
# below as the difference between q16 with _log16 and with an exact log.
LOG16_Q_EFFECT = 1e-6


def _log16():
    return importlib.import_module("invact._generated.gelu")._log16


def test_log16_is_log_to_its_bound_on_every_binade():
    exponents = torch.arange(-126, 128, dtype=torch.float64)
    mantissas = torch.linspace(1, 2, 4097, dtype=torch.float64)[:-1]
    v = (torch.exp2(exponents)[:, None] * mantissas[None, :]).flatten().float()
    v = v[torch.isfinite(v)]
    err = (_log16()(v).double() - v.double().log()).abs()
    assert err.max().item() <= LOG16_ERROR, err.max().item()


@pytest.mark.parametrize("name", SIXTEEN)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_q16_at_every_16bit_y_is_the_familys(name, dtype):
    """q16 in fp32 (the CPU backend's evaluation of what the Triton kernels print) at every y of the
    dtype on each branch, against f'(f^-1(y)) in float64: the 16-bit fit's own error there (linf_bf16,
    linf_fp16), plus _log16's effect and fp32 rounding."""
    act, fit_act = ACTIVATIONS[name], get_activation(name)
    gen = act.generated
    fmt = FORMATS[FORMAT_OF[dtype]]
    for branch in gen.ERRORS_16BIT:
        y = dtype_eval_points(fit_act, branch, fmt)
        y = y[(y >= act.y_min) & np.isfinite(y)]
        want = target(fit_act, y, branch)
        q16 = getattr(gen, f"q16_{branch}")
        got = q16(torch.from_numpy(y).float()).double().numpy()
        rounding = FP32_Q_ROUNDING * np.maximum(np.abs(want), 1)
        err = np.abs(got - want) - rounding
        bound = gen.ERRORS_16BIT[branch][f"linf_{fmt.name}"] + LOG16_Q_EFFECT
        assert err.max() <= bound, (branch, err.max(), bound)
        with pytest.MonkeyPatch.context() as m:  # the log's share alone: q16 with an exact log
            m.setattr(gen, "_log16", torch.log)
            exact_log = q16(torch.from_numpy(y)).numpy()
        assert (np.abs(got - exact_log) - rounding).max() <= LOG16_Q_EFFECT


@pytest.mark.parametrize("name", SIXTEEN)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", [_numba, _portable], ids=["numba", "portable"])
def test_the_cpu_backends_evaluate_the_dtypes_q(name, dtype, backend):
    """Each CPU backend's dx (dy in fp32, so dx is not rounded to 16 bits) against q evaluated on the
    op's own saved y and bits: q16 for 16-bit y, the fp32 family's q for fp32 y, to fp32 rounding. The
    two q differ by more than that (up to their fits' errors), so a backend that took the other one
    fails here. The op's gradient is the numba backend's, rounded to the dtype."""
    if backend is _numba and not _numba.available():
        pytest.skip("numba is not installed")
    act = ACTIVATIONS[name]
    x = (torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    y, bits = torch.ops.invact.forward(x, name, False)
    dy = torch.randn(4096, generator=torch.Generator().manual_seed(1))
    dx = backend.backward(act, y, bits, dy, False)
    assert dx.dtype == torch.float32
    sixteen = dtype != torch.float32
    fp32_q = (getattr(act.generated, "q_left", None), act.generated.q_right)
    q_left, q_right = act.q16 if sixteen else fp32_q
    other_left, other_right = fp32_q if sixteen else act.q16
    y32, left = y.float(), None if act.monotone else _bits.unpack(bits, y.numel())

    def q_of(ql, qr):
        return qr(y32) if left is None else torch.where(left, ql(y32), qr(y32))

    q, other = q_of(q_left, q_right), q_of(other_left, other_right)
    assert ((dx - dy * q).abs() <= FP32_Q_ROUNDING * (dy * q).abs().clamp_min(1)).all()
    assert (q - other).abs().max().item() > 2 * FP32_Q_ROUNDING
    if backend is _numba:
        xr = x.clone().requires_grad_()
        out = invact_op(xr, name, "bits")
        out.backward(dy.to(dtype))
        assert torch.equal(out.detach(), y)
        assert torch.equal(xr.grad, backend.backward(act, y, bits, dy.to(dtype), False))
