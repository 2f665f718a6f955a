"""exp32, log32 and expm1_32, the vectorizable fp32 math of the numba CPU kernels, against float64 numpy."""

import importlib

import numpy as np
import pytest

numba = pytest.importorskip("numba")

from invact.activation._cpu_math import exp32, expm1_32, log32  # noqa: E402


def _vectorized(fn, fastmath=False):
    @numba.njit(fastmath=fastmath)
    def apply(x, out):
        for i in range(x.size):
            out[i] = fn(x[i])

    return apply


def _ulps(got: np.ndarray, exact: np.ndarray) -> np.ndarray:
    """|got - exact| in ulps of the fp32 value nearest to exact."""
    nearest = exact.astype(np.float32)
    ulp = np.spacing(np.abs(nearest)).astype(np.float64)
    return np.abs(got.astype(np.float64) - exact) / ulp


def test_exp32_within_one_ulp_and_saturates():
    x = np.linspace(-87.3, 88.7, 2**20, dtype=np.float32)
    out = np.empty_like(x)
    _vectorized(exp32)(x, out)
    assert _ulps(out, np.exp(x.astype(np.float64))).max() <= 1.0  # measured 0.9 here
    edges = np.array([-88.0, -1e30, -np.inf, 89.0, np.inf], dtype=np.float32)
    out = np.empty_like(edges)
    _vectorized(exp32)(edges, out)
    assert (out[:3] == 0).all() and (out[3:] > 3e38).all() and np.isfinite(out[3:]).all()


def test_log32_within_two_ulps_and_rejects_the_domain_edge():
    x = np.geomspace(1.2e-38, 3.4e38, 2**20, dtype=np.float32)
    out = np.empty_like(x)
    _vectorized(log32)(x, out)
    assert _ulps(out, np.log(x.astype(np.float64))).max() <= 2.0
    edges = np.array([-1.0, np.nan, 0.0], dtype=np.float32)
    out = np.empty_like(edges)
    _vectorized(log32)(edges, out)
    assert np.isnan(out[:2]).all() and -88.8 < out[2] < -87.3  # 0 saturates at log(1.18e-38)


# The fast-math flags the generated kernels compile with (each prints the same set): expm1_32's sign of
# zero must survive them, as well as a strict build.
_KERNEL_FLAGS = importlib.import_module("invact._generated.softplus_cpu")._FASTMATH


@pytest.mark.parametrize("fastmath", [False, _KERNEL_FLAGS], ids=["strict", "kernel-flags"])
def test_expm1_32_within_two_ulps_keeps_minus_zero_and_saturates(fastmath):
    # exp32(x) - 1 alone loses everything as x -> 0 (x = 1e-6: 6% off); one reduction x = k ln 2 + r and
    # r (1 + r P(r)) keep it within 2 ulps: measured 1.77 here (at x = 0.3546, the edge of k = 0), over
    # both signs from 1e-12 to the saturation points.
    x = np.concatenate([-np.geomspace(1e-12, 30, 2**18), np.geomspace(1e-12, 88.72, 2**18),
                        np.linspace(-30, 88.72, 2**18)]).astype(np.float32)  # fmt: skip
    out = np.empty_like(x)
    _vectorized(expm1_32, fastmath)(x, out)
    assert _ulps(out, np.expm1(x.astype(np.float64))).max() <= 2.0
    edges = np.array([-0.0, 0.0, -31.0, -1e30, -np.inf, 88.8, np.inf], dtype=np.float32)
    out = np.empty_like(edges)
    _vectorized(expm1_32, fastmath)(edges, out)
    assert np.signbit(out[0]) and out[0] == 0 and not np.signbit(out[1]) and out[1] == 0
    assert (out[2:5] == -1).all() and (out[5:] > 3e38).all() and np.isfinite(out[5:]).all()
